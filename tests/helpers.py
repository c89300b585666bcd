"""Shared test helpers: repository paths, the example files, small synthetic models and profiles."""

import copy
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from costmodel import ModelConfig
from costmodel.config import RopeScaling

REPO = Path(__file__).resolve().parent.parent


def load_benchmark(name: str):
    """The script benchmarks/<name>.py as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = REPO / "examples"
PLAN_HETERO = EXAMPLES / "plan-hetero.json"
CLUSTER_8_7 = EXAMPLES / "cluster-8-7.json"

# Three blocks, tied embeddings and grouped-query attention (4 query heads share 2 key/value heads):
# the shape that exercises the paths gpt-tiny does not.
TIED_TINY = ModelConfig(
    name="tied-tiny",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_blocks=3,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
    tie_embeddings=True,
)


# Qwen2's shape: biases on the query, key and value projections (split with their rows under TP).
QWEN_TINY = dataclasses.replace(TIED_TINY, name="qwen-tiny", qkv_bias=True, rope_theta=1e6)
# Llama 3.1's rotary scaling, with an original context short enough that the 4 frequencies of its
# head dimension 8 fall in all three bands: kept (wavelength 6.3), mixed (63), stretched (628, 6283).
SCALED_TINY = dataclasses.replace(
    TIED_TINY,
    name="scaled-tiny",
    tie_embeddings=False,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64),
)


def example_plan_json() -> dict[str, Any]:
    """A fresh, mutable copy of examples/plan-hetero.json."""
    return copy.deepcopy(json.loads(PLAN_HETERO.read_text()))


def run_elastor(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m elastor ARGS` in a fresh interpreter, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "elastor", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )

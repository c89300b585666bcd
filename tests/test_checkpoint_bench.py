"""`benchmarks/checkpoint_bench.py`, scaled down: four gloo processes save gpt-tiny's state with
Elastor and with torch.distributed.checkpoint, and load it back in the same layout and resharded.
The benchmark itself asserts that every load is bit-identical (the same-layout loads to the live
state, the resharded loads to each other); this runs it so that it cannot go stale unnoticed. A
process of its own: its workers are spawned and import it by its file."""

import json
import subprocess
import sys

import pytest
from helpers import REPO


def test_the_checkpoint_benchmark_runs_and_its_loads_are_bit_identical(tmp_path):
    out = tmp_path / "checkpoint_bench.json"
    args = ["--model", "gpt-tiny", "--procs", "4", "--repeats", "1", "--steps", "1", "--dir", str(tmp_path)]
    script = str(REPO / "benchmarks" / "checkpoint_bench.py")
    # It takes about 10 s; it once hung until this timeout. Every process prints its stacks first.
    command = [sys.executable, script, *args, "--out", str(out), "--hang-report-s", "240"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as hung:
        stderr = hung.stderr.decode(errors="replace") if isinstance(hung.stderr, bytes) else hung.stderr
        pytest.fail(f"the benchmark hung; its processes' stacks:\n{(stderr or '')[-12000:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    for key in ("elastor_stall_s", "elastor_save_s", "elastor_load_same_s", "elastor_load_resharded_s"):
        assert results[key] > 0

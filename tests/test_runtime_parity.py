"""docs/DESIGN.md invariant 1: any plan trains to the same losses and weights as one process.

Each test runs 10 optimizer steps of a plan under torchrun (gloo, CPU, up to 6 processes) and
compares with `runtime.reference.train_reference` on the same global batch. Tolerance (fp32): every
loss within 1e-5 relative; every final parameter within 1e-5 absolute + 1e-5 relative. Replicas of an
element on different ranks must be bit-identical (checked by `assemble`).
"""

import functools
import json

import pytest
import torch
from dist_helpers import PARITY_OPTIM, assemble, plan_json, run_worker

from costmodel import PRESETS, ModelConfig
from costmodel.config import RopeScaling
from runtime.optim import OptimConfig
from runtime.reference import train_reference

STEPS = 10
# run with -m slow (make test's time budget); the others cover pipelines (three stages in the tied
# plan), TP fan-in and tied weights
SLOW = ("pure-dp", "three-stages", "tp2", "tp3-tp2-vs-dp")
LOSS_RTOL = 1e-5
PARAM_RTOL = PARAM_ATOL = 1e-5

TINY = PRESETS["gpt-tiny"].to_json()
# Tied embeddings, grouped-query attention (6 query heads on 3 key/value heads), and a vocabulary
# (250) and MLP width (100) that TP degree 3 splits unevenly (84/83/83 and 34/33/33); Qwen2's q/k/v
# biases (split with their heads) and Llama 3.1's rotary scaling (its three bands within head_dim 8).
TIED = ModelConfig(
    name="tied-gqa-tiny",
    vocab_size=250,
    hidden_size=48,
    intermediate_size=100,
    num_blocks=3,
    num_heads=6,
    num_kv_heads=3,
    max_seq_len=64,
    tie_embeddings=True,
    qkv_bias=True,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64),
).to_json()

PLANS = {
    # Three data-parallel replicas of the whole model, 3 + 3 + 2 micro-batches.
    "pure-dp": plan_json(
        TINY,
        [(3, [((0, 6), ["n0:0"])]), (3, [((0, 6), ["n0:1"])]), (2, [((0, 6), ["n0:2"])])],
    ),
    # One pipeline, three uneven stages (1, 3 and 2 layers): warm-up, steady 1F1B and drain.
    "three-stages": plan_json(
        TINY, [(4, [((0, 1), ["n0:0"]), ((1, 4), ["n0:1"]), ((4, 6), ["n0:2"])])], micro_batch_size=2
    ),
    # Tensor parallelism only: the whole model on a TP group of 2.
    "tp2": plan_json(TINY, [(8, [((0, 6), ["n0:0", "n0:1"])])]),
    # A TP-3 stage feeding a TP-2 stage (fan-in 3 -> 2), beside a single-device replica: gradient
    # segments cut at thirds and halves; 6 and 2 micro-batches.
    "tp3-tp2-vs-dp": plan_json(
        TINY,
        [
            (6, [((0, 2), ["n0:0", "n0:1", "n0:2"]), ((2, 6), ["n0:3", "n0:4"])]),
            (2, [((0, 6), ["n1:0"])]),
        ],
    ),
    # Two pipelines with different stage boundaries and TP degrees, 5 and 3 micro-batches.
    "hetero-5-3": plan_json(
        TINY,
        [
            (5, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2"])]),
            (3, [((0, 2), ["n1:0"]), ((2, 6), ["n1:1", "n1:2"])]),
        ],
    ),
    # Tied embeddings: the head stage (TP 3, uneven shards) keeps its own copy of embed.weight,
    # summed with the first stage's and the other replica's; 2 micro-batches on 3 stages (all warm-up).
    "tied-gqa-uneven": plan_json(
        TIED,
        [
            (2, [((0, 1), ["n0:0"]), ((1, 3), ["n0:1"]), ((3, 5), ["n0:2", "n0:3", "n0:4"])]),
            (3, [((0, 5), ["n1:0"])]),
        ],
    ),
}


@functools.cache
def reference(model_json: str, global_batch_size: int, seq_len: int):
    torch.set_num_threads(1)
    config = ModelConfig.from_json(json.loads(model_json))
    return train_reference(
        config,
        global_batch_size=global_batch_size,
        seq_len=seq_len,
        steps=STEPS,
        optim=OptimConfig(**PARITY_OPTIM),
    )


def check_parity(plan: dict, out, first_step: int = 0) -> None:
    """The run in `out` (steps first_step + 1 .. STEPS) against the single-process run."""
    ref_losses, ref_params = reference(json.dumps(plan["model"]), plan["global_batch_size"], plan["seq_len"])
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses) == STEPS - first_step
    for step, (got, want) in enumerate(zip(losses, ref_losses[first_step:], strict=True), start=first_step):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step + 1}: loss {got} vs reference {want}"
    params = assemble(out)
    assert set(params) == set(ref_params)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    assert ref_losses[-1] < ref_losses[0]  # the run trained: the comparison is not between two inits


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PLANS])
def test_plan_matches_single_process(name, tmp_path):
    plan = PLANS[name]
    result = run_worker(plan, tmp_path, steps=STEPS)
    assert result.returncode == 0, result.stderr[-4000:]
    check_parity(plan, tmp_path)


# About 35 s, so -m slow (make test's budget); tests/test_checkpoint_resume.py resumes under another
# plan by default.
@pytest.mark.slow
def test_state_saved_under_one_plan_resumes_under_another(tmp_path):
    """The checkpoint contract of runtime/state.py: pieces saved under plan A after step 4 (two
    pipelines, TP 2 and 1), assembled to full tensors and cut to plan B's boxes (TP 3 feeding TP 2,
    beside a replica), continue to the same losses and weights as one uninterrupted process."""
    check_resume(PLANS["hetero-5-3"], PLANS["tp3-tp2-vs-dp"], tmp_path)


def check_resume(a: dict, b: dict, tmp_path, at: int = 4) -> None:
    """Plan `a` trains `at` steps and saves its pieces; plan `b` resumes from them and trains to
    STEPS: its losses and final weights must be the single-process run's."""
    saved = run_worker(a, tmp_path / "a", steps=at, extra=("--save-at", str(at)))
    assert saved.returncode == 0, saved.stderr[-4000:]
    resumed = run_worker(
        b, tmp_path / "b", steps=STEPS, extra=("--resume-from", str(tmp_path / "a" / "state"))
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    check_parity(b, tmp_path / "b", first_step=at)

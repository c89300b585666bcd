"""Interleaved 1F1B (stages holding several layer chunks) against one process, and checkpoints moving
between interleaved and non-interleaved plans.

Each plan trains 10 steps under torchrun (gloo, CPU, up to 6 processes) and is compared with
`runtime.reference.train_reference` at the tolerances of tests/test_runtime_parity.py (fp32) and
tests/test_runtime_precision.py (bf16). The plans cover v = 2 and 3, a TP-3 stage beside a TP-2
stage, sequence parallelism, uneven micro-batch counts across pipelines, micro-batch counts that the
stage count does not divide (and fewer micro-batches than stages), tied embeddings, and recompute on
one chunk of a stage but not the other. `SPLIT_PLANS` split their backwards (ZB-H1), interleaved and
not, with TP 3 beside TP 2, sequence parallelism, recomputation and ZeRO-1.
"""

import copy

import pytest
from dist_helpers import plan_json, run_worker
from test_runtime_parity import STEPS, TIED, check_parity, check_resume
from test_runtime_precision import BF16, SP, _with, check_bf16_parity

from costmodel import ModelConfig, Plan

# 8 blocks (10 layers): enough for 2 x 3 and 3 x 2 chunks; 6 heads split by TP 2 and 3.
DEEP = ModelConfig(
    name="gpt-deep-tiny",
    vocab_size=256,
    hidden_size=48,
    intermediate_size=64,
    num_blocks=8,
    num_heads=6,
    num_kv_heads=6,
    max_seq_len=64,
).to_json()


def _n(node: int, *gpus: int) -> list[str]:
    return [f"n{node}:{g}" for g in gpus]


PLANS = {
    # Two stages, two chunks each, 4 micro-batches (a multiple of the stage count).
    "s2-v2": plan_json(DEEP, [(4, [(((0, 3), (5, 8)), _n(0, 0)), (((3, 5), (8, 10)), _n(0, 1))])]),
    # Two stages, three chunks each, 3 micro-batches: not a multiple of 2.
    "s2-v3": plan_json(
        DEEP, [(3, [(((0, 2), (4, 6), (8, 9)), _n(0, 0)), (((2, 4), (6, 8), (9, 10)), _n(0, 1))])]
    ),
    # TP 2 -> TP 1 -> TP 3 on three stages, two chunks each, 5 micro-batches (not a multiple of 3).
    "s3-v2-tp": plan_json(
        DEEP,
        [
            (
                5,
                [
                    (((0, 2), (5, 7)), _n(0, 0, 1)),
                    (((2, 4), (7, 8)), _n(0, 2)),
                    (((4, 5), (8, 10)), _n(0, 3, 4, 5)),
                ],
            )
        ],
    ),
    # An interleaved pipeline (TP 3 feeding TP 2, 5 micro-batches) beside a 1F1B replica (3).
    "tp3-tp2-v2-vs-dp": plan_json(
        DEEP,
        [
            (5, [(((0, 3), (5, 7)), _n(0, 0, 1, 2)), (((3, 5), (7, 10)), _n(0, 3, 4))]),
            (3, [((0, 10), _n(1, 0))]),
        ],
    ),
    # Tied embeddings: the last stage's copy of embed.weight sits in its last chunk; 1 micro-batch
    # (of 4 samples), fewer than the stages.
    "tied-v2-m1": plan_json(
        TIED, [(1, [(((0, 2), (3, 4)), _n(0, 0)), (((2, 3), (4, 5)), _n(0, 1))])], micro_batch_size=4
    ),
}
# Recompute on one chunk of each stage: full on stage 0's first chunk, selective on stage 1's last.
PLANS["recompute-one-chunk"] = _with(
    PLANS["s2-v2"], {(0, 0): {"recompute": ["full", "none"]}, (0, 1): {"recompute": ["none", "selective"]}}
)
# Sequence-parallel TP-2 stages, two chunks each, beside a replica; 3 and 2 micro-batches.
PLANS["sp-v2"] = _with(
    plan_json(
        DEEP,
        [
            (3, [(((0, 3), (5, 8)), _n(0, 0, 1)), (((3, 5), (8, 10)), _n(0, 2, 3))]),
            (2, [((0, 10), _n(1, 0))]),
        ],
    ),
    {(0, 0): SP, (0, 1): SP},
)


def _split(plan: dict, *pipelines: int) -> dict:
    """`plan` with the given pipelines' backwards split (ZB-H1: weight gradients deferred)."""
    plan = copy.deepcopy(plan)
    for pi in pipelines:
        plan["pipelines"][pi]["split_backward"] = True
    return plan


# Split backward (runtime/split_backward.py): interleaved and plain 1F1B pipelines whose weight
# gradients run later than their input gradients, beside pipelines that do not split.
SPLIT_PLANS = {
    # TP 3 -> TP 2, two chunks, 5 micro-batches, beside an unsplit replica; with ZeRO-1 the
    # deferred gradients still complete every bucket.
    "split-tp3-tp2-v2-zero1": _with(
        _split(PLANS["tp3-tp2-v2-vs-dp"], 0), {}, optimizer={"sharding": "zero1", "bucket_bytes": 8192}
    ),
    # Plain 1F1B order (one chunk) split: TP 2 -> TP 1 -> TP 3, full recompute on the middle stage.
    "split-1f1b-s3": _with(
        _split(
            plan_json(DEEP, [(5, [((0, 3), _n(0, 0, 1)), ((3, 6), _n(0, 2)), ((6, 10), _n(0, 3, 4, 5))])]), 0
        ),
        {(0, 1): {"recompute": "full"}},
    ),
    # Sequence parallelism, selective recompute on one chunk, 3 and 2 micro-batches, both split.
    "split-sp-v2": _with(_split(PLANS["sp-v2"], 0), {(0, 1): {"recompute": ["none", "selective"]}}),
    # Three chunks, 3 micro-batches on 2 stages (not a multiple of the stage count).
    "split-s2-v3": _split(PLANS["s2-v3"], 0),
}
# The rest -m slow (make test's time budget). "split-tp3-tp2-v2-zero1" runs "tp3-tp2-v2-vs-dp" with
# pipeline 0's backward split and ZeRO-1; "recompute-one-chunk" keeps the plain interleaved order.
FAST = ("recompute-one-chunk", "split-tp3-tp2-v2-zero1")


def test_plans_are_valid_and_interleaved():
    for name, data in PLANS.items():
        plan = Plan.from_json(data).validate()
        assert max(p.num_chunks for p in plan.pipelines) > 1, name
    for name, data in SPLIT_PLANS.items():
        assert Plan.from_json(data).validate().pipelines[0].split_backward, name


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in (*PLANS, *SPLIT_PLANS)]
)
def test_interleaved_plan_matches_single_process(name, tmp_path):
    plan = PLANS.get(name) or SPLIT_PLANS[name]
    result = run_worker(plan, tmp_path, steps=STEPS)
    assert result.returncode == 0, result.stderr[-4000:]
    check_parity(plan, tmp_path)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) for n in ("s3-v2-tp", "sp-v2", "split-sp-v2", "split-1f1b-s3")],
)
def test_interleaved_bf16_matches_single_process_bf16(name, tmp_path):
    plan = _with(PLANS.get(name) or SPLIT_PLANS[name], {}, **BF16)
    result = run_worker(plan, tmp_path, steps=STEPS)
    assert result.returncode == 0, result.stderr[-4000:]
    check_bf16_parity(plan, tmp_path)


@pytest.mark.parametrize(
    "direction",
    [pytest.param(d, marks=pytest.mark.slow) for d in ("interleaved-to-1f1b", "1f1b-to-interleaved")],
)
def test_state_resumes_across_schedules(direction, tmp_path):
    """Pieces saved after step 4 under an interleaved plan continue under a non-interleaved one of
    another layout (and back) to the single-process losses and weights."""
    interleaved = PLANS["tp3-tp2-v2-vs-dp"]
    plain = plan_json(DEEP, [(4, [((0, 4), _n(0, 0, 1)), ((4, 10), _n(0, 2))]), (4, [((0, 10), _n(1, 0))])])
    a, b = (interleaved, plain) if direction == "interleaved-to-1f1b" else (plain, interleaved)
    check_resume(a, b, tmp_path)

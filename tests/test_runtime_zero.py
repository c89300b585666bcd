"""ZeRO-1 over holder groups (`"optimizer": {"sharding": "zero1"}`) against one process, resharding
between sharded and unsharded plans, and the optimizer memory it saves.

Parity: each plan trains 10 steps with its gradient buckets reduce-scattered over their holders,
each holder updating its own slice and all-gathering the result, in small buckets (8 KiB, so every
plan has many buckets issued from backward's hooks). fp32 matches `train_reference` within the 1e-5 of
tests/test_runtime_parity.py, bf16 the single-process bf16 run within the measured bound of
tests/test_runtime_precision.py.

Memory: the `memory` event of a sharded run and of the same plan unsharded; per device, the measured
ratio of optimizer bytes must equal the cost model's predicted ratio within 5%.
"""

import json

import pytest
from dist_helpers import gloo_threads_left, plan_json, run_worker
from test_runtime_parity import PLANS, STEPS, TINY, check_parity, check_resume
from test_runtime_precision import BF16, SP_PLANS, _with, check_bf16_parity

ZERO = {"optimizer": {"sharding": "zero1", "bucket_bytes": 8192}}
ZERO_PLANS = {
    "pure-dp": PLANS["pure-dp"],
    "tp3-tp2-vs-dp": PLANS["tp3-tp2-vs-dp"],
    "hetero-5-3": PLANS["hetero-5-3"],
    "tied-gqa-uneven": PLANS["tied-gqa-uneven"],
    "sp-hetero": SP_PLANS["sp-hetero"],
    # One pipeline, but its sequence-parallel stages reduce their norms' partial gradients over
    # their TP ranks: those buckets are sharded too.
    "sp-chain": SP_PLANS["sp-chain"],
}
# All -m slow (make test's time budget): by default ZeRO-1 matches one process in
# tests/test_runtime_interleaved.py ("split-tp3-tp2-v2-zero1", two pipelines unlike in TP and cuts),
# and a ZeRO-1 bf16 run is bit for bit its resumed twin in tests/test_inprocess.py.
FAST: tuple[str, ...] = ()


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ZERO_PLANS]
)
def test_zero1_plan_matches_single_process(name, tmp_path):
    plan = _with(ZERO_PLANS[name], {}, **ZERO)
    result = run_worker(plan, tmp_path, steps=STEPS)
    assert result.returncode == 0, result.stderr[-4000:]
    check_parity(plan, tmp_path)
    # Every group (TP, bucket, ring and the default one) freed and its threads joined before exit.
    assert not gloo_threads_left(tmp_path)


# Both with -m slow (about 20 s each; make test's budget): the fp32 ZeRO-1 plans and the bf16 plans
# without ZeRO-1 run by default.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["hetero-5-3", "tied-gqa-uneven"])
def test_zero1_bf16_plan_matches_single_process_bf16(name, tmp_path):
    plan = _with(ZERO_PLANS[name], {}, **ZERO, **BF16)
    result = run_worker(plan, tmp_path, steps=STEPS)
    assert result.returncode == 0, result.stderr[-4000:]
    check_bf16_parity(plan, tmp_path)


@pytest.mark.parametrize(
    "direction", [pytest.param(d, marks=pytest.mark.slow) for d in ("zero1-to-none", "none-to-zero1")]
)
def test_state_resumes_across_sharding(direction, tmp_path):
    """Pieces saved after step 4 under one sharding (and layout) continue under the other to the
    single-process losses and weights."""
    a, b = PLANS["hetero-5-3"], PLANS["tp3-tp2-vs-dp"]
    if direction == "zero1-to-none":
        a = _with(a, {}, **ZERO)
    else:
        b = _with(b, {}, **ZERO)
    check_resume(a, b, tmp_path)


def _memory(out) -> dict:
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(e for e in events if e.get("event") == "memory")["devices"]


def test_zero1_optimizer_memory_is_the_predicted_fraction(tmp_path):
    """Three pipelines of different layouts (holder sets of 3, TP shards cut at halves and thirds),
    bf16, default bucket size: measured optimizer bytes sharded / unsharded per device against the
    cost model's ratio for the same device."""
    plan = plan_json(
        TINY,
        [
            (2, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2"])]),
            (2, [((0, 6), ["n1:0"])]),
            (2, [((0, 2), ["n2:0"]), ((2, 6), ["n2:1", "n2:2", "n2:3"][:2])]),
        ],
    )
    runs = {}
    for sharding in ("none", "zero1"):
        variant = _with(plan, {}, optimizer={"sharding": sharding}, **BF16)
        result = run_worker(variant, tmp_path / sharding, steps=1)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[sharding] = _memory(tmp_path / sharding)
    for device, sharded in runs["zero1"].items():
        whole = runs["none"][device]
        measured = sharded["optimizer_bytes"] / whole["optimizer_bytes"]
        predicted = sharded["predicted"]["optimizer_bytes"] / whole["predicted"]["optimizer_bytes"]
        assert measured < 0.6, (device, measured)  # every element has at least two holders here
        assert abs(measured / predicted - 1) <= 0.05, (device, measured, predicted)
        assert sharded["optimizer_bytes"] <= sharded["predicted"]["optimizer_bytes"], device

"""Two CPU profiles of the same model, back to back, agree within a stated spread.

What is compared: per layer kind, the sum over the profiled shapes (micro-batch 1 and 2, TP 1 and
2) of the median forward + backward time.

Two kinds of difference are told apart, because they have different causes. The machine's own
speed drifts: on this shared two-core machine 12 back-to-back pairs differed by up to 1.37x, and a
fresh CI machine once took the first profile 1.28x slower while an earlier test's processes wound
down; in every such pair block, head and whole profile moved together (within 8% of one another).
The profiler cannot control that, so the absolute bound is 1.5x either way per block, head and
whole profile. The profiler's own noise (its warm-up, its discard of preempted runs, its medians)
shows in the profile's shape instead, the block's time relative to the head's, which is what the
planner's choices rest on: over the same pairs it moved by at most 8%, and it is held to 15%.
The embedding's totals are a few tens of microseconds, where cache and timer noise reached 1.45x;
it is held to an absolute bound instead: the two embedding totals differ by less than 5% of the
whole profile.

It stays meaningful: the same profile at four times the sequence length (block and head 3-5x
slower) must fall outside the per-layer tolerance, so the comparison does not pass anything.
"""

import pytest

from costmodel.config import PRESETS
from profiler.measure import measure_profile

TINY = PRESETS["gpt-tiny"]
PER_LAYER = 1.5  # allowed ratio either way for the block, the head and their sum: machine drift
SHAPE = 1.15  # allowed ratio either way for the block's time relative to the head's
EMBED_SHARE = 0.05  # allowed embedding difference, as a share of the whole profile


def layer_totals(seq_len: int) -> dict[str, float]:
    profile = measure_profile(
        TINY, micro_batch_sizes=[1, 2], tp_degrees=[1, 2], seq_len=seq_len, progress=False
    )
    rows = (profile.layers[0], profile.layers[1], profile.layers[-1])
    return {layer.name: sum(c.fwd_s + c.bwd_s for c in layer.costs) for layer in rows}


@pytest.fixture(scope="module")
def first() -> dict[str, float]:
    return layer_totals(64)


def test_a_second_profile_is_within_the_spread_of_the_first(first):
    second = layer_totals(64)
    for name in ("blocks.0", "head"):
        ratio = second[name] / first[name]
        assert 1 / PER_LAYER <= ratio <= PER_LAYER, f"{name}: {ratio:.2f}x ({first} vs {second})"
    whole = sum(second.values()) / sum(first.values())
    assert 1 / PER_LAYER <= whole <= PER_LAYER, f"whole profile: {whole:.2f}x ({first} vs {second})"
    shape = (second["blocks.0"] / second["head"]) / (first["blocks.0"] / first["head"])
    assert 1 / SHAPE <= shape <= SHAPE, f"block relative to head: {shape:.2f}x ({first} vs {second})"
    assert abs(second["embed"] - first["embed"]) < EMBED_SHARE * sum(first.values()), (first, second)


def test_the_tolerance_tells_a_different_workload_apart(first):
    longer = layer_totals(256)
    assert longer["blocks.0"] / first["blocks.0"] > PER_LAYER
    assert longer["head"] / first["head"] > PER_LAYER

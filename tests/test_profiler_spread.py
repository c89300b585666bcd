"""Two CPU profiles of the same model, back to back, agree within a stated spread.

What is compared: per layer kind, the sum over the profiled shapes (micro-batch 1 and 2, TP 1 and
2) of the median forward + backward time. The tolerance is set for this shared two-core machine,
where other engineers' test runs keep the load at 4-6: measured there (12 pairs each), block and
head totals differed by up to 1.24x and whole profiles by up to 1.14x. We allow 1.5x per block and
head and 1.25x for the whole profile. The embedding's totals are a few tens of microseconds, where
cache and timer noise reached 1.45x; it is held to an absolute bound instead: the two embedding
totals differ by less than 5% of the whole profile.

It stays meaningful: the same profile at four times the sequence length (block and head 3-5x
slower) must fall outside the per-layer tolerance, so the comparison does not pass anything.
"""

import pytest

from costmodel.config import PRESETS
from profiler.measure import measure_profile

TINY = PRESETS["gpt-tiny"]
PER_LAYER = 1.5  # allowed ratio either way for the block and the head
WHOLE = 1.25  # allowed ratio either way for the sum over layer kinds
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
    assert 1 / WHOLE <= whole <= WHOLE, f"whole profile: {whole:.2f}x ({first} vs {second})"
    assert abs(second["embed"] - first["embed"]) < EMBED_SHARE * sum(first.values()), (first, second)


def test_the_tolerance_tells_a_different_workload_apart(first):
    longer = layer_totals(256)
    assert longer["blocks.0"] / first["blocks.0"] > PER_LAYER
    assert longer["head"] / first["head"] > PER_LAYER

"""Activation memory: the formula of costmodel/analytic.py against what autograd really keeps.

Measured: the distinct non-parameter storages autograd saves when TP rank 0's shard of a layer runs
on CPU (profiler.memory). The formula was derived from runtime/model.py tensor by tensor, not fitted,
so the two agree to the byte except where the formula rounds up on purpose (log-sum-exp rows padded
to 32, the vocabulary-parallel loss's mask). Tolerance: no under-prediction beyond 2% (the planning
bar), and no over-prediction beyond 2% either, so the formula stays tight enough to plan with.
"""

import pytest
from helpers import TIED_TINY

from costmodel.analytic import activation_bytes
from costmodel.config import PRESETS, ModelConfig
from profiler.measure import measure_profile
from profiler.memory import measured_activation_bytes, measured_stage_activation_bytes

TOLERANCE = 0.02
# The CUDA caching allocator rounds every block up to 512 bytes; a block keeps fewer than 64 tensors.
ALLOCATOR_ROUNDING = 512 * 64
TINY = PRESETS["gpt-tiny"]
# Uneven splits at TP 3: MLP width 250 -> 84, 83, 83 and vocabulary 1001 -> 334, 334, 333.
UNEVEN = ModelConfig(
    name="uneven",
    vocab_size=1001,
    hidden_size=96,
    intermediate_size=250,
    num_blocks=2,
    num_heads=6,
    num_kv_heads=3,
    max_seq_len=128,
)

COMBOS = [
    # (model, layer kind, micro-batch size, seq_len, TP degree, dtype)
    (TINY, "embed", 1, 64, 1, "float32"),
    (TINY, "embed", 4, 64, 3, "float32"),
    (TINY, "block", 1, 64, 1, "float32"),
    (TINY, "block", 4, 64, 2, "float32"),
    (TINY, "block", 2, 64, 6, "float32"),
    (TINY, "block", 2, 50, 3, "float32"),  # seq_len not a multiple of 32
    (TINY, "block", 2, 64, 1, "bfloat16"),
    (TINY, "head", 1, 64, 1, "float32"),
    (TINY, "head", 4, 64, 6, "float32"),
    (TINY, "head", 2, 64, 2, "bfloat16"),
    (TIED_TINY, "block", 2, 64, 2, "float32"),  # grouped-query attention
    (TIED_TINY, "head", 2, 64, 1, "float32"),  # tied output projection
    (UNEVEN, "block", 2, 64, 3, "float32"),
    (UNEVEN, "head", 2, 64, 3, "float32"),
]


@pytest.mark.parametrize(
    ("config", "kind", "mbs", "seq_len", "tp", "dtype"),
    COMBOS,
    ids=[f"{c.name}-{k}-b{m}-s{s}-tp{t}-{d}" for c, k, m, s, t, d in COMBOS],
)
def test_activation_formula_matches_the_saved_tensors(config, kind, mbs, seq_len, tp, dtype):
    predicted = activation_bytes(config, kind, mbs, seq_len, tp, dtype)
    measured = measured_activation_bytes(config, kind, mbs, seq_len, tp, dtype)
    error = (predicted - measured) / measured
    assert -TOLERANCE <= error <= TOLERANCE, f"predicted {predicted} B, measured {measured} B ({error:+.2%})"


MATH = [
    # (model, micro-batch size, seq_len, TP degree, dtype): blocks under the math attention kernel
    (TINY, 2, 64, 1, "float32"),
    (TINY, 2, 50, 2, "float32"),
    (TINY, 2, 64, 1, "bfloat16"),  # 16 bit throughout: torch would otherwise keep fp32 copies
    (TIED_TINY, 2, 64, 2, "bfloat16"),  # grouped-query attention
    (UNEVEN, 1, 64, 3, "float32"),
]


@pytest.mark.parametrize(
    ("config", "mbs", "seq_len", "tp", "dtype"),
    MATH,
    ids=[f"{c.name}-b{m}-s{s}-tp{t}-{d}" for c, m, s, t, d in MATH],
)
def test_the_math_kernel_keeps_its_scores_and_the_formula_counts_them(config, mbs, seq_len, tp, dtype):
    """The plan's attention field changes what a block keeps: the math kernel's b x H x s x s softmax
    output instead of the fused kernel's log-sum-exp, to the byte."""
    measured = {
        kernel: measured_activation_bytes(config, "block", mbs, seq_len, tp, dtype, attention=kernel)
        for kernel in ("fused", "math")
    }
    predicted = {
        kernel: activation_bytes(config, "block", mbs, seq_len, tp, dtype, attention=kernel)
        for kernel in ("fused", "math")
    }
    scores = mbs * (config.num_heads // tp) * seq_len * seq_len * (4 if dtype == "float32" else 2)
    assert measured["math"] - measured["fused"] >= scores * 0.9  # the scores are there
    for kernel in ("fused", "math"):
        error = (predicted[kernel] - measured[kernel]) / measured[kernel]
        assert -TOLERANCE <= error <= TOLERANCE, f"{kernel}: {predicted[kernel]} B vs {measured[kernel]} B"


@pytest.mark.parametrize(
    ("start", "end", "dtype"), [(0, 6, "float32"), (1, 5, "float32"), (2, 6, "bfloat16")]
)
def test_a_stage_keeps_the_sum_of_its_layers(start, end, dtype):
    # The runtime's own ModelSlice, with the loss when it ends with the head. The sum over-counts
    # only the fp32 rotary tables the stage's blocks share (2 x seq x head_dim x 4 B per extra block).
    mbs, seq_len = 2, 64
    measured = measured_stage_activation_bytes(TINY, start, end, mbs, seq_len, dtype)
    predicted = sum(
        activation_bytes(TINY, TINY.layer_kind(i), mbs, seq_len, 1, dtype) for i in range(start, end)
    )
    assert measured <= predicted <= measured * (1 + TOLERANCE)


def test_the_profile_records_the_measured_bytes():
    profile = measure_profile(
        TINY, micro_batch_sizes=[2], tp_degrees=[2], seq_len=32, repeats=1, warmup=0, progress=False
    )
    for index in (0, 1, TINY.num_layers - 1):
        kind = TINY.layer_kind(index)
        measured = profile.cost(index, 2, 2).activation_bytes
        assert measured == measured_activation_bytes(TINY, kind, 2, 32, 2, "float32")


@pytest.mark.gpu
def test_cuda_profile_memory_and_times():
    # On CUDA the bytes come from the allocator, not from autograd's hooks; the formula must still
    # not under-predict them beyond the tolerance, allowing each kept tensor's rounding.
    profile = measure_profile(
        TINY, micro_batch_sizes=[2], tp_degrees=[1, 2], seq_len=64, device="cuda", progress=False
    )
    assert profile.source == "cuda"
    for index in (0, 1, TINY.num_layers - 1):
        for tp in (1, 2):
            cost = profile.cost(index, 2, tp)
            assert cost.fwd_s > 0 and cost.bwd_s > 0
            predicted = activation_bytes(TINY, TINY.layer_kind(index), 2, 64, tp, "float32")
            assert cost.activation_bytes <= predicted * (1 + TOLERANCE) + ALLOCATOR_ROUNDING

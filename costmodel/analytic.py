"""Closed-form per-layer costs: FLOPs, activation bytes kept for backward, and a roofline time.

Torch-free. The profiler's analytic path (`elastor profile --analytic`) fills a profile from these,
the memory benchmark and tests hold them against what the reference model really does on CPU.
Every function describes ONE tensor-parallel shard (TP rank 0, which holds the largest piece of
every uneven split), for one micro-batch of `b` samples of `s` tokens.

FLOPs (2 per multiply-add, matrix products only). Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", count 96·B·s·l·h²·(1 + s/(6h) +
V/(16·l·h)) FLOPs per iteration: a GPT layer's forward is 24·b·s·h² + 4·b·s²·h, its backward twice
that, and their 96 (= 4 × 24) includes a recomputed forward that Elastor does not run (3 × 24).
Written per matrix product, which also covers grouped-query attention and a three-matrix SwiGLU MLP
of width F:
    q and o projections   2 · 2·b·s·h·(H·d)          (H query heads of size d)
    k and v projections   2 · 2·b·s·h·(K·d)          (K key/value heads)
    scores and values     2 · 2·b·s²·(H·d) · CAUSAL_ATTENTION_FRACTION
    MLP gate, up, down    3 · 2·b·s·h·F
    output projection     2·b·s·h·V                  (head; the embedding is a gather, no FLOPs)
with H, K, F and V divided by the TP degree. Backward = BACKWARD_FLOPS_FACTOR × forward.

Activation memory. Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", equation (1)-(2), give s·b·h·(34 + 5·a·s/h) bytes per GPT layer in 16-bit precision
(sbh·(10 + 24/t + 5as/(ht)) with TP degree t and no sequence parallelism). Their count assumes
LayerNorm, a GELU MLP of width 4h, dropout masks and an attention that materialises the s×s
scores. Our `runtime/model.py` differs in each, so `activation_bytes` counts, tensor by tensor,
what autograd saves when it runs (verified with saved-tensor hooks, `benchmarks/memory_validation.py`):
    per RMSNorm (two per block, one in the head; computed in fp32, replicated under TP):
        its input in fp32 (the input itself in fp32, a converted copy otherwise)   4·b·s·h
        the reciprocal RMS                                                          4·b·s
        the normalised input before the weight, in the model dtype                  D·b·s·h
        the scaled output, kept by the next projection                              D·b·s·h
    attention (a fused kernel: flash attention on CPU and on CUDA in 16 bit, memory-efficient
    attention on CUDA in fp32; no s×s matrix is kept, which removes Korthikanti's 5as²b term):
        q after rotary, k and v as attention sees them (grouped k, v repeated to H heads
        before the kernel whenever K < H), the attention output           4 · D·b·s·(H/t)·d
        the log-sum-exp per query row, fp32, rows padded to LSE_ROW_MULTIPLE 4·b·(H/t)·s'
        the rotary cos and sin tables (fp32: two shared tables; else a converted copy per q and k)
    SwiGLU MLP: the gate output, its SiLU, the up output, their product       4 · D·b·s·(F/t)
    no dropout, no biases, the residual additions keep nothing.
    embed (vocabulary-parallel): the token ids (int64), and for t > 1 the out-of-shard mask (bool)
    head: its RMSNorm as above, then the loss: at t = 1 `cross_entropy_sum` keeps the fp32
        log-probabilities, the int64 targets and a 4-byte total weight; at t > 1 the runtime's
        vocabulary-parallel loss (runtime/tensor_parallel.py, after Megatron-LM's
        `_VocabParallelCrossEntropy`) keeps the fp32 softmax of the shard's V/t logits, the int64
        shifted targets and a bool mask of the targets inside the shard. The logits are not kept.
        (The profiler times `cross_entropy_sum` over the shard's logits as a stand-in at t > 1: the
        same work and softmax, a 4-byte total weight instead of the b·s-byte mask.)
D is the model dtype's size in bytes. Parameters are excluded (the cost model counts them apart).
A stage of several blocks shares one pair of fp32 rotary tables, so summing layers over-counts that
pair per extra block: a few KB, on the safe side.
"""

from costmodel.config import ModelConfig
from costmodel.hardware import DeviceKind
from costmodel.layout import shard_size
from costmodel.profile import DTYPE_BYTES

# Backward computes the gradients of both the input and the weights of every product: twice the
# forward's FLOPs (Narayanan et al. 2021).
BACKWARD_FLOPS_FACTOR = 2.0
# Causal flash-attention kernels (Dao 2023, FlashAttention-2, section 3.1.1) skip the blocks above
# the diagonal, so they run half of the s² products; Narayanan's formula counts the full square.
CAUSAL_ATTENTION_FRACTION = 0.5
# The memory-efficient attention kernel (used on CUDA in fp32) pads its log-sum-exp rows to a
# multiple of 32 (PyTorch's `_efficient_attention_forward`); counting that padding always keeps the
# formula from under-predicting, at most 31 floats per head per sample.
LSE_ROW_MULTIPLE = 32

FP32_BYTES = 4
INT64_BYTES = 8
BOOL_BYTES = 1

# Fraction of a device kind's peak FLOP/s that one layer's forward or backward reaches. End-to-end
# training reaches 44-52% of peak on A100 (Narayanan et al. 2021, table 1: 137-163 TFLOP/s per GPU
# of 312) and 38-43% on H100 (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4); those
# figures include pipeline bubbles and communication, which the cost model adds separately, so the
# layer compute alone runs at the top of each range: we take 0.52 (A100) and 0.43 (H100, H200: the
# same compute die). For the `cpu` kind the peak itself is a placeholder; measure a CPU instead.
ACHIEVABLE_EFFICIENCY = {
    "A100-40GB": 0.52,
    "A100-80GB": 0.52,
    "H100-80GB": 0.43,
    "H200-141GB": 0.43,
    "cpu": 0.5,
}
DEFAULT_ACHIEVABLE_EFFICIENCY = 0.4  # a device kind not in the table above
# Fraction of the datasheet memory bandwidth that streaming kernels reach: Jia et al. 2018,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", measure 750 of 900 GB/s.
MEMORY_BANDWIDTH_EFFICIENCY = 0.8


def achievable_efficiency(kind: str) -> float:
    return ACHIEVABLE_EFFICIENCY.get(kind, DEFAULT_ACHIEVABLE_EFFICIENCY)


def _local(config: ModelConfig, tp_degree: int) -> tuple[int, int, int, int]:
    """Query heads, key/value heads, MLP width and vocabulary rows on TP rank 0."""
    return (
        config.num_heads // tp_degree,
        config.num_kv_heads // tp_degree,
        shard_size(config.intermediate_size, tp_degree, 0),
        shard_size(config.vocab_size, tp_degree, 0),
    )


# ---- FLOPs ------------------------------------------------------------------------------------------
def forward_flops(
    config: ModelConfig, kind: str, micro_batch_size: int, seq_len: int, tp_degree: int
) -> float:
    """Forward FLOPs of one TP shard of a layer of `kind` (embed, block, head); see the module docstring."""
    b, s, h, d = micro_batch_size, seq_len, config.hidden_size, config.head_dim
    heads, kv_heads, width, vocab = _local(config, tp_degree)
    if kind == "embed":
        return 0.0
    if kind == "head":
        return 2.0 * b * s * h * vocab
    projections = 2 * 2 * b * s * h * heads * d + 2 * 2 * b * s * h * kv_heads * d
    attention = 2 * 2 * b * s * s * heads * d * CAUSAL_ATTENTION_FRACTION
    mlp = 3 * 2 * b * s * h * width
    return float(projections + attention + mlp)


def backward_flops(
    config: ModelConfig, kind: str, micro_batch_size: int, seq_len: int, tp_degree: int
) -> float:
    return BACKWARD_FLOPS_FACTOR * forward_flops(config, kind, micro_batch_size, seq_len, tp_degree)


# ---- activation memory -------------------------------------------------------------------------------
def _rmsnorm_bytes(b: int, s: int, h: int, dtype_bytes: int, shards: int = 1) -> int:
    """What one RMSNorm and the projection after it keep: fp32 input, 1/rms, normalised, and the
    projection's input. Under sequence parallelism (`shards` = t) the norm sees s/t tokens and the
    projection keeps the all-gathered whole sequence."""
    local = b * (s // shards)
    return FP32_BYTES * local * h + FP32_BYTES * local + dtype_bytes * local * h + dtype_bytes * b * s * h


def activation_bytes(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """Bytes one TP shard of a layer keeps for backward per micro-batch; see the module docstring.

    `recompute` applies to blocks: "full" keeps the block's input alone (its forward reruns in
    backward); "selective" keeps the q, k, v projections' outputs (k and v before their repetition
    to H heads) and the attention output, not the rotated q and k, the repeated k and v, the
    log-sum-exp or the 16-bit rotary copies, which the attention core recomputes.
    """
    b, s, h, d = micro_batch_size, seq_len, config.hidden_size, config.head_dim
    dt = DTYPE_BYTES[dtype]
    shards = tp_degree if sequence_parallel and tp_degree > 1 else 1
    heads, kv_heads, width, vocab = _local(config, tp_degree)
    if kind == "embed":
        return INT64_BYTES * b * s + (BOOL_BYTES * b * s if tp_degree > 1 else 0)
    if kind == "head":
        loss = FP32_BYTES * b * s * vocab + INT64_BYTES * b * s
        loss += BOOL_BYTES * b * s if tp_degree > 1 else FP32_BYTES
        return _rmsnorm_bytes(b, s, h, dt, shards) + loss
    if recompute == "full":
        return dt * b * (s // shards) * h
    shared_tables = 2 * s * d * FP32_BYTES if dt == FP32_BYTES else 0  # fp32 tables: no copies
    if recompute == "selective":
        attention = dt * b * s * d * (2 * heads + 2 * kv_heads) + shared_tables
    else:
        rows = -(-s // LSE_ROW_MULTIPLE) * LSE_ROW_MULTIPLE
        rotary_tables = shared_tables if dt == FP32_BYTES else 4 * s * d * dt
        attention = 4 * dt * b * s * heads * d + FP32_BYTES * b * heads * rows + rotary_tables
    mlp = 4 * dt * b * s * width
    return 2 * _rmsnorm_bytes(b, s, h, dt, shards) + attention + mlp


def recompute_transient_bytes(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    sequence_parallel: bool,
    recompute: str,
) -> int:
    """What recomputing one block in backward holds at once on top of what it kept: the activations
    its rerun forward saves (the whole block's, or the attention core's), freed as its backward
    consumes them."""
    if kind != "block" or recompute == "none":
        return 0
    args = (config, kind, micro_batch_size, seq_len, tp_degree, dtype, sequence_parallel)
    return activation_bytes(*args, "none") - activation_bytes(*args, recompute)


def backward_transient_bytes(
    config: ModelConfig, kind: str, micro_batch_size: int, seq_len: int, tp_degree: int, dtype: str
) -> int:
    """Working memory of one layer shard's forward and backward above what it keeps, for profiles
    that do not measure it (the analytic ones). Every layer: its parameters' gradients, which autograd
    makes anew before adding them to the accumulated ones. Measured on CPU (`profiler.memory`): the
    embedding's backward makes a dense gradient of its V/t x h rows (that one) plus two (three with
    the out-of-shard mask) hidden-sized gradients; the head's holds its V/t logits and two fp32
    buffers of their size (the fp32 copy and the shifted logits in the loss forward, the softmax
    gradient and the logits' own in backward). A block's is bounded by the gradients of everything it keeps
    alive at once plus its output gradient (measured: 35-65% of that bound), which this takes:
    never below the truth."""
    b, s, h = micro_batch_size, seq_len, config.hidden_size
    dt = DTYPE_BYTES[dtype]
    _, _, _, vocab = _local(config, tp_degree)
    if kind == "embed":
        return vocab * h * dt + (3 if tp_degree > 1 else 2) * dt * b * s * h
    grads = shard_param_count(config, kind, tp_degree) * dt
    if kind == "head":  # the logits, and two fp32 logit-sized buffers in the loss forward or backward
        return grads + (2 * FP32_BYTES + dt) * b * s * vocab
    kept = activation_bytes(config, kind, micro_batch_size, seq_len, tp_degree, dtype)
    return grads + kept + dt * b * s * h


def attention_core_fraction(
    config: ModelConfig, micro_batch_size: int, seq_len: int, tp_degree: int
) -> float:
    """The attention core's share (scores and values products) of a block's forward FLOPs: what a
    selective recomputation reruns."""
    b, s = micro_batch_size, seq_len
    heads = config.num_heads // tp_degree
    core = 2 * 2 * b * s * s * heads * config.head_dim * CAUSAL_ATTENTION_FRACTION
    return core / forward_flops(config, "block", micro_batch_size, seq_len, tp_degree)


def output_bytes_per_sample(config: ModelConfig, kind: str, seq_len: int, dtype: str) -> int:
    """What a stage ending after this layer sends per sample: hidden states, or the head's logits."""
    width = config.vocab_size if kind == "head" else config.hidden_size
    return seq_len * width * DTYPE_BYTES[dtype]


def shard_param_count(config: ModelConfig, kind: str, tp_degree: int) -> int:
    """Parameters one TP shard of a layer holds (rank 0; norms are replicated)."""
    h, d = config.hidden_size, config.head_dim
    heads, kv_heads, width, vocab = _local(config, tp_degree)
    if kind == "embed":
        return vocab * h
    if kind == "head":
        return h + vocab * h  # a tied head still multiplies by its copy of the embedding
    return 2 * h + 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * width


# ---- time: a roofline ------------------------------------------------------------------------------
def roofline_s(flops: float, traffic_bytes: float, device: DeviceKind, efficiency: float) -> float:
    """Williams, Waterman & Patterson 2009, "Roofline": the slower of compute and memory traffic."""
    compute = flops / (device.peak_flops * efficiency)
    memory = traffic_bytes / (device.memory_bandwidth_gbps * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


def layer_times_s(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    device: DeviceKind,
    efficiency: float,
) -> tuple[float, float]:
    """(forward, backward) seconds of one TP shard on `device`.

    Memory traffic of a forward: the shard's weights read once, its kept activations and its output
    written once; the backward moves about twice that (weights, their gradients, the activations,
    the input gradient), as its FLOPs. The embedding is the exception: its forward reads only the
    b·s rows it gathers, and PyTorch's dense embedding backward writes a gradient the size of the
    whole V/t × h shard and adds it to `.grad`.
    """
    dt = DTYPE_BYTES[dtype]
    weights = shard_param_count(config, kind, tp_degree) * dt
    kept = activation_bytes(config, kind, micro_batch_size, seq_len, tp_degree, dtype)
    hidden = micro_batch_size * seq_len * config.hidden_size * dt
    if kind == "embed":
        fwd_traffic, bwd_traffic = 2 * hidden + kept, 2 * weights
    else:
        fwd_traffic = weights + kept + hidden
        bwd_traffic = BACKWARD_FLOPS_FACTOR * fwd_traffic
    fwd = forward_flops(config, kind, micro_batch_size, seq_len, tp_degree)
    return (
        roofline_s(fwd, fwd_traffic, device, efficiency),
        roofline_s(BACKWARD_FLOPS_FACTOR * fwd, bwd_traffic, device, efficiency),
    )

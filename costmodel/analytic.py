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
    attention, the fused kernel (flash attention on CPU and on CUDA in 16 bit, memory-efficient
    attention on CUDA in fp32; no s×s matrix is kept, which removes Korthikanti's 5as²b term):
        q after rotary, k and v as attention sees them (grouped k, v repeated to H heads
        before the kernel whenever K < H), the attention output           4 · D·b·s·(H/t)·d
        the log-sum-exp per query row, fp32, rows padded to LSE_ROW_MULTIPLE 4·b·(H/t)·s'
        the rotary cos and sin tables (fp32: two shared tables; else a converted copy per q and k)
    attention, the math kernel (`costmodel.profile.ATTENTION_KERNELS`): the scaled q and k its
        first product keeps, v, the attention output (4 · D·b·s·(H/t)·d, as above), the softmax
        output D·b·(H/t)·s², and the rotary tables as above; no log-sum-exp
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

# Named kernel efficiencies: the fraction of a device kind's datasheet peak that one class of
# kernel reaches, each from a published microbenchmark of that kernel on that GPU (not from an
# end-to-end training run, whose bubbles and communication the cost model counts on its own).
#   gemm       dense 16-bit matrix products (cuBLAS). A100: optimised GEMMs reach 80-90% of peak
#              (Dao 2023, "FlashAttention-2", section 1); we take the low end, as a transformer's
#              GEMMs are narrower than the square best case. H100 and H200 (one compute die): the
#              maximum achievable bf16 matmul throughput measured on H100 SXM, about 80% of its 989
#              TFLOP/s (Bekman, "Machine Learning Engineering", chapter "Maximum Achievable Matmul
#              FLOPS", 2024).
#   attention  the causal attention kernel torch's scaled_dot_product_attention dispatches in 16 bit
#              (FlashAttention-2). A100: 50-73% of peak forward and backward (Dao 2023, abstract); we
#              take the middle, 0.6. H100/H200: 35% (Shah et al. 2024, "FlashAttention-3", abstract:
#              FlashAttention-2 does not use Hopper's asynchronous tensor cores).
#   bandwidth  streaming elementwise and reduction kernels (norms, rotary, SiLU, residual adds,
#              casts, the loss): 80% of the datasheet memory bandwidth (Jia et al. 2018,
#              "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking": 750 of 900 GB/s).
# The `cpu` kind's peak is a placeholder (measure a CPU instead); its efficiencies are too.
KERNEL_EFFICIENCY = {
    "A100-40GB": {"gemm": 0.80, "attention": 0.60, "bandwidth": 0.80},
    "A100-80GB": {"gemm": 0.80, "attention": 0.60, "bandwidth": 0.80},
    "H100-80GB": {"gemm": 0.80, "attention": 0.35, "bandwidth": 0.80},
    "H200-141GB": {"gemm": 0.80, "attention": 0.35, "bandwidth": 0.80},
    "cpu": {"gemm": 0.5, "attention": 0.5, "bandwidth": 0.8},
}
DEFAULT_KERNEL_EFFICIENCY = {"gemm": 0.6, "attention": 0.35, "bandwidth": 0.7}  # a kind not listed
# FlashAttention's backward runs five matrix products per tile (it recomputes the scores) against
# the forward's two: 2.5 times the forward FLOPs (Dao 2023, section 3.1.2).
ATTENTION_BACKWARD_FLOPS_FACTOR = 2.5
# An elementwise kernel's backward reads the output gradient and what the forward saved and writes
# the input gradients: about twice the tensors its forward reads and writes (a multiply: 3 forward,
# 5 backward; a unary op: 2 and 3; a norm's backward adds a reduction pass).
ELEMENTWISE_BACKWARD_FACTOR = 2.0


def kernel_efficiency(kind: str) -> dict[str, float]:
    return KERNEL_EFFICIENCY.get(kind, DEFAULT_KERNEL_EFFICIENCY)


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
    attention: str = "fused",
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
        core = dt * b * s * d * (2 * heads + 2 * kv_heads) + shared_tables
    else:
        rotary_tables = shared_tables if dt == FP32_BYTES else 4 * s * d * dt
        if attention == "math":
            scores = dt * b * heads * s * s  # the softmax output
        else:
            scores = FP32_BYTES * b * heads * (-(-s // LSE_ROW_MULTIPLE) * LSE_ROW_MULTIPLE)  # log-sum-exp
        core = 4 * dt * b * s * heads * d + scores + rotary_tables
    mlp = 4 * dt * b * s * width
    return 2 * _rmsnorm_bytes(b, s, h, dt, shards) + core + mlp


def recompute_transient_bytes(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    sequence_parallel: bool,
    recompute: str,
    attention: str = "fused",
) -> int:
    """What recomputing one block in backward holds at once on top of what it kept: the activations
    its rerun forward saves (the whole block's, or the attention core's), freed as its backward
    consumes them."""
    if kind != "block" or recompute == "none":
        return 0
    args = (config, kind, micro_batch_size, seq_len, tp_degree, dtype, sequence_parallel)
    return activation_bytes(*args, "none", attention) - activation_bytes(*args, recompute, attention)


def backward_transient_bytes(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    attention: str = "fused",
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
    kept = activation_bytes(config, kind, micro_batch_size, seq_len, tp_degree, dtype, attention=attention)
    return grads + kept + dt * b * s * h


def attention_core_fraction(
    config: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    attention: str = "fused",
    priced_on: tuple[str, DeviceKind] | None = None,
) -> float:
    """The attention core's share of a block's forward: what a selective recomputation reruns. For
    the fused kernel its share of the FLOPs (scores and values products). The math kernel's core is
    bound by the traffic of its s x s scores: its share of the block's roofline time in the (dtype,
    device kind) `priced_on`, or without one its FLOP share (the whole square: a lower bound)."""
    args = (config, micro_batch_size, seq_len, tp_degree)
    if attention == "math" and priced_on is not None:
        dtype, device = priced_on
        core, _ = attention_core_s(*args, dtype, device, attention)
        block, _ = layer_times_s(config, "block", *args[1:], dtype, device, attention)
        return core / block
    b, s = micro_batch_size, seq_len
    heads = config.num_heads // tp_degree
    square = 1.0 if attention == "math" else CAUSAL_ATTENTION_FRACTION
    core = 2 * 2 * b * s * s * heads * config.head_dim * square
    return min(1.0, core / forward_flops(config, "block", micro_batch_size, seq_len, tp_degree))


# ---- split backward (ZB-H1; runtime/split_backward.py) ---------------------------------------------
def _projection_gemms_s(
    config: ModelConfig, tokens: int, tp_degree: int, dt: int, device: DeviceKind
) -> float:
    """The forward time of a block shard's seven projections (q, k, v, o, gate, up, down) on
    `device`; their input gradients take as long again, and so do their weight gradients."""
    h, d = config.hidden_size, config.head_dim
    heads, kv_heads, width, _ = _local(config, tp_degree)
    q, kv = heads * d, kv_heads * d
    return (
        gemm_s(tokens, h, q, dt, device)
        + gemm_s(tokens, h, kv, dt, device, copies=2)
        + gemm_s(tokens, q, h, dt, device)
        + gemm_s(tokens, h, width, dt, device, copies=2)
        + gemm_s(tokens, width, h, dt, device)
    )


def weight_gradient_fraction(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    attention: str = "fused",
    priced_on: DeviceKind | None = None,
) -> float:
    """The share of a layer shard's backward that the split backward defers to its W: a block's
    projections' weight-gradient GEMMs and its main-gradient accumulation (the hooks fire in W);
    0 for the embedding and the head, whose gradients stay in B. On a device kind it is their
    share of `layer_times_s`'s backward (so an analytic profile's W is exactly those kernels' time);
    without one, the GEMMs' share of the backward FLOPs."""
    if kind != "block":
        return 0.0
    b, s = micro_batch_size, seq_len
    if priced_on is not None:
        dt = DTYPE_BYTES[dtype]
        bandwidth = priced_on.memory_bandwidth_gbps * 1e9 * kernel_efficiency(priced_on.kind)["bandwidth"]
        deferred = _projection_gemms_s(config, b * s, tp_degree, dt, priced_on)
        deferred += main_gradient_bytes(config, kind, tp_degree, dtype) / bandwidth
        _, backward = layer_times_s(config, kind, b, s, tp_degree, dtype, priced_on, attention)
        return min(1.0, deferred / backward)
    # the projections are the forward's FLOPs less the (causal) attention core's
    return (1.0 - attention_core_fraction(config, b, s, tp_degree)) / BACKWARD_FLOPS_FACTOR


def deferred_gradient_bytes(
    config: ModelConfig, kind: str, micro_batch_size: int, seq_len: int, tp_degree: int, dtype: str
) -> int:
    """What a block shard holds per micro-batch from its B to its W (runtime/split_backward.py): each
    deferred projection's input (the two normalised inputs, the attention output, the MLP's product;
    shared by q, k, v and by gate, up) and output gradient (q, k, v, gate and up at their shard's
    width, o and down at the hidden size), all over the whole sequence as the projections see it,
    under sequence parallelism too. The rest of its activations B frees; under recomputation the
    inputs are the rerun forward's, held all the same."""
    if kind != "block":
        return 0
    b, s, h, d = micro_batch_size, seq_len, config.hidden_size, config.head_dim
    heads, kv_heads, width, _ = _local(config, tp_degree)
    q, kv = heads * d, kv_heads * d
    inputs = 2 * h + q + width
    output_gradients = q + 2 * kv + 2 * width + 2 * h
    return DTYPE_BYTES[dtype] * b * s * (inputs + output_gradients)


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
    biases = (heads + 2 * kv_heads) * d if config.qkv_bias else 0
    return 2 * h + 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * width + biases


# ---- time: a roofline per kernel --------------------------------------------------------------------
def roofline_s(flops: float, traffic_bytes: float, device: DeviceKind, flops_efficiency: float) -> float:
    """Williams, Waterman & Patterson 2009, "Roofline": the slower of compute and memory traffic."""
    bandwidth = device.memory_bandwidth_gbps * 1e9 * kernel_efficiency(device.kind)["bandwidth"]
    return max(flops / (device.peak_flops * flops_efficiency), traffic_bytes / bandwidth)


def gemm_s(m: int, k: int, n: int, dtype_bytes: int, device: DeviceKind, copies: int = 1) -> float:
    """`copies` products of [m, k] x [k, n] (2 m k n FLOPs each, the three matrices moved once)."""
    eff = kernel_efficiency(device.kind)["gemm"]
    return copies * roofline_s(2.0 * m * k * n, dtype_bytes * (m * k + k * n + m * n), device, eff)


def elementwise_bytes(config: ModelConfig, kind: str, b: int, s: int, tp: int, dtype: str) -> int:
    """Bytes the forward's elementwise and reduction kernels read and write on one TP shard, op by
    op as runtime/model.py runs them in eager PyTorch (per token, D = dtype bytes, 4 = fp32):
        RMSNorm (per norm, h wide): the fp32 copy (D + 4, none in fp32), its square (8), the mean
            (4), the scaling (8), back to the dtype (4 + D, none in fp32), times the weight (3 D)
        rotary on q and k (n = their widths): two products, the half rotation and its concatenation,
            the sum: 10 D n; key/value repetition for grouped heads: D (k, v read, q-wide written)
        the attention output's transpose to [b, s, heads]: 2 D q
        SwiGLU: SiLU (2 D F) and the product with up (3 D F); two residual additions (3 D h each)
        embedding: the gather (2 D h), and under TP the out-of-shard mask and zeroing (1 + 2 D h)
        head: its norm, then the loss over the V/t logits: the fp32 copy (D + 4), log-softmax
            (two passes over it and the output: 12), the picked targets (negligible)"""
    dt, tokens = DTYPE_BYTES[dtype], b * s
    heads, kv_heads, width, vocab = _local(config, tp)
    q, kv = heads * config.head_dim, kv_heads * config.head_dim
    cast = 0 if dt == FP32_BYTES else dt + FP32_BYTES  # one conversion to or from fp32
    norm = config.hidden_size * (2 * cast + 8 + 4 + 8 + 3 * dt)
    if kind == "embed":
        return tokens * config.hidden_size * (2 * dt + (1 + 2 * dt if tp > 1 else 0))
    if kind == "head":
        return tokens * (norm + vocab * (cast + 12))
    rotary = 10 * dt * (q + kv)
    repeat = dt * (2 * kv + 2 * q) if kv_heads < heads else 0
    mlp = 5 * dt * width
    return tokens * (2 * norm + rotary + repeat + 2 * dt * q + mlp + 2 * 3 * dt * config.hidden_size)


def layer_times_s(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    device: DeviceKind,
    attention: str = "fused",
) -> tuple[float, float]:
    """(forward, backward) seconds of one TP shard on `device`: every kernel at its own roofline
    and named efficiency (KERNEL_EFFICIENCY), summed, as the kernels of one stream run one after the
    other. Backward: each GEMM twice (input and weight gradients), attention at
    ATTENTION_BACKWARD_FLOPS_FACTOR, elementwise traffic at ELEMENTWISE_BACKWARD_FACTOR, and the
    runtime's main-gradient accumulation (`main_gradient_bytes`). The embedding's backward also
    writes a dense gradient of its whole V/t x h shard (PyTorch's dense embedding backward)."""
    b, s, h = micro_batch_size, seq_len, config.hidden_size
    dt = DTYPE_BYTES[dtype]
    vocab = _local(config, tp_degree)[3]
    eff = kernel_efficiency(device.kind)
    tokens = b * s
    bandwidth = device.memory_bandwidth_gbps * 1e9 * eff["bandwidth"]
    moved = elementwise_bytes(config, kind, b, s, tp_degree, dtype) / bandwidth
    accumulate = main_gradient_bytes(config, kind, tp_degree, dtype) / bandwidth
    if kind == "embed":
        dense_grad = vocab * h * dt  # written whole, then accumulated like any other gradient
        return moved, ELEMENTWISE_BACKWARD_FACTOR * moved + dense_grad / bandwidth + accumulate
    if kind == "head":
        gemm = gemm_s(tokens, h, vocab, dt, device)
        return gemm + moved, 2 * gemm + ELEMENTWISE_BACKWARD_FACTOR * moved + accumulate
    gemms = _projection_gemms_s(config, tokens, tp_degree, dt, device)
    core, core_bwd = attention_core_s(config, b, s, tp_degree, dtype, device, attention)
    backward = 2 * gemms + core_bwd + ELEMENTWISE_BACKWARD_FACTOR * moved + accumulate
    return gemms + core + moved, backward


def main_gradient_bytes(config: ModelConfig, kind: str, tp_degree: int, dtype: str) -> int:
    """Bytes one micro-batch's gradient accumulation moves on a layer's TP shard: the runtime's
    post-accumulate-grad hook (runtime/dist_optim.py) adds each parameter's gradient, in the model
    dtype, into its fp32 main gradient (read D, read and write 4 per parameter), a kernel of its
    own, as the measured profile times it (profiler/measure.py). Megatron-LM fuses this add into the
    weight-gradient GEMM (its gradient accumulation fusion); this runtime does not, and the model
    counts what the runtime does."""
    return shard_param_count(config, kind, tp_degree) * (DTYPE_BYTES[dtype] + 2 * FP32_BYTES)


def attention_core_s(
    config: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    device: DeviceKind,
    attention: str = "fused",
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one block's TP shard, by kernel
    (`costmodel.profile.ATTENTION_KERNELS`).

    fused: one kernel at the attention efficiency, the causal half of the s² products, backward at
    ATTENTION_BACKWARD_FLOPS_FACTOR. math, kernel by kernel as torch's math attention runs them (per
    head, D = dtype bytes, Z = D·b·H·s² the bytes of one scores matrix): forward, q and k scaled
    (each read and written), q k^T and the product with v (full s x s GEMMs: the causal mask does
    not skip work), the mask added in place (scores and mask read, scores written: 3 Z), the
    softmax (2 Z); backward, four s x s GEMMs (the gradients of both products), the softmax's (its
    output and output gradient read, the input gradient written: 3 Z) and the two scalings'."""
    b, s, d = micro_batch_size, seq_len, config.head_dim
    dt = DTYPE_BYTES[dtype]
    heads = config.num_heads // tp_degree
    eff = kernel_efficiency(device.kind)
    q = heads * d
    if attention == "math":
        bandwidth = device.memory_bandwidth_gbps * 1e9 * eff["bandwidth"]
        scores = dt * b * heads * s * s
        scaling = 2 * 2 * dt * b * s * q / bandwidth
        product = gemm_s(s, d, s, dt, device, copies=b * heads)  # q k^T; p v moves and multiplies as much
        forward = 2 * product + scaling + 5 * scores / bandwidth
        return forward, 4 * product + scaling + 3 * scores / bandwidth
    core_flops = 2 * 2 * b * s * s * q * CAUSAL_ATTENTION_FRACTION
    core_bytes = dt * b * s * 4 * q  # q, k and v (repeated to H heads) read, the output written
    forward = roofline_s(core_flops, core_bytes, device, eff["attention"])
    backward = roofline_s(
        ATTENTION_BACKWARD_FLOPS_FACTOR * core_flops, 2 * core_bytes, device, eff["attention"]
    )
    return forward, backward

"""The reference model: a Llama-style decoder whose layers can be built in any contiguous range.

The layer list is `embed`, `blocks.0` ... `blocks.{n-1}`, `head`. `ModelSlice(config, start, end)`
builds entries [start, end) only, with the same parameter names (FQNs) as the whole model, so a
pipeline stage holds exactly `blocks.17.attn.wq.weight` and not a renumbered copy. Parameters are
initialised from the seed and their global name alone (`init_parameters`): every partition of the
model starts from identical weights.

Conventions follow Hugging Face's LlamaForCausalLM so that checkpoints export without permutation:
rotary embeddings rotate the two halves of each head (`rotate_half`), RMSNorm computes in fp32.
With tied embeddings, a slice that holds `head` but not `embed` keeps its own copy of `embed.weight`;
the runtime sums the two copies' gradients like any other replicated parameter.

`tp_degree` (and `tp_rank`) build one rank's shard of attention (heads / t) and MLP (its share of
the width, which costmodel/layout.py splits larger-first when t does not divide it) without any
communication; the runtime adds the collectives, the profiler times the shard as it is.
"""

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from costmodel.config import ModelConfig
from costmodel.layout import shard_size

INIT_STD = 0.02  # GPT-2 / Llama reference initialisation of weight matrices


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_frequencies(config: ModelConfig, device=None) -> torch.Tensor:
    """The head_dim / 2 rotary frequencies theta^(-2i/d), with Llama 3.1's scaling when the model has
    it: wavelengths (2 pi / frequency) above original_max_seq_len / low_freq_factor are stretched by
    `factor`, those below original_max_seq_len / high_freq_factor kept, and in between the two are
    mixed linearly in original_max_seq_len / wavelength (Dubey et al. 2024; Meta's reference code)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    mix = (s.original_max_seq_len / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mixed = (1 - mix) * inv_freq / s.factor + mix * inv_freq
    long_waves = wavelength > s.original_max_seq_len / s.low_freq_factor
    short_waves = wavelength < s.original_max_seq_len / s.high_freq_factor
    return torch.where(long_waves, inv_freq / s.factor, torch.where(short_waves, inv_freq, mixed))


def rotary_tables(config: ModelConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim] (Su et al. 2021, RoFormer; half-split layout)."""
    inv_freq = rotary_frequencies(config, device)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention; with `tp_degree` t, this rank's heads/t query heads.

    `recompute_core` (selective recomputation, Korthikanti et al. 2022, section 5) keeps only the
    q, k, v projections' outputs and reruns the attention core (rotary, key/value repetition, the
    attention kernel) in backward, with `torch.utils.checkpoint` (non-reentrant: bit-identical).
    `kernel` is the plan's attention (costmodel.profile.ATTENTION_KERNELS): "fused" lets
    scaled_dot_product_attention dispatch its flash or memory-efficient kernel, "math" runs the
    unfused composition that materialises the scores (`math_attention`).
    """

    def __init__(self, config: ModelConfig, tp_degree: int = 1):
        super().__init__()
        self.recompute_core = False
        self.kernel = "fused"
        self.head_dim = config.head_dim
        self.local_heads = config.num_heads // tp_degree
        self.local_kv_heads = config.num_kv_heads // tp_degree
        h = config.hidden_size
        bias = config.qkv_bias
        self.wq = nn.Linear(h, self.local_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(h, self.local_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(h, self.local_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.local_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if self.recompute_core:
            out = checkpoint(self._core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self._core(q, k, v, cos, sin)
        return self.wo(out)

    def _core(self, q, k, v, cos, sin) -> torch.Tensor:
        """Rotary, key/value repetition and causal attention: [b, heads, s, d] in, [b, s, heads * d] out."""
        b, _, s, _ = q.shape
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.local_heads // self.local_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        with math_attention() if self.kernel == "math" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)


@contextlib.contextmanager
def math_attention():
    """torch's math attention (SDPBackend.MATH) in the inputs' dtype. By default torch computes it
    in fp32 from 16-bit inputs, keeping fp32 copies of q, k, v and the scores; the cost model and the
    unfused attention it prices (Megatron-LM before FlashAttention) keep them in 16 bit, so 16-bit
    reductions are allowed for the call (a process-wide switch, restored after it)."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); with `tp_degree` t, TP rank `tp_rank`'s
    share of the width (rank 0's, the largest, by default)."""

    def __init__(self, config: ModelConfig, tp_degree: int = 1, tp_rank: int = 0):
        super().__init__()
        width = shard_size(config.intermediate_size, tp_degree, tp_rank)
        self.gate = nn.Linear(config.hidden_size, width, bias=False)
        self.up = nn.Linear(config.hidden_size, width, bias=False)
        self.down = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, tp_degree: int = 1, tp_rank: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, tp_degree)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config, tp_degree, tp_rank)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """Final RMSNorm and output projection (absent when tied: the slice's `embed.weight` is used)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.output = (
            None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None) -> torch.Tensor:
        x = self.norm(x)
        return F.linear(x, tied_weight) if self.output is None else self.output(x)


class ModelSlice(nn.Module):
    """Entries [start, end) of the layer list, with global parameter names.

    Input: token ids [batch, seq] when the slice starts at `embed`, else hidden states
    [batch, seq, hidden]. Output: logits [batch, seq, vocab] when it ends with `head`, else hidden states.
    """

    def __init__(self, config: ModelConfig, start: int = 0, end: int | None = None, *, seed: int = 0):
        super().__init__()
        end = config.num_layers if end is None else end
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {config.num_layers})")
        self.config, self.start, self.end = config, start, end
        has_head = end == config.num_layers
        needs_embedding = start == 0 or (has_head and config.tie_embeddings)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size) if needs_embedding else None
        first_block, last_block = max(start, 1) - 1, min(end, config.num_layers - 1) - 1
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(first_block, last_block)})
        self.head = Head(config) if has_head else None
        init_parameters(self, config, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.start == 0:
            x = self.embed(x)
        if len(self.blocks):
            cos, sin = rotary_tables(self.config, x.shape[1], device=x.device)
            for block in self.blocks.values():
                x = block(x, cos, sin)
        if self.head is not None:
            x = self.head(x, self.embed.weight if self.head.output is None else None)
        return x


def build_model(config: ModelConfig, *, seed: int = 0) -> ModelSlice:
    """The whole model: the single-process reference every plan must reproduce."""
    return ModelSlice(config, 0, config.num_layers, seed=seed)


def _init_std(name: str, config: ModelConfig) -> float | None:
    """None for norm weights (ones); 0 for biases (zeros); residual-output projections scaled by
    1/sqrt(2 * blocks) (GPT-2)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(("attn.wo.weight", "mlp.down.weight")):
        return INIT_STD / math.sqrt(2 * config.num_blocks)
    return INIT_STD


def init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, seed: int) -> torch.Tensor:
    """The initial value of the full parameter `name`; a function of (seed, name, shape) alone."""
    std = _init_std(name, config)
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(module: nn.Module, config: ModelConfig, seed: int) -> None:
    for name, param in module.named_parameters():
        param.copy_(init_tensor(name, tuple(param.shape), config, seed))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy; callers divide by the global token count so gradients add up."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

"""Model FLOPs and MFU: the one definition every throughput in Elastor is reported with.

Model FLOPs per token are the matrix products of one forward and backward pass of the model,
recomputation excluded (Chowdhery et al. 2022, "PaLM", appendix B: MFU counts what the model needs,
not what the implementation reruns). Per token of a sequence of s tokens, with 2 FLOPs per
multiply-add and the backward twice the forward (Narayanan et al. 2021, section 5.1):

    forward = sum over blocks of  2·(2·h·H·d + 2·h·K·d + 3·h·F)      projections and SwiGLU MLP
                                + 2·2·s·H·d                          attention scores and values
            + 2·h·V                                                  output projection
    model FLOPs per token = 3 · forward

(h hidden size, H query heads and K key/value heads of size d, F MLP width, V vocabulary). The
attention term counts the whole s × s square, as both references do, although a causal kernel runs
half of it. For a GPT layer (H·d = K·d = h, a two-matrix MLP of 4h, 8h² = 3·h·F) that is
72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V per step of B sequences, PaLM's 6N + 12·L·H·Q·T per token.
Narayanan's published 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) is the same with every block's
forward run twice (full recomputation; the head is not recomputed, its 6·B·s·h·V stays).

    MFU = model FLOPs per step / (step time × GPUs × the device kind's peak 16-bit FLOP/s)

Hardware FLOPs (HFU) add what recomputation reruns, as Narayanan's published TFLOP/s per GPU do;
`hardware_flops_per_token` counts either mode.
"""

from costmodel.config import ModelConfig


def _attention_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """One block's attention scores and values for one token: the whole s x s square."""
    return 2 * 2 * seq_len * config.num_heads * config.head_dim


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Matrix-product FLOPs of one token's forward pass (module docstring)."""
    h, d = config.hidden_size, config.head_dim
    projections = 2 * (2 * h * config.num_heads * d + 2 * h * config.num_kv_heads * d)
    mlp = 2 * 3 * h * config.intermediate_size
    blocks = config.num_blocks * (projections + mlp + _attention_flops_per_token(config, seq_len))
    return float(blocks + 2 * h * config.vocab_size)


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(config, seq_len)


def model_flops_per_step(config: ModelConfig, seq_len: int, global_batch_size: int) -> float:
    """Model FLOPs of a step of `global_batch_size` sequences of `seq_len` tokens."""
    return model_flops_per_token(config, seq_len) * seq_len * global_batch_size


def hardware_flops_per_token(config: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """Model FLOPs plus a rerun forward of every block (full) or of its attention core (selective)."""
    if recompute == "full":
        rerun = forward_flops_per_token(config, seq_len) - 2 * config.hidden_size * config.vocab_size
    elif recompute == "selective":
        rerun = config.num_blocks * _attention_flops_per_token(config, seq_len)
    else:
        rerun = 0.0
    return model_flops_per_token(config, seq_len) + rerun


def mfu(model_flops_per_step: float, step_time_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation of a step (module docstring)."""
    return model_flops_per_step / (step_time_s * gpus * peak_flops)

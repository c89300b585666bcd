"""The per-rank shards the profiler times: one TP rank's piece of embed, a block, and the head.

A TP degree t is profiled on one device by building what TP rank 0 holds (the largest piece of every
uneven split) and running it alone; the collectives that would join the ranks are left out, the
cost model adds them. Each shard maps an example input to the tensor backward starts from:
    embed  token ids [b, s] -> hidden [b, s, h]; vocabulary-parallel rows [0, V/t), ids outside the
           shard look up row 0 and are zeroed (Megatron-LM's VocabParallelEmbedding without its
           all-reduce)
    block  hidden -> hidden; `runtime.model.Block(config, tp_degree=t)` itself, with the rotary
           tables made once outside it, as `ModelSlice` does for a whole stage
    head   hidden -> summed loss; final RMSNorm, the V/t rows of the output projection, and the
           runtime's `cross_entropy_sum` over those V/t logits (the same work and the same kept
           softmax as a vocabulary-parallel cross-entropy, without its two small all-reduces)
"""

import torch
from torch import nn

from costmodel.config import ModelConfig
from costmodel.layout import shard_size
from runtime.model import Block, RMSNorm, cross_entropy_sum, rotary_tables

KINDS = ("embed", "block", "head")


class EmbedShard(nn.Module):
    def __init__(self, config: ModelConfig, tp_degree: int):
        super().__init__()
        self.tp_degree = tp_degree
        self.rows = shard_size(config.vocab_size, tp_degree, 0)
        self.weight = nn.Parameter(torch.randn(self.rows, config.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return nn.functional.embedding(ids, self.weight)
        outside = ids >= self.rows  # rank 0 owns rows [0, rows)
        local = ids.masked_fill(outside, 0)
        return nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)


class BlockShard(nn.Module):
    def __init__(self, config: ModelConfig, tp_degree: int):
        super().__init__()
        self.config = config
        self.block = Block(config, tp_degree)
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rotary is None or self._rotary[0].shape[0] != x.shape[1]:
            self._rotary = rotary_tables(self.config, x.shape[1], device=x.device)
        return self.block(x, *self._rotary)


class HeadShard(nn.Module):
    def __init__(self, config: ModelConfig, tp_degree: int):
        super().__init__()
        self.rows = shard_size(config.vocab_size, tp_degree, 0)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.output = nn.Linear(config.hidden_size, self.rows, bias=False)
        self.targets: torch.Tensor | None = None  # set by `example_input`, like a batch's labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(self.output(self.norm(x)), self.targets)


def build_shard(
    config: ModelConfig, kind: str, tp_degree: int, device: str, dtype: torch.dtype, attention: str = "fused"
) -> nn.Module:
    """TP rank 0's shard of a layer of `kind`, on `device` in `dtype`; a block runs the `attention`
    kernel (costmodel.profile.ATTENTION_KERNELS)."""
    module = {"embed": EmbedShard, "block": BlockShard, "head": HeadShard}[kind](config, tp_degree)
    if kind == "block":
        module.block.attn.kernel = attention
    return module.to(device=device, dtype=dtype)


def example_input(
    shard: nn.Module, config: ModelConfig, micro_batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """A micro-batch for `shard`: token ids for embed, hidden states (needing grad) otherwise."""
    weight = next(shard.parameters())
    b, s = micro_batch_size, seq_len
    if isinstance(shard, EmbedShard):
        return torch.randint(0, config.vocab_size, (b, s), generator=generator).to(weight.device)
    if isinstance(shard, HeadShard):
        shard.targets = torch.randint(0, shard.rows, (b, s), generator=generator).to(weight.device)
    x = torch.randn(b, s, config.hidden_size, generator=generator).to(weight.device, weight.dtype)
    return x.requires_grad_()

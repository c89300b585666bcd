"""Tensor parallelism inside a stage: Megatron-style regions made of two autograd functions.

Shoeybi et al. 2019 (Megatron-LM, section 3) parallelise a block with two conjugate operators:
`f` is the identity forward and an all-reduce backward (before a column-parallel layer, whose input
every rank needs whole), `g` is an all-reduce forward and the identity backward (after a row-parallel
layer, whose outputs are partial sums). Attention is column-parallel in whole heads (wq, wk, wv) and
row-parallel in wo; the MLP is column-parallel in gate/up and row-parallel in down. The embedding and
the output projection are split along the vocabulary.

Why explicit autograd functions rather than DTensor's `parallelize_module`: costmodel/layout.py is
the sharding contract, and it splits an uneven dimension larger-first (an MLP of width 100 on 3 ranks
is 34, 33, 33) while DTensor's `Shard` follows `torch.chunk` (34, 34, 32). Explicit regions take
whatever local shapes the layout gives, add exactly two all-reduces per block forward and two
backward, and are exact: every rank ends a region with the same full activation.

Why a vocabulary-parallel cross-entropy rather than all-gathering the logits: the gathered logits
would be [tokens, vocab] on every rank of the last stage (for Llama's 32k vocabulary, the largest
activation of the model) and the gather moves tp-1 times that; the parallel loss moves three numbers
per token (a max, a sum of exponentials, the target's logit).

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) replaces the two all-reduces of a
region by their halves: between regions the residual stream and the norms are split along the
sequence (rank r holds tokens [r·s/t, (r+1)·s/t), `costmodel.boundary.token_range`), the region's
input is all-gathered along the sequence (`g`: reduce-scatter backward) and its partial output
reduce-scattered back to the slices (`g-bar`: all-gather backward). The bytes each rank moves are
those of the all-reduce (a ring all-reduce is a reduce-scatter then an all-gather), the norms compute
on s/t tokens, and the activations they keep shrink by t. Explicit functions rather than DTensor's
`SequenceParallel` for the same reason as above: the layout contract's uneven shards. The
sequence itself is split evenly (`Plan.validate` requires t to divide seq_len, as Megatron does).
Under sequence parallelism the TP replicas of a norm weight see different tokens, so their
gradients are partial sums that the gradient sync adds up (`costmodel.layout.contributes`).

The model itself knows nothing of this: `apply_tensor_parallel` wraps an ordinary `Block` (built with
its shard's shapes) with forward hooks, so parameter names stay global.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from costmodel.config import ModelConfig
from runtime.distributed import all_gather_single, reduce_scatter_single
from runtime.model import RMSNorm, cross_entropy_sum


class _CopyToRegion(torch.autograd.Function):
    """`f`: identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """`g`: all-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/t, h] slices of every rank -> the whole [b, s, h], in rank order along the sequence."""
    t = dist.get_world_size(group)
    b, part, h = x.shape
    out = torch.empty((t * b, part, h), dtype=x.dtype, device=x.device)  # rank-major along dim 0
    all_gather_single(out, x.contiguous(), group=group)
    return out.view(t, b, part, h).transpose(0, 1).reshape(b, t * part, h)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [b, s, h] on every rank -> this rank's slice [b, s/t, h] of their sum."""
    t = dist.get_world_size(group)
    b, s, h = x.shape
    stacked = x.reshape(b, t, s // t, h).transpose(0, 1).reshape(t * b, s // t, h)
    out = torch.empty((b, s // t, h), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, stacked, group=group)
    return out


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's `g`: all-gather along the sequence forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's `g-bar`: reduce-scatter of the partial outputs forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad.contiguous(), ctx.group), None


def copy_to_region(x: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """Enter a column-parallel region: `f` (identity / all-reduce), or SP's all-gather."""
    if group is None:
        return x
    return (_GatherFromSequence if sequence_parallel else _CopyToRegion).apply(x, group)


def reduce_from_region(x: torch.Tensor, group, sequence_parallel: bool = False) -> torch.Tensor:
    """Leave a row-parallel region: `g` (all-reduce / identity), or SP's reduce-scatter."""
    if group is None:
        return x
    return (_ScatterToSequence if sequence_parallel else _ReduceFromRegion).apply(x, group)


def apply_tensor_parallel(block: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Make a `Block` built with its shard's shapes (`Block(config, t, r)`) compute the full block.

    Its attention and MLP each become one region: the normalised input enters through `f` (or SP's
    all-gather), the row-parallel output leaves through `g` (or SP's reduce-scatter). A no-op
    without a group (TP degree 1).
    """
    if group is None:
        return block
    sp = sequence_parallel
    for region in (block.attn, block.mlp):
        region.register_forward_pre_hook(lambda _m, args: (copy_to_region(args[0], group, sp), *args[1:]))
        region.register_forward_hook(lambda _m, _args, out: reduce_from_region(out, group, sp))
    return block


class VocabParallelEmbedding(nn.Module):
    """Rows [offset, offset + rows) of the embedding; tokens outside them contribute zeros, and the
    all-reduce of `g` assembles every token's vector on every rank (SP: the reduce-scatter, each
    rank's sequence slice)."""

    def __init__(self, rows: int, hidden: int, offset: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.offset, self.group, self.sequence_parallel = offset, group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(tokens, self.weight)
        local = tokens - self.offset
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(out, self.group, self.sequence_parallel)


class VocabParallelHead(nn.Module):
    """Final RMSNorm and this rank's rows of the output projection: logits for its vocabulary shard.

    With tied embeddings there is no `output` parameter; `forward` gets the stage's `embed.weight`
    shard, which covers the same vocabulary rows. Under SP the norm runs on this rank's sequence slice
    and its output is all-gathered before the projection.
    """

    def __init__(self, config: ModelConfig, rows: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.hidden_size, rows, bias=False)

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None) -> torch.Tensor:
        x = copy_to_region(self.norm(x), self.group, self.sequence_parallel)
        return F.linear(x, tied_weight if self.output is None else self.output.weight)


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    """Summed token cross-entropy of logits split along the vocabulary.

    loss_n = log sum_v exp(z_nv - m_n) - (z_n,t_n - m_n) with m_n the global max (for stability):
    one all-reduce (max) for m, one (sum) for the sum of exponentials and the target's shifted logit.
    The gradient is local: softmax minus the one-hot target, on this rank's columns.
    """

    @staticmethod
    def forward(ctx, logits, targets, offset, group):
        z = logits.float().reshape(-1, logits.shape[-1])
        t = targets.reshape(-1) - offset
        mine = (t >= 0) & (t < z.shape[1])
        m = z.max(dim=1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(1)
        picked = shifted.gather(1, t.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1) * mine
        exp = shifted.exp_()  # in place: one fp32 copy of the logits fewer at the forward's peak
        sums = torch.stack([exp.sum(dim=1), picked])
        dist.all_reduce(sums, group=group)
        softmax = exp.div_(sums[0].unsqueeze(1))
        ctx.save_for_backward(softmax, t, mine)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return (sums[0].log() - sums[1]).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, t, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)[mine]
        g[rows, t[mine]] -= 1.0
        return (g * grad).to(ctx.dtype).reshape(ctx.shape), None, None, None


def vocab_parallel_cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, offset: int, group
) -> torch.Tensor:
    """Summed cross-entropy of `logits` (this rank's vocabulary columns from `offset`) and `targets`."""
    if group is None:
        return cross_entropy_sum(logits, targets)
    return _VocabParallelCrossEntropySum.apply(logits, targets, offset, group)

"""Split backward (ZB-H1, Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1): a
block's backward computes its input gradient now and its weight gradients later.

A linear layer y = x W^T + b has two backward products: the input gradient dx = g W, which the
previous stage waits for, and the weight gradient dW = g^T x (db = sum g), which nobody waits for.
Under a pipeline whose plan says `split_backward`, the schedule runs each chunk-backward as "B"
inside `DeferredWeightGradients.deferring(key)`: the linears of the blocks return dx at once and
hold (x, g) under `key`; the schedule's later "W" op for the same key (`run`) computes the held
weight gradients and accumulates them through autograd (`torch.autograd.backward` on the
parameters), so every post-accumulate-grad hook fires once per micro-batch exactly as it would in
an unsplit backward (fp32 main gradients, the distributed optimizer's bucket counting).

What is deferred: the seven projections of every block (wq, wk, wv, wo, gate, up, down), which
hold nearly all of a block's weight-gradient FLOPs. Norm weights (a vector each), the embedding
(a scatter-add) and the output projection (whose output gradient is the logits', [tokens, vocab]:
holding it would cost more than the bubble it fills) keep their gradients in B.

What it costs in memory: the inputs x the linears saved anyway now live until W instead of until
B, and each deferred linear also holds its output gradient g (the stage's `held` bytes in
`costmodel.estimate`); the rest of the chunk's activations are freed at B as before.

Why hand-written: torch's `ScheduleInterleavedZeroBubble` splits a stage's backward with
`torch.autograd.grad` over its inputs and then its parameters, which needs one TP degree per
pipeline (runtime/pipeline.py); and autograd itself has no switch to postpone a node's weight
gradient. A small autograd function per linear does, whatever the TP degree, sequence
parallelism or recomputation around it (under full recomputation x comes from the recomputed
forward and is held like any other).
"""

import contextlib
import types
from collections.abc import Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# The projections whose weight gradients are deferred, by their path inside a `Block`.
DEFERRED_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down")


def _weight_gradients(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """dW = g^T x over all tokens (and db = sum g), in the order of `_parameters(layer)`."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    grads = [g2.t().mm(x2)]
    if layer.bias is not None:
        grads.append(g2.sum(dim=0))
    return grads


def _parameters(layer: nn.Linear) -> list[nn.Parameter]:
    return [layer.weight] if layer.bias is None else [layer.weight, layer.bias]


class _Linear(torch.autograd.Function):
    """F.linear of x and a detached weight: its backward returns dx and hands (x, g) to the store.

    The weight and bias enter detached so that autograd does not reach their gradient accumulators
    in B (it would run their post-accumulate-grad hooks with no gradient); `run` reaches them in W."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, store):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.store = layer, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        ctx.store.hold(ctx.layer, x, g)
        return g.matmul(weight), None, None, None, None


class DeferredWeightGradients:
    """The weight gradients a stage's "B" ops hold back, by key, until its "W" ops."""

    def __init__(self):
        self.key: Hashable | None = None  # set while a backward defers (`deferring`)
        self._held: dict[Hashable, list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]] = {}

    def install(self, blocks: nn.ModuleDict) -> None:
        """Route the forward of every deferred linear of `blocks` through `_Linear`."""
        for block in blocks.values():
            for path in DEFERRED_LINEARS:
                layer = block.get_submodule(path)
                layer.forward = types.MethodType(self._forward, layer)

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):  # evaluation: nothing to defer
            return F.linear(x, layer.weight, layer.bias)
        bias = None if layer.bias is None else layer.bias.detach()
        return _Linear.apply(x, layer.weight.detach(), bias, layer, self)

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Inside: backwards hold their linears' weight gradients under `key`."""
        if key in self._held:
            raise RuntimeError(f"weight gradients of {key!r} are already held")
        self.key, self._held[key] = key, []
        try:
            yield
        finally:
            self.key = None

    def hold(self, layer: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> None:
        if self.key is None:
            raise RuntimeError("a split-backward linear ran its backward outside `deferring`")
        self._held[self.key].append((layer, x, g))

    def run(self, key: Hashable) -> None:
        """Compute and accumulate the weight gradients held under `key`, and let go of their inputs."""
        held = self._held.pop(key)
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        with torch.no_grad():
            for layer, x, g in held:
                params += _parameters(layer)
                grads += _weight_gradients(layer, x, g)
        del held
        if params:
            torch.autograd.backward(params, grads)

    @property
    def pending(self) -> int:
        """Keys still held (zero after a whole pass of the schedule)."""
        return len(self._held)

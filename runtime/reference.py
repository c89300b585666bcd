"""The slow, obviously correct reference: the whole model in one process, the whole global batch at once.

Same model (`build_model`), same initial weights, same samples, same loss normalisation, same AdamW,
clipping (torch's `clip_grad_norm_`, an implementation independent of the runtime's sharded norm)
and learning-rate schedule. Every plan must reproduce its losses and final weights (DESIGN.md
invariant 1); tests/test_runtime_parity.py holds it.
"""

import torch

from costmodel.config import ModelConfig
from runtime.data import fetch, open_source
from runtime.model import build_model, cross_entropy_sum
from runtime.optim import OptimConfig, build_optimizer, set_lr


def train_reference(
    config: ModelConfig,
    *,
    global_batch_size: int,
    seq_len: int,
    steps: int,
    optim: OptimConfig,
    seed: int = 0,
    data: str | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of `steps` optimizer steps and the final parameters by global name."""
    model = build_model(config, seed=seed)
    params = dict(model.named_parameters())
    optimizer = build_optimizer(params, optim)
    source = open_source(data, config.vocab_size, seq_len, seed)
    losses = []
    for step in range(steps):
        batch = fetch(source, step * global_batch_size, global_batch_size)
        optimizer.zero_grad()
        loss = cross_entropy_sum(model(batch[:, :-1]), batch[:, 1:]) / (global_batch_size * seq_len)
        loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        set_lr(optimizer, optim.lr_at(step))
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in params.items()}

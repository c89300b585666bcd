"""The slow, obviously correct reference: the whole model in one process, the whole global batch at once.

Same model (`build_model`), same initial weights, same samples, same loss normalisation, AdamW by
torch's own class (`torch.optim.AdamW`, fused: the kernel the runtime's `runtime.optim.AdamW` calls),
clipping (torch's `clip_grad_norm_`, an implementation independent of the runtime's sharded norm)
and learning-rate schedule, same mixed precision (runtime/precision.py: the model in the plan's dtype,
fp32 masters). Every plan must reproduce its losses and final weights (docs/DESIGN.md invariant 1);
tests/test_runtime_parity.py holds it. `accumulation` > 1 runs the global batch as that many equal
micro-batches instead: in fp32 the same mathematics, in bf16 another rounding of the same sums,
which is how the bf16 tolerance of the parity tests is measured.
"""

import torch

from costmodel.config import ModelConfig
from runtime.data import fetch, open_source
from runtime.model import build_model, cross_entropy_sum
from runtime.optim import OptimConfig, decay_groups, set_lr
from runtime.precision import MasterWeights


def train_reference(
    config: ModelConfig,
    *,
    global_batch_size: int,
    seq_len: int,
    steps: int,
    optim: OptimConfig,
    seed: int = 0,
    data: str | None = None,
    dtype: str = "float32",
    accumulation: int = 1,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of `steps` optimizer steps and the final (fp32 master) parameters by global name."""
    model = build_model(config, seed=seed)
    precision = MasterWeights(model, dtype)
    params = precision.masters
    groups = decay_groups(list(params.values()), optim)
    betas = (optim.beta1, optim.beta2)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.eps, fused=True)
    source = open_source(data, config.vocab_size, seq_len, seed)
    losses = []
    for step in range(steps):
        batch = fetch(source, step * global_batch_size, global_batch_size)
        optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        for part in batch.chunk(accumulation):
            share = cross_entropy_sum(model(part[:, :-1]), part[:, 1:]) / (global_batch_size * seq_len)
            share.backward()
            loss += share.detach()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), optim.grad_clip)
        set_lr(optimizer, optim.lr_at(step))
        optimizer.step()
        precision.publish()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in params.items()}

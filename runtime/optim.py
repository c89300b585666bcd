"""Optimiser settings shared by the distributed runtime and the single-process reference.

AdamW (Loshchilov & Hutter 2019) from torch, fp32 state, on each rank's local shards: its update is
element-wise, so shards updated with the full-batch gradient equal slices of the full update.
Weight decay applies to matrices (embeddings, projections), not to norm weights (GPT-2 / Llama
practice). The learning rate warms up linearly, then follows a half cosine down to `min_lr` at
`decay_steps` (Loshchilov & Hutter 2017, SGDR; the schedule of nanoGPT and Llama). Gradients are
clipped to `grad_clip` by their global norm with torch's formula, coef = clip / (norm + 1e-6), at most 1.
"""

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from costmodel.errors import ElastorError

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    decay_steps: int = 1000  # the step at which the cosine reaches min_lr (the run's --steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        """Refuse, in one sentence, what would train to NaN or ascend: every field finite, in range."""
        bounds = {  # field: (lowest, highest, whether the lowest is allowed)
            "lr": (0.0, 10.0, False),
            "min_lr": (0.0, 10.0, True),
            "weight_decay": (0.0, 10.0, True),
            "beta1": (0.0, 1.0, True),
            "beta2": (0.0, 1.0, True),
            "eps": (0.0, 1.0, False),
            "grad_clip": (0.0, 1e6, True),
        }
        for name, (lo, hi, closed) in bounds.items():
            value = getattr(self, name)
            ok = type(value) in (int, float) and math.isfinite(value) and value <= hi
            if not ok or value < lo or (value == lo and not closed):
                side = "[" if closed else "("
                raise ElastorError(
                    f"The optimizer's {name} is {value!r}; it must be a number in {side}{lo}, {hi}]."
                )
        if max(self.beta1, self.beta2) >= 1.0:  # Adam's bias correction divides by 1 - beta^t
            raise ElastorError(f"The optimizer's betas are {self.beta1}, {self.beta2}; each must be below 1.")
        for name in ("warmup_steps", "decay_steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ElastorError(f"The optimizer's {name} is {value!r}; it must be a non-negative integer.")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def clip_coefficient(self, norm: float) -> float:
        if self.grad_clip <= 0:
            return 1.0
        return min(1.0, self.grad_clip / (norm + CLIP_EPS))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "OptimConfig":
        if not isinstance(data, dict):
            raise ElastorError(
                f"An optimizer configuration must be a JSON object, not {type(data).__name__}."
            )
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ElastorError(f"The optimizer configuration has unknown field(s) {', '.join(unknown)}.")
        return cls(**data)


def build_optimizer(
    params: dict[str, torch.nn.Parameter] | list[torch.nn.Parameter], config: OptimConfig
) -> torch.optim.AdamW:
    """AdamW over parameters (named, or rows of them: runtime/dist_optim.py keeps a matrix's rows
    2-D and a norm's 1-D): decay for matrices, none for norm weights (1-D).

    torch's fused implementation (one kernel over all tensors, on CUDA and on CPU): the for-each and
    per-tensor ones make parameter-sized temporaries (the square root of the second moment, the
    update), which would be a step's memory peak on a stage of few activations."""
    params = list(params.values()) if isinstance(params, dict) else list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=True,
    )
    for p in params:  # AdamW's own zero state, made up front so a checkpoint at step 0 has it
        optimizer.state[p] = {
            "step": torch.tensor(0.0, device=p.device),  # the fused kernel reads it where it runs
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return optimizer


def configure(optimizer: torch.optim.Optimizer, config: OptimConfig) -> None:
    """Give a built optimizer `config`'s decay, betas and eps (the matrices' group decays, as in
    `build_optimizer`): for a schedule that changed after the optimizer was built (a resume)."""
    for group in optimizer.param_groups:
        if any(p.ndim >= 2 for p in group["params"]):
            group["weight_decay"] = config.weight_decay
        group["betas"], group["eps"] = (config.beta1, config.beta2), config.eps


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

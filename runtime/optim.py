"""Optimiser settings shared by the distributed runtime and the single-process reference.

AdamW (Loshchilov & Hutter 2019) by torch's fused kernel, fp32 state, on each rank's local shards: its
update is element-wise, so shards updated with the full-batch gradient equal slices of the full update.

`AdamW` below calls the kernel that `torch.optim.AdamW(fused=True)` runs (`torch._fused_adamw_`), with
the same step counting, so its updates are that class's bit for bit (tests/test_runtime_units.py), but
it is not a `torch.optim.Optimizer`: that class's methods are wrapped in `torch._disable_dynamo`, whose
first call imports `torch._dynamo`, 1.6 s of CPU per process here. Every worker pays that at start,
and so does every restart of a recovery; the runtime needs none of what the class adds (hooks,
`state_dict`, closures, compile support). The single-process reference (runtime/reference.py) keeps
torch's class, so the parity tests compare the two.
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


class AdamW:
    """AdamW over parameter groups by torch's fused kernel (see the module docstring); `state` and
    `param_groups` have torch.optim's layout, the state made up front (zero moments, step 0) so a
    checkpoint at step 0 has it."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [
            {
                "params": list(g["params"]),
                "weight_decay": g["weight_decay"],
                "lr": lr,
                "betas": betas,
                "eps": eps,
            }
            for g in groups
        ]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            p: {
                "step": torch.tensor(0.0, device=p.device),  # the fused kernel reads it where it runs
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            for g in self.param_groups
            for p in g["params"]
        }

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient, or with `set_to_none=False` zero it in place."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if set_to_none:
            for p in params:
                p.grad = None
        elif params:
            torch._foreach_zero_([p.grad for p in params])

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient: per group, per device and dtype, the step
        counts advanced by one and one fused kernel over the tensors (torch.optim.AdamW's order)."""
        for group in self.param_groups:
            batches: dict[tuple, tuple[list, ...]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
                lists = batches.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for into, tensor in zip(lists, tensors, strict=True):
                    into.append(tensor)
            beta1, beta2 = group["betas"]
            for params, grads, exp_avgs, exp_avg_sqs, steps in batches.values():
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(
                    params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                    beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False,
                )  # fmt: skip


def decay_groups(params: list[torch.Tensor], config: OptimConfig) -> list[dict]:
    """Decay for matrices, none for norm weights (1-D); empty groups left out."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    params: dict[str, torch.nn.Parameter] | list[torch.nn.Parameter], config: OptimConfig
) -> AdamW:
    """AdamW over parameters (named, or rows of them: runtime/dist_optim.py keeps a matrix's rows
    2-D and a norm's 1-D), groups by `decay_groups`.

    torch's fused implementation (one kernel over all tensors, on CUDA and on CPU): the for-each and
    per-tensor ones make parameter-sized temporaries (the square root of the second moment, the
    update), which would be a step's memory peak on a stage of few activations."""
    params = list(params.values()) if isinstance(params, dict) else list(params)
    return AdamW(
        decay_groups(params, config), lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps
    )


def configure(optimizer: AdamW, config: OptimConfig) -> None:
    """Give a built optimizer `config`'s decay, betas and eps (the matrices' group decays, as in
    `build_optimizer`): for a schedule that changed after the optimizer was built (a resume)."""
    for group in optimizer.param_groups:
        if any(p.ndim >= 2 for p in group["params"]):
            group["weight_decay"] = config.weight_decay
        group["betas"], group["eps"] = (config.beta1, config.beta2), config.eps


def set_lr(optimizer: AdamW | torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

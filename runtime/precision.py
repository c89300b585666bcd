"""Mixed precision as Megatron-LM and torchtitan train: bf16 compute, fp32 master weights and gradients.

Micikevicius et al. 2018 ("Mixed Precision Training"): the model's parameters and activations are
16-bit, the optimizer owns an fp32 master copy of every parameter, and gradients accumulate in fp32
across micro-batches. The distributed runtime keeps its masters and main gradients in gradient
buckets (runtime/dist_optim.py); `MasterWeights` is the same arithmetic for one whole model in one
process (runtime/reference.py, the profiler): a model's parameters are cast to the dtype, and an
fp32 copy of each is kept, whose `.grad` is the fp32 main gradient. A post-accumulate-grad hook on
each 16-bit parameter adds the micro-batch's gradient into the main gradient as soon as autograd has
produced it and frees the 16-bit gradient, so no 16-bit gradient outlives its micro-batch (Megatron's
`main_grad`). The gradient sync, the global norm, clipping, AdamW and the checkpoint all work on the
masters; after each optimizer step `publish` rounds them into the module's parameters once. There is
no per-micro-batch copy of any weight (autocast over fp32 weights would make one per micro-batch).

In float32 the masters are the module's own parameters and nothing is copied. bfloat16 is the only
16-bit dtype: its fp32 exponent range needs no loss scaling.
"""

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MasterWeights:
    """fp32 master parameters (by global name) of `model`, whose parameters become `dtype`."""

    def __init__(self, model: nn.Module, dtype: str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype]
        self.model_params = dict(model.named_parameters())
        if self.dtype == torch.float32:
            self.masters = self.model_params
        else:
            self.masters = {
                name: nn.Parameter(p.detach().float().clone()) for name, p in self.model_params.items()
            }
            model.to(self.dtype)
            for name, p in self.model_params.items():
                p.register_post_accumulate_grad_hook(self._accumulator(self.masters[name]))
        for master in self.masters.values():  # every main gradient exists from the start
            master.grad = torch.zeros_like(master)

    @staticmethod
    def _accumulator(master: nn.Parameter):
        def accumulate(param: torch.Tensor) -> None:
            master.grad.add_(param.grad)
            param.grad = None

        return accumulate

    @property
    def mixed(self) -> bool:
        return self.masters is not self.model_params

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the module's 16-bit parameters (after a step or a restore)."""
        if self.mixed:
            torch._foreach_copy_(list(self.model_params.values()), list(self.masters.values()))

    def bytes_by_kind(self) -> dict[str, int]:
        """What these weights hold: module parameters (and fp32 masters), main gradients."""
        model = sum(p.numel() * p.element_size() for p in self.model_params.values())
        masters = sum(m.numel() * m.element_size() for m in self.masters.values()) if self.mixed else 0
        grads = sum(m.grad.numel() * m.grad.element_size() for m in self.masters.values())
        return {"parameters_bytes": model + masters, "gradients_bytes": grads}

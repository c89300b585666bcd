"""The CUDA paths of the runtime on one GPU: NCCL, fp32 parity, and bf16 plans with fp32 master weights.

Skipped without a CUDA device (the `gpu` marker). Tolerances: fp32 on the GPU against the CPU reference
within 1e-4 relative per loss (different kernels sum in different orders; TF32 stays off); a bf16
plan within 2e-2 relative of the fp32 reference, its module parameters bf16 and its master weights
and AdamW state fp32.
"""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import PARITY_OPTIM, plan_json

from costmodel import PRESETS, Plan
from runtime.distributed import init_distributed
from runtime.optim import OptimConfig
from runtime.reference import train_reference
from runtime.trainer import Trainer

pytestmark = pytest.mark.gpu
STEPS = 10
PLAN = plan_json(PRESETS["gpt-tiny"].to_json(), [(4, [((0, 6), ["n0:0"])])], micro_batch_size=2, seq_len=64)


@pytest.fixture
def reference_losses():
    losses, _ = train_reference(
        PRESETS["gpt-tiny"], global_batch_size=8, seq_len=64, steps=STEPS, optim=OptimConfig(**PARITY_OPTIM)
    )
    return losses


@pytest.fixture
def cuda_trainer():
    made = []

    def make(bf16: bool) -> Trainer:
        plan = Plan.from_json({**PLAN, "dtype": "bfloat16" if bf16 else "float32"})
        ctx = init_distributed(plan, device="cuda")
        assert ctx.backend == "nccl" and ctx.device.type == "cuda"
        made.append(Trainer(plan, ctx, optim=OptimConfig(**PARITY_OPTIM)))
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("bf16", "rtol"), [(False, 1e-4), (True, 2e-2)])
def test_cuda_training_matches_the_cpu_reference(cuda_trainer, reference_losses, bf16, rtol):
    torch.backends.cuda.matmul.allow_tf32 = False
    trainer = cuda_trainer(bf16)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    for got, want in zip(losses, reference_losses, strict=True):
        assert abs(got - want) <= rtol * want
    masters = [piece.param for piece in trainer.main.pieces]
    assert masters and all(p.dtype == torch.float32 and p.is_cuda for p in masters)
    module_dtype = torch.bfloat16 if bf16 else torch.float32
    assert all(p.dtype == module_dtype and p.is_cuda for p in trainer.model.parameters())
    for master in masters:
        state = trainer.optimizer.state[master]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32

"""`elastor train --plan PLAN --steps N --metrics FILE`: train from a plan, one process per plan device."""

import argparse
from pathlib import Path

from costmodel import ElastorError, Plan
from costmodel.jsonio import read_json
from elastor.commands import subcommand

EXAMPLE = (
    "python -m torch.distributed.run --nproc-per-node 7 --master-addr 127.0.0.1 --master-port 29511 \\\n"
    "      -m elastor train --plan examples/plan-hetero.json --steps 20 --metrics metrics.jsonl"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "train",
        "Train from a plan under torchrun (one process per plan device; rank r plays the plan's r-th "
        "device) in the plan's dtype, sequence parallelism and recomputation; rank 0 appends per-step "
        "metrics to --metrics and shows a progress bar.",
        EXAMPLE,
    )
    p.add_argument("--plan", required=True, help="plan JSON file")
    p.add_argument("--steps", type=int, required=True, help="the global optimizer step to reach")
    p.add_argument("--metrics", required=True, help="metrics JSON-lines file (rank 0 appends to it)")
    p.add_argument(
        "--ckpt-dir",
        help="checkpoint directory: resume from its newest complete checkpoint (any plan), save into it",
    )
    p.add_argument(
        "--ckpt-every", type=int, default=0, help="steps between checkpoints; 0: only at the end (default)"
    )
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default: %(default)s)")
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop (with a checkpoint) at this step, before --steps; the schedule still ends at --steps",
    )
    p.add_argument(
        "--data",
        help="uint16 token file (.bin) or UTF-8 text tokenised by bytes (default: synthetic tokens)",
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights and synthetic data (default: 0)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: %(default)s)")
    p.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine (default: lr / 10)")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps (default: %(default)s)")
    p.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default: %(default)s)"
    )
    p.add_argument(
        "--grad-clip", type=float, default=1.0, help="global-norm clip, 0 for none (default: %(default)s)"
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when torch sees one"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="a collective that waits longer fails the job (default: %(default)s)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if min(args.steps, args.warmup_steps, args.ckpt_every) < 0 or args.lr <= 0 or args.timeout_s <= 0:
        raise ElastorError(
            "--steps, --warmup-steps and --ckpt-every must be non-negative, --lr and --timeout-s positive."
        )
    if (args.ckpt_every or args.stop_at is not None) and not args.ckpt_dir:
        raise ElastorError("--ckpt-every and --stop-at need --ckpt-dir.")
    plan = Plan.from_json(read_json(args.plan, "plan")).validate()

    import torch  # torch only for the commands that train
    import torch.distributed as dist

    from runtime.checkpointing import CheckpointHook, resume
    from runtime.data import open_source
    from runtime.distributed import init_distributed
    from runtime.loop import train
    from runtime.metrics import MetricsWriter
    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    source = open_source(args.data, plan.model.vocab_size, plan.seq_len, args.seed)  # errors before joining
    ctx = init_distributed(plan, device=args.device, timeout_s=args.timeout_s)
    if ctx.is_cuda and plan.dtype == "float32":  # fp32 plans run their matrix products in TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    optim = OptimConfig(
        lr=args.lr,
        min_lr=args.lr / 10 if args.min_lr is None else args.min_lr,
        warmup_steps=args.warmup_steps,
        decay_steps=args.steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
    )
    trainer = Trainer(plan, ctx, optim=optim, seed=args.seed, source=source, timeout_s=args.timeout_s)
    metrics = MetricsWriter(args.metrics) if ctx.rank == 0 else None
    try:
        ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else None
        resumed = ckpt_dir is not None and resume(trainer, ckpt_dir, metrics)
        hook = CheckpointHook(
            trainer,
            ckpt_dir,
            args.ckpt_every,
            keep=args.keep,
            metrics=metrics,
            metrics_path=Path(args.metrics),
            resumed=resumed,
        )
        until = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
        train(trainer, until_step=until, metrics=metrics, after_step=hook)
        hook.finish()
    finally:
        trainer.close()
        if metrics:
            metrics.close()
    dist.destroy_process_group()
    return 0

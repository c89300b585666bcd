"""`elastor train --plan PLAN --steps N --metrics FILE`: train from a plan, one process per plan device."""

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

from costmodel import ElastorError, Plan
from costmodel.jsonio import read_json
from elastor.commands import subcommand
from elastor.commands.argtypes import MAX_STEPS, SEED, STEPS, integer, real

EVAL_FRACTION = real(0.0, 0.5)
EVAL_BATCHES = integer(1, 10_000)

# The optimizer's ranges, as runtime.optim.OptimConfig checks them again (torch is imported only once
# training starts, so the flags are checked here first): a learning rate above 10 or a decay above 10
# diverges at once, and inf or nan trains to NaN.
LR = real(above=0.0, high=10.0)
MIN_LR = real(low=0.0, high=10.0)
WEIGHT_DECAY = real(low=0.0, high=10.0)
GRAD_CLIP = real(low=0.0, high=1e6)
# A day: far past any collective's time, and short of a timeout that never fires.
TIMEOUT_S = real(above=0.0, high=86_400.0)
# Checkpoints kept: each is a full copy of the training state.
KEEP = integer(1, 1000)
SNAPSHOT_EVERY = integer(0, MAX_STEPS)

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
    p.add_argument("--steps", type=int, required=True, help=f"the global optimizer step to reach, {STEPS}")
    p.add_argument("--metrics", required=True, help="metrics JSON-lines file (rank 0 appends to it)")
    p.add_argument(
        "--ckpt-dir",
        help="checkpoint directory: resume from its newest complete checkpoint (any plan), save into it",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help=f"steps between checkpoints, {STEPS}; 0: only at the end (default)",
    )
    p.add_argument("--keep", type=KEEP, default=2, help=f"checkpoints to keep, {KEEP} (default: %(default)s)")
    p.add_argument(
        "--stop-at",
        type=STEPS,
        help="stop (with a checkpoint) at this step, before --steps; the schedule still ends at --steps",
    )
    p.add_argument(
        "--reset-schedule",
        action="store_true",
        help="on resume, use this command line's schedule (--lr, --min-lr, --warmup-steps, --steps, "
        "--weight-decay, --grad-clip) from the resumed step on; without it the checkpoint's schedule "
        "continues and a warning names every flag that differs from it",
    )
    p.add_argument(
        "--data",
        help="token data: a .npy file of uint16 or uint32 tokens, a .bin file of uint16 ones, a directory "
        "of such shards, or UTF-8 text tokenised by bytes (default: synthetic tokens)",
    )
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer (its tokenizer.json, or a folder holding one) that encodes a text "
        "--data file (default: text is tokenised by bytes); `elastor ckpt export` writes it beside the model",
    )
    p.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="read --data's windows in order (default: a permutation per epoch, chosen by --seed)",
    )
    p.add_argument(
        "--eval-fraction",
        type=EVAL_FRACTION,
        default=0.0,
        help=f"hold out this last fraction of --data's windows for evaluation, {EVAL_FRACTION} (default: 0)",
    )
    p.add_argument(
        "--eval-every",
        type=STEPS,
        default=0,
        help="every this many steps, write the held-out loss (eval_loss) to --metrics; 0 for never "
        "(synthetic data holds out a stream of its own)",
    )
    p.add_argument(
        "--eval-batches",
        type=EVAL_BATCHES,
        default=1,
        help=f"global batches of held-out samples each evaluation reads, {EVAL_BATCHES} (default: 1)",
    )
    p.add_argument(
        "--seed", type=SEED, default=0, help=f"initial weights and synthetic data, {SEED} (default: 0)"
    )
    p.add_argument("--lr", type=LR, default=3e-4, help=f"peak learning rate, {LR} (default: %(default)s)")
    p.add_argument(
        "--min-lr",
        type=MIN_LR,
        help="learning rate at the end of the cosine, at least 0 and at most --lr (default: lr / 10)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=10, help=f"linear warm-up steps, {STEPS} (default: %(default)s)"
    )
    p.add_argument(
        "--weight-decay",
        type=WEIGHT_DECAY,
        default=0.1,
        help=f"AdamW decay of matrices, {WEIGHT_DECAY} (default: %(default)s)",
    )
    p.add_argument(
        "--grad-clip",
        type=GRAD_CLIP,
        default=1.0,
        help=f"global-norm clip, {GRAD_CLIP}, 0 for none (default: %(default)s)",
    )
    p.add_argument(
        "--peer-snapshot-every",
        type=SNAPSHOT_EVERY,
        default=0,
        help=f"under `elastor run`'s in-process recovery, every this many steps copy the state only "
        f"this rank keeps (ZeRO-1 slices; any row without a replica) to a peer's host memory, so that "
        f"its loss rolls back to that copy instead of restarting, {SNAPSHOT_EVERY}; 0 for never "
        "(default)",
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when torch sees one"
    )
    p.add_argument(
        "--timeout-s",
        type=TIMEOUT_S,
        default=300.0,
        help=f"a collective that waits longer fails the job, {TIMEOUT_S} seconds (default: %(default)s)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    counts = (args.steps, args.warmup_steps, args.ckpt_every)
    if min(counts) < 0 or max(counts) > MAX_STEPS:
        raise ElastorError(
            f"--steps, --warmup-steps and --ckpt-every must be non-negative and at most {MAX_STEPS:,}."
        )
    if args.min_lr is not None and args.min_lr > args.lr:
        raise ElastorError(f"--min-lr {args.min_lr:g} exceeds --lr {args.lr:g}; the cosine decays to it.")
    if (args.ckpt_every or args.stop_at is not None) and not args.ckpt_dir:
        raise ElastorError("--ckpt-every and --stop-at need --ckpt-dir.")
    if Path(args.metrics).is_dir():
        raise ElastorError(f"--metrics {args.metrics} is a directory; name the metrics file to append to.")
    plan = Plan.from_json(read_json(args.plan, "plan")).validate()

    import torch  # torch only for the commands that train

    from runtime.checkpoint.load import files_opened
    from runtime.checkpoint.lock import lock_directory
    from runtime.checkpointing import CheckpointHook, reconcile_schedule, resume
    from runtime.data import open_source
    from runtime.distributed import init_distributed, leave_job
    from runtime.elastic import faults, inprocess, progress
    from runtime.loop import train
    from runtime.metrics import MetricsWriter
    from runtime.optim import OptimConfig
    from runtime.stopping import current as stop_request
    from runtime.trainer import Trainer

    source = open_source(  # errors before joining
        args.data,
        plan.model.vocab_size,
        plan.seq_len,
        args.seed,
        shuffle=args.shuffle,
        eval_fraction=args.eval_fraction,
        tokenizer=args.tokenizer,
    )
    if args.eval_every:
        source.held_out()  # an evaluation needs a split: say so now, not at the first evaluation
    ctx = init_distributed(plan, device=args.device, timeout_s=args.timeout_s)
    progress.current.start(ctx.device_name)  # read by `elastor run`'s hang detection
    supervised = os.environ.get(progress.ENV_DIR)
    stop_request.listen(supervised)  # SIGTERM/SIGINT, or the supervisor's word: finish the step, save
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

    recovery = inprocess.Recovery.from_env(os.environ, ctx.backend, args.timeout_s)
    injected = faults.decode(os.environ.get(faults.ENV_FAILURES, ""))

    def build(plan: Plan, ctx) -> Trainer:
        fault = None
        if recovery is not None:  # `commit:` faults test the in-process path's commit check
            fault = faults.at_commit(
                list(plan.devices), ctx.device_name, injected, Path(args.metrics), recovery.aborted
            )
        return Trainer(
            plan, ctx, optim=optim, seed=args.seed, source=source, timeout_s=args.timeout_s, at_commit=fault
        )

    snapshots = None
    if recovery is not None and args.peer_snapshot_every:
        from runtime.elastic.snapshots import PeerSnapshots

        snapshots = PeerSnapshots(args.peer_snapshot_every, timeout_s=args.timeout_s)
    trainer = build(plan, ctx)
    metrics = MetricsWriter(args.metrics) if ctx.rank == 0 else None
    ckpt_dir, lock, hook, stopped = (Path(args.ckpt_dir) if args.ckpt_dir else None), None, None, False
    try:
        if ckpt_dir is not None and ctx.rank == 0:  # rank 0 owns the directory for the job
            lock = lock_directory(ckpt_dir)
        resumed = ckpt_dir is not None and resume(trainer, ckpt_dir, metrics)
        if resumed:
            reconcile_schedule(trainer, optim, reset=args.reset_schedule, metrics=metrics)

        def checkpoint_hook(resumed: bool) -> CheckpointHook:
            return CheckpointHook(
                trainer,
                ckpt_dir,
                args.ckpt_every,
                keep=args.keep,
                metrics=metrics,
                metrics_path=Path(args.metrics),
                resumed=resumed,
            )

        hook = checkpoint_hook(resumed)
        if snapshots is not None:
            snapshots.bind(trainer)
            _announce_snapshots(snapshots, trainer, metrics)

        def after_step(trainer, result) -> float:
            """The checkpoint's hook, then the peer snapshot's: the seconds both blocked the step."""
            stall = hook(trainer, result)
            return stall + (snapshots.after_step(trainer) if snapshots is not None else 0.0)

        until = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
        while True:
            failure = None
            try:
                results = train(
                    trainer,
                    until_step=until,
                    metrics=metrics,
                    after_step=after_step,
                    eval_every=args.eval_every,
                    eval_batches=args.eval_batches,
                )
                hook.finish()
            except Exception as e:
                if recovery is None or not (recovery.aborted.is_set() or inprocess.is_peer_failure(e)):
                    raise
                failure = str(e).splitlines()[0][:300]
            if failure is None:
                break
            # In-process recovery (runtime/elastic/inprocess.py): leave with the state, rejoin.
            files_before_recovery = files_opened()
            if hook.saver is not None:
                hook.saver.abandon()
            left = recovery.leave(trainer, snapshots)
            trainer = hook = None  # nothing may keep the old process groups alive
            if metrics:
                metrics.close()
                metrics = None
            try:
                rejoined = recovery.rejoin(left, failure, build, say=_say, snapshots=snapshots)
            except inprocess.CannotRecover as e:
                print(f"elastor train: error: in-process recovery is not possible: {e}", file=sys.stderr)
                return inprocess.FALLBACK_EXIT
            except Exception as e:  # e.g. another peer lost while re-forming: the restart path
                traceback.print_exc()
                first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                print(f"elastor train: error: in-process recovery failed: {first}", file=sys.stderr)
                return inprocess.FALLBACK_EXIT
            if rejoined is None:  # the new plan leaves this survivor out; its state has been passed on
                return 0
            trainer, ctx = rejoined.trainer, rejoined.ctx
            metrics = MetricsWriter(args.metrics) if ctx.rank == 0 else None
            if metrics:
                metrics.event(
                    "restored",
                    step=trainer.step,
                    path="in-process",
                    source=rejoined.source,
                    rolled_back_steps=rejoined.rolled_back_steps,
                    generation=rejoined.generation,
                    lost=rejoined.lost,
                    devices=ctx.world_size,
                    phases_s=rejoined.phases_s,
                    load_s=rejoined.phases_s["restored"],
                    received_bytes=rejoined.received_bytes,
                    checkpoint_files_read=files_opened() - files_before_recovery,
                )
            last = rejoined.last
            if metrics and rejoined.record_missing and last and last.step == trainer.step:
                # The old writer of the metrics died, or stopped inside the step's commit: that
                # step's record may be missing (every survivor knows its loss from its all-reduce).
                metrics.write(
                    {
                        "step": last.step,
                        "loss": last.loss,
                        "step_time_s": last.step_time_s,
                        "samples_per_s": plan.global_batch_size / last.step_time_s,
                        "ckpt_stall_s": 0.0,
                        "lr": last.lr,
                        "grad_norm": last.grad_norm,
                        "rewritten": True,
                    }
                )
            left = None
            hook = checkpoint_hook(resumed=True)
            if snapshots is not None:
                snapshots.bind(trainer)
                _announce_snapshots(snapshots, trainer, metrics)
        stopped = bool(results) and results[-1].stop and trainer.step < until
        if stopped and metrics:
            saved = (
                f"checkpoint at step {trainer.step} in {ckpt_dir}"
                if ckpt_dir
                else "no --ckpt-dir: nothing saved"
            )
            metrics.event(
                "stopped", step=trainer.step, signal=stop_request.name(), saved=ckpt_dir is not None
            )
            print(f"elastor train: stopped on request after step {trainer.step}; {saved}", file=sys.stderr)
    finally:
        if snapshots is not None:
            snapshots.release()  # its exchange finishes first: every rank takes the same snapshots
        if recovery is not None:
            recovery.close()
        if trainer is not None:
            trainer.close()
        if metrics:
            metrics.close()
        if lock is not None:
            if hook is not None and hook.saver is not None:
                hook.saver.settle()  # no save may go on without the lock
            lock.release()
    stop_request.restore()
    trainer = hook = snapshots = recovery = None  # the last references to the process groups:
    leave_job()  # freed here, their gloo threads joined before the interpreter's finalization
    if stopped and not supervised:  # alone: the status of a process that the signal ended
        return stop_request.exit_code() if stop_request.requested else 128 + signal.SIGTERM
    return 0


def _announce_snapshots(snapshots, trainer, metrics) -> None:
    """The `peer_snapshots` event of a plan whose state needs them: what they cost this job."""
    if not snapshots.active:
        return
    import torch
    import torch.distributed as dist

    own, ward = snapshots.sent_bytes, snapshots.ward_bytes
    sizes = torch.tensor([float(own), float(ward), 2.0 * (own + ward)], dtype=torch.float64)
    if trainer.ctx.is_cuda:
        sizes = sizes.to(trainer.ctx.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    if metrics:
        metrics.event(
            "peer_snapshots",
            step=trainer.step,
            every=snapshots.every,
            max_sent_bytes=int(sizes[0].item()),  # per snapshot, by the rank that sends most
            max_received_bytes=int(sizes[1].item()),
            max_host_bytes=int(sizes[2].item()),  # its own and its ward's, twice while one is in flight
        )


def _say(line: str) -> None:
    print(f"elastor train: {line}", file=sys.stderr, flush=True)

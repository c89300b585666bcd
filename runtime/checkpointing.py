"""Checkpointing inside `elastor train`: resume from the newest checkpoint, save every N steps, and
the elastic run's per-worker hooks (injected failures, `restored` / `resumed` / `checkpoint_saved`).

The training state is runtime/state.py's pieces and metadata; runtime/checkpoint/ stores them in the
partition-agnostic format, so `resume` works whatever plan the checkpoint was saved under: each rank
reads only the boxes its new shards need.
"""

import os
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from costmodel.plan import Plan
from runtime.checkpoint import Checkpointer, CheckpointError, Wanted, load_checkpoint
from runtime.checkpoint.format import parse_step_dir
from runtime.checkpoint.load import ModelMismatch
from runtime.checkpoint.store import committed, set_aside
from runtime.elastic import faults
from runtime.metrics import MetricsWriter
from runtime.optim import OptimConfig, configure
from runtime.state import check_meta, restore_training_state, state_pieces, training_state
from runtime.trainer import StepResult, Trainer


def resume(trainer: Trainer, ckpt_dir: Path, metrics: MetricsWriter | None) -> bool:
    """Load the newest complete checkpoint of `ckpt_dir` that every rank can read into `trainer`,
    resharding it; False if there is none.

    A checkpoint that fails its checks on any rank (a bad CRC in the boxes one rank reads, a
    damaged manifest, metadata that is not the runtime's, an I/O error) is skipped by every rank:
    after each attempt the ranks agree (one all-reduce) on whether anyone failed and on which
    checkpoint they tried, so they never resume from different steps, and a file system whose
    listing differs between ranks stops the job instead. Rank 0 then renames the skipped
    checkpoint to `<name>.damaged`, so that it is neither tried again nor counted by the retention
    of the saves that follow; the skip is printed and recorded as a `checkpoint_skipped` event. A
    checkpoint of another model is not skipped but refused: the directory is another model's.
    """
    candidates = committed(ckpt_dir)
    started = time.perf_counter()
    pieces = state_pieces(trainer)
    wanted = [
        Wanted(p.name, p.global_shape, p.offsets, tuple(p.tensor.shape), p.tensor.dtype) for p in pieces
    ]
    _agree(trainer, 0, len(candidates), ckpt_dir)
    for path in reversed(candidates):
        problem, tensors, meta = None, None, None
        try:
            tensors, meta = load_checkpoint(path, wanted, model=trainer.plan.model)
            check_meta(meta, path)
        except ModelMismatch:
            raise
        except (CheckpointError, OSError) as e:
            problem = str(e)
        step, revision = parse_step_dir(path.name)
        failed = _agree(trainer, int(problem is not None), step * 1_000_000 + revision, ckpt_dir)
        if failed is not None:
            reason = problem or f"rank {failed} could not read its part of it (its error is in its log)"
            aside = set_aside(path) if trainer.ctx.rank == 0 else None
            moved = f"; moved to {aside}" if aside else ""
            _say(trainer, f"skipping the checkpoint {path}: {reason.rstrip('.')}{moved}.")
            if metrics:
                metrics.event("checkpoint_skipped", checkpoint=path.name, reason=reason)
            continue
        restore_training_state(
            trainer, {(w.name, w.offsets): t for w, t in zip(wanted, tensors, strict=True)}, meta
        )
        if metrics:
            metrics.event(
                "restored",
                step=trainer.step,
                load_s=time.perf_counter() - started,
                checkpoint=path.name,
                saved_devices=Plan.from_json(meta["plan"]).world_size,
                devices=trainer.plan.world_size,
            )
        return True
    if candidates:
        raise CheckpointError(
            f"None of the {len(candidates)} checkpoint(s) in {ckpt_dir} can be read (the lines above say "
            "why; each was renamed to <name>.damaged); restore an intact copy, or run again to start afresh."
        )
    return False


# The command-line flag of each schedule field (the others have none).
_FLAGS = {
    "lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_steps": "--warmup-steps",
    "decay_steps": "--steps",
    "weight_decay": "--weight-decay",
    "grad_clip": "--grad-clip",
}


def reconcile_schedule(
    trainer: Trainer, asked: OptimConfig, *, reset: bool, metrics: MetricsWriter | None
) -> None:
    """The one rule for a resumed run whose command line asks for another schedule than the
    checkpoint's: the checkpoint's schedule (learning rates, warm-up, decay horizon, weight decay,
    clipping) continues, and one line names every field that differs, old and new; with `reset`
    (`--reset-schedule`) the command line's schedule replaces it from the resumed step on, and the
    line says so. Never silent: the same line goes to the metrics as a `schedule` event."""
    saved = trainer.optim
    differ = [(f.name, getattr(saved, f.name), getattr(asked, f.name)) for f in fields(OptimConfig)]
    differ = [(name, old, new) for name, old, new in differ if old != new]
    if not differ:
        return
    listed = ", ".join(f"{_FLAGS.get(name, name)} {old:g} -> {new:g}" for name, old, new in differ)
    if reset:
        trainer.optim = asked
        line = (
            f"resuming at step {trainer.step} with this command line's schedule (--reset-schedule): {listed}."
        )
    else:
        line = (
            f"resuming at step {trainer.step} with the checkpoint's schedule, which this command line "
            f"differs from ({listed}); pass --reset-schedule to use the command line's."
        )
    configure(trainer.optimizer, trainer.optim)
    if trainer.ctx.rank == 0:
        print(f"elastor train: warning: {line}", file=sys.stderr, flush=True)
    if metrics:
        metrics.event(
            "schedule",
            step=trainer.step,
            reset=reset,
            changed={name: [old, new] for name, old, new in differ},
            schedule=trainer.optim.to_json(),
        )


def _agree(trainer: Trainer, failed: int, key: int, ckpt_dir: Path) -> int | None:
    """One all-reduce: the lowest rank whose `failed` is set (None if none), after checking that
    every rank has the same `key` (the checkpoint tried, or how many there are)."""
    rank, world = trainer.ctx.rank, trainer.ctx.world_size
    values = [rank if failed else world, key, -key]
    if world > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        reduced = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
        values = reduced.tolist()
    if values[1] != -values[2]:
        raise CheckpointError(
            f"The ranks see different checkpoints in {ckpt_dir}; every rank must see the same directory "
            "(a file system whose listing lags on some hosts cannot hold --ckpt-dir)."
        )
    return None if values[0] == world else values[0]


def _say(trainer: Trainer, line: str) -> None:
    print(f"elastor train: rank {trainer.ctx.rank}: {line}", file=sys.stderr, flush=True)


class CheckpointHook:
    """The training loop's `after_step`: injected failures, periodic asynchronous saves, events.

    Returns the seconds the step was blocked by checkpointing (the `ckpt_stall_s` metric).
    """

    def __init__(
        self,
        trainer: Trainer,
        ckpt_dir: Path | None,
        every: int,
        *,
        keep: int = 2,
        metrics: MetricsWriter | None = None,
        metrics_path: Path | None = None,
        resumed: bool = False,
    ):
        self.trainer, self.every, self.metrics = trainer, every, metrics
        self.metrics_path = metrics_path
        self.pending = faults.decode(os.environ.get(faults.ENV_FAILURES, ""))
        self.saver = None
        if ckpt_dir is not None:
            self.saver = Checkpointer(ckpt_dir, trainer.plan, trainer.ctx.rank, keep=keep)
        self._announce_resume = resumed
        self._committed = None
        self._last_saved = None
        self.check_failure()  # a failure due at the step we resume from fires during the recovery

    def check_failure(self) -> None:
        if self.pending and self.metrics_path is not None:
            faults.maybe_fail(
                self.trainer.ctx.device_name, self.trainer.step, self.pending, self.metrics_path
            )

    def __call__(self, trainer: Trainer, result: StepResult) -> float:
        if self._announce_resume and self.metrics:
            self.metrics.event("resumed", step=trainer.step)
        self._announce_resume = False
        stall = 0.0
        if self.saver is not None and self.every and trainer.step % self.every == 0:
            stall = self.save()
        self._report_commits()
        self.check_failure()
        return stall

    def save(self) -> float:
        """Start an asynchronous save of the current state; the seconds training was blocked."""
        if self.saver is None or self._last_saved == self.trainer.step:
            return 0.0
        pieces, meta = training_state(self.trainer)
        self._last_saved = self.trainer.step
        return self.saver.save(self.trainer.step, pieces, meta)

    def finish(self) -> None:
        """Save the final state (unless this step is saved already) and wait until it is durable."""
        if self.saver is None:
            return
        self.save()
        self.saver.wait()
        self._report_commits()

    def _report_commits(self) -> None:
        """Rank 0 reports each checkpoint once it is committed (saves finish in the background)."""
        if self.saver is None or self.metrics is None:
            return
        path = self.saver.last_path
        if path is not None and path != self._committed:
            self._committed = path
            step, _ = parse_step_dir(path.name)
            self.metrics.event(
                "checkpoint_saved", step=step, checkpoint=path.name, save_s=self.saver.last_save_s
            )

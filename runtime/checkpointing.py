"""Checkpointing inside `elastor train`: resume from the newest checkpoint, save every N steps, and
the elastic run's per-worker hooks (injected failures, `restored` / `resumed` / `checkpoint_saved`).

The training state is runtime/state.py's pieces and metadata; runtime/checkpoint/ stores them in the
partition-agnostic format, so `resume` works whatever plan the checkpoint was saved under: each rank
reads only the boxes its new shards need.
"""

import os
import time
from pathlib import Path

from runtime.checkpoint import Checkpointer, Wanted, latest_checkpoint, load_checkpoint
from runtime.checkpoint.format import parse_step_dir
from runtime.elastic import faults
from runtime.metrics import MetricsWriter
from runtime.state import restore_training_state, state_pieces, training_state
from runtime.trainer import StepResult, Trainer


def resume(trainer: Trainer, ckpt_dir: Path, metrics: MetricsWriter | None) -> bool:
    """Load the newest complete checkpoint of `ckpt_dir` into `trainer`, resharding it; False if none."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        return False
    started = time.perf_counter()
    pieces = state_pieces(trainer)
    wanted = [
        Wanted(p.name, p.global_shape, p.offsets, tuple(p.tensor.shape), p.tensor.dtype) for p in pieces
    ]
    tensors, meta = load_checkpoint(path, wanted, model=trainer.plan.model)
    restore_training_state(
        trainer, {(w.name, w.offsets): t for w, t in zip(wanted, tensors, strict=True)}, meta
    )
    if metrics:
        saved_under = meta["plan"]
        metrics.event(
            "restored",
            step=trainer.step,
            load_s=time.perf_counter() - started,
            checkpoint=path.name,
            saved_devices=sum(len(s["devices"]) for p in saved_under["pipelines"] for s in p["stages"]),
            devices=trainer.plan.world_size,
        )
    return True


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

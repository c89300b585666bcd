"""The training loop around `Trainer.train_step`: metrics, progress bar, and a per-step hook.

Every `eval_every` steps all ranks evaluate `eval_batches` global batches of held-out samples,
forward only (`Trainer.evaluate`), and rank 0 writes an `eval` event (`eval_loss`, `eval_s`).

A step whose all-reduce carried a stop request (runtime/stopping.py) is the last: the loop returns
after it, on every rank, without the `done` event.

`after_step(trainer, result)` runs after every step on every rank (the checkpoint plugs in here) and
returns the seconds it blocked training, reported as `ckpt_stall_s`. `step_time_s` is the step's
whole wall time on rank 0, stall included, and `samples_per_s` is the global batch over it. On a
GPU whose kind the hardware table knows, `mfu` is that throughput's model FLOPs utilisation
(`costmodel.flops`: the plan's model FLOPs per step over the step time, the plan's GPUs and the
kind's peak), shown on the progress bar too; a CPU has no peak to measure against.

The first step this process runs is measured (runtime/memory.py): every rank's bytes by kind are
gathered once, and rank 0 writes them beside the cost model's prediction as a `memory` event and
prints the worst measured/predicted ratio of the peak.
"""

import time
from collections.abc import Callable

from tqdm import tqdm

from costmodel import flops
from costmodel.hardware import DEVICE_KINDS
from runtime.memory import measure_step, memory_event
from runtime.metrics import MetricsWriter
from runtime.trainer import StepResult, Trainer


def train(
    trainer: Trainer,
    *,
    until_step: int,
    metrics: MetricsWriter | None = None,
    after_step: Callable[[Trainer, StepResult], float] | None = None,
    progress: bool = True,
    eval_every: int = 0,
    eval_batches: int = 1,
) -> list[StepResult]:
    """Run steps until `trainer.step == until_step` (a global step count: steps done before count);
    every `eval_every` steps (0: never), the loss on `eval_batches` held-out global batches."""
    batch = trainer.plan.global_batch_size
    utilisation = _mfu_of(trainer)
    if metrics:
        metrics.event(
            "start",
            step=trainer.step,
            world_size=trainer.plan.world_size,
            pipelines=len(trainer.plan.pipelines),
            model=trainer.plan.model.name,
        )
    bar = tqdm(
        total=until_step,
        initial=trainer.step,
        unit="step",
        desc="train",
        disable=not progress or trainer.ctx.rank != 0,
    )
    results = []
    try:
        while trainer.step < until_step:
            start = time.perf_counter()
            if results:
                result, event = trainer.train_step(), None
            else:
                result, measured = measure_step(trainer)
            stall = after_step(trainer, result) if after_step else 0.0
            elapsed = time.perf_counter() - start
            if not results:  # gathered and predicted outside the step's time
                event = memory_event(trainer, measured)
            results.append(result)
            if metrics:
                metrics.write(
                    {
                        "step": result.step,
                        "loss": result.loss,
                        "step_time_s": elapsed,
                        "samples_per_s": batch / elapsed,
                        **({"mfu": utilisation(elapsed)} if utilisation else {}),
                        "ckpt_stall_s": stall,
                        "lr": result.lr,
                        "grad_norm": result.grad_norm,
                    }
                )
            if event is not None:
                if metrics:
                    metrics.event("memory", step=result.step, **event)
                bar.write(
                    f"memory: worst measured/predicted peak {event['worst_measured_over_predicted']:.3f} "
                    f"({event['method']})"
                )
            bar.update(1)
            shown = {"mfu": f"{utilisation(elapsed):.1%}"} if utilisation else {}
            bar.set_postfix(loss=f"{result.loss:.4f}", samples_s=f"{batch / elapsed:.1f}", **shown)
            if eval_every and result.step % eval_every == 0:
                started = time.perf_counter()
                loss = trainer.evaluate(eval_batches)
                seconds = time.perf_counter() - started
                if metrics:
                    metrics.event(
                        "eval", step=result.step, eval_loss=loss, batches=eval_batches, eval_s=seconds
                    )
                bar.write(
                    f"step {result.step}: eval loss {loss:.4f} ({eval_batches} batch(es), {seconds:.2f} s)"
                )
            if result.stop:  # every rank saw the same flag in the step's all-reduce
                break
    finally:
        bar.close()
    if metrics and trainer.step >= until_step:
        metrics.event("done", step=trainer.step)
    return results


def _mfu_of(trainer: Trainer) -> Callable[[float], float] | None:
    """A step time's MFU (module docstring), or None where the device has no known peak."""
    if not trainer.ctx.is_cuda:
        return None
    from profiler.measure import cuda_device_kind

    kind = DEVICE_KINDS.get(cuda_device_kind())
    if kind is None:
        return None
    plan = trainer.plan
    per_step = flops.model_flops_per_step(plan.model, plan.seq_len, plan.global_batch_size)
    return lambda step_s: flops.mfu(per_step, step_s, plan.world_size, kind.peak_flops)

"""Training from any valid plan: one `Trainer` per rank, built by an ordered list of steps.

Construction, in order: the process groups of the plan (every rank, same order), this rank's stage
module (its layers, its TP shard, initialised from the seed), its main state (runtime/dist_optim.py:
fp32 main-gradient buckets, fp32 masters of the rows it keeps, the module cast to the plan's
dtype), the pipeline schedule, AdamW over the masters. One optimizer step (`train_step`):

1. run the pipeline's 1F1B schedule over its micro-batches of samples [cursor, cursor + B);
   gradients accumulate into the fp32 buckets, and each bucket's reduction (all-reduce, or
   reduce-scatter under ZeRO-1) is issued as soon as backward has produced all of it;
2. wait for the reductions;
3. one all-reduce over the job of [owned squared gradient, loss share, stop flag]: the global norm,
   the loss, and whether any rank was asked to stop (runtime/stopping.py);
4. clip, set the scheduled learning rate, AdamW step on the masters, publish them into the module
   (a copy, or under ZeRO-1 an all-gather of each bucket); advance step and cursor.

Everything that defines the training state lives on the trainer (`main.pieces`, the fp32 masters
by rows of global parameters, `optimizer`, `step`, `cursor`, `optim`, `seed`); runtime/state.py turns
it into checkpoint pieces and back.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from costmodel.plan import Plan
from runtime import stopping
from runtime.data import Prefetcher, fetch, open_source, pipeline_samples
from runtime.dist_optim import MainState
from runtime.distributed import DEFAULT_TIMEOUT_S, DistContext, ProcessGroups
from runtime.elastic import progress
from runtime.optim import OptimConfig, build_optimizer, set_lr
from runtime.pipeline import make_schedule
from runtime.precision import DTYPES
from runtime.stage import StageModule


@dataclass(frozen=True, kw_only=True)
class StepResult:
    step: int  # steps completed, 1-based: the first optimizer step is step 1
    loss: float  # mean token cross-entropy over the global batch, before this step's update
    grad_norm: float  # global gradient norm before clipping
    lr: float
    step_time_s: float
    stop: bool = False  # some rank was asked to stop: training ends after this step (runtime/stopping.py)


class Trainer:
    def __init__(
        self,
        plan: Plan,
        ctx: DistContext,
        *,
        optim: OptimConfig,
        seed: int = 0,
        source=None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        at_commit=None,
    ):
        self.plan, self.ctx, self.optim, self.seed = plan, ctx, optim, seed
        self.at_commit = at_commit  # injected `commit:` faults (runtime/elastic/faults.py), or None
        self.groups = ProcessGroups(plan, timeout_s=timeout_s)
        device = ctx.device_name
        pi, si = plan.placement(device)
        stage = plan.pipelines[pi].stages[si]
        self.pipeline_index, self.stage_index = pi, si
        self.tp_rank = stage.devices.index(device)

        self.model = StageModule(plan, device, self.groups.group(stage.devices), seed=seed).to(ctx.device)
        # fp32 masters and main gradient buckets from the fp32 weights; the module becomes plan.dtype
        self.main = MainState(plan, device, self.model, self.groups, DTYPES[plan.dtype])
        self.schedule = make_schedule(
            plan,
            device,
            self.model,
            torch_device=ctx.device,
            global_tokens=plan.global_batch_size * plan.seq_len,
            dtype=DTYPES[plan.dtype],
        )
        self.optimizer = build_optimizer([piece.param for piece in self.main.pieces], optim)
        self.step, self.cursor = 0, 0
        self.last: StepResult | None = None  # the newest step's result (an in-process recovery reports it)
        self.last_totals: torch.Tensor | None = None  # and its all-reduced totals
        self.awaiting_commit = False  # inside a step's all-reduce: gradients reduced, totals not known

        # The sample stream (runtime/data.py); synthetic tokens from the seed unless one is given.
        self.prefetcher: Prefetcher | None = None
        self.use_source(
            open_source(None, plan.model.vocab_size, plan.seq_len, seed) if source is None else source
        )
        # The loss is known on the last stage; its first TP rank reports it, once per pipeline.
        self.reports_loss = self.model.is_last and self.tp_rank == 0

    def use_source(self, source) -> None:
        """Read samples from `source` from now on (first and last stages prefetch them)."""
        self._stop_prefetcher()
        self.source = source
        if self.model.is_first or self.model.is_last:
            offset, count = pipeline_samples(self.plan, self.pipeline_index)
            stride = self.plan.global_batch_size
            self.prefetcher = Prefetcher(source, offset, count, stride, pin=self.ctx.is_cuda)

    def _micro_batches(self) -> list[torch.Tensor | None]:
        m = self.plan.pipelines[self.pipeline_index].num_microbatches
        if self.prefetcher is None:
            return [None] * m
        batch = self.prefetcher.get(self.cursor).to(self.ctx.device, non_blocking=True)
        return list(batch.split(self.plan.micro_batch_size))

    def train_step(self) -> StepResult:
        start = time.perf_counter()
        self.main.zero_grad()
        loss = self.schedule.run(self._micro_batches())  # hooks issue the bucket reductions
        with progress.current.waiting():
            self.main.finish_reduction()
        totals = torch.stack(
            [
                self.main.owned_square_sum(),
                loss.float() if self.reports_loss else torch.zeros((), device=self.ctx.device),
                torch.tensor(float(stopping.current.requested), device=self.ctx.device),
            ]
        )
        self.awaiting_commit = True  # until the totals are known: an in-process recovery may finish it
        with progress.current.waiting():
            dist.all_reduce(totals)
            if self.at_commit is not None:
                self.at_commit(self.step + 1)
        return self.commit(totals, start)

    def commit(self, totals: torch.Tensor, start: float | None = None) -> StepResult:
        """The rest of a step once its all-reduced totals (squared gradient norm, loss, stop flag) are
        known: clip, AdamW on the masters, publish, advance. Local: a survivor whose step's all-reduce
        failed after some peer had completed it finishes the step with that peer's totals
        (runtime/elastic/inprocess.py)."""
        self.awaiting_commit = False
        self.last_totals = totals.detach().clone()
        norm, global_loss, stop = totals[0].sqrt().item(), totals[1].item(), totals[2].item() > 0
        coef = self.optim.clip_coefficient(norm)
        if coef < 1.0:
            self.main.scale_grads(coef)
        lr = self.optim.lr_at(self.step)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.main.publish()
        self.step += 1
        self.cursor += self.plan.global_batch_size
        progress.current.step_done(self.step)
        self.last = StepResult(
            step=self.step,
            loss=global_loss,
            grad_norm=norm,
            lr=lr,
            step_time_s=time.perf_counter() - (start if start is not None else time.perf_counter()),
            stop=stop,
        )
        return self.last

    @torch.no_grad()
    def evaluate(self, batches: int = 1) -> float:
        """Mean token cross-entropy over `batches` global batches of the source's held-out samples
        (`held_out()`), forward only, every rank of the job together; the model is not changed. Each
        batch is split across pipelines and micro-batches exactly as a training step's is."""
        held = self.source.held_out()
        total = torch.zeros((), device=self.ctx.device)
        offset, count = pipeline_samples(self.plan, self.pipeline_index)
        for j in range(batches):
            micro = [None] * self.plan.pipelines[self.pipeline_index].num_microbatches
            if self.model.is_first or self.model.is_last:
                first = j * self.plan.global_batch_size + offset
                batch = fetch(held, first, count).to(self.ctx.device)
                micro = list(batch.split(self.plan.micro_batch_size))
            loss = self.schedule.evaluate(micro)
            total += loss.float() if self.reports_loss else 0.0
        with progress.current.waiting():
            dist.all_reduce(total)
        return total.item() / batches

    def close(self) -> None:
        """After the last step: stop the prefetcher and the optimizer's worker thread."""
        self._stop_prefetcher()
        self.main.close()

    def _stop_prefetcher(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

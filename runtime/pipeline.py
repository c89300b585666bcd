"""One pipeline's 1F1B schedule with point-to-point sends, for stages of any TP degree.

The schedule is PipeDream-Flush / Megatron's non-interleaved 1F1B (Narayanan et al. 2021, section
2.2): stage s of S runs min(S - s - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards; at most S - s micro-batches' activations are alive.
Every step's send is paired with the receive the neighbour is posting at the same moment and the
pair goes out as one `batch_isend_irecv`, so no ordering of blocking calls can deadlock.

Why not `torch.distributed.pipelining`: its stages are one rank each, linked by consecutive ranks of
one group; tensor parallelism is added by running one pipeline per TP rank, which requires every
stage of a pipeline to have the same TP degree. Elastor's stages do not (a stage of 3 feeding a stage
of 2). Here the activations leaving a stage are complete on each of its TP ranks, so stage a (degree
A) feeds stage b (degree B) by fan-out: b's rank j receives from a's rank j mod A, and in backward,
a's rank i receives the input gradient (also complete on every rank of b, thanks to the TP regions'
backward all-reduce) from b's rank i mod B. Each receiver gets exactly one message per micro-batch
and the senders share the work.

Gradients are not scaled by the micro-batch count: the last stage's loss is the summed token
cross-entropy divided by the global token count, so gradients summed over micro-batches and then
over pipelines give the full-batch gradient whatever each pipeline's micro-batch count.
"""

from collections import deque
from contextlib import nullcontext

import torch
import torch.distributed as dist

from costmodel.plan import Plan
from runtime.stage import StageModule


class PipelineSchedule:
    def __init__(
        self,
        plan: Plan,
        device: str,
        model: StageModule,
        *,
        torch_device: torch.device,
        global_tokens: int,
        autocast_dtype: torch.dtype | None = None,
    ):
        rank_of = {d: i for i, d in enumerate(plan.devices)}
        pi, si = plan.placement(device)
        stages = plan.pipelines[pi].stages
        me, tp = stages[si].devices.index(device), stages[si].tp_degree
        self.num_stages, self.stage_index = len(stages), si
        self.model, self.device, self.global_tokens = model, torch_device, global_tokens
        self.autocast_dtype = autocast_dtype
        self.hidden_shape = (plan.micro_batch_size, plan.seq_len, plan.model.hidden_size)
        prev = stages[si - 1].devices if si > 0 else ()
        nxt = stages[si + 1].devices if si + 1 < len(stages) else ()
        self.recv_fwd_from = rank_of[prev[me % len(prev)]] if prev else None
        self.send_fwd_to = [rank_of[d] for j, d in enumerate(nxt) if j % tp == me]
        self.recv_bwd_from = rank_of[nxt[me % len(nxt)]] if nxt else None
        self.send_bwd_to = [rank_of[d] for i, d in enumerate(prev) if i % tp == me]

    # ---- point-to-point ------------------------------------------------------------------------
    def _exchange(
        self, sends: list[tuple[torch.Tensor, list[int]]], recv_from: int | None
    ) -> torch.Tensor | None:
        """Post every send and at most one receive together; wait for all of them."""
        ops = [dist.P2POp(dist.isend, t, peer) for t, peers in sends for peer in peers]
        received = None
        if recv_from is not None:
            received = torch.empty(self.hidden_shape, dtype=torch.float32, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def _recv_forward(self) -> torch.Tensor | None:
        x = self._exchange([], self.recv_fwd_from)
        return None if x is None else x.requires_grad_()

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor | None, batch: torch.Tensor) -> torch.Tensor:
        """Hidden states to send on, or (last stage) this micro-batch's share of the loss."""
        context = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else nullcontext()
        )
        with context:
            out = self.model(batch[:, :-1] if x is None else x)
            if self.model.is_last:
                return self.model.loss_sum(out, batch[:, 1:]) / self.global_tokens
        return out.float()

    def _backward(
        self, x: torch.Tensor | None, y: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        torch.autograd.backward(y, grad)
        return None if x is None else x.grad

    # ---- the schedule ---------------------------------------------------------------------------
    def run(self, micro_batches: list[torch.Tensor | None]) -> torch.Tensor:
        """Forward and backward every micro-batch (token windows [mb, seq + 1] on stages that read
        data, None elsewhere); gradients accumulate in the model. Returns the last stage's summed loss
        share (zero elsewhere)."""
        m = len(micro_batches)
        warmup = min(self.num_stages - self.stage_index - 1, m)
        inputs: deque = deque()
        outputs: deque = deque()
        loss = torch.zeros((), device=self.device)
        last = self.model.is_last

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal loss
            y = self._forward(x, micro_batches[i])
            inputs.append(x)
            outputs.append(y)
            if last:
                loss = loss + y.detach()
            return y

        for i in range(warmup):
            y = forward(i, self._recv_forward())
            self._exchange([(y.detach(), self.send_fwd_to)], None)
        x = self._recv_forward() if warmup < m else None
        for i in range(warmup, m):
            y = forward(i, x)
            grad = self._exchange([] if last else [(y.detach(), self.send_fwd_to)], self.recv_bwd_from)
            gx = self._backward(inputs.popleft(), outputs.popleft(), grad)
            sends = [(gx, self.send_bwd_to)] if gx is not None else []
            if i == m - 1:
                self._exchange(sends, None)
                x = None
            else:
                x = self._exchange(sends, self.recv_fwd_from)
                if x is not None:
                    x.requires_grad_()
        for _ in range(warmup):
            grad = self._exchange([], self.recv_bwd_from)
            gx = self._backward(inputs.popleft(), outputs.popleft(), grad)
            self._exchange([(gx, self.send_bwd_to)] if gx is not None else [], None)
        return loss

"""One pipeline's 1F1B schedule with point-to-point sends, for stages of any TP degree.

The schedule is PipeDream-Flush / Megatron's non-interleaved 1F1B (Narayanan et al. 2021, section
2.2): stage s of S runs min(S - s - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards; at most S - s micro-batches' activations are alive.
Every step's send is paired with the receive the neighbour is posting at the same moment and the
pair goes out as one `batch_isend_irecv`, so no ordering of blocking calls can deadlock.

Why not `torch.distributed.pipelining`: its stages are one rank each, linked by consecutive ranks of
one group; tensor parallelism is added by running one pipeline per TP rank, which requires every
stage of a pipeline to have the same TP degree. Elastor's stages do not (a stage of 3 feeding a stage
of 2). Here each rank of a stage holds the activations leaving it whole, or under sequence
parallelism its sequence slice, and each rank of the next stage needs them whole or its own slice:
`costmodel.boundary.routes` cuts every needed range into pieces and names one holder per piece, so
each rank receives every token it needs exactly once (forward: activations; backward: their
gradients, with the roles swapped) and the holders share the sending. Without sequence parallelism
that is b's rank j receiving from a's rank j mod A. Messages travel in the plan's dtype.

Gradients are not scaled by the micro-batch count: the last stage's loss is the summed token
cross-entropy divided by the global token count, so gradients summed over micro-batches and then
over pipelines give the full-batch gradient whatever each pipeline's micro-batch count.
"""

from collections import deque

import torch
import torch.distributed as dist

from costmodel.boundary import Transfer, routes, stage_ranges
from costmodel.plan import Plan, Stage
from runtime.stage import StageModule


def _links(
    front: Stage, back: Stage, me: int, seq_len: int, rank_of: dict[str, int], i_am_front: bool
) -> tuple[list, list]:
    """This rank's (sends, receives) across the front -> back boundary, forward then backward.

    Each entry is (peer rank, start, stop) in this rank's local token coordinates, in a fixed order
    that the peer derives identically."""
    ranges = {
        "front": stage_ranges(seq_len, front.tp_degree, front.sequence_parallel),
        "back": stage_ranges(seq_len, back.tp_degree, back.sequence_parallel),
    }
    devices = {"front": front.devices, "back": back.devices}

    def mine(transfers: list[Transfer], holder: str, needer: str) -> tuple[list, list]:
        side = "front" if i_am_front else "back"
        sends = [
            (rank_of[devices[needer][t.dst]], t.start - ranges[holder][me][0], t.stop - ranges[holder][me][0])
            for t in transfers
            if holder == side and t.src == me
        ]
        recvs = [
            (rank_of[devices[holder][t.src]], t.start - ranges[needer][me][0], t.stop - ranges[needer][me][0])
            for t in transfers
            if needer == side and t.dst == me
        ]
        return sends, recvs

    forward = mine(routes(ranges["front"], ranges["back"]), "front", "back")
    backward = mine(routes(ranges["back"], ranges["front"]), "back", "front")
    return forward, backward


class PipelineSchedule:
    def __init__(
        self,
        plan: Plan,
        device: str,
        model: StageModule,
        *,
        torch_device: torch.device,
        global_tokens: int,
        dtype: torch.dtype = torch.float32,
    ):
        rank_of = {d: i for i, d in enumerate(plan.devices)}
        pi, si = plan.placement(device)
        stages = plan.pipelines[pi].stages
        me = stages[si].devices.index(device)
        self.num_stages, self.stage_index = len(stages), si
        self.model, self.device, self.global_tokens = model, torch_device, global_tokens
        self.dtype = dtype
        self.batch_hidden = (plan.micro_batch_size, plan.model.hidden_size)
        no_links: tuple[list, list] = ([], [])
        before = _links(stages[si - 1], stages[si], me, plan.seq_len, rank_of, False) if si > 0 else None
        after = (
            _links(stages[si], stages[si + 1], me, plan.seq_len, rank_of, True)
            if si + 1 < len(stages)
            else None
        )
        # (sends, receives) of activations forward and of their gradients backward.
        (_, self.recv_fwd), (self.send_bwd, _) = before or (no_links, no_links)
        (self.send_fwd, _), (_, self.recv_bwd) = after or (no_links, no_links)
        self.bytes_sent = self.messages_sent = 0  # point-to-point payload and messages this rank sent

    # ---- point-to-point ------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor | None, to: list, receive: list) -> torch.Tensor | None:
        """Post the pieces of `send` to their peers and the pieces to receive, together; wait for all,
        and return the received pieces joined along the sequence (None if nothing was received)."""
        ops = []
        if send is not None:
            for peer, lo, hi in to:
                piece = send[:, lo:hi].contiguous()
                ops.append(dist.P2POp(dist.isend, piece, peer))
                self.bytes_sent += piece.numel() * piece.element_size()
                self.messages_sent += 1
        pieces = []
        for peer, lo, hi in receive:
            pieces.append(
                torch.empty(
                    (self.batch_hidden[0], hi - lo, self.batch_hidden[1]),
                    dtype=self.dtype,
                    device=self.device,
                )
            )
            ops.append(dist.P2POp(dist.irecv, pieces[-1], peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _recv_forward(self) -> torch.Tensor | None:
        x = self._exchange(None, [], self.recv_fwd)
        return None if x is None else x.requires_grad_()

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor | None, batch: torch.Tensor) -> torch.Tensor:
        """Hidden states to send on, or (last stage) this micro-batch's share of the loss (fp32)."""
        out = self.model(batch[:, :-1] if x is None else x)
        if self.model.is_last:
            return self.model.loss_sum(out, batch[:, 1:]) / self.global_tokens
        return out

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
            self._exchange(y.detach(), self.send_fwd, [])
        x = self._recv_forward() if warmup < m else None
        for i in range(warmup, m):
            y = forward(i, x)
            grad = self._exchange(None if last else y.detach(), self.send_fwd, self.recv_bwd)
            gx = self._backward(inputs.popleft(), outputs.popleft(), grad)
            if i == m - 1:
                self._exchange(gx, self.send_bwd, [])
                x = None
            else:
                x = self._exchange(gx, self.send_bwd, self.recv_fwd)
                if x is not None:
                    x.requires_grad_()
        for _ in range(warmup):
            grad = self._exchange(None, [], self.recv_bwd)
            gx = self._backward(inputs.popleft(), outputs.popleft(), grad)
            self._exchange(gx, self.send_bwd, [])
        return loss

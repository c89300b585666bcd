"""One pipeline's 1F1B schedule with point-to-point sends, for stages of any TP degree, and the
interleaved 1F1B schedule for stages that hold several layer chunks (`InterleavedSchedule`).

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

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from costmodel import schedule
from costmodel.boundary import Transfer, routes, stage_ranges
from costmodel.plan import Plan, Stage
from costmodel.schedule import Op
from runtime.elastic import progress
from runtime.split_backward import DeferredWeightGradients
from runtime.stage import StageModule


def make_schedule(plan: Plan, device: str, model: StageModule, **kwargs):
    """The schedule of `device`'s pipeline: 1F1B, or `InterleavedSchedule` when its stages hold
    chunks or it splits its backwards (which runs plain 1F1B's order at one chunk)."""
    pipe = plan.pipelines[plan.placement(device)[0]]
    general = pipe.num_chunks > 1 or pipe.split_backward
    return (InterleavedSchedule if general else PipelineSchedule)(plan, device, model, **kwargs)


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


class _Schedule:
    """What both schedules know of their rank: its stage, its TP rank there, the model, and how
    large a boundary piece is."""

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
        self.rank_of = {d: i for i, d in enumerate(plan.devices)}
        pi, self.stage_index = plan.placement(device)
        self.pipe = plan.pipelines[pi]
        self.num_stages = len(self.pipe.stages)
        self.tp_rank = self.pipe.stages[self.stage_index].devices.index(device)
        self.model, self.device, self.global_tokens, self.dtype = model, torch_device, global_tokens, dtype
        self.seq_len = plan.seq_len
        self.batch_hidden = (plan.micro_batch_size, plan.model.hidden_size)
        self.bytes_sent = self.messages_sent = 0  # point-to-point payload and messages this rank sent

    def _links(self, front: int, back: int) -> tuple[list, list]:
        """This rank's links across the boundary from stage `front` to stage `back` (`_links`)."""
        stages, mine = self.pipe.stages, self.stage_index
        return _links(stages[front], stages[back], self.tp_rank, self.seq_len, self.rank_of, front == mine)


class PipelineSchedule(_Schedule):
    def __init__(self, plan: Plan, device: str, model: StageModule, **kwargs):
        super().__init__(plan, device, model, **kwargs)
        si, stages = self.stage_index, self.pipe.stages
        no_links: tuple[list, list] = ([], [])
        before = self._links(si - 1, si) if si > 0 else None
        after = self._links(si, si + 1) if si + 1 < len(stages) else None
        # (sends, receives) of activations forward and of their gradients backward.
        (_, self.recv_fwd), (self.send_bwd, _) = before or (no_links, no_links)
        (self.send_fwd, _), (_, self.recv_bwd) = after or (no_links, no_links)

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
            with progress.current.waiting():
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def evaluate(self, micro_batches: list[torch.Tensor | None]) -> torch.Tensor:
        """Forward only (call under `torch.no_grad()`): each micro-batch in turn is received, run and
        sent on, so every wait is for an earlier stage. Returns the last stage's summed loss share."""
        loss = torch.zeros((), device=self.device)
        for batch in micro_batches:
            y = self._forward(self._exchange(None, [], self.recv_fwd), batch)
            if self.model.is_last:
                loss = loss + y
            else:
                self._exchange(y, self.send_fwd, [])
        return loss

    def _recv_forward(self) -> torch.Tensor | None:
        x = self._exchange(None, [], self.recv_fwd)
        return None if x is None else x.requires_grad_()

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor | None, batch: torch.Tensor) -> torch.Tensor:
        """Hidden states to send on, or (last stage) this micro-batch's share of the loss (fp32)."""
        progress.current.mark("forward")
        out = self.model(batch[:, :-1] if x is None else x)
        if self.model.is_last:
            return self.model.loss_sum(out, batch[:, 1:]) / self.global_tokens
        return out

    def _backward(
        self, x: torch.Tensor | None, y: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        progress.current.mark("backward")
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


class InterleavedSchedule(_Schedule):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) for stages of any TP degree: each stage
    runs `costmodel.schedule.program`'s order of chunk-forwards and chunk-backwards.

    Messages: a chunk's output goes to the next virtual stage (stage s + 1, or from the last stage to
    the first for the next chunk) and its input gradient to the previous one, cut into the same
    per-rank pieces as 1F1B's boundaries (`_links`, each boundary of the ring with its own routes).
    Sends are posted (`isend`) as soon as a chunk is done and never waited for in the step's course
    (a finished send is dropped when the next op starts; all are waited for at the step's end).
    Receives are posted in the order the sending stage sends (`costmodel.schedule.sends`), so every
    pair of ranks matches its messages in one order whatever the backend (NCCL has no tags), and a
    rank waits only for the input of the op it runs next; a receive posted ahead of the one it needs
    holds its buffer until then. With sends that do not wait there is no cycle of waits as long as
    every op's input is produced by an op its sender runs without waiting for this rank's later
    work, which `costmodel.schedule.replay` checks for the orders used (it raises on a deadlock).

    With the pipeline's `split_backward`, each chunk-backward is ZB-H1's input-gradient "B" and a
    later "W" computes its weight gradients (`costmodel.schedule.split_backward` places them,
    runtime/split_backward.py defers them); at one chunk the order is plain 1F1B's, split.

    Why not `torch.distributed.pipelining.ScheduleInterleaved1F1B`: like its 1F1B, it needs one TP
    degree for the whole pipeline (see the module docstring).
    """

    def __init__(self, plan: Plan, device: str, model: StageModule, **kwargs):
        super().__init__(plan, device, model, **kwargs)
        S, v, m, si = self.num_stages, self.pipe.num_chunks, self.pipe.num_microbatches, self.stage_index
        self.num_chunks = v
        split = self.pipe.split_backward
        self.program = schedule.program(si, S, v, m, split)
        self.deferred = DeferredWeightGradients() if split else None
        if split:
            self.deferred.install(model.blocks)
        previous, following = (si - 1) % S, (si + 1) % S
        (_, self.recv_fwd), (self.send_bwd, _) = self._links(previous, si)
        (self.send_fwd, _), (_, self.recv_bwd) = self._links(si, following)
        # what each neighbouring stage sends this one, in its order (one list when both are one stage)
        self.incoming = {src: schedule.sends(src, si, S, v, m, split) for src in {previous, following}}

    # ---- point-to-point ------------------------------------------------------------------------
    def _post_receive(self, kind: str) -> tuple[list, list]:
        receive = self.recv_fwd if kind == "F" else self.recv_bwd
        pieces, works = [], []
        for peer, lo, hi in receive:
            piece = torch.empty(
                (self.batch_hidden[0], hi - lo, self.batch_hidden[1]), dtype=self.dtype, device=self.device
            )
            works.append(dist.irecv(piece, peer))
            pieces.append(piece)
        return pieces, works

    def _receive(self, op: Op) -> torch.Tensor:
        """The input `op` needs from its neighbour: post receives up to its message, wait for it."""
        S = self.num_stages
        src = schedule.source(op, self.stage_index, S, self.num_chunks)
        virtual = op.chunk * S + self.stage_index
        wanted = Op(op.kind, op.micro_batch, (virtual - 1 if op.kind == "F" else virtual + 1) // S)
        queue = self._incoming[src]
        while wanted not in self._posted[src]:
            sent = queue[self._cursor[src]]
            self._cursor[src] += 1
            self._posted[src][sent] = self._post_receive(sent.kind)
        pieces, works = self._posted[src].pop(wanted)
        with progress.current.waiting():
            for work in works:
                work.wait()
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _send(self, tensor: torch.Tensor, to: list) -> None:
        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]
        for peer, lo, hi in to:
            piece = tensor[:, lo:hi].contiguous()
            self._sending.append((dist.isend(piece, peer), piece))
            self.bytes_sent += piece.numel() * piece.element_size()
            self.messages_sent += 1

    def _begin(self, incoming: dict[int, list[Op]]) -> None:
        """Before a pass: what each neighbour will send, in its order; nothing posted or in flight."""
        self._incoming = incoming
        self._posted: dict[int, dict] = {src: {} for src in incoming}
        self._cursor = dict.fromkeys(incoming, 0)
        self._sending: list = []

    def _end(self) -> None:
        """After a pass: wait for every send still in flight."""
        with progress.current.waiting():
            for work, _ in self._sending:
                work.wait()
        self._sending = []

    # ---- the schedule ---------------------------------------------------------------------------
    def evaluate(self, micro_batches: list[torch.Tensor | None]) -> torch.Tensor:
        """Forward only (call under `torch.no_grad()`): micro-batch by micro-batch, chunk by chunk.
        Every stage runs the same order, so each waits only for an earlier virtual stage, and its
        receives are posted in the order its neighbours send (each neighbour's forwards that end
        here, in that order)."""
        S, v, si = self.num_stages, self.num_chunks, self.stage_index
        order = [Op("F", i, k) for i in range(len(micro_batches)) for k in range(v)]
        self._begin(
            {src: [op for op in order if schedule.destination(op, src, S, v) == si] for src in self.incoming}
        )
        loss = torch.zeros((), device=self.device)
        for op in order:
            i, k = op.micro_batch, op.chunk
            x = None if self.model.starts(k) else self._receive(op)
            y = self.model(micro_batches[i][:, :-1] if x is None else x, chunk=k)
            if self.model.ends(k):
                loss = loss + self.model.loss_sum(y, micro_batches[i][:, 1:]) / self.global_tokens
            elif schedule.destination(op, si, S, v) is not None:
                self._send(y, self.send_fwd)
        self._end()
        return loss

    def run(self, micro_batches: list[torch.Tensor | None]) -> torch.Tensor:
        """As `PipelineSchedule.run`, chunk by chunk in `costmodel.schedule.program`'s order."""
        S, v, si = self.num_stages, self.num_chunks, self.stage_index
        self._begin(self.incoming)
        alive: dict[tuple[int, int], tuple] = {}
        loss = torch.zeros((), device=self.device)
        for op in self.program:
            i, k = op.micro_batch, op.chunk
            progress.current.mark("forward" if op.kind == "F" else "backward")
            if op.kind == "W":
                self.deferred.run((i, k))
            elif op.kind == "F":
                if self.model.starts(k):
                    x, y = None, self.model(micro_batches[i][:, :-1], chunk=k)
                else:
                    x = self._receive(op).requires_grad_()
                    y = self.model(x, chunk=k)
                if self.model.ends(k):
                    y = self.model.loss_sum(y, micro_batches[i][:, 1:]) / self.global_tokens
                    loss = loss + y.detach()
                elif schedule.destination(op, si, S, v) is not None:
                    self._send(y.detach(), self.send_fwd)
                alive[(i, k)] = (x, y)
            else:
                x, y = alive.pop((i, k))
                grad = None if self.model.ends(k) else self._receive(op)
                with self.deferred.deferring((i, k)) if self.deferred else contextlib.nullcontext():
                    torch.autograd.backward(y, grad)
                if x is not None:
                    self._send(x.grad, self.send_bwd)
        self._end()
        if self.deferred is not None and self.deferred.pending:  # every W ran: the program's promise
            raise RuntimeError(
                f"{self.deferred.pending} micro-batch chunks' weight gradients were never computed"
            )
        return loss

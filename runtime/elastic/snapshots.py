"""Peer snapshots: a copy of the training state that only one rank holds, kept in another rank's host
memory, so that the in-process recovery (runtime/elastic/inprocess.py) can be taken when that rank
is lost.

Under ZeRO-1 each fp32 master row and its AdamW moments live on one rank only (and in a plan without
data parallelism every row does): when that rank dies no survivor holds them, and without a copy the
recovery must restart from the storage checkpoint. After Gemini (Wang et al., "Gemini: Fast Failure
Recovery in Distributed Training with In-Memory Checkpoints", SOSP 2023), every rank therefore keeps
a snapshot of its own state in host memory every `every` steps and sends a copy to its *buddy*, a
rank on another node, over a gloo group of its own in a background thread while training goes on.

Consistency: a lost rank's rows exist only at the step of its newest snapshot, so a recovery that
needs them rolls every survivor back to that step (each restores its own snapshot of it) and redoes
the steps since; the losses are those of an uninterrupted run because every step is a function of
the state and the step number (the data of a step are a function of its sample indices). Each
exchange ends with an all-reduce over the snapshot group, so a rank that has seen it return knows
that every buddy holds its ward's copy of that step (`Snapshot.agreed`); the rank keeps that agreed
snapshot until the next one is agreed, and the one in flight beside it. The survivors then agree on
the newest step that every one of them holds and whose copy of every lost rank survived
(`rollback_step`).

Who keeps whose: `buddies(plan)` puts the plan's devices in a ring interleaved by node (the first
device of every node, then the second, ...), and each device's copy goes to the next one in the ring:
on another node wherever the ring's neighbour is (everywhere when the nodes have the same number of
the plan's devices), one copy per device, one ward per buddy.

Costs, per rank: host memory for its own snapshot and its ward's, twice while an exchange is in
flight (4 x the state it keeps at most, 2 x once the exchange is agreed: 12 bytes per kept parameter
each, fp32 master and two moments), and every `every` steps that state's bytes sent once and received
once. A snapshot whose predecessor's exchange has not finished waits for it (the stall is reported
with the checkpoint's, `ckpt_stall_s`). The rollback costs the steps since the snapshot, at most
`every`. Snapshots are taken only when the plan holds some row on one rank alone (`needed`): a plan
whose every row has a replica loses nothing it cannot fetch from the survivors.

Why not torch's pieces: `torch.distributed.checkpoint` writes to storage; this copy lives in a peer's
memory, and the recovery reads it with the same point-to-point transfers that fetch the survivors'
live state (runtime/elastic/peers.py), into a different heterogeneous plan.
"""

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from costmodel.cluster import parse_device
from costmodel.plan import Plan
from costmodel.sharding import state_boxes
from runtime.checkpoint.assign import split_dim
from runtime.elastic.peers import STATE_PREFIXES, Pieces, Rows, kept_by
from runtime.state import StatePiece, training_state


def buddies(plan: Plan) -> dict[str, str]:
    """Device -> the device whose host memory keeps its snapshot (module docstring)."""
    by_node: dict[str, list[str]] = {}
    for device in plan.devices:
        by_node.setdefault(parse_device(device)[0], []).append(device)
    widest = max(len(devices) for devices in by_node.values())
    ring = [devices[i] for i in range(widest) for devices in by_node.values() if i < len(devices)]
    return {device: ring[(k + 1) % len(ring)] for k, device in enumerate(ring)}


def needed(plan: Plan) -> bool:
    """Whether some row of the plan's state is kept by one device alone (its loss loses the row)."""
    return len(plan.devices) > 1 and any(
        len(holders) == 1 for coverage in kept_by(plan, plan.devices).values() for holders in coverage.holders
    )


def layout(plan: Plan, device: str) -> list[Rows]:
    """The runs of rows of `device`'s state under `plan` in the order its snapshot lays them out
    flat: every box it keeps (`costmodel.sharding.state_boxes`), master then moments."""
    out = []
    for spec, box in state_boxes(plan)[device]:
        d = split_dim(spec)
        start = box.offsets[d]
        out += [
            Rows(prefix + spec.name, spec.shape, d, start, start + box.sizes[d]) for prefix in STATE_PREFIXES
        ]
    return out


def pieces_of(plan: Plan, device: str, flat: torch.Tensor) -> list[StatePiece]:
    """`device`'s state as pieces viewing a flat snapshot laid out by `layout`."""
    pieces, at = [], 0
    for rows in layout(plan, device):
        shape = list(rows.shape)
        shape[rows.dim] = rows.stop - rows.start
        offsets = [0] * len(shape)
        offsets[rows.dim] = rows.start
        pieces.append(
            StatePiece(rows.name, rows.shape, tuple(offsets), flat[at : at + rows.numel].view(shape))
        )
        at += rows.numel
    return pieces


@dataclass
class Snapshot:
    """One step's snapshot on one rank: its own state and its ward's copy (flat, fp32, host)."""

    step: int
    own: torch.Tensor
    meta: dict[str, Any]
    ward: torch.Tensor
    ward_done: bool = False  # the ward's copy has arrived
    agreed: bool = False  # every rank's exchange of this step has finished


class PeerSnapshots:
    """This rank's snapshots, every `every` steps (0: never), for the plan it trains under now."""

    def __init__(self, every: int, *, timeout_s: float):
        self.every, self.timeout_s = every, timeout_s
        self.plan: Plan | None = None
        self.group = None
        self.agreed: Snapshot | None = None  # the newest snapshot every rank's exchange finished
        self.pending: Snapshot | None = None  # the newest one taken, its exchange maybe in flight
        self._thread: threading.Thread | None = None
        self.sent_bytes = self.ward_bytes = 0  # per snapshot: this rank's own state, its ward's

    @property
    def active(self) -> bool:
        return self.group is not None

    def bind(self, trainer) -> None:
        """Start over under `trainer`'s plan (every rank of it together: a collective) and take the
        first snapshot of its state now."""
        self.release()
        self.plan = trainer.plan
        if self.every <= 0 or not needed(self.plan):
            return
        me = trainer.ctx.device_name
        ring = buddies(self.plan)
        self.me, self.buddy = me, ring[me]
        self.ward_device = next(d for d, b in ring.items() if b == me)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._ward_numel = sum(r.numel for r in layout(self.plan, self.ward_device))
        self.ward_bytes = self._ward_numel * 4  # fp32
        self.take(trainer)

    def after_step(self, trainer) -> float:
        """The training loop's hook: a snapshot every `every` steps; returns the seconds it blocked."""
        if self.active and trainer.step % self.every == 0:
            return self.take(trainer)
        return 0.0

    def take(self, trainer) -> float:
        """Copy this rank's state to host memory and send it to the buddy in the background (after
        the previous exchange has finished); returns the seconds training was blocked."""
        started = time.perf_counter()
        self._settle()
        pieces, meta = training_state(trainer)
        wanted = Pieces(pieces)
        own = torch.cat([wanted.rows(r).reshape(-1).cpu() for r in layout(self.plan, self.me)])
        self.sent_bytes = own.numel() * own.element_size()
        snapshot = Snapshot(trainer.step, own, meta, torch.empty(self._ward_numel, dtype=own.dtype))
        self.pending = snapshot
        self._thread = threading.Thread(
            target=self._exchange, args=(snapshot,), name="peer-snapshot", daemon=True
        )
        self._thread.start()
        return time.perf_counter() - started

    def _exchange(self, snapshot: Snapshot) -> None:
        group, rank = self.group, self.plan.devices.index  # the snapshot group spans the job
        try:
            ops = [
                dist.P2POp(dist.isend, snapshot.own, rank(self.buddy), group),
                dist.P2POp(dist.irecv, snapshot.ward, rank(self.ward_device), group),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            snapshot.ward_done = True
            dist.all_reduce(torch.ones(1), group=group)
            snapshot.agreed = True
        except Exception:  # a peer failed: the recovery reads the flags of what did arrive
            pass

    def _settle(self) -> None:
        """Wait for the exchange in flight; an agreed snapshot replaces the previous one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.pending is not None and self.pending.agreed:
            self.agreed, self.pending = self.pending, None

    def stop(self) -> list:
        """After the job's communication was aborted: wait for the exchange thread (it fails at once)
        and hand over the snapshot group's reference (`runtime.distributed.leave_job` frees it)."""
        self._settle()
        group, self.group = self.group, None
        return [group] if group is not None else []

    def release(self) -> None:
        """Drop every snapshot (they belong to the plan that is going)."""
        self.stop()
        self.agreed = self.pending = None

    # ---- the recovery's side ---------------------------------------------------------------------
    def summary(self) -> list[float]:
        """[agreed step, pending step, whether the pending one's ward copy arrived]; -1: none."""
        agreed = self.agreed.step if self.agreed else -1
        pending = self.pending.step if self.pending else -1
        return [float(agreed), float(pending), float(bool(self.pending and self.pending.ward_done))]

    def held_at(self, step: int) -> tuple[list[StatePiece], dict[str, Any]]:
        """The pieces this rank holds of step `step` (its own and, where it arrived, its ward's), and
        its own metadata of that step."""
        for snapshot in (self.agreed, self.pending):
            if snapshot is not None and snapshot.step == step:
                pieces = pieces_of(self.plan, self.me, snapshot.own)
                if snapshot.ward_done:
                    pieces += pieces_of(self.plan, self.ward_device, snapshot.ward)
                return pieces, snapshot.meta
        raise KeyError(f"no snapshot of step {step} on {getattr(self, 'me', '?')}")


def rollback_step(plan: Plan, order: list[str], summaries: list[list[float]], lost: list[str]) -> int | None:
    """The newest step every survivor (`order`, with their `summaries`) holds a snapshot of, and
    whose copy of every `lost` device arrived at its buddy (a survivor); None when there is none."""
    ring = buddies(plan)
    own = {d: {int(s[0]), int(s[1])} - {-1} for d, s in zip(order, summaries, strict=True)}
    ward = {d: {int(s[0])} | ({int(s[1])} if s[2] else set()) for d, s in zip(order, summaries, strict=True)}
    steps = set.intersection(*own.values()) if own else set()
    for device in lost:
        keeper = ring.get(device)
        steps &= ward[keeper] - {-1} if keeper in ward else set()
    return max(steps, default=None)

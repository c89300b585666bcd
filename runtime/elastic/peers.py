"""Resharding from the survivors' memory: the new plan's training state assembled from the old plan's
surviving ranks over point-to-point, with no checkpoint file read (the first part of recovery without
a restart; `agreed_step` is its commit check).

Under any plan every rank keeps the fp32 masters and AdamW moments of the rows
`costmodel.sharding.state_boxes` gives it (runs of rows along each tensor's storage dimension, the
checkpoint's unit). After a failure, the rows a rank of the new plan needs are either held by some
survivor of the old plan (data parallelism of at least 2 leaves a copy of every unsharded row) or
by nobody (the lost rank's ZeRO-1 slice, or a plan without replicas): then they must come from the
storage checkpoint.

`plan_transfers(old, new, survivors)` is a pure function of the two plans and the survivors, so
every rank computes the same answer without talking: for each run of rows a rank of the new plan
keeps, the survivors that hold each part of it; each part is taken from the rank itself when it
holds it (a copy, no message), else from a holder on the same node, else from the holder with the
fewest bytes to send so far (ties: the earlier rank of the old plan); adjacent parts from one run of
one source merge into one transfer. Parts no survivor holds are listed as `missing`. Its cost is
Python over every run of rows of both plans: 1.9 s for llama2-70b on 128 GPUs losing one, 9.4 s on
512 (a third of it the two plans' `state_boxes`, most of the rest the 643,000 transfers).

`exchange(transfers, me, held, wanted, group, rank_of)` runs the transfers on one rank: in the
transfers' global order, cut into rounds of at most `round_bytes` (every rank cuts the same rounds),
each rank posts the sends and receives of the round that concern it as one batch of point-to-point
operations and waits for them before the next. Every pair of ranks therefore posts its messages in
one order, which is what gloo's tags and NCCL's group calls need, and at most a round's bytes are in
flight. Why not `torch.distributed.checkpoint`'s resharding: it reads and writes storage; these
states live in the survivors' memory.
"""

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from costmodel.analytic import FP32_BYTES
from costmodel.cluster import parse_device
from costmodel.errors import ElastorError
from costmodel.plan import Plan
from costmodel.sharding import state_boxes
from runtime.checkpoint.assign import split_dim
from runtime.checkpoint.format import OPTIMIZER_PREFIXES
from runtime.state import StatePiece

STATE_PREFIXES = ("", *OPTIMIZER_PREFIXES)  # the master, then its AdamW moments, all fp32
ROUND_BYTES = 256 << 20  # bytes in flight per round of an exchange


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of state tensor `name` (global `shape`) along dimension `dim`."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        n = self.stop - self.start
        for k, s in enumerate(self.shape):
            if k != self.dim:
                n *= s
        return n


@dataclass(frozen=True)
class Transfer:
    """`rows` go from `source` (a survivor of the old plan) to `target` (a device of the new plan)."""

    source: str
    target: str
    rows: Rows

    @property
    def local(self) -> bool:
        return self.source == self.target


@dataclass(frozen=True)
class Transfers:
    moves: tuple[Transfer, ...]  # in the global order every rank runs them in
    missing: tuple[tuple[str, Rows], ...]  # (target device, rows of a master) no survivor holds

    @property
    def complete(self) -> bool:
        return not self.missing

    def sent_bytes(self) -> int:
        """Bytes that cross between ranks (local copies excluded)."""
        return sum(m.rows.numel * FP32_BYTES for m in self.moves if not m.local)


@dataclass
class _Coverage:
    """Who holds which rows of one parameter: its holders' run boundaries cut it into elementary
    segments [cuts[i], cuts[i + 1]), each with the devices holding it (in rank order)."""

    cuts: list[int]
    holders: list[list[str]]
    ends: set[tuple[str, int]]  # (device, row) where one of the device's runs starts or ends

    @classmethod
    def of(cls, runs: list[tuple[str, int, int]]) -> "_Coverage":
        cuts = sorted({x for _, lo, hi in runs for x in (lo, hi)})
        at = {c: i for i, c in enumerate(cuts)}
        holders: list[list[str]] = [[] for _ in range(max(0, len(cuts) - 1))]
        for device, lo, hi in runs:
            for i in range(at[lo], at[hi]):
                holders[i].append(device)
        return cls(cuts, holders, {(d, x) for d, lo, hi in runs for x in (lo, hi)})

    def parts(self, a: int, b: int) -> list[tuple[int, int, list[str]]]:
        """[a, b) cut at the segments' boundaries, each part with its holders (none outside them)."""
        out, pos, cuts = [], a, self.cuts
        while pos < b:
            i = bisect.bisect_right(cuts, pos) - 1
            if 0 <= i < len(self.holders):
                nxt = min(b, cuts[i + 1])
                out.append((pos, nxt, self.holders[i]))
            else:
                nxt = min(b, cuts[0]) if i < 0 and cuts else b
                out.append((pos, nxt, []))
            pos = nxt
        return out


def kept_by(
    plan: Plan, devices: Iterable[str], stand_ins: Mapping[str, str] | None = None
) -> dict[str, _Coverage]:
    """Per parameter name, which of `devices` keep which of its rows; the rows of each device of
    `stand_ins` are kept by the device it maps to (a copy of them: runtime/elastic/snapshots.py)."""
    boxes = state_boxes(plan)
    runs: dict[str, list] = {}
    keepers = [(d, d) for d in devices] + list((stand_ins or {}).items())
    for device, keeper in keepers:
        for spec, box in boxes[device]:
            d = split_dim(spec)
            runs.setdefault(spec.name, []).append((keeper, box.offsets[d], box.offsets[d] + box.sizes[d]))
    return {name: _Coverage.of(r) for name, r in runs.items()}


def plan_transfers(
    old: Plan,
    new: Plan,
    survivors: Iterable[str],
    *,
    prefixes: Sequence[str] = STATE_PREFIXES,
    stand_ins: Mapping[str, str] | None = None,
) -> Transfers:
    """Which survivor sends which rows to which device of `new` (module docstring). `stand_ins` maps
    a lost device of `old` to the survivor that holds a copy of its rows (a peer snapshot)."""
    alive = [d for d in old.devices if d in set(survivors)]
    order = {d: i for i, d in enumerate(old.devices)}
    node_of = {d: parse_device(d)[0] for d in alive}
    held = kept_by(old, alive, {d: k for d, k in (stand_ins or {}).items() if d not in alive and k in alive})
    nobody = _Coverage([], [], set())
    load = dict.fromkeys(alive, 0)
    moves: list[Transfer] = []
    missing: list[tuple[str, Rows]] = []
    wanted = state_boxes(new)
    for target in new.devices:
        node = parse_device(target)[0]
        for spec, box in wanted[target]:
            d = split_dim(spec)
            row = box.numel // box.sizes[d] if box.sizes[d] else 0  # elements per row
            coverage = held.get(spec.name, nobody)
            parts: list[tuple[str | None, int, int]] = []
            for lo, hi, holders in coverage.parts(box.offsets[d], box.offsets[d] + box.sizes[d]):
                if not holders:
                    source = None
                elif target in holders:
                    source = target
                else:
                    source = min(holders, key=lambda h: (node_of[h] != node, load[h], order[h]))
                # adjacent parts join when they lie in one run of their source (or are both missing)
                joins = (
                    parts and parts[-1][0] == source and (source is None or (source, lo) not in coverage.ends)
                )
                if joins:
                    parts[-1] = (source, parts[-1][1], hi)
                else:
                    parts.append((source, lo, hi))
            for source, lo, hi in parts:
                if source is None:
                    missing.append((target, Rows(spec.name, spec.shape, d, lo, hi)))
                    continue
                if source != target:
                    load[source] += (hi - lo) * row * len(prefixes)
                moves.extend(
                    Transfer(source, target, Rows(prefix + spec.name, spec.shape, d, lo, hi))
                    for prefix in prefixes
                )
    return Transfers(tuple(moves), tuple(missing))


class Pieces:
    """A rank's state tensors by name, each a box of its global tensor (the fields of
    `runtime.state.StatePiece`: name, offsets, tensor), looked up by rows."""

    def __init__(self, pieces: Iterable):
        self._by_name: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        for piece in pieces:
            self._by_name.setdefault(piece.name, []).append((tuple(piece.offsets), piece.tensor))

    def rows(self, rows: Rows) -> torch.Tensor:
        """The view of `rows` in the piece that holds them all (KeyError if none does)."""
        for offsets, tensor in self._by_name.get(rows.name, ()):
            start = offsets[rows.dim]
            if start <= rows.start and rows.stop <= start + tensor.shape[rows.dim]:
                return tensor.narrow(rows.dim, rows.start - start, rows.stop - rows.start)
        raise KeyError(f"no piece of {rows.name} holds rows [{rows.start}, {rows.stop})")


def _rounds(moves: Sequence[Transfer], round_bytes: int) -> list[list[Transfer]]:
    rounds, current, size = [], [], 0
    for move in moves:
        nbytes = 0 if move.local else move.rows.numel * FP32_BYTES
        if current and size + nbytes > round_bytes:
            rounds.append(current)
            current, size = [], 0
        current.append(move)
        size += nbytes
    if current:
        rounds.append(current)
    return rounds


@torch.no_grad()
def exchange(
    transfers: Transfers,
    me: str,
    held: Pieces,
    wanted: Pieces,
    *,
    rank_of: Mapping[str, int],
    group=None,
    round_bytes: int = ROUND_BYTES,
    device: torch.device | str | None = None,
) -> int:
    """Run the transfers that concern device `me`: copy what it holds itself, send what others need,
    receive into `wanted` (module docstring). `rank_of` maps a device to its rank in `group` (every
    survivor must be in it); what is sent goes from `device` (where the backend wants it: a copy in
    host memory goes to the GPU first under NCCL). Returns the bytes this rank received from others."""
    received = 0
    for batch in _rounds(transfers.moves, round_bytes):
        ops, landing = [], []
        for move in batch:
            if move.local:
                if move.target == me:
                    wanted.rows(move.rows).copy_(held.rows(move.rows))
                continue
            if move.source == me:
                buffer = held.rows(move.rows)
                buffer = (buffer if device is None else buffer.to(device)).contiguous()
                ops.append(dist.P2POp(dist.isend, buffer, _peer(rank_of[move.target], group), group))
            elif move.target == me:
                view = wanted.rows(move.rows)
                buffer = torch.empty(view.shape, dtype=view.dtype, device=view.device)
                ops.append(dist.P2POp(dist.irecv, buffer, _peer(rank_of[move.source], group), group))
                landing.append((view, buffer))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for view, buffer in landing:
            view.copy_(buffer)
            received += buffer.numel() * buffer.element_size()
    return received


def _peer(rank: int, group) -> int:
    """The global rank of `rank` of `group` (P2POp takes global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


class MissingRows(ElastorError):
    """Rows of the new plan's state that no survivor holds (the storage checkpoint must supply them)."""

    def __init__(self, transfers: Transfers):
        self.transfers = transfers
        first = transfers.missing[0]
        super().__init__(
            f"{len(transfers.missing)} runs of rows of the new plan's state are held by no survivor, the "
            f"first rows [{first[1].start}, {first[1].stop}) of {first[1].name} for {first[0]}."
        )


def fetch_state(
    held_pieces: Iterable,
    old: Plan,
    new: Plan,
    survivors: Sequence[str],
    me: str,
    *,
    rank_of: Mapping[str, int],
    group=None,
    round_bytes: int = ROUND_BYTES,
    device: torch.device | str = "cpu",
    stand_ins: Mapping[str, str] | None = None,
    transfers: Transfers | None = None,
) -> tuple[dict[tuple[str, tuple[int, ...]], torch.Tensor], Transfers, int]:
    """The state device `me` keeps under `new` (its boxes of every master and moment, keyed by (name,
    offsets) as `runtime.state.restore_training_state` takes them; empty for a survivor the new plan
    leaves out), filled from the survivors' `held_pieces` (each survivor passes its own: the
    `runtime.state.state_pieces` of its trainer under `old`). Every survivor calls it together, in
    `group` (`rank_of` gives each survivor's rank there). Raises `MissingRows` on every survivor,
    before any message, when some rows are held by none. `stand_ins`: as `plan_transfers`, the
    stand-in passing the copy among its `held_pieces`; `transfers`, when given, is that answer
    already computed. Returns the tensors, the transfers and the bytes this rank received."""
    if transfers is None:
        transfers = plan_transfers(old, new, survivors, stand_ins=stand_ins)
    if not transfers.complete:
        raise MissingRows(transfers)
    tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    mine = []
    for spec, box in state_boxes(new)[me] if me in new.devices else ():
        for prefix in STATE_PREFIXES:
            tensor = torch.empty(box.sizes, dtype=torch.float32, device=device)
            tensors[prefix + spec.name, box.offsets] = tensor
            mine.append(StatePiece(prefix + spec.name, spec.shape, box.offsets, tensor))
    received = exchange(
        transfers,
        me,
        Pieces(held_pieces),
        Pieces(mine),
        rank_of=rank_of,
        group=group,
        round_bytes=round_bytes,
        device=device,
    )
    return tensors, transfers, received


def agreed_step(step: int, group=None) -> int | None:
    """The step every survivor's state is at, or None when they differ (a failure inside the step's
    final all-reduce, which some ranks completed and went on to update from: the in-process path is
    then not taken and the storage checkpoint is loaded instead). The commit point of a step is that
    all-reduce: a failure before it leaves every survivor on the previous step, one after it (the
    optimizer step is local, a ZeRO-1 all-gather only republishes what every holder has updated)
    every survivor on this one, and the step in flight is redone from the agreed one."""
    extremes = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = int(extremes[0]), -int(extremes[1])
    return step if highest == lowest else None

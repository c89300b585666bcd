"""Who writes what: every byte of the training state written by exactly one rank, bytes balanced.

A pure function of the plan (and of the state's kinds: parameters, AdamW moments, and their item
sizes), so every rank computes the same answer without talking to the others. After the gradient
sync all replicas of a parameter's state are identical, so any rank keeping a part may write it:

1. cut each parameter along its storage dimension at every boundary of the row runs whose state ranks keep
   (`costmodel.sharding.state_boxes`: TP shards, gradient buckets, and under ZeRO-1 each holder's
   slice); each segment is kept whole by a known set of ranks (one, for a ZeRO-1 slice);
2. cut each segment into pieces of at most `piece_bytes` along the split dimension, for every kind
   of state (the parameter and its `optim.exp_avg.` / `optim.exp_avg_sq.` moments);
3. assign pieces greedily, pieces with a single holder first, then the rest largest first, each to
   the holder that has the fewest bytes so far (ties: the lower rank) — longest-processing-time
   list scheduling restricted to holders (Graham 1969: within 4/3 of optimal without the restriction).
"""

from dataclasses import dataclass
from itertools import pairwise

from costmodel.layout import Box, ParamSpec, layer_params
from costmodel.plan import Plan
from costmodel.sharding import state_boxes


@dataclass(frozen=True)
class WriteItem:
    """Rows [start, stop) of `name` along `split_dim`, written by rank `writer`."""

    name: str
    shape: tuple[int, ...]
    split_dim: int
    start: int
    stop: int
    writer: int
    nbytes: int


def split_dim(spec: ParamSpec) -> int:
    """The dimension a parameter is stored and cut along: its TP split, else 0."""
    return 0 if spec.shard_dim is None else spec.shard_dim


def holdings(plan: Plan) -> dict[str, tuple[ParamSpec, list[tuple[int, Box]]]]:
    """Every parameter, in layer order, with the ranks keeping its state: (rank, a box of rows it
    keeps; `costmodel.sharding.state_boxes`, one entry per run of rows)."""
    held: dict[str, tuple[ParamSpec, list[tuple[int, Box]]]] = {}
    kept = state_boxes(plan)
    for rank, device in enumerate(plan.devices):
        for spec, box in kept[device]:
            held.setdefault(spec.name, (spec, []))[1].append((rank, box))
    order = [s.name for i in range(plan.model.num_layers) for s in layer_params(plan.model, i)]
    return {name: held[name] for name in order if name in held}


def _segments(holders: list[tuple[int, Box]], d: int):
    """(lo, hi, ranks keeping all of it) for each run between consecutive box boundaries along `d`, by
    one sweep over the boundaries (the ranks in `holders` order); runs no box covers are skipped."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for j, (_, b) in enumerate(holders):
        starts.setdefault(b.offsets[d], []).append(j)
        ends.setdefault(b.offsets[d] + b.sizes[d], []).append(j)
    active: set[int] = set()
    for lo, hi in pairwise(sorted(starts.keys() | ends.keys())):
        active.difference_update(ends.get(lo, ()))
        active.update(starts.get(lo, ()))
        if active:
            yield lo, hi, tuple(holders[j][0] for j in sorted(active))


def assign_writers(plan: Plan, kinds: dict[str, int], piece_bytes: int) -> list[WriteItem]:
    """Every piece of the state and its writer.

    `kinds` maps a name prefix ("" for parameters, "optim.exp_avg." ...) to the item size in bytes
    of that kind's tensors.
    """
    candidates: list[tuple[str, ParamSpec, int, int, tuple[int, ...], int]] = []
    for name, (spec, holders) in holdings(plan).items():
        d = split_dim(spec)
        row_elements = spec.full_box().numel // spec.shape[d]
        for lo, hi, owners in _segments(holders, d):
            for prefix, itemsize in kinds.items():
                row_bytes = row_elements * itemsize
                rows = max(1, piece_bytes // row_bytes)
                for start in range(lo, hi, rows):
                    stop = min(hi, start + rows)
                    candidates.append((prefix + name, spec, start, stop, owners, (stop - start) * row_bytes))
    load = [0] * plan.world_size
    order = sorted(range(len(candidates)), key=lambda i: (len(candidates[i][4]) > 1, -candidates[i][5], i))
    writers = [0] * len(candidates)
    for i in order:
        owners, nbytes = candidates[i][4], candidates[i][5]
        writers[i] = min(owners, key=lambda r: (load[r], r))
        load[writers[i]] += nbytes
    return [
        WriteItem(name, spec.shape, split_dim(spec), start, stop, writer, nbytes)
        for (name, spec, start, stop, _, nbytes), writer in zip(candidates, writers, strict=True)
    ]

"""Gradient buckets and the distributed optimizer's slices: which device reduces, updates and gathers what.

`costmodel.layout.holder_sets` groups every parameter segment by the exact devices holding it. Here
each group is cut into buckets of at most `plan.optimizer.bucket_bytes` of fp32 main gradient, in
reverse layer order (the order backward produces gradients), at whole rows along each parameter's
storage dimension (its TP split, else 0: the checkpoint's storage order, runtime/checkpoint/format.py).
Under interleaved 1F1B no bucket spans two layer chunks of a holder's stage: each chunk's buckets
are ready as soon as its last backward is done, well before the next chunk's.

A bucket whose segments need a reduction (holders in two or more stages, or a sequence-parallel
stage) is dealt into one region per holder, in rank order: contiguous runs of rows with as equal a
number of elements as whole rows allow (each region within one row of E/n). Its flat buffer is the
regions one after the other; under ZeRO-1 each is padded to the largest, which is what
reduce-scatter and all-gather need (equal parts). Region i is holder i's:

- under `"sharding": "zero1"` (Rajbhandari et al. 2020, stage 1) the buffer is reduce-scattered, and
  holder i keeps the fp32 masters and AdamW moments of region i only, updates it, and the updated
  regions are all-gathered back in the plan's dtype;
- under `"none"` the buffer is all-reduced and every holder updates all regions;
- in both, holder i counts region i's elements in the global gradient norm, so each element is
  counted exactly once.

A bucket of segments that need no reduction (a device's own shards, a stage's replicated norms
without sequence parallelism) is a single region kept by each of its holders; the first holder
counts it in the norm.

Global bucket order: every device creates the same list (`buckets`) and issues the reductions of the
buckets it belongs to in that order, so two devices that share two groups issue their collectives
on them in the same relative order (no cross-group deadlock, whatever the layouts). Torch-free:
the runtime, the checkpoint and the cost model read the same slices.
"""

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from costmodel.layout import Box, ParamSpec, holder_sets, layer_params
from costmodel.plan import Plan

MAIN_GRAD_BYTES = 4  # fp32 main gradients, masters and moments
GATHER_WINDOW = 2  # ZeRO-1 all-gathers in flight after the step (each holds one bucket in the plan's dtype)


def storage_dim(spec: ParamSpec) -> int:
    """The dimension a parameter is stored, cut into rows and sliced along: its TP split, else 0."""
    return 0 if spec.shard_dim is None else spec.shard_dim


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) along `dim` of parameter `spec`, whole in every other dimension of `box`."""

    spec: ParamSpec
    box: Box  # in global coordinates

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dim(self) -> int:
        return storage_dim(self.spec)

    @property
    def numel(self) -> int:
        return self.box.numel

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The box with `dim` moved to the front: how its elements lie in a bucket's buffer."""
        sizes = list(self.box.sizes)
        return (sizes.pop(self.dim), *sizes)

    def take(self, start: int, stop: int) -> "Rows":
        """Rows [start, stop) counted from this box's first row."""
        offsets, sizes = list(self.box.offsets), list(self.box.sizes)
        offsets[self.dim] += start
        sizes[self.dim] = stop - start
        return Rows(self.spec, Box(tuple(offsets), tuple(sizes)))

    @property
    def row_numel(self) -> int:
        return self.numel // self.box.sizes[self.dim]


@dataclass(frozen=True)
class Bucket:
    holders: tuple[str, ...]  # in rank order
    regions: tuple[tuple[Rows, ...], ...]  # region i is holder i's (reduced), else the one region
    reduced: bool
    sharded: bool  # reduced under ZeRO-1: reduce-scattered, so its regions are padded to one size

    @cached_property
    def region_numel(self) -> int:
        """Elements of the largest region (the padded size of every region of a sharded bucket)."""
        return max(sum(r.numel for r in region) for region in self.regions)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Where each region starts in the flat buffer: at multiples of `region_numel` when sharded
        (reduce-scatter and all-gather need equal parts), one after the other otherwise."""
        if self.sharded:
            return tuple(i * self.region_numel for i in range(len(self.regions)))
        starts = [0]
        for region in self.regions[:-1]:
            starts.append(starts[-1] + sum(r.numel for r in region))
        return tuple(starts)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        if self.sharded:
            return len(self.regions) * self.region_numel
        return self.payload_numel

    @property
    def rows(self) -> list[Rows]:
        return [r for region in self.regions for r in region]

    @cached_property
    def payload_numel(self) -> int:
        """Elements of the parameters in the bucket, padding excluded."""
        return sum(r.numel for region in self.regions for r in region)

    def span(self, region: int) -> tuple[int, int]:
        """[start, stop) of a region in the flat buffer (a sharded bucket's padding included)."""
        start = self.starts[region]
        size = self.region_numel if self.sharded else sum(r.numel for r in self.regions[region])
        return start, start + size

    def region_of(self, device: str) -> int:
        """The region `device` counts in the norm and, sharded, keeps: its own (reduced), else 0."""
        return self.holders.index(device) if self.reduced else 0

    def kept(self, device: str) -> list[int]:
        """The regions whose optimizer state `device` keeps: its own if sharded, else all."""
        return [self.region_of(device)] if self.sharded else list(range(len(self.regions)))

    def kept_numel(self, device: str) -> int:
        """Elements of `device`'s master buffer for this bucket (a sharded region's padding included):
        one padded region if sharded, else every region, which lie one after the other."""
        return self.region_numel if self.sharded else self.payload_numel

    def counts_norm(self, device: str) -> bool:
        """Whether `device` adds its region to the global norm (a local bucket: its first holder)."""
        return self.reduced or self.holders[0] == device


def buckets(plan: Plan) -> list[Bucket]:
    """Every bucket of the plan: the reduced ones in the global issue order, then the local ones."""
    position = {
        s.name: i
        for i, s in enumerate(p for k in range(plan.model.num_layers) for p in layer_params(plan.model, k))
    }
    rank = {d: i for i, d in enumerate(plan.devices)}
    reduced, local = [], []
    zero1 = plan.optimizer.sharding == "zero1"
    for holders, needs_reduction, chunk in _bucket_rows(plan):
        n = len(holders) if needs_reduction else 1
        bucket = Bucket(holders, _deal(chunk, n), needs_reduction, zero1 and needs_reduction)
        (reduced if needs_reduction else local).append(bucket)
    # Latest layer first (backward's order), then holders in rank order: the same list everywhere.
    reduced.sort(key=lambda b: (-position[b.rows[0].name], [rank[d] for d in b.holders]))
    return reduced + local


def device_buckets(plan: Plan, device: str) -> list[Bucket]:
    """The buckets `device` holds, in the global order."""
    return [b for b in buckets(plan) if device in b.holders]


def state_boxes(plan: Plan) -> dict[str, list[tuple[ParamSpec, Box]]]:
    """Per device, the boxes of the optimizer state it keeps (fp32 masters and AdamW moments), one
    per run of rows of a kept region: what it checkpoints and what it loads."""
    kept: dict[str, list[tuple[ParamSpec, Box]]] = {d: [] for d in plan.devices}
    for bucket in buckets(plan):
        for device in bucket.holders:
            for i in bucket.kept(device):
                kept[device].extend((rows.spec, rows.box) for rows in bucket.regions[i])
    return kept


def _bucket_rows(plan: Plan) -> Iterator[tuple[tuple[str, ...], bool, list[Rows]]]:
    """(holders, whether reduced, rows) of every bucket, holder set by holder set in rank order, each
    set's rows in backward's order cut at layer chunks and at the bucket size."""
    for holders, needs_reduction, run, spans in _bucket_spans(plan):
        yield holders, needs_reduction, [run[i].take(a, b) for i, a, b in spans]


Span = tuple[int, int, int]  # (item of a run of rows, its first row, the row past its last)


def _bucket_spans(plan: Plan) -> Iterator[tuple[tuple[str, ...], bool, list[Rows], list[Span]]]:
    """`_bucket_rows` before its rows are built: (holders, whether reduced, the run of rows the bucket
    is cut from, and its (item of the run, first row, row past the last) spans)."""
    cap = max(1, plan.optimizer.bucket_bytes // MAIN_GRAD_BYTES)
    layer = {p.name: k for k in range(plan.model.num_layers) for p in layer_params(plan.model, k)}
    for holders, (needs_reduction, segs) in holder_sets(plan).items():
        rows = [Rows(spec, box) for spec, box in reversed(segs)]
        for run in _layer_chunk_runs(plan, holders, rows, layer):
            shape = [(r.row_numel, r.box.sizes[r.dim]) for r in run]
            for spans in _chunk_spans(shape, cap):
                yield holders, needs_reduction, run, spans


def _layer_chunk_runs(
    plan: Plan, holders: tuple[str, ...], rows: list[Rows], layer: dict[str, int]
) -> list[list[Rows]]:
    """`rows` (backward's order) cut where a holder's stage passes from one layer chunk to another:
    under interleaved 1F1B a chunk's gradients are complete long before the next chunk's, so a
    bucket never waits for two chunks (as Megatron-LM keeps buckets per model chunk). One run for
    plans of one chunk per stage."""
    stages = [plan.pipelines[pi].stages[si] for pi, si in map(plan.placement, holders)]
    if all(stage.num_chunks == 1 for stage in stages):
        return [rows] if rows else []

    def key(item: Rows) -> tuple[int, ...]:
        k = layer[item.name]
        return tuple(next((c for c, (a, b) in enumerate(st.chunks) if a <= k < b), -1) for st in stages)

    runs: list[list[Rows]] = []
    last = None
    for item in rows:
        at = key(item)
        if at != last:
            runs.append([])
            last = at
        runs[-1].append(item)
    return runs


def _chunk_spans(shape: list[tuple[int, int]], cap: int) -> list[list[Span]]:
    """Cut a run of rows, given per item as (elements per row, rows), into consecutive chunks of at
    most `cap` elements (a row larger than `cap` is a chunk of its own): each chunk as its (item,
    first row, row past the last) spans."""
    chunks, current, size = [], [], 0
    for i, (per_row, total) in enumerate(shape):
        at = 0
        while at < total:
            fit = (cap - size) // per_row
            if fit == 0 and current:
                chunks.append(current)
                current, size = [], 0
                continue
            take = min(total - at, max(fit, 1))
            current.append((i, at, at + take))
            size += take * per_row
            at += take
    if current:
        chunks.append(current)
    return chunks


def _cuts(items: list[tuple[int, int]], n: int) -> tuple[list[int], list[int]]:
    """The element offsets of a chunk's items, given as (elements, elements per row), and its end,
    and the n + 1 cuts of `_deal`: cut k at the row boundary nearest to k/n of the chunk's elements."""
    starts = [0]
    for numel, _ in items:
        starts.append(starts[-1] + numel)
    total = starts[-1]
    cuts = [0]
    for k in range(1, n):
        target = k * total / n
        i = min(bisect.bisect_left(starts, target, 1) - 1, len(items) - 1)  # first item ending at or after it
        row = items[i][1]
        cut = starts[i] + round((target - starts[i]) / row) * row
        cuts.append(max(cuts[-1], min(cut, total)))
    cuts.append(total)
    return starts, cuts


def _overlapping(starts: list[int], lo: int, hi: int) -> range:
    """The items of a chunk (by their element offsets `starts`) that overlap elements [lo, hi)."""
    if lo >= hi:
        return range(0)
    return range(bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi))


def _deal(chunk: list[Rows], n: int) -> tuple[tuple[Rows, ...], ...]:
    """Split a chunk's rows into `n` contiguous regions, each cut at the row boundary nearest to
    k/n of the chunk's elements."""
    if n == 1:
        return (tuple(chunk),)
    starts, cuts = _cuts([(r.numel, r.row_numel) for r in chunk], n)
    regions = []
    for lo, hi in pairwise(cuts):
        region = []
        for j in _overlapping(starts, lo, hi):
            r, begin = chunk[j], starts[j]
            a, b = max(lo, begin), min(hi, begin + r.numel)
            region.append(r.take((a - begin) // r.row_numel, (b - begin) // r.row_numel))
        regions.append(tuple(region))
    return tuple(regions)


@dataclass(frozen=True)
class StateBytes:
    """What a device allocates for its optimizer's side (runtime/dist_optim.py), in bytes."""

    masters: int  # fp32 master buffers of the kept regions
    grads: int  # fp32 main-gradient buffers (a sharded bucket's padding included)
    moments: int  # AdamW's exp_avg and exp_avg_sq of the kept rows
    steps: int  # AdamW's step count, one fp32 scalar per kept run of rows
    gather: int  # the ZeRO-1 all-gather buffers in flight after the step, in the plan's dtype


def state_bytes(plan: Plan, dtype_bytes: int) -> dict[str, StateBytes]:
    """Per device, exactly what its buckets (`buckets`) allocate under `plan`. Counted from each
    bucket's cuts, without building its regions: this prices every plan the solver returns.

    The last plan's answer is kept: the solver prices each answer twice in a row, as it gives back
    recomputation its stages do not need (which leaves the state alone) and then in the estimate
    (0.16 s of CPU in a 5 s solve of llama2-70b on 61 GPUs)."""
    key = (
        plan.model,
        plan.optimizer,
        dtype_bytes,
        tuple(
            tuple((st.chunks, st.devices, st.sequence_parallel) for st in p.stages) for p in plan.pipelines
        ),
    )
    if _LAST_STATE[0] != key:
        _LAST_STATE[:] = key, _state_bytes(plan, dtype_bytes)
    return dict(_LAST_STATE[1])


_LAST_STATE: list = [None, None]  # (what the state depends on, per device) of the last plan priced


def _state_bytes(plan: Plan, dtype_bytes: int) -> dict[str, StateBytes]:
    zero1 = plan.optimizer.sharding == "zero1"
    totals = {d: [0, 0, 0, 0, []] for d in plan.devices}
    for holders, needs_reduction, run, spans in _bucket_spans(plan):
        n = len(holders) if needs_reduction else 1
        items = [(run[i].row_numel * (b - a), run[i].row_numel) for i, a, b in spans]
        starts, cuts = _cuts(items, n)
        runs = [len(_overlapping(starts, lo, hi)) for lo, hi in pairwise(cuts)]  # per region
        if zero1 and needs_reduction:  # holder i keeps region i, padded to the largest
            largest = max(hi - lo for lo, hi in pairwise(cuts))
            numel, kept, pieces = n * largest, [largest] * n, runs
        else:  # every holder keeps every region
            numel = starts[-1]
            kept, pieces = [numel] * len(holders), [sum(runs)] * len(holders)
        for i, device in enumerate(holders):
            t = totals[device]
            t[0] += kept[i] * MAIN_GRAD_BYTES
            t[1] += numel * MAIN_GRAD_BYTES
            t[2] += 2 * kept[i] * MAIN_GRAD_BYTES
            t[3] += pieces[i] * MAIN_GRAD_BYTES  # one AdamW step count per kept run of rows
            if zero1 and needs_reduction:
                t[4].append(numel * dtype_bytes)
    return {
        d: StateBytes(m, g, o, s, sum(sorted(gathers)[-GATHER_WINDOW:]))
        for d, (m, g, o, s, gathers) in totals.items()
    }


def state_bound(
    params: int, tensors: int, row: int, replicas: int, dtype_bytes: int, bucket_bytes: int
) -> StateBytes:
    """An upper bound on `state_bytes` for a device holding `params` parameters in `tensors` tensors
    (rows of at most `row` elements) whose state is sharded over at least `replicas` holders (1:
    unsharded), before the plan exists (the planner's tables). Buckets: at most one per
    `bucket_bytes` of gradient plus one per tensor (a new holder set can start at each); a sharded
    bucket pads each of its n regions by less than a row, and a holder keeps 1/n of it."""
    count = -(-params * MAIN_GRAD_BYTES // bucket_bytes) + tensors
    if replicas <= 1:
        kept, grads, gather = params, params, 0
    else:
        kept = -(-params // replicas) + count * row
        grads = params + count * replicas * row
        gather = GATHER_WINDOW * (bucket_bytes // MAIN_GRAD_BYTES + replicas * row) * dtype_bytes
    pieces = tensors + count
    return StateBytes(
        masters=kept * MAIN_GRAD_BYTES,
        grads=grads * MAIN_GRAD_BYTES,
        moments=2 * kept * MAIN_GRAD_BYTES,
        steps=pieces * MAIN_GRAD_BYTES,
        gather=gather,
    )

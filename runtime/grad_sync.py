"""Gradient synchronisation across pipelines whose layouts differ, and the global gradient norm.

`costmodel.layout.sync_buckets` cuts every parameter at each shard boundary any holder induces and
groups the resulting segments by the exact set of devices holding them. `GradSync` issues one
all-reduce per bucket this rank belongs to, over that bucket's group: it packs the bucket's segments
(views into its local gradients) into one flat buffer, reduces it, and copies the sum back. A rank
never sends bytes of a parameter it does not hold, and receives only the segments it holds.

Because each pipeline's loss is divided by the global token count, the sum over pipelines is the
full-batch gradient. A stage's TP replicas of a norm weight hold the same gradient, so only the first
of them contributes (`costmodel.layout.contributes`); the others add zeros and still receive the sum.

A parameter held whole by one bucket (every parameter under pure data parallelism) keeps its
gradient inside that bucket's buffer, as DDP's `gradient_as_bucket_view` does: autograd accumulates
into the buffer and the reduction needs no copies. Parameters cut into several segments are packed
and unpacked around the collective.

The global norm counts each element once: after the sync every holder of an element has the same
gradient, and the element's owner is its first holder in rank order. `owned_regions` gives, per local
parameter, the ranges along its shard dimension this rank owns; each rank sums the squares it owns,
and one all-reduce over the job adds them up.

Bytes are counted where they are issued: a ring all-reduce of S bytes among n ranks sends
2(n-1)/n * S per rank (Patarasuk & Yuan 2009, bandwidth-optimal), which is what `bytes_sent` adds.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from costmodel.layout import Box, contributes, device_pieces, sync_buckets
from costmodel.plan import Plan
from runtime.distributed import ProcessGroups
from runtime.stage import box_slices


@dataclass
class _Bucket:
    group: object
    size: int  # number of ranks
    views: list[tuple[str, tuple[slice, ...], bool]]  # (parameter, local slices, contributes)
    buffer: torch.Tensor
    resident: set[str] = field(default_factory=set)  # parameters whose .grad is a view of `buffer`


@dataclass
class SyncStats:
    collectives: int = 0
    bytes_sent: float = 0.0  # by this rank, ring all-reduce volume
    log: list[tuple[int, int]] = field(default_factory=list)  # (ranks, bytes) of each collective issued


class GradSync:
    """All-reduce this rank's gradient segments among exactly their holders, one collective per bucket."""

    def __init__(self, plan: Plan, device: str, params: dict[str, torch.nn.Parameter], groups: ProcessGroups):
        self.params = params
        local = {spec.name: box for spec, box in device_pieces(plan, device)}
        self.buckets: list[_Bucket] = []
        for holders, segments in sync_buckets(plan).items():
            if device not in holders:
                continue
            mine = contributes(plan, device, holders)
            views = [(name, box_slices(seg.relative_to(local[name])), mine) for name, seg in segments]
            numel = sum(seg.numel for _, seg in segments)
            dtype, where = params[segments[0][0]].dtype, params[segments[0][0]].device
            buffer = torch.zeros(numel, dtype=dtype, device=where)
            bucket = _Bucket(groups.group(holders), len(holders), views, buffer)
            offset = 0
            for name, seg in segments:
                if seg == local[name]:  # the whole local tensor: its gradient can live in the buffer
                    param = params[name]
                    resident = buffer[offset : offset + seg.numel].view_as(param)
                    if param.grad is not None:
                        resident.copy_(param.grad)
                    param.grad = resident
                    bucket.resident.add(name)
                offset += seg.numel
            self.buckets.append(bucket)
        self.stats = SyncStats()

    def all_reduce(self) -> None:
        works = []
        for bucket in self.buckets:
            offset = 0
            for name, slices, mine in bucket.views:
                grad = self.params[name].grad[slices]
                chunk = bucket.buffer[offset : offset + grad.numel()]
                if not mine:
                    chunk.zero_()
                elif name not in bucket.resident:
                    chunk.view_as(grad).copy_(grad)
                offset += grad.numel()
            works.append(dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True))
            nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
            self.stats.collectives += 1
            self.stats.bytes_sent += 2 * (bucket.size - 1) / bucket.size * nbytes
            self.stats.log.append((bucket.size, nbytes))
        for bucket, work in zip(self.buckets, works, strict=True):
            work.wait()
            offset = 0
            for name, slices, _ in bucket.views:
                grad = self.params[name].grad[slices]
                if name not in bucket.resident:
                    grad.copy_(bucket.buffer[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def owned_regions(plan: Plan, device: str) -> dict[str, list[tuple[int, int, int]]]:
    """Per local parameter, the (dim, start, stop) ranges in local coordinates whose elements this
    device owns for the norm: those no device earlier in rank order holds. dim -1 means the whole
    tensor (a replicated parameter)."""
    rank = {d: i for i, d in enumerate(plan.devices)}
    earlier: dict[str, list[Box]] = {}
    for other in plan.devices[: rank[device]]:
        for spec, box in device_pieces(plan, other):
            earlier.setdefault(spec.name, []).append(box)
    regions: dict[str, list[tuple[int, int, int]]] = {}
    for spec, box in device_pieces(plan, device):
        taken = earlier.get(spec.name, [])
        if spec.shard_dim is None:
            regions[spec.name] = [] if taken else [(-1, 0, 0)]
            continue
        dim, lo = spec.shard_dim, box.offsets[spec.shard_dim]
        covered = torch.zeros(box.sizes[dim], dtype=torch.bool)
        for other in taken:
            a = max(other.offsets[dim], lo)
            b = min(other.offsets[dim] + other.sizes[dim], lo + box.sizes[dim])
            if a < b:
                covered[a - lo : b - lo] = True
        regions[spec.name] = _runs(dim, ~covered)
    return regions


def _runs(dim: int, mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of True in a 1-D mask, as (dim, start, stop)."""
    runs, start = [], None
    for i, owned in enumerate([*mask.tolist(), False]):
        if owned and start is None:
            start = i
        elif not owned and start is not None:
            runs.append((dim, start, i))
            start = None
    return runs


def owned_square_sum(params: dict[str, torch.nn.Parameter], regions: dict[str, list]) -> torch.Tensor:
    """Sum of squared gradient elements this rank owns (fp32), by `torch._foreach_norm` over the owned
    parts (one kernel for all of them, no squared copy of any gradient)."""
    device = next(iter(params.values())).device
    parts = [
        grad if dim < 0 else grad.narrow(dim, start, stop - start)
        for name, runs in regions.items()
        for grad in (params[name].grad,)
        for dim, start, stop in runs
    ]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(parts, 2)
    return torch.stack(norms).float().pow(2).sum()

"""The optimizer's side of a rank: fp32 main gradients in buckets, their reduction overlapped with
backward, fp32 master weights (all of them, or this rank's ZeRO-1 slice), and publishing the update.

The buckets and their regions are `costmodel.sharding`'s (read its docstring first): a pure function
of the plan, so the checkpoint and the cost model see the same slices. Per bucket this rank holds:

- a flat fp32 gradient buffer, the regions one after the other (each padded to the largest), every
  parameter's rows in storage order (split dimension first). These buffers are the main gradients:
  a post-accumulate-grad hook on each module parameter adds the micro-batch's gradient (bf16 or
  fp32) into its rows and frees it (Megatron's `main_grad`; Micikevicius et al. 2018), so no
  per-parameter gradient outlives its micro-batch and accumulation is fp32 in every dtype;
- an fp32 master buffer of the regions it keeps (all; under ZeRO-1 its own), whose rows are the
  optimizer's parameters, with gradients that are views of the same rows of the gradient buffer.

Overlap (as DDP and Megatron do): the hook counts a parameter's micro-batches; when every
parameter of a bucket has all of its pipeline's micro-batches, the bucket is ready, and ready
buckets are issued asynchronously in the global bucket order (`costmodel.sharding.buckets`) while
backward continues: all-reduce, or under ZeRO-1 an in-place reduce-scatter into this rank's region.
`finish_reduction` waits for them just before the optimizer step. On gloo the reduce-scatter is
this module's own ring of point-to-point steps (`_ring_reduce_scatter`): gloo's `reduce_scatter`
runs a whole all-reduce underneath and sends 2(n-1)/n of the buffer per rank instead of (n-1)/n
(measured on the sockets by benchmarks/runtime_bench.py). A ring's steps depend on each other, so
the rings run one bucket after another, in the global order, on one worker thread per rank, each
holder set on a private group (`ProcessGroups.ring_group`); NCCL's reduce-scatter is already a ring
and is used as it is. After the step, `publish` writes
the masters into the module's parameters: locally, or under ZeRO-1 by an in-place all-gather of each
bucket in the plan's dtype, at most `GATHER_WINDOW` buckets in flight (so the gather buffers cost at
most that many buckets of memory).

Why not DDP or FSDP: both assume every replica holds the same parameters in the same layout, while
here a bucket's holders are any set of devices whose pipelines cut layers and TP shards differently;
the buckets, their groups and the region each holder owns come from the plan instead. fp32 plans keep
masters beside the fp32 module weights too (4 bytes per parameter, or 4/n under ZeRO-1): one code
path for both dtypes, and the cost model counts it.

Each rank's squared norm is the sum over the regions it counts (`Bucket.counts_norm`), so one
all-reduce of one number gives the global norm exactly, whatever the layouts. Bytes are counted
where they are issued, ring volumes per rank (Patarasuk & Yuan 2009): all-reduce 2(n-1)/n * S,
reduce-scatter and all-gather (n-1)/n * S each.
"""

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from costmodel.layout import contributes, device_pieces
from costmodel.plan import Plan
from costmodel.sharding import GATHER_WINDOW, Bucket, Rows, device_buckets
from runtime.distributed import ProcessGroups, all_gather_single, reduce_scatter_single
from runtime.stage import box_slices

CPU_NORM_CHUNK = 1 << 14  # elements per CPU norm (`square_sum`)


@dataclass
class SyncStats:
    collectives: int = 0
    bytes_sent: float = 0.0  # by this rank, ring volumes
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (op, ranks, bytes) of each collective


@dataclass
class MainPiece:
    """A run of rows whose optimizer state this rank keeps: the checkpoint's unit of state."""

    rows: Rows
    param: nn.Parameter  # fp32 master rows, storage order; `.grad` is a view of the gradient buffer

    def global_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (storage order, like `param`) in the global tensor's layout."""
        return tensor.detach().movedim(0, self.rows.dim)


@dataclass
class _Held:
    bucket: Bucket
    group: object
    grads: torch.Tensor  # fp32, bucket.numel
    masters: torch.Tensor  # fp32, one region per kept region
    kept: list[int]
    pending: int = 0  # parameters of this bucket still expecting micro-batches this step
    work: object = None
    ring: tuple[object, list[int]] | None = None  # private group, holders' ranks: reduce-scatter by ring


class MainState:
    """Main gradients, masters and the bucketed reductions of one rank (see the module docstring)."""

    def __init__(self, plan: Plan, device: str, model: nn.Module, groups: ProcessGroups, dtype: torch.dtype):
        self.plan, self.device = plan, device
        self.sharded = plan.optimizer.sharding == "zero1"
        self.model_params = dict(model.named_parameters())
        where = next(iter(self.model_params.values())).device
        self._local = local = {spec.name: box for spec, box in device_pieces(plan, device)}
        self.micro_batches = plan.pipelines[plan.placement(device)[0]].num_microbatches
        self.held: list[_Held] = []
        self.pieces: list[MainPiece] = []
        # per module parameter: (held index, gradient view, local slices, dim, contributes)
        self._targets: dict[str, list[tuple[int, torch.Tensor, tuple, int, bool]]] = {n: [] for n in local}
        # masters written locally by `publish`: (master view, parameter, local slices, dim)
        self._writes: list[tuple[torch.Tensor, str, tuple, int]] = []
        for bucket in device_buckets(plan, device):
            kept = bucket.kept(device)
            held = _Held(
                bucket,
                groups.group(bucket.holders) if bucket.reduced else None,
                torch.zeros(bucket.numel, dtype=torch.float32, device=where),
                torch.zeros(bucket.kept_numel(device), dtype=torch.float32, device=where),
                kept,
            )
            if bucket.sharded and groups.ring_group(bucket.holders) is not None:
                held.ring = (groups.ring_group(bucket.holders), [groups.rank_of[d] for d in bucket.holders])
            index = len(self.held)
            self.held.append(held)
            mine = not bucket.reduced or contributes(plan, device, bucket.holders)
            master_at = 0  # where the next kept region starts in the master buffer
            for r, region in enumerate(bucket.regions):
                offset = bucket.starts[r]
                at = master_at
                for rows in region:
                    slices = box_slices(rows.box.relative_to(local[rows.name]))
                    grad = held.grads[offset : offset + rows.numel].view(rows.storage_shape)
                    self._targets[rows.name].append((index, grad, slices, rows.dim, mine))
                    if r in kept:
                        master = held.masters[at : at + rows.numel].view(rows.storage_shape)
                        source = self.model_params[rows.name].detach()[slices].movedim(rows.dim, 0)
                        master.copy_(source)
                        param = nn.Parameter(master)
                        param.grad = grad
                        self.pieces.append(MainPiece(rows, param))
                        if not bucket.sharded:  # a sharded bucket's rows come back by all-gather
                            self._writes.append((master, rows.name, slices, rows.dim))
                        at += rows.numel
                    offset += rows.numel
                if r in kept:
                    start, stop = bucket.span(r)
                    master_at += stop - start
        self._buckets_of = {n: sorted({t[0] for t in ts}) for n, ts in self._targets.items()}
        # parameters each bucket waits for: fixed by the plan, so counted once
        self._waits_for = [0] * len(self.held)
        for indices in self._buckets_of.values():
            for index in indices:
                self._waits_for[index] += 1
        self._order = [i for i, h in enumerate(self.held) if h.bucket.reduced]  # the global order
        self.stats = SyncStats()
        # Issue each bucket from backward's hooks as soon as it is ready (False: all of them in
        # `finish_reduction`, after backward; benchmarks/runtime_bench.py times both).
        self.overlap = True
        self._ring_worker = ThreadPoolExecutor(1, "elastor-ring") if any(h.ring for h in self.held) else None
        model.to(dtype)
        self._counts: dict[str, int] = {}
        # Removed by `close`: a hook's closure holds this state, which holds the parameter, a cycle
        # the collector cannot see through the tensor (it held the process groups to the exit).
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook(name))
            for name, param in self.model_params.items()
        ]
        self.zero_grad()

    # ---- backward: accumulate, and issue buckets as they become ready -------------------------------
    def zero_grad(self) -> None:
        """Start a step: empty main gradients, every bucket waiting for all of its micro-batches."""
        for index, held in enumerate(self.held):
            held.grads.zero_()
            held.pending = self._waits_for[index]
            held.work = None
        self._counts = dict.fromkeys(self.model_params, 0)
        self._next = 0

    def _hook(self, name: str):
        targets = self._targets[name]

        @torch.no_grad()
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            for _, view, slices, dim, mine in targets:
                if mine:
                    view.add_(grad[slices].movedim(dim, 0))
            param.grad = None
            self._counts[name] += 1
            if self._counts[name] == self.micro_batches:
                for index in self._buckets_of[name]:
                    self.held[index].pending -= 1
                if self.overlap:
                    self._issue_ready()

        return accumulate

    def _issue_ready(self) -> None:
        while self._next < len(self._order) and self.held[self._order[self._next]].pending == 0:
            self._issue(self.held[self._order[self._next]])
            self._next += 1

    def _issue(self, held: _Held) -> None:
        n = len(held.bucket.holders)
        nbytes = held.grads.numel() * held.grads.element_size()
        if held.ring is not None:
            group, ranks = held.ring
            bucket = held.bucket
            position = bucket.region_of(self.device)
            future = self._ring_worker.submit(
                _ring_reduce_scatter, held.grads, bucket.region_numel, position, ranks, group
            )
            held.work = _Done(future)
            self._count("reduce_scatter", n, (n - 1) / n * nbytes, nbytes)
        elif held.bucket.sharded:
            region = self._region(held, held.grads)
            held.work = reduce_scatter_single(region, held.grads, group=held.group, async_op=True)
            self._count("reduce_scatter", n, (n - 1) / n * nbytes, nbytes)
        else:
            held.work = dist.all_reduce(held.grads, group=held.group, async_op=True)
            self._count("all_reduce", n, 2 * (n - 1) / n * nbytes, nbytes)

    def _region(self, held: _Held, flat: torch.Tensor) -> torch.Tensor:
        """This rank's region of a bucket-sized buffer."""
        start, stop = held.bucket.span(held.bucket.region_of(self.device))
        return flat[start:stop]

    def _count(self, op: str, ranks: int, sent: float, nbytes: int) -> None:
        self.stats.collectives += 1
        self.stats.bytes_sent += sent
        self.stats.log.append((op, ranks, nbytes))

    def finish_reduction(self) -> None:
        """Issue what backward has not (a bucket is issued only once all its gradients exist), then
        wait for every reduction: the optimizer's gradients are complete."""
        while self._next < len(self._order):
            self._issue(self.held[self._order[self._next]])
            self._next += 1
        for index in self._order:
            self.held[index].work.wait()
            self.held[index].work = None

    # ---- the step's reductions over what this rank owns ---------------------------------------------
    def owned_square_sum(self) -> torch.Tensor:
        """Sum of the squared gradient elements this rank counts for the global norm (fp32)."""
        parts = [self._region(h, h.grads) for h in self.held if h.bucket.counts_norm(self.device)]
        return square_sum(parts, next(iter(self.model_params.values())).device)

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        """Multiply the gradients the optimizer reads by `coef` (clipping)."""
        grads = [self._region(h, h.grads) if h.bucket.sharded else h.grads for h in self.held]
        torch._foreach_mul_(grads, coef)

    # ---- after the step --------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """Write the masters into the module's parameters (in its dtype): this rank's own rows
        locally, the other holders' rows of a sharded bucket by an all-gather."""
        for master, name, slices, dim in self._writes:
            self.model_params[name].data[slices].copy_(master.movedim(0, dim))
        if not self.sharded:
            return
        dtype = next(iter(self.model_params.values())).dtype
        in_flight: list[tuple[_Held, torch.Tensor, object]] = []
        for index in self._order:
            held = self.held[index]
            if not held.bucket.sharded:
                continue
            gathered = torch.empty(held.bucket.numel, dtype=dtype, device=held.grads.device)
            mine = self._region(held, gathered)
            mine.copy_(held.masters)
            work = all_gather_single(gathered, mine, group=held.group, async_op=True)
            n, nbytes = len(held.bucket.holders), gathered.numel() * gathered.element_size()
            self._count("all_gather", n, (n - 1) / n * nbytes, nbytes)
            in_flight.append((held, gathered, work))
            if len(in_flight) >= GATHER_WINDOW:
                self._unpack(*in_flight.pop(0))
        for item in in_flight:
            self._unpack(*item)

    def _unpack(self, held: _Held, gathered: torch.Tensor, work) -> None:
        work.wait()
        for r, region in enumerate(held.bucket.regions):
            offset = held.bucket.starts[r]
            for rows in region:
                slices = box_slices(rows.box.relative_to(self._local[rows.name]))
                values = gathered[offset : offset + rows.numel].view(rows.storage_shape)
                self.model_params[rows.name].data[slices].copy_(values.movedim(0, rows.dim))
                offset += rows.numel

    def drain(self) -> None:
        """Wait for every reduction issued and not yet waited for, ignoring its error: after a peer's
        failure, once this process's connections are shut down, so that no operation of the old
        groups is pending when they are destroyed (runtime/elastic/inprocess.py)."""
        for held in self.held:
            if held.work is not None:
                with contextlib.suppress(Exception):
                    held.work.wait()
                held.work = None

    def close(self) -> None:
        """After the last step: stop the ring's worker thread and remove backward's hooks."""
        if self._ring_worker is not None:
            self._ring_worker.shutdown(wait=True)
            self._ring_worker = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ---- accounting ---------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        """What this state holds beside the optimizer's moments: module parameters and fp32 masters,
        main gradients (padding included)."""
        model = sum(p.numel() * p.element_size() for p in self.model_params.values())
        masters = sum(h.masters.numel() * h.masters.element_size() for h in self.held)
        grads = sum(h.grads.numel() * h.grads.element_size() for h in self.held)
        return {"parameters_bytes": model + masters, "gradients_bytes": grads}


@dataclass
class _Done:
    """A worker thread's reduction, waited for like a collective's work handle."""

    future: Future

    def wait(self) -> None:
        self.future.result()


@torch.no_grad()
def _ring_reduce_scatter(flat: torch.Tensor, size: int, position: int, ranks: list[int], group) -> None:
    """Reduce-scatter `flat` (n regions of `size` elements, region i belongs to `ranks[i]`) in place
    over `group`: afterwards this rank's region, `position`, holds the sum over all n ranks (the other
    regions hold partial sums). n - 1 steps; at step s each rank sends region (position - s - 1) to
    its successor and adds what its predecessor sends into region (position - s - 2): (n - 1)/n of
    the buffer sent per rank, the minimum (Patarasuk & Yuan 2009)."""
    n = len(ranks)
    successor, predecessor = ranks[(position + 1) % n], ranks[(position - 1) % n]
    incoming = torch.empty(size, dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):
        out = (position - step - 1) % n
        into = (position - step - 2) % n
        sent = dist.isend(flat[out * size : (out + 1) * size], successor, group=group)
        dist.irecv(incoming, predecessor, group=group).wait()
        flat[into * size : (into + 1) * size].add_(incoming)
        sent.wait()


def square_sum(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Sum of the squares of every element of `tensors` (fp32), by one `torch._foreach_norm` (no
    squared copy of any tensor), the per-tensor norms squared and added in fp64.

    On CPU each tensor is normed in views of `CPU_NORM_CHUNK` elements: torch's CPU norm kernel adds
    a long tensor's squares in fp32 one after another, so its error grows with the length (-1.5e-5
    relative on 1.2M elements, -4.6e-5 on 2.4M, against 4e-8 in chunks of 16,384). The buckets of two
    layouts differ in length, so unchunked the clipping coefficient of one model differed by 1.2e-5
    between a pipeline and one process, and AdamW turned that into a 1.2e-5 weight difference where
    a gradient element is ~1e-8 (below its eps). CUDA's kernel reduces by a tree and is not chunked.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    if torch.device(device).type == "cpu":
        tensors = [piece for t in tensors for piece in t.reshape(-1).split(CPU_NORM_CHUNK)]
    norms = torch._foreach_norm(tensors, 2)
    return torch.stack(norms).double().pow(2).sum().float()

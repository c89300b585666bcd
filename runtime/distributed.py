"""Joining the job: which device this process plays, the backend, and every process group of a plan.

Rank to device (docs/DESIGN.md): torchrun numbers ranks node by node, so global rank r plays `plan.devices[r]`
(nodes in plan order, on a node the healthy GPUs ascending): local rank i on a node is its i-th
healthy GPU, and the CUDA ordinal is that GPU's id. On CPU one machine plays every node, one process
per device. A plan whose device count differs from the world size is refused on every rank before
any rendezvous, so no rank waits for a peer that will never come.

Process groups are objects held by `ProcessGroups`, never module globals. `new_group` is collective
over the whole job, so every rank creates every group, in one order derived from the plan alone:
`costmodel.communicators.plan_groups`, first the TP group of each stage (pipelines in plan order,
stages in order), then one group per gradient-sync bucket of `costmodel.layout.sync_buckets` (in its
deterministic order); a rank set that occurs twice gets one group, a single rank none (the cost
model counts each group's NCCL buffers on its ranks). Under ZeRO-1 on gloo each holder set also
gets a private group for the ring reduce-scatter that `runtime.dist_optim` runs on a worker
thread (`ring_group`): a group shared with the main thread's collectives (a stage's TP group is
also the holder set of its replicated norm weights) could interleave the two threads' operations
differently on its ranks.

Failure bound: a rank that raises or is killed exits non-zero and its sockets close, so its gloo
peers fail at once; torchrun polls its workers every 0.1 s and sends SIGTERM to the rest as soon as
one has failed, then exits non-zero itself (measured here: 1.9 s after an exception, 0.9 s after a
SIGKILL, on CPU with 3 ranks). A rank that hangs while alive is caught by the process-group timeout
(`timeout_s`, `elastor train --timeout-s`, default 300 s): its peers' collectives raise, and torchrun
stops it (8 s with a 5 s timeout). tests/test_runtime_failure.py holds these bounds.
"""

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take `group=group.WORLD` as a
# default argument, evaluated at import. Imported later (torch._dynamo imports it, and the first
# optimizer built imports torch._dynamo), those defaults hold the default group to the end of the
# process: `destroy_process_group` then frees nothing, and the group's gloo threads outlive the
# interpreter's finalization, where one that finishes a collective aborts the process (it must take
# the GIL to free the collective's Python tensors). `leave_job` relies on the groups being freed
# when this process lets go of them.
import torch.distributed.nn.functional

from costmodel.cluster import parse_device
from costmodel.communicators import plan_groups
from costmodel.errors import ElastorError
from costmodel.layout import sync_buckets
from costmodel.plan import Plan

# Set by `elastor run` for its workers. torchrun only starts and watches them there: its rendezvous
# assigns node ranks in its own order, and its store would listen on every interface. So the workers
# take their ranks from the plan (the first rank of their node plus the local rank) and join through
# the round's store at ELASTOR_MASTER (HOST:PORT), which a supervisor hosts.
ENV_MASTER = "ELASTOR_MASTER"
ENV_FIRST_RANK = "ELASTOR_FIRST_RANK"
ENV_VISIBLE_GPUS = "ELASTOR_VISIBLE_GPUS"  # the physical ids behind CUDA_VISIBLE_DEVICES, set with it
DEFAULT_TIMEOUT_S = 300.0  # long enough for a first NCCL step on a large model, short enough to notice a hang
# The one-tensor collectives by their names since torch 2.13, which deprecates the old ones; the
# releases before it (torch >= 2.5 is supported) have only the old names, with the same arguments.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    device_name: str  # the plan's device this rank plays, e.g. "n1:3"
    device: torch.device  # where its tensors live
    backend: str  # "gloo" or "nccl"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def check_world_size(plan: Plan, world_size: int) -> None:
    if world_size != plan.world_size:
        raise ElastorError(
            f"The plan needs {plan.world_size} processes, one per device, but this job has "
            f"{world_size}; launch torchrun with {plan.world_size} processes in total or use a plan "
            f"for {world_size} devices."
        )


def cuda_index(gpu: int) -> int:
    """torch's index of physical GPU `gpu`: under `elastor run` a worker sees only its node's GPUs of
    the plan (CUDA_VISIBLE_DEVICES, in the plan's order, mirrored in ELASTOR_VISIBLE_GPUS), so it is
    the place of `gpu` in that list; elsewhere the GPU's own number."""
    visible = os.environ.get(ENV_VISIBLE_GPUS)
    return [int(g) for g in visible.split(",")].index(gpu) if visible else gpu


def _round_store(world_size: int, timeout_s: float) -> dist.Store:
    """The round's store at ELASTOR_MASTER (hosted by a supervisor on its --host only; torch's own
    env:// store would listen on every interface), the workers' keys under a prefix of their own."""
    host, _, port = os.environ[ENV_MASTER].rpartition(":")
    store = dist.TCPStore(host, int(port), world_size, False, timedelta(seconds=timeout_s))
    return dist.PrefixStore("workers/", store)


def init_distributed(
    plan: Plan, *, device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
) -> DistContext:
    """Join torchrun's job (or run alone when there is no torchrun and the plan has one device)."""
    launched = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if launched and ENV_FIRST_RANK in os.environ:  # `elastor run`: ranks follow the plan's node order
        rank = int(os.environ[ENV_FIRST_RANK]) + int(os.environ["LOCAL_RANK"])
    check_world_size(plan, world_size)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ElastorError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu.")
    name = plan.devices[rank]
    if device == "cuda":
        node, gpu = parse_device(name)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        on_node = [d for d in plan.devices if parse_device(d)[0] == node]
        if launched and on_node.index(name) != local_rank:
            raise ElastorError(
                f"Rank {rank} is local rank {local_rank} on its node but plays {name}, the "
                f"{on_node.index(name)}-th device of node {node}; start one torchrun per node in the "
                "plan's node order with as many processes as the plan gives that node."
            )
        torch_device = torch.device("cuda", cuda_index(gpu))
        torch.cuda.set_device(torch_device)
        backend = "nccl"
    else:
        torch_device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s)
    if launched and ENV_MASTER in os.environ:
        dist.init_process_group(
            backend,
            store=_round_store(world_size, timeout_s),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif launched:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(
        rank=rank, world_size=world_size, device_name=name, device=torch_device, backend=backend
    )


class ProcessGroups:
    """Every group a plan needs, created on every rank in the same order (see the module docstring)."""

    def __init__(self, plan: Plan, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank_of = {d: i for i, d in enumerate(plan.devices)}
        self._groups: dict[tuple[int, ...], object] = {}
        timeout = timedelta(seconds=timeout_s)
        for devices in plan_groups(plan):  # the groups whose NCCL buffers the cost model counts
            self._create(devices, timeout)
        self._ring: dict[tuple[int, ...], object] = {}
        if plan.optimizer.sharding == "zero1" and dist.get_backend() == "gloo":
            for holders in sync_buckets(plan):
                ranks = self._ranks(holders)
                if len(ranks) > 1 and ranks not in self._ring:
                    self._ring[ranks] = dist.new_group(list(ranks), timeout=timeout)
        # The first operation on the default group must involve every rank (NCCL's rule for batched
        # point-to-point, which the pipelines use on it); this barrier is that operation.
        dist.barrier()

    def _ranks(self, devices) -> tuple[int, ...]:
        return tuple(sorted(self.rank_of[d] for d in devices))

    def _create(self, devices, timeout: timedelta) -> None:
        ranks = self._ranks(devices)
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)

    def group(self, devices) -> object:
        """The group of `devices` (any order); None for a single device, which needs no collective."""
        ranks = self._ranks(devices)
        return None if len(ranks) == 1 else self._groups[ranks]

    def ring_group(self, devices) -> object | None:
        """The private group of a holder set for the worker thread's ring (ZeRO-1 on gloo), else None."""
        return self._ring.get(self._ranks(devices))

    def __len__(self) -> int:
        return len(self._groups)

    def all(self) -> list:
        """Every group object made here (the TP, bucket and ring groups)."""
        return [*self._groups.values(), *self._ring.values()]


def leave_job(held: list | None = None) -> None:
    """Tear down every process group of this process, destroy them, then collect them: at the end of
    a run (after the last collective, its trainer closed and dropped), so that the groups' gloo
    threads are joined here, on this thread, and not during the interpreter's finalization, where
    one that finishes a collective aborts the process ("terminate called without an active
    exception": it must take the GIL to free the collective's Python tensors); or as the first step
    of an in-process recovery, so that the peers' pending operations with this process fail at once.

    Gloo closes a group's connections and joins its threads only when the group object is freed,
    and `ProcessGroup.abort` does not close them (measured: a peer blocked in a collective errs when
    the group is freed, 1 s after the failure in the test, not when it is aborted), so the caller
    must first drop every reference to them (the trainer that holds them; `MainState.close` removes
    backward's hooks, whose closures would keep it alive). A group must not be freed by one of
    gloo's own threads either (its destructor joins them: the process aborts), which happens when a
    pending operation holds the last reference: a caller that may have operations pending passes
    `held`, its own references to every group, which are dropped here, after the destroy, on this
    thread."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if held:  # the caller's own references, dropped here: the groups are freed on this thread
        held.clear()
    gc.collect()

"""What a rank's training really allocates, by kind: the measurement beside the cost model's prediction.

Static kinds are read off the trainer's tensors, each distinct storage once: `parameters_bytes` (the
module's parameters, and the fp32 masters of a bf16 plan), `gradients_bytes` (the fp32 main
gradients, with the gradient sync's flat buffers they live in) and `optimizer_bytes` (AdamW's
moments and step counts). `activations_peak_bytes` is the highest level, above what was allocated
when the step began, that the step's own allocations reach: everything a step creates and frees
(saved activations of the micro-batches in flight, received and sent boundary pieces, recomputed
blocks, collective buffers, 16-bit gradients before they reach the main gradient, the optimizer's
temporaries). On CUDA that is the caching allocator's `max_memory_allocated`; on a CPU, where torch
keeps no such counter, `LiveBytes` counts it: a `TorchDispatchMode` that sees every tensor every
operator returns, registers each new storage with its size (outputs that the operator's schema marks
as aliases, views and in-place results, and outputs in an input's storage, as the collectives' are,
are not new) and notices, through a weak reference, when
it is freed. Tensors made outside the dispatcher (a collective's internal buffers in gloo or
NCCL) are not seen on a CPU; the allocator sees NCCL's on CUDA.
"""

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runtime.distributed import all_gather_single

KINDS = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_peak_bytes")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # data pointer -> (weak ref, bytes)
        self.current = self.peak = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: nothing runs under torch.compile here. By default torch wraps `__torch_dispatch__` in
        `torch._disable_dynamo`, whose first call imports torch._dynamo (1.6 s of CPU per process on
        a 2-core machine), which every worker would pay on its first step (runtime/optim.py)."""
        return False

    def _sweep(self) -> None:
        for ptr in [p for p, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(ptr)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place result: no new storage
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self._live and ptr not in inputs and storage.nbytes():
                    self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True, kw_only=True)
class MeasuredMemory:
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_peak_bytes: int

    def as_list(self) -> list[int]:
        return [getattr(self, k) for k in KINDS]


def static_bytes(trainer) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes the trainer holds between steps."""
    main = trainer.main
    params = distinct_bytes([*main.model_params.values(), *(h.masters for h in main.held)])
    grads = distinct_bytes([h.grads for h in main.held])
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return params, grads, distinct_bytes(state)


def measure_step(trainer):
    """Run one training step and return (its StepResult, this rank's MeasuredMemory)."""
    if trainer.ctx.is_cuda:
        torch.cuda.synchronize(trainer.ctx.device)
        before = torch.cuda.memory_allocated(trainer.ctx.device)
        torch.cuda.reset_peak_memory_stats(trainer.ctx.device)
        result = trainer.train_step()
        torch.cuda.synchronize(trainer.ctx.device)
        peak = torch.cuda.max_memory_allocated(trainer.ctx.device) - before
    else:
        with LiveBytes() as live:
            result = trainer.train_step()
        peak = live.peak
    params, grads, optimizer = static_bytes(trainer)
    return result, MeasuredMemory(
        parameters_bytes=params, gradients_bytes=grads, optimizer_bytes=optimizer, activations_peak_bytes=peak
    )


def predicted_memory(plan) -> dict[str, dict[str, int]]:
    """The cost model's memory per device by the same kinds, from the analytic formulas of the plan's
    model (a runtime has no profile; `benchmarks/memory_validation.py` holds both side by side):
    parameters (16-bit copies and fp32 masters), main gradients with the sync's packing buffers,
    AdamW state, and the step's peak above them (activations of the micro-batches in flight, the
    boundary pieces of one exchange, the largest layer's transient). NCCL's communicator buffers
    (`costmodel.communicators`) live outside torch's allocator, so neither side counts them here."""
    from costmodel.cluster import ClusterSpec, DeviceSpec, LinkSpec, NodeSpec, parse_device
    from costmodel.estimate import CostModel
    from profiler.analytic import analytic_profile

    tps = sorted({s.tp_degree for p in plan.pipelines for s in p.stages})
    profile = analytic_profile(
        plan.model,
        device_kind="cpu",
        micro_batch_sizes=[plan.micro_batch_size],
        tp_degrees=tps,
        seq_len=plan.seq_len,
        dtype=plan.dtype,
        attention=plan.attention,
    )
    gpus: dict[str, list[int]] = {}
    for device in plan.devices:
        node, gpu = parse_device(device)
        gpus.setdefault(node, []).append(gpu)
    cluster = ClusterSpec(
        device=DeviceSpec(kind="cpu", memory_bytes=1 << 60, peak_flops=1e12),  # memory only: no bound
        nodes=tuple(NodeSpec(name=n, gpus=tuple(g)) for n, g in gpus.items()),
        links=LinkSpec(intra_node_gbps=1.0, inter_node_gbps=1.0),
    )
    predicted = {}
    for stage in CostModel(profile, cluster).estimate(plan).stages:
        m = stage.memory
        for device in stage.devices:
            predicted[device] = {
                "parameters_bytes": m["params"],
                "gradients_bytes": m["grads"] + m["sync_buffers"],
                "optimizer_bytes": m["optimizer"],
                "activations_peak_bytes": m["activations"] + m["exchange_buffers"] + m["transient"],
            }
    return predicted


def memory_event(trainer, measured: MeasuredMemory) -> dict | None:
    """Gather every rank's measurement (a collective: every rank calls it) and, on rank 0, the
    `memory` event's fields: per device its measured bytes by kind, the prediction beside them, and
    the worst measured/predicted ratio of the peak. None on the other ranks."""
    ctx = trainer.ctx
    mine = torch.tensor(measured.as_list(), dtype=torch.int64, device=ctx.device)
    every = torch.zeros((ctx.world_size, len(KINDS)), dtype=torch.int64, device=ctx.device)
    all_gather_single(every, mine.unsqueeze(0))
    if ctx.rank != 0:
        return None
    predicted = predicted_memory(trainer.plan)
    devices, worst = {}, 0.0
    for rank, row in enumerate(every.tolist()):
        device = trainer.plan.devices[rank]
        entry = dict(zip(KINDS, row, strict=True))
        entry["predicted"] = predicted[device]
        total, expected = sum(row), sum(predicted[device].values())
        entry["measured_total_bytes"], entry["predicted_total_bytes"] = total, expected
        worst = max(worst, total / expected)
        devices[device] = entry
    return {"devices": devices, "worst_measured_over_predicted": worst, "method": _method(ctx)}


def _method(ctx) -> str:
    return "cuda-allocator" if ctx.is_cuda else "dispatch-mode live storages"

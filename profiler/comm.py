"""Measure the collectives on this host and fit a latency + bandwidth (alpha-beta) model to each.

`measure_collectives` spawns N local processes (gloo on CPU, NCCL with one GPU each on CUDA) that
meet through a FileStore in a temporary directory and talk over the loopback interface only. For
every group size n = 2..N (ranks 0..n-1) it times all-reduce, all-gather, reduce-scatter and
point-to-point exchanges (pairs 0<->1, 2<->3, ... at once; each rank of a pair sends and receives
the message, as a pipeline stage does in 1F1B's steady state, with `batch_isend_irecv` as the
runtime does) at message sizes from 4 bytes to 64 MiB.

Collectives are timed as training uses them: straight after a burst of compute, not back to back
after a barrier. On a CPU the two differ several-fold: a rank that reaches a collective from
computing pays for waking its peer and for the transport's threads competing with compute for the
cores (gloo on two cores: a 100 kB all-reduce cost 1.6-2.5 ms after a 1.4 ms burst of matmuls,
against the ~0.3 ms that back-to-back timing predicted; tensor-parallel stages, which all-reduce
after every attention and MLP, ran 2.5x slower than predicted from back-to-back figures). Each
sample is the time of ITERATIONS (burst, collective) rounds less that of ITERATIONS bursts alone,
per round; the median of `repeats` samples after `warmup`, the slowest rank's median counting.
On CUDA the burst is synchronised before the collective starts, so what is timed is the
collective's own kernel.

`fit` fits, per collective, the model the cost model evaluates (costmodel/comm.py):
    time_s = steps(n) * latency_s + bus_bytes(n, S) / (bandwidth_gbps * 1e9)
    all_reduce      steps 2(n-1)  bus 2(n-1)/n * S   (S: the buffer reduced)
    all_gather      steps n-1     bus (n-1)/n * S    (S: the gathered output)
    reduce_scatter  steps n-1     bus (n-1)/n * S    (S: the input reduced)
    p2p             steps 1       bus S              (S: the message each rank of a pair sends and receives)
by least absolute relative error (numpy; robust to a disturbed size), so microsecond latencies
weigh as much as megabyte transfers, over all group sizes together, and per group size for
inspection. Messages too small to show a bandwidth (all latency-bound) keep the device kind's table
figure, marked `bandwidth_from`.

One host can only measure the intra-node scope. The inter-node entry is a copy of the intra-node
fit, marked `copied_from`, so that a cluster file written here is complete; replace it with a
measurement across hosts (or the datasheet defaults) before planning multi-node jobs.
"""

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.cluster import ClusterSpec, DeviceSpec, LinkSpec, NodeSpec
from costmodel.errors import ElastorError
from costmodel.hardware import DEVICE_KINDS

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
# 4 B to 64 MiB by factors of 8: latency-bound to bandwidth-bound on any link.
DEFAULT_SIZES = tuple(4 * 8**k for k in range(9))
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 2
# The compute before each timed collective, and the (burst, collective) rounds per sample.
BURST_S = 1.5e-3
ITERATIONS = 4
# The whole benchmark must finish within this, or it is stopped and reported.
TIMEOUT_S = 600


def default_max_group_size(device: str = "cpu") -> int:
    """Every GPU up to a node of 8; on CPU four processes, or two per core on smaller machines."""
    if device == "cuda":
        return min(8, torch.cuda.device_count())
    return min(4, 2 * (os.cpu_count() or 1))


def model_terms(collective: str, n: int, num_bytes: float) -> tuple[float, float]:
    """(steps, bus bytes) of a collective on n ranks; the ring algorithms of costmodel/comm.py."""
    if collective == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * num_bytes
    if collective in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n * num_bytes
    return 1, num_bytes


# ---- the worker processes --------------------------------------------------------------------------
def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name.startswith("lo")), None)


def _operation(collective: str, n: int, rank: int, numel: int, group, device):
    """A closure running one `collective` of `numel` float32 elements."""
    if collective == "all_reduce":
        buf = torch.zeros(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if collective == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.zeros(numel // n, device=device)
        return lambda: dist.all_gather_single(out, inp, group=group)
    if collective == "reduce_scatter":
        out, inp = torch.empty(numel // n, device=device), torch.zeros(numel, device=device)
        return lambda: dist.reduce_scatter_single(out, inp, group=group)
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...; the last rank of an odd group idles
    if peer >= n:
        return lambda: None
    send, recv = torch.zeros(numel, device=device), torch.empty(numel, device=device)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange


def _compute_burst(device) -> Callable[[], None]:
    """A closure computing for about BURST_S seconds (matmuls; the count calibrated here)."""
    a = torch.randn(128, 128, device=device)

    def matmuls(count: int) -> None:
        out = a
        for _ in range(count):
            out = a @ out
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    matmuls(10)
    start = time.perf_counter()
    matmuls(50)
    count = max(1, round(BURST_S / ((time.perf_counter() - start) / 50)))
    return lambda: matmuls(count)


def _time_collective(
    collective, n, rank, num_bytes, group, device, burst, repeats, warmup
) -> tuple[int, float]:
    """(bytes, seconds) of one collective as training meets it, after a compute burst (module docstring)."""
    numel = max(n, num_bytes // 4 // n * n)  # float32 elements, divisible by n
    op = _operation(collective, n, rank, numel, group, device)

    def rounds(with_op: bool) -> float:
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(ITERATIONS):
            burst()
            if with_op:
                op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / ITERATIONS

    samples = [rounds(True) - rounds(False) for _ in range(warmup + repeats)]
    seconds = max(float(np.median(samples[warmup:])), 0.0)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return numel * 4, float(slowest.item())


def _worker(
    rank: int, world: int, store_path: str, backend: str, interface: str | None, options: dict
) -> None:
    if interface:
        os.environ["GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        groups = {n: dist.new_group(list(range(n))) for n in range(2, world)}
        groups[world] = dist.group.WORLD
        burst = _compute_burst(device)
        samples = []
        for n, group in sorted(groups.items()):
            for collective in COLLECTIVES:
                for size in options["sizes"]:
                    if rank < n:
                        num_bytes, seconds = _time_collective(
                            collective,
                            n,
                            rank,
                            size,
                            group,
                            device,
                            burst,
                            options["repeats"],
                            options["warmup"],
                        )
                        samples.append(
                            {"collective": collective, "group_size": n, "bytes": num_bytes, "time_s": seconds}
                        )
                    dist.barrier()  # the ranks outside the group wait here
        if rank == 0:
            with open(options["result_path"], "w") as f:
                json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def measure_collectives(
    max_group_size: int,
    *,
    device: str = "cpu",
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    timeout_s: float = TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Samples {collective, group_size, bytes, time_s} for group sizes 2..max_group_size."""
    if max_group_size < 2:
        raise ElastorError(
            f"Measuring collectives needs a group of at least 2 processes, not {max_group_size}."
        )
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < max_group_size:
        raise ElastorError(
            f"Measuring NCCL collectives on {max_group_size} ranks needs as many GPUs, but this machine "
            f"has {torch.cuda.device_count()}; lower --comm-ranks."
        )
    with tempfile.TemporaryDirectory(prefix="elastor-comm-") as tmp:
        options = {
            "sizes": list(sizes),
            "repeats": repeats,
            "warmup": warmup,
            "result_path": os.path.join(tmp, "samples.json"),
        }
        args = (max_group_size, os.path.join(tmp, "store"), backend, _loopback_interface(), options)
        context = mp.spawn(_worker, args=args, nprocs=max_group_size, join=False)
        try:
            deadline = time.monotonic() + timeout_s
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise ElastorError(
                        f"The collective benchmark did not finish within {timeout_s:.0f} s; "
                        "use fewer ranks or smaller messages."
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(timeout=10)
        with open(options["result_path"]) as f:
            return json.load(f)


# ---- the fit -----------------------------------------------------------------------------------------
def fit_alpha_beta(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Latency and bandwidth of one collective's samples, minimising the absolute relative error.

    A negative latency is clamped to zero and the bandwidth refitted. When the messages never leave
    the latency-bound regime (the fitted seconds per byte is not positive), the samples say nothing
    about bandwidth: the latency is fitted alone and `bandwidth_gbps` is None.
    """
    collective = samples[0]["collective"]
    terms = np.array([model_terms(collective, s["group_size"], s["bytes"]) for s in samples], dtype=float)
    times = np.array([s["time_s"] for s in samples], dtype=float)
    weighted = terms / times[:, None]  # each row divided by its time: relative residuals
    (latency, seconds_per_byte) = _least_absolute(weighted)
    if seconds_per_byte <= 0:
        seconds_per_byte = 0.0
        latency = max(_least_absolute(weighted[:, :1])[0], 0.0)
    elif latency < 0:
        latency = 0.0
        seconds_per_byte = _least_absolute(weighted[:, 1:])[0]
    predicted = terms @ np.array([latency, seconds_per_byte])
    return {
        "latency_s": float(latency),
        "bandwidth_gbps": float(1.0 / seconds_per_byte / 1e9) if seconds_per_byte > 0 else None,
        "max_rel_error": float(np.max(np.abs(predicted - times) / times)),
        "samples": len(samples),
    }


def _least_absolute(rows: np.ndarray, iterations: int = 100) -> np.ndarray:
    """x minimising sum |rows @ x - 1| (least absolute deviations, by iteratively reweighted least
    squares): one disturbed message size among eight moves the fit far less than under squares."""
    ones = np.ones(len(rows))
    x = np.linalg.lstsq(rows, ones, rcond=None)[0]
    for _ in range(iterations):
        weights = 1.0 / np.maximum(np.abs(rows @ x - ones), 1e-6)
        root = np.sqrt(weights)
        x = np.linalg.lstsq(rows * root[:, None], ones * root, rcond=None)[0]
    return x


def _fit(samples: Sequence[dict[str, Any]], fallback_gbps: float) -> dict[str, Any]:
    """`fit_alpha_beta`, with the hardware table's bandwidth where the samples do not resolve one."""
    fit = fit_alpha_beta(samples)
    if fit["bandwidth_gbps"] is None:
        fit["bandwidth_gbps"] = fallback_gbps
        fit["bandwidth_from"] = "hardware table: the messages were too small to resolve a bandwidth"
    return fit


def collectives_block(
    samples: Sequence[dict[str, Any]], backend: str, fallback_gbps: float
) -> dict[str, Any]:
    """The cluster file's `links.collectives`: per collective an intra-node fit and its inter-node copy.

    `fallback_gbps` (the device kind's intra-node figure) stands in for a bandwidth that messages
    this small cannot show; the fit then says so in `bandwidth_from`.
    """
    block: dict[str, Any] = {}
    for collective in COLLECTIVES:
        mine = [s for s in samples if s["collective"] == collective]
        if not mine:
            continue
        intra = _fit(mine, fallback_gbps)
        intra["by_group_size"] = {
            str(n): _fit([s for s in mine if s["group_size"] == n], fallback_gbps)
            for n in sorted({s["group_size"] for s in mine})
        }
        inter = {k: intra[k] for k in ("latency_s", "bandwidth_gbps")}
        inter["copied_from"] = "intra_node"
        block[collective] = {"intra_node": intra, "inter_node": inter}
    block["measurement"] = {
        "backend": backend,
        "model": "time_s = steps(n) * latency_s + bus_bytes(n, S) / (bandwidth_gbps * 1e9), ring "
        "algorithms as in costmodel/comm.py; p2p is a two-way exchange; each timed after a burst of "
        "compute, as training meets it",
        "scopes_measured": ["intra_node"],
        "note": "measured on one host, so only the intra-node scope is real; inter_node is a copy of "
        "the intra-node fit until it is measured across hosts",
        "samples": list(samples),
    }
    return block


def measured_cluster(block: dict[str, Any], num_devices: int, kind: str) -> ClusterSpec:
    """One node of `num_devices` devices whose links are the measured fits (all-reduce sets the GB/s)."""
    hw = DEVICE_KINDS.get(kind, DEVICE_KINDS["cpu"])
    bandwidth = block["all_reduce"]["intra_node"]["bandwidth_gbps"]
    return ClusterSpec(
        device=DeviceSpec(kind=kind, memory_bytes=hw.memory_bytes, peak_flops=hw.peak_flops),
        nodes=(NodeSpec(name="n0", gpus=tuple(range(num_devices))),),
        links=LinkSpec(intra_node_gbps=bandwidth, inter_node_gbps=bandwidth, collectives=block),
    )

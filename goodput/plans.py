"""Throughput of the best plan for a set of healthy GPUs, from the real solver, cached by signature.

The simulation asks one question of the planner, many times: "these GPUs are healthy; how fast can
we train, and on which of them?" An *oracle* answers it: a callable from a healthy-set signature to
a `PlanPoint` (samples/s, pipelines, GPUs used per node), or None when no plan fits.

Signature: the healthy-GPU counts per node, sorted, as run lengths, e.g. ((8, 2047), (7, 1)).
Nodes with equal counts are interchangeable to the solver, and so are GPUs within a node, so the
plan for a signature serves every healthy set with that signature. The plan's nodes are matched to
the physical nodes in signature order (most healthy GPUs first, ties by node index), and a plan that
uses u GPUs of a node runs on that node's first u healthy GPUs.
"""

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

import solver
from costmodel import ClusterSpec, ElastorError, ModelProfile
from costmodel.cluster import parse_device

Signature = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PlanPoint:
    samples_per_s: float
    num_pipelines: int
    used_per_node: tuple[int, ...] | None = None  # GPUs used per node in signature order; None: all


Oracle = Callable[[Signature], PlanPoint | None]


def signature(counts: Iterable[int]) -> Signature:
    """Run-length form of the per-node healthy counts, largest first; nodes with none are left out."""
    array = np.fromiter(counts, dtype=np.int64) if not isinstance(counts, np.ndarray) else counts
    values, reps = np.unique(array[array > 0], return_counts=True)
    return tuple((int(v), int(r)) for v, r in zip(values[::-1], reps[::-1], strict=True))


def expand(sig: Signature) -> list[int]:
    """Per-node counts of a signature, in signature order: ((8, 2), (7, 1)) -> [8, 8, 7]."""
    return [count for count, reps in sig for _ in range(reps)]


def signature_order(counts: np.ndarray) -> np.ndarray:
    """Physical node indices in signature order: most healthy GPUs first, ties by index; no empty nodes."""
    order = np.lexsort((np.arange(len(counts)), -counts))
    return order[counts[order] > 0]


def place(point: PlanPoint, nodes: np.ndarray, healthy: np.ndarray) -> np.ndarray:
    """Which physical GPUs a plan runs on: a boolean mask like `healthy` (nodes x GPU positions).

    `nodes` are the physical nodes the plan's nodes map to, in signature order.
    """
    in_use = np.zeros_like(healthy)
    rows = healthy[nodes]
    if point.used_per_node is None:
        in_use[nodes] = rows
        return in_use
    rank = np.cumsum(rows, axis=1) - 1  # each healthy GPU's position among its node's healthy GPUs
    used = np.asarray(point.used_per_node)[:, None]
    in_use[nodes] = rows & (rank < used)
    return in_use


class CachedOracle:
    """Memoises an oracle per signature and keeps count of what the simulation asked."""

    def __init__(self, oracle: Oracle):
        self._oracle = oracle
        self._cache: dict[Signature, PlanPoint | None] = {}
        self.calls = 0
        self.solve_wall_s = 0.0

    def __call__(self, sig: Signature) -> PlanPoint | None:
        self.calls += 1
        if sig not in self._cache:
            start = time.perf_counter()
            self._cache[sig] = self._oracle(sig)
            self.solve_wall_s += time.perf_counter() - start
        return self._cache[sig]

    @property
    def solves(self) -> int:
        return len(self._cache)


class SolverOracle:
    """The real planner: `solver.solve` on a cluster built from the signature (kind and links kept)."""

    def __init__(
        self, profile: ModelProfile, cluster: ClusterSpec, global_batch_size: int, method: str = "elastor"
    ):
        self.profile = profile
        self.template = cluster
        self.global_batch_size = global_batch_size
        self.method = method

    def cluster_for(self, sig: Signature) -> ClusterSpec:
        counts = expand(sig)
        base = ClusterSpec.from_counts(counts, self.template.device.kind)
        return ClusterSpec(device=self.template.device, nodes=base.nodes, links=self.template.links)

    def __call__(self, sig: Signature) -> PlanPoint | None:
        if not sig:
            return None
        try:
            plan = solver.solve(
                self.profile, self.cluster_for(sig), self.global_batch_size, method=self.method
            )
        except ElastorError:
            return None
        used = [0] * sum(reps for _, reps in sig)
        for device in plan.devices:
            node, _ = parse_device(device)
            used[int(node[1:])] += 1
        return PlanPoint(
            samples_per_s=float(plan.predicted["samples_per_s"]),
            num_pipelines=len(plan.pipelines),
            used_per_node=tuple(used),
        )

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

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np

import solver
from costmodel import ClusterSpec, ElastorError, ModelProfile
from costmodel.cluster import parse_device
from costmodel.jsonio import read_json, write_json

Signature = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PlanPoint:
    samples_per_s: float
    num_pipelines: int
    used_per_node: tuple[int, ...] | None = None  # GPUs used per node in signature order; None: all
    status: str = ""  # the solver's: OPTIMAL, or FEASIBLE with a proven relative gap
    gap: float = 0.0

    def to_json(self) -> dict[str, Any]:
        used = self.used_per_node
        return {
            "samples_per_s": self.samples_per_s,
            "num_pipelines": self.num_pipelines,
            "used_per_node": None if used is None else [[u, len(list(g))] for u, g in groupby(used)],
            "status": self.status,
            "gap": self.gap,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PlanPoint":
        runs = data["used_per_node"]
        return cls(
            samples_per_s=float(data["samples_per_s"]),
            num_pipelines=int(data["num_pipelines"]),
            used_per_node=None if runs is None else tuple(u for u, reps in runs for _ in range(reps)),
            status=data.get("status", ""),
            gap=float(data.get("gap", 0.0)),
        )


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
    """Memoises an oracle per signature and keeps count of what the simulation asked.

    With `path`, solved plans persist in a JSON file under `context` (a fingerprint of everything
    the answers depend on besides the signature: profile, device, links, batch, method, time limit),
    so a later run with the same inputs solves nothing it has solved before. The fingerprint does
    not cover the solver's code: delete the file after the solver changes.
    """

    def __init__(self, oracle: Oracle, path: str | None = None, context: str = ""):
        self._oracle = oracle
        self._cache: dict[Signature, PlanPoint | None] = {}
        self.path, self.context = path, context
        self.calls = 0
        self.solve_wall_s = 0.0
        self.solved = 0  # by the oracle in this process, not read from the file
        self._file: dict[str, Any] = {"schema_version": 1, "plans": {}}
        if path and Path(path).exists():
            self._file = read_json(path, "plan cache")
            plans = self._file.get("plans")
            if not isinstance(plans, dict) or not all(isinstance(v, dict) for v in plans.values()):
                raise ElastorError(f"The plan cache {path} is not one Elastor wrote; delete it.")
            try:
                for key, point in plans.get(context, {}).items():
                    self._cache[_parse_key(key)] = None if point is None else PlanPoint.from_json(point)
            except (KeyError, TypeError, ValueError):
                raise ElastorError(f"The plan cache {path} is not one Elastor wrote; delete it.") from None

    def __call__(self, sig: Signature) -> PlanPoint | None:
        self.calls += 1
        if sig not in self._cache:
            start = time.perf_counter()
            point = self._oracle(sig)
            self.solve_wall_s += time.perf_counter() - start
            self.solved += 1
            self._cache[sig] = point
            if self.path:
                entries = self._file["plans"].setdefault(self.context, {})
                entries[_key(sig)] = None if point is None else point.to_json()
                write_json(self.path, self._file)
        return self._cache[sig]

    @property
    def solves(self) -> int:
        return len(self._cache)

    def points(self) -> dict[Signature, PlanPoint | None]:
        return dict(self._cache)


def _key(sig: Signature) -> str:
    return ",".join(f"{count}x{reps}" for count, reps in sig)


def _parse_key(key: str) -> Signature:
    return tuple((int(c), int(r)) for c, r in (part.split("x") for part in key.split(","))) if key else ()


class SolverOracle:
    """The real planner: `solver.solve` on a cluster built from the signature (kind and links kept)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        global_batch_size: int,
        method: str = "elastor",
        time_limit_s: float | None = None,
        interleave: bool = False,
    ):
        self.profile = profile
        self.template = cluster
        self.global_batch_size = global_batch_size
        self.method = method
        self.time_limit_s = time_limit_s
        self.interleave = interleave  # also search interleaved 1F1B (`solver.solve`)

    def fingerprint(self) -> str:
        """What the answers depend on besides the signature, hashed (the plan cache's context)."""
        inputs = {
            # the profile's costs; not its `method` block, which records how long profiling took
            "profile": {k: v for k, v in self.profile.to_json().items() if k != "method"},
            "device": self.template.to_json()["device"],
            "links": self.template.to_json()["links"],
            "gpus_per_node": self.template.gpus_per_node,  # which nodes node-drop (and Elastor) see as whole
            "global_batch_size": self.global_batch_size,
            "method": self.method,
            "time_limit_s": self.time_limit_s,
        }
        if self.interleave:  # absent otherwise, so caches written before the option stay valid
            inputs["interleave"] = True
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    def cluster_for(self, sig: Signature) -> ClusterSpec:
        counts = expand(sig)
        base = ClusterSpec.from_counts(counts, self.template.device.kind)
        return ClusterSpec(
            device=self.template.device,
            nodes=base.nodes,
            links=self.template.links,
            gpus_per_node=self.template.gpus_per_node,
        )

    def __call__(self, sig: Signature) -> PlanPoint | None:
        if not sig:
            return None
        limit = {} if self.time_limit_s is None else {"time_limit_s": self.time_limit_s}
        try:
            plan = solver.solve(
                self.profile,
                self.cluster_for(sig),
                self.global_batch_size,
                method=self.method,
                interleave=self.interleave,
                **limit,
            )
        except ElastorError:
            return None
        used = [0] * sum(reps for _, reps in sig)
        for device in plan.devices:
            node, _ = parse_device(device)
            used[int(node[1:])] += 1
        info = plan.solver or {}
        return PlanPoint(
            samples_per_s=float(plan.predicted["samples_per_s"]),
            num_pipelines=len(plan.pipelines),
            used_per_node=tuple(used),
            status=str(info.get("status", "")),
            gap=float(info.get("gap", 0.0)),
        )

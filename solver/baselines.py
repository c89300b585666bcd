"""The plans other systems would run, each the best of its family under the same cost model.

uniform      Megatron-style: one TP x PP x DP grid, every pipeline the same, stages with equal numbers
             of blocks (the embedding joins the first stage, the head the last), every pipeline the
             same number of micro-batches, TP groups inside nodes, on the largest subset of the
             healthy GPUs that admits a grid (TP x PP x DP = its size); among the grids on that many
             GPUs, the best (TP, PP, DP, micro-batch size) wins.
pow2-greedy  the Elastor paper's released heuristic: on every node, power-of-two TP groups of at most
             the nominal TP, largest first (7 GPUs at TP 4: 4 + 2 + 1); groups, largest first, each
             go to the pipeline with the fewest GPUs among a fixed number D of pipelines, in that
             order as stages; layers then balanced per pipeline (the split with the smallest slowest
             stage, then the smallest sum, whose memory fits), micro-batches split to minimise the
             slowest pipeline (solved exactly). The best (nominal TP, D, micro-batch size) wins.
node-drop    (in solver/__init__.py) Elastor's own search on the fully healthy nodes only.
"""

import bisect
import heapq
import itertools
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from costmodel import ClusterSpec, Pipeline, Plan
from costmodel.estimate import CostModel, plan_sync_s, steady_period_s
from costmodel.profile import ModelProfile
from solver.core import pipeline_sync, tp_degrees
from solver.master import balance
from solver.skeletons import Splitter, block_uniform
from solver.stages import StageTable, exchanges_s, stage_table, sync_terms
from solver.templates import fewest_gpus

# A stage of a baseline plan: (start, end, tp, node index, first GPU index on that node).
Placed = tuple[int, int, int, int, int]


def _pipeline_time(tables: dict[int, StageTable], stages: Sequence[Placed], m: int) -> float:
    times = [tables[tp].time_s[s][e] for s, e, tp, _, _ in stages]
    p2p = exchanges_s(tables, [st[:3] for st in stages], [st[3] for st in stages])
    return sum(times) + 2 * sum(p2p) + (m - 1) * steady_period_s(times, p2p)


def _fits(tables: dict[int, StageTable], stages: Sequence[Placed]) -> bool:
    p = len(stages)
    return all(tables[tp].max_in_flight[s][e] >= p - i for i, (s, e, tp, _, _) in enumerate(stages))


def _score(cm: CostModel, tables, pipes: Sequence[Sequence[Placed]], counts: Sequence[int]) -> float:
    """Step time of a plan from the stage tables: slowest pipeline + sync + optimizer (as estimate)."""
    inter = len({st[3] for pipe in pipes for st in pipe}) > 1
    optimizer = max(tables[tp].optimizer_s[s][e] for pipe in pipes for s, e, tp, *_ in pipe)
    slowest = max(_pipeline_time(tables, pipe, m) for pipe, m in zip(pipes, counts, strict=True))
    priced = []
    for pipe in pipes:
        hide, last = sync_terms(tables, [st[:3] for st in pipe], [st[3] for st in pipe])
        widest = max(tables[tp].params[s][e] for s, e, tp, *_ in pipe)
        priced.append((pipeline_sync(cm, inter, len(pipes), widest, last), hide))
    return slowest + plan_sync_s(priced) + optimizer


def _plan(cm: CostModel, cluster, gbs, mbs, pipes: Sequence[Sequence[Placed]], counts: Sequence[int]) -> Plan:
    built = []
    for pipe, m in zip(pipes, counts, strict=True):
        stages = []
        for s, e, tp, node, first in pipe:
            n = cluster.nodes[node]
            stages.append(
                cm.planned_stage((s, e), tuple(f"{n.name}:{g}" for g in n.gpus[first : first + tp]))
            )
        built.append(Pipeline(num_microbatches=m, stages=tuple(stages)))
    plan = Plan(
        optimizer=cm.optimizer,
        model=cm.profile.model,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        seq_len=cm.profile.seq_len,
        dtype=cm.profile.dtype,
        pipelines=tuple(built),
    )
    return plan.validate(cluster)


def equal_split(num_blocks: int, stages: int) -> list[tuple[int, int]] | None:
    """Layer ranges of `stages` stages with blocks as equal as possible (first ones get the extra)."""
    if stages > max(num_blocks, 1):
        return None
    bounds, start = [], 0
    for i in range(stages):
        blocks = num_blocks // stages + (1 if i < num_blocks % stages else 0)
        end = start + blocks + (1 if i == 0 else 0) + (1 if i == stages - 1 else 0)
        bounds.append((start, end))
        start = end
    return bounds


def uniform(
    profile: ModelProfile, cluster: ClusterSpec, gbs: int, sizes: Sequence[int], recompute: str = "none"
) -> tuple[float, Plan] | None:
    """Among the grids that fit (memory, and a global batch that splits evenly into DP x micro-batch
    size), those on the most GPUs, and of them the fastest: Megatron-style planners run TP x PP x DP
    = world size on the largest subset of the healthy GPUs that admits a grid."""
    cm = CostModel(profile, cluster, recompute=recompute)
    model = profile.model
    best = None  # (-GPUs used, step time, plan parts): the most GPUs first, then the fastest
    for mbs in sizes:
        N = gbs // mbs
        tables = {t: stage_table(cm, t, mbs) for t in tp_degrees(profile, cluster)}
        for tp in tables:
            groups = [(i, g * tp) for i, n in enumerate(cluster.nodes) for g in range(len(n.gpus) // tp)]
            for pp in range(1, len(groups) + 1):
                split = equal_split(model.num_blocks, pp)
                if split is None:
                    break
                for dp in range(1, len(groups) // pp + 1):
                    if N % dp or N // dp < pp:
                        continue
                    pipes = [
                        [(s, e, tp, *groups[j * pp + i]) for i, (s, e) in enumerate(split)] for j in range(dp)
                    ]
                    if not _fits(tables, pipes[0]):
                        break  # more pipelines do not change a stage's memory
                    counts = [N // dp] * dp
                    key = (-tp * pp * dp, _score(cm, tables, pipes, counts))
                    if best is None or key < best[:2]:
                        best = (*key, (mbs, pipes, counts))
    if best is None:
        return None
    _, cost, (mbs, pipes, counts) = best
    return cost, _plan(cm, cluster, gbs, mbs, pipes, counts)


def balanced_split(
    arrays: dict[int, tuple[np.ndarray, np.ndarray]], tps: Sequence[int], num_layers: int
) -> list[tuple[int, int]] | None:
    """Layer ranges for stages of the given TP degrees (front to back) that fit in memory, with the
    smallest slowest stage and then the smallest sum of stage times (exact, over all splits).

    `arrays[t]` = (time_s, max_in_flight) as [s, e] arrays. For a threshold x on stage time:
    best_i[e] = least sum of times of stages 0..i-1 covering [0, e) with every stage at most x
    (best_0 = 0 at e = 0); the smallest feasible x is found by bisection over the distinct times.
    """
    p = len(tps)
    if p > num_layers:
        return None
    masks = [arrays[t][1] >= p - i for i, t in enumerate(tps)]

    def cover(limit: float):
        best = np.full(num_layers + 1, np.inf)
        best[0] = 0.0
        choices = []
        for i, t in enumerate(tps):
            time = arrays[t][0]
            cost = np.where(masks[i] & (time <= limit) & np.triu(np.ones_like(masks[i]), 1), time, np.inf)
            total = best[:, None] + cost  # [start, end]
            choices.append(np.argmin(total, axis=0))
            best = total.min(axis=0)
        if not np.isfinite(best[num_layers]):
            return None
        bounds, end = [], num_layers
        for i in range(p - 1, -1, -1):
            start = int(choices[i][end])
            bounds.append((start, end))
            end = start
        return bounds[::-1]

    times = np.unique(np.concatenate([arrays[t][0][np.triu_indices(num_layers + 1, 1)] for t in set(tps)]))
    if cover(times[-1]) is None:
        return None
    lo = bisect.bisect_left(
        range(len(times)), True, hi=len(times) - 1, key=lambda i: cover(times[i]) is not None
    )
    return cover(times[lo])


def pow2_groups(cluster: ClusterSpec, nominal: int, allowed: Sequence[int]) -> list[tuple[int, int, int]]:
    """(size, node index, first GPU index) of every node's power-of-two TP groups, largest first."""
    sizes = sorted((t for t in allowed if t & (t - 1) == 0 and t <= nominal), reverse=True)
    groups = []
    for i, node in enumerate(cluster.nodes):
        left, first = len(node.gpus), 0
        for size in sizes:
            while left >= size:
                groups.append((size, i, first))
                left, first = left - size, first + size
    return sorted(groups, key=lambda g: -g[0])


def pow2_greedy(
    profile: ModelProfile, cluster: ClusterSpec, gbs: int, sizes: Sequence[int], recompute: str = "none"
) -> tuple[float, Plan] | None:
    cm = CostModel(profile, cluster, recompute=recompute)
    L = profile.model.num_layers
    uniform_blocks = block_uniform(profile)
    best = None
    for mbs in sizes:
        N = gbs // mbs
        allowed = tp_degrees(profile, cluster)
        tables = {t: stage_table(cm, t, mbs) for t in allowed}
        split = _BalancedSplit(tables, L, uniform_blocks)
        total = len(cluster.devices)
        smallest = fewest_gpus(tables, L, total)  # no pipeline of fewer GPUs fits

        for nominal in [t for t in allowed if t & (t - 1) == 0]:
            groups = pow2_groups(cluster, nominal, allowed)
            for D in range(1, len(groups) + 1):
                if total // D < smallest:
                    break  # some pipeline gets at most the average: too few GPUs, here and beyond
                members: list[list[tuple[int, int, int]]] = [[] for _ in range(D)]
                loads = [(0, i) for i in range(D)]  # (GPUs, pipeline): each group to the emptiest
                for g in groups:
                    gpus, i = heapq.heappop(loads)
                    members[i].append(g)
                    heapq.heappush(loads, (gpus + g[0], i))
                pipes = []
                for member in members:
                    bounds = split.of(member)
                    if bounds is None:
                        break
                    pipes.append(
                        [
                            (s, e, size, node, first)
                            for (s, e), (size, node, first) in zip(bounds, member, strict=True)
                        ]
                    )
                else:
                    counts = _balance_placed(tables, pipes, N)
                    if counts is None:
                        continue
                    cost = _score(cm, tables, pipes, counts)
                    if best is None or cost < best[0]:
                        best = (cost, (mbs, pipes, counts))
    if best is None:
        return None
    cost, (mbs, pipes, counts) = best
    return cost, _plan(cm, cluster, gbs, mbs, pipes, counts)


class _BalancedSplit:
    """The balanced layer split of one pipeline's groups, cached by TP degrees and node changes."""

    def __init__(self, tables: dict[int, StageTable], num_layers: int, uniform_blocks: bool):
        self.L = num_layers
        self.splitter = Splitter(tables, num_layers) if uniform_blocks else None
        self.arrays = {t: (np.array(tab.time_s), np.array(tab.max_in_flight)) for t, tab in tables.items()}
        self.cache: dict[tuple, list | None] = {}

    def of(self, member: list[tuple[int, int, int]]) -> list[tuple[int, int]] | None:
        tps = tuple(size for size, _, _ in member)
        runs = tuple(itertools.accumulate((a[1] != b[1] for a, b in pairwise(member)), initial=0))
        if (tps, runs) not in self.cache:
            if self.splitter is not None:  # identical blocks: the closed form of solver.skeletons
                found = self.splitter.templates(tps, runs)
                self.cache[tps, runs] = [(s, e) for s, e, _ in found[0].stages] if found else None
            else:
                self.cache[tps, runs] = balanced_split(self.arrays, tps, self.L)
        return self.cache[tps, runs]


class _Line:
    """A pipeline's time as a function of its micro-batches, for `balance`."""

    def __init__(self, tables, stages):
        self.num_stages = len(stages)
        self._zero = _pipeline_time(tables, stages, 1)
        self._step = max(tables[tp].time_s[s][e] for s, e, tp, _, _ in stages)

    def time_s(self, m: int) -> float:
        return self._zero + (m - 1) * self._step


def _balance_placed(tables, pipes, N: int) -> list[int] | None:
    return balance([_Line(tables, p) for p in pipes], N) if pipes else None

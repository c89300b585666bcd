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

Not a method: `deep_grids`, the fastest grid of one-degree pipelines of any depth, seeds Elastor's
search on large instances beside uniform and pow2-greedy (its docstring says why).
"""

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from costmodel import ClusterSpec, Pipeline, Plan
from costmodel.estimate import CostModel, plan_sync_s, steady_period_s
from costmodel.plan import OptimizerLayout
from costmodel.profile import ModelProfile
from solver.core import pipeline_sync, tp_degrees
from solver.core import sync as sync_pricing
from solver.interleave import chunk_ranges, fastest_variant, least_time_s
from solver.master import balance
from solver.skeletons import Splitter, block_uniform, splitter_of
from solver.stages import StageTable, exchanges_s, stage_table, sync_terms
from solver.templates import Template, fewest_gpus

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


def _plan(cm: CostModel, cluster, gbs, mbs, pipes, counts: Sequence[int], split: Sequence[bool] = ()) -> Plan:
    """A plan of pipelines of stages (layers, tp, node index, first GPU index), where layers is a
    range (start, end) or a stage's chunks ((start, end), ...); `split`: which pipelines split their
    backwards (none if empty)."""
    built = []
    for pi, (pipe, m) in enumerate(zip(pipes, counts, strict=True)):
        stages = []
        for layers, tp, node, first in pipe:
            n = cluster.nodes[node]
            stages.append(
                cm.planned_stage(layers, tuple(f"{n.name}:{g}" for g in n.gpus[first : first + tp]))
            )
        built.append(
            Pipeline(num_microbatches=m, stages=tuple(stages), split_backward=bool(split and split[pi]))
        )
    plan = Plan(
        optimizer=cm.optimizer,
        model=cm.profile.model,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        seq_len=cm.profile.seq_len,
        dtype=cm.profile.dtype,
        attention=cm.profile.attention,
        pipelines=tuple(built),
    )
    return plan.validate(cluster)


def equal_split(num_blocks: int, stages: int) -> list[tuple[int, int]] | None:
    """Layer ranges of `stages` stages with blocks as equal as possible (first ones get the extra)."""
    split = virtual_split(num_blocks, stages, 1)
    return None if split is None else [chunks[0] for chunks in split]


def virtual_split(num_blocks: int, stages: int, chunks: int) -> list[tuple[tuple[int, int], ...]] | None:
    """Megatron's layer assignment for `stages` stages of `chunks` chunks each: the blocks cut into
    stages x chunks virtual stages as equal as possible (the first ones get the extra block), the
    embedding joining virtual stage 0 and the head the last; stage s holds virtual stages s,
    s + stages, s + 2 stages, ... (Narayanan et al. 2021, section 2.2.2). None when there are more
    virtual stages than blocks."""
    virtual = stages * chunks
    if virtual > max(num_blocks, 1) or (chunks > 1 and stages < 2):
        return None
    bounds, start = [], 0
    for i in range(virtual):
        blocks = num_blocks // virtual + (1 if i < num_blocks % virtual else 0)
        end = start + blocks + (1 if i == 0 else 0) + (1 if i == virtual - 1 else 0)
        bounds.append((start, end))
        start = end
    return [tuple(bounds[k * stages + s] for k in range(chunks)) for s in range(stages)]


@dataclass(frozen=True)
class Grid:
    """The dimensions of a Megatron-style grid a user pins (`elastor plan --method uniform --tp T
    --pp P --chunks V`); None leaves one to the search. The recompute mode and the optimizer
    layout are pinned by the passes `solve` runs."""

    tp: int | None = None
    pp: int | None = None
    chunks: int = 1
    split_backward: bool = False  # every pipeline of more than one stage splits its backwards

    @property
    def pinned(self) -> bool:
        return self.tp is not None or self.pp is not None or self.chunks != 1 or self.split_backward

    def describe(self) -> str:
        parts = [f"TP{self.tp}" if self.tp else "any TP", f"PP{self.pp}" if self.pp else "any PP"]
        return (
            " x ".join(parts)
            + (f" (interleaved, {self.chunks} chunks per stage)" if self.chunks > 1 else "")
            + (", split backward" if self.split_backward else "")
        )


NO_PINS = Grid()  # every dimension left to the search


@dataclass(frozen=True)
class _Candidate:
    mbs: int
    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def grid_candidates(
    profile: ModelProfile, cluster: ClusterSpec, gbs: int, sizes: Sequence[int], grid: Grid
) -> Iterator[_Candidate]:
    """Every (micro-batch size, TP, PP) the grid allows, with the most pipelines it can have: TP
    groups inside nodes, as many as there are PP-sized sets of them, dividing the micro-batches
    (gbs / mbs), each pipeline with at least as many micro-batches as stages."""
    num_blocks = profile.model.num_blocks
    for mbs in sizes:
        N = gbs // mbs
        for tp in tp_degrees(profile, cluster):
            if grid.tp not in (None, tp):
                continue
            groups = len(_tp_groups(cluster, tp))
            for pp in [grid.pp] if grid.pp else range(1, groups + 1):
                if virtual_split(num_blocks, pp, grid.chunks) is None:
                    break
                dp = next((d for d in range(groups // pp, 0, -1) if N % d == 0 and N // d >= pp), None)
                if dp is not None:
                    yield _Candidate(mbs, tp, pp, dp)


def _tp_groups(cluster: ClusterSpec, tp: int) -> list[tuple[int, int]]:
    """(node index, first GPU index) of every TP group of `tp` GPUs inside a node, node by node."""
    return [(i, g * tp) for i, n in enumerate(cluster.nodes) for g in range(len(n.gpus) // tp)]


def _grid_pipes(num_blocks: int, cluster: ClusterSpec, c: _Candidate, chunks: int) -> list[list[tuple]]:
    """Pipeline j's stage i on the (j * pp + i)-th TP group, groups node by node: (layers, tp, node
    index, first GPU index) per stage, layers a range, or the stage's chunks when interleaved."""
    groups = _tp_groups(cluster, c.tp)
    split = virtual_split(num_blocks, c.pp, chunks)
    return [
        [(layers if chunks > 1 else layers[0], c.tp, *groups[j * c.pp + i]) for i, layers in enumerate(split)]
        for j in range(c.dp)
    ]


def grid_plan(
    cm: CostModel, cluster: ClusterSpec, gbs: int, c: _Candidate, chunks: int, split: bool = False
) -> Plan:
    """The plan of one grid (`_grid_pipes`), every pipeline with the same micro-batches; `split`:
    their backwards split where they have more than one stage."""
    pipes = _grid_pipes(cm.model.num_blocks, cluster, c, chunks)
    return _plan(cm, cluster, gbs, c.mbs, pipes, [gbs // c.mbs // c.dp] * c.dp, [split and c.pp > 1] * c.dp)


def uniform(
    profile: ModelProfile,
    cluster: ClusterSpec,
    gbs: int,
    sizes: Sequence[int],
    recompute: str = "none",
    *,
    grid: Grid = NO_PINS,
    sharding: str = "none",
) -> tuple[float, Plan] | None:
    """Among the grids that fit (memory, and a global batch that splits evenly into DP x micro-batch
    size), those on the most GPUs, and of them the fastest: Megatron-style planners run TP x PP x DP
    = world size on the largest subset of the healthy GPUs that admits a grid. Plain 1F1B grids
    without sharding are priced from the stage tables; interleaved or ZeRO-1 grids, whose memory
    and time the tables do not hold, by the cost model's estimate of the whole plan."""
    layout = OptimizerLayout(sharding=sharding)
    cm = CostModel(profile, cluster, recompute=recompute, optimizer=layout)
    exact = CostModel(profile, cluster)
    best = None  # (-GPUs used, step time, candidate): the most GPUs first, then the fastest
    for c in grid_candidates(profile, cluster, gbs, sizes, grid):
        if best is not None and c.gpus < -best[0]:
            continue
        if grid.chunks == 1 and sharding == "none" and not grid.split_backward:
            table = {c.tp: stage_table(cm, c.tp, c.mbs)}  # memoised by solver.stages
            grid_pipes = _grid_pipes(profile.model.num_blocks, cluster, c, 1)
            pipes = [[(s, e, tp, node, first) for (s, e), tp, node, first in pipe] for pipe in grid_pipes]
            if not _fits(table, pipes[0]):
                continue
            cost = _score(cm, table, pipes, [gbs // c.mbs // c.dp] * c.dp)
        else:
            estimate = exact.estimate(grid_plan(cm, cluster, gbs, c, grid.chunks, grid.split_backward))
            if not estimate.fits:
                continue
            cost = estimate.step_time_s
        key = (-c.gpus, cost)
        if best is None or key < best[:2]:
            best = (*key, c)
    if best is None:
        return None
    _, cost, c = best
    return cost, grid_plan(cm, cluster, gbs, c, grid.chunks, grid.split_backward)


def deep_grids(
    profile: ModelProfile,
    cluster: ClusterSpec,
    gbs: int,
    sizes: Sequence[int],
    recompute: str = "none",
    *,
    interleave: bool = False,
) -> tuple[float, Plan] | None:
    """A seed of Elastor's search, not a method: the fastest grid of identical one-degree pipelines
    of any depth, as many of them as the cluster's TP groups (taken node by node) hold or the fewest
    that give each micro-batch count per pipeline (fewer pipelines, less gradient sync), each split
    by the skeleton family's closed form and given any micro-batch count (`balance`). Only for
    models with identical blocks, where the skeleton family is searched.

    The skeleton family is not closed under adding GPUs: its whole-node runs change with the
    cluster, so a bigger cluster can lose a pipeline depth a smaller one had. llama3-70b at 2M
    tokens with chunks planned 12 pipelines of 41 TP-4 stages (2 chunks of 82 layers) on 251
    nodes of 8 but could not on 256, where only 42- and 43-stage pipelines of TP 4 were offered,
    and planned 7.9% slower there. A grid of depth d on a cluster is a grid of depth d on any
    cluster with more TP groups, so the best grid here is at least as fast as the best grid of
    every smaller cluster, up to where its node boundaries fall. It is priced as the master prices
    plans (`plan_cost_s`); with `interleave` each pipeline runs its fastest chunk count
    (solver.interleave). The plan bounds the search and is its answer where nothing faster exists,
    but its pipelines do not join the search's templates (its solver block says `bound_only`):
    deep templates make the master slow (llama2-70b on 987 GPUs with chunks: 41 s to a time limit
    against 14-19 s proven)."""
    if not block_uniform(profile):
        return None
    cm = CostModel(profile, cluster, recompute=recompute)
    L = profile.model.num_layers
    pricing = {inter: sync_pricing(cm, inter) for inter in (False, True)}
    tables = {mbs: {t: stage_table(cm, t, mbs) for t in tp_degrees(profile, cluster)} for mbs in sizes}
    grids = []  # (a bound on its step time, micro-batch size, TP, PP, DP) of every grid
    for mbs, by_tp in tables.items():
        N = gbs // mbs
        for tp, table in by_tp.items():
            groups = len(_tp_groups(cluster, tp))
            work = sum(table.time_s[i][i + 1] for i in range(L))  # a micro-batch through every layer
            for pp in range(1, min(groups, L) + 1):
                most = min(groups // pp, N // pp)
                if most == 0:
                    break
                # as many pipelines as the groups hold, and for each micro-batch count per pipeline
                # the fewest that give it (less to synchronise): a smaller cluster's grid is here
                for dp in range(1, most + 1):
                    if dp == most or dp == 1 or math.ceil(N / (dp - 1)) != math.ceil(N / dp):
                        # no pipeline is faster than its stages' equal share of the work, no bubble
                        grids.append((math.ceil(N / dp) * work / pp, mbs, tp, pp, dp))
    best = None
    for bound, mbs, tp, pp, dp in sorted(grids):
        if best is not None and bound >= best[0]:
            break
        N, groups = gbs // mbs, _tp_groups(cluster, tp)
        found = _grid_templates(splitter_of(tables[mbs], L), groups, tp, pp, dp)
        if found is None:
            continue
        kinds, of_pipeline = found
        inter = groups[0][0] != groups[dp * pp - 1][0]
        if interleave:
            m = math.ceil(N / dp)  # some pipeline takes at least this many micro-batches
            # no faster than its kinds' fastest variant before the memory check and sync, which are
            # the costly parts: a grid that cannot win even so is not interleaved (llama2-70b on
            # 987 GPUs: 65 grids of 445 in mode none, and 0.43x the time over the three modes)
            least = min(least_time_s(t, tables[mbs], m) for t in kinds)
            if best is not None and least + max(t.optimizer_s for t in kinds) >= best[0]:
                continue
            kinds = [_fastest_variant(t, tables[mbs], m, dp, pricing[inter]) for t in kinds]
        copies = [of_pipeline.count(i) for i in range(len(kinds))]
        cost = _copies_cost_s(kinds, copies, N, pricing[inter])
        if cost is not None and (best is None or cost < best[0]):
            best = (cost, mbs, tp, [kinds[i] for i in of_pipeline])
    if best is None:
        return None
    cost, mbs, tp, pipes = best
    groups, pp = _tp_groups(cluster, tp), len(pipes[0].stages)
    placed = []
    for j, t in enumerate(pipes):
        layers = chunk_ranges(t.stages, t.chunks) if t.chunks > 1 else [(s, e) for s, e, _ in t.stages]
        placed.append([(chunks, tp, *groups[j * pp + i]) for i, chunks in enumerate(layers)])
    plan = _plan(cm, cluster, gbs, mbs, placed, balance(pipes, gbs // mbs), [t.split_backward for t in pipes])
    return cost, dataclasses.replace(plan, solver={"method": "deep-grid", "bound_only": True})


def _fastest_variant(
    template: Template, tables: dict[int, StageTable], m: int, copies: int, pricing
) -> Template:
    """`template`, or its interleaved variant fastest at `m` micro-batches among `copies` pipelines
    (with the gradient sync each leaves exposed) where that is faster."""

    def cost(t: Template) -> float:
        return t.time_s(m) + pricing(copies, t).exposed_s(t.hide_s)

    variant = fastest_variant(template, tables, m, lambda t: cost(t) - t.time_s(m))
    return template if variant is None or cost(template) <= cost(variant) else variant


def _grid_templates(
    splitter: Splitter, groups: list[tuple[int, int]], tp: int, pp: int, dp: int
) -> tuple[list[Template], list[int]] | None:
    """The distinct templates of the `dp` pipelines of `pp` consecutive TP groups (pipelines differ
    only in where their node changes fall) and each pipeline's, by index; None where one does not
    fit in memory."""
    index: dict[tuple[int, ...], int] = {}
    kinds: list[Template] = []
    of_pipeline: list[int] = []
    for j in range(dp):
        member = groups[j * pp : (j + 1) * pp]
        runs = tuple(itertools.accumulate((a[0] != b[0] for a, b in pairwise(member)), initial=0))
        if runs not in index:
            split = splitter.templates((tp,) * pp, runs)
            if not split:
                return None
            index[runs] = len(kinds)
            kinds.append(split[0])
        of_pipeline.append(index[runs])
    return kinds, of_pipeline


def _copies_cost_s(kinds: list[Template], copies: list[int], N: int, pricing) -> float | None:
    """A plan's step time as the master prices it (`plan_cost_s`) where `copies[i]` pipelines are
    of template `kinds[i]`: the micro-batches dealt as `balance` deals them (each to the copy that
    stays fastest with it; copies of one template take them in turn), None when N is too few."""
    base = [t.num_stages for t in kinds]  # every copy of kind i holds base[i] or base[i] + 1
    ahead = [0] * len(kinds)  # copies of kind i holding base[i] + 1
    left = N - sum(b * k for b, k in zip(base, copies, strict=True))
    if left < 0:
        return None
    heap = [(t.time_s(b + 1), i) for i, (t, b) in enumerate(zip(kinds, base, strict=True))]
    heapq.heapify(heap)
    while left:  # the copies of the kind that stays fastest, all at once: none of them is slower
        _, i = heapq.heappop(heap)
        given = min(copies[i] - ahead[i], left)
        ahead[i], left = ahead[i] + given, left - given
        if ahead[i] == copies[i]:
            base[i], ahead[i] = base[i] + 1, 0
        heapq.heappush(heap, (kinds[i].time_s(base[i] + 1), i))
    slowest = max(t.time_s(b + (1 if a else 0)) for t, b, a in zip(kinds, base, ahead, strict=True))
    pipelines = sum(copies)
    exposed = plan_sync_s([(pricing(pipelines, t), t.hide_s) for t in kinds])
    return slowest + exposed + max(t.optimizer_s for t in kinds)


def grid_misfit(
    profile: ModelProfile,
    cluster: ClusterSpec,
    gbs: int,
    sizes: Sequence[int],
    grid: Grid,
    recompute: str,
    sharding: str,
) -> str:
    """Why no plan of a pinned grid exists, in one sentence: no grid of it is buildable on the
    cluster and batch, or the one that needs least memory (smallest micro-batch, most pipelines)
    does not fit, naming its fullest device."""
    candidates = sorted(grid_candidates(profile, cluster, gbs, sizes, grid), key=lambda c: (c.mbs, -c.dp))
    where = f"{profile.model.name} on cluster {cluster.short_form()}"
    if not candidates:
        return (
            f"No {grid.describe()} grid of {where} exists at global batch {gbs}: it needs TP groups "
            "inside nodes, enough of them for every stage, at most one virtual stage per block, and "
            "at least as many micro-batches per pipeline as stages."
        )
    cm = CostModel(profile, cluster, recompute=recompute, optimizer=OptimizerLayout(sharding=sharding))
    c = candidates[0]
    estimate = CostModel(profile, cluster).estimate(grid_plan(cm, cluster, gbs, c, grid.chunks))
    worst = max(estimate.stages, key=lambda s: s.peak_memory_bytes)
    gib = 1 << 30
    return (
        f"The {grid.describe()} grid of {where} does not fit even at micro-batch {c.mbs} with {c.dp} "
        f"pipelines, recompute {recompute}, optimizer {sharding}: {worst.devices[0]} (stage {worst.stage}) "
        f"needs {worst.peak_memory_bytes / gib:.1f} GiB of the {estimate.usable_memory_bytes / gib:.1f} GiB "
        f"usable per {cluster.device.kind}."
    )


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
    return cost, _plan(cm, cluster, gbs, mbs, [[((s, e), *rest) for s, e, *rest in p] for p in pipes], counts)


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

    max_microbatches = 0  # 1F1B: any count

    def __init__(self, tables, stages):
        self.num_stages = len(stages)
        self._zero = _pipeline_time(tables, stages, 1)
        self._step = max(tables[tp].time_s[s][e] for s, e, tp, _, _ in stages)

    def time_s(self, m: int) -> float:
        return self._zero + (m - 1) * self._step


def _balance_placed(tables, pipes, N: int) -> list[int] | None:
    return balance([_Line(tables, p) for p in pipes], N) if pipes else None

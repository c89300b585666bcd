"""A slow, obviously correct planner: enumerate every plan of the search space, score each, keep the best.

The search space (the solver's module docstring): any number of pipelines on disjoint healthy GPUs;
each pipeline any number of stages with contiguous layer ranges covering the model; each stage one
TP degree (dividing the heads and kv heads, profiled, at most a node) on one node; an integer number
of micro-batches per pipeline, at least its number of stages, summing to the global batch over the
micro-batch size; GPUs may stay idle. Nothing is pruned: every pipeline is listed, every multiset of
pipelines that fits the nodes, every split of the micro-batches.

Scoring uses the cost model's own pieces exactly as `CostModel.estimate` combines them (slowest
pipeline + the plan's exposed gradient sync + slowest optimizer step, every stage's
memory within the usable memory); the best plan is then built and `CostModel.estimate` must agree
with its score.

Which GPUs of a node a stage gets does not matter to the cost model (it compares node names only), so
a stage is listed by its node and the plan takes the node's GPUs in order.

Stages are sequence parallel wherever they can be, as the solver builds them; recomputation and the
optimizer layout are enumerated as the solver defines its space: every pipeline in each recompute
mode (all its stages in it; pipelines of one plan may differ), once per pass of
`solver.sharding_passes` (ZeRO-1 plans of at least 2, 4, ... pipelines, each stage's memory with its
state sharded that far), each best plan relaxed stage by stage (`solver.relax_recompute`), the
fastest relaxed plan kept.
"""

import functools
import math
from dataclasses import dataclass

from costmodel import ClusterSpec, Pipeline, Plan
from costmodel.estimate import CostModel, buckets_of, hide_window_s, in_flight, pipeline_time_s, plan_sync_s
from costmodel.plan import SHARDING
from costmodel.profile import ModelProfile
from solver import RECOMPUTE_PASSES, relax_recompute, sharding_passes


@dataclass(frozen=True)
class Candidate:
    stages: tuple[tuple[int, int, int, int], ...]  # (start, end, tp, node index)
    usage: tuple[int, ...]  # GPUs per node
    times: dict  # m -> pipeline time
    costs: tuple  # StageCost per stage
    recompute: str  # every stage's mode
    hide_s: float  # how much of its gradient reduction its backward hides
    last_params: int  # what its backward produces last: the first stage's first layer


def pipelines(cm: CostModel, capacities: list[int], tps: list[int], mbs: int, max_m: int) -> list[Candidate]:
    """Every pipeline whose stages fit in memory and whose GPUs fit on the nodes."""
    L = cm.model.num_layers
    out = []

    def extend(start: int, stages: list, usage: list[int]) -> None:
        if start == L:
            out.append(_score(cm, tuple(stages), tuple(usage), mbs, max_m))
            return
        for end in range(start + 1, L + 1):
            for tp in tps:
                for node, free in enumerate(capacities):
                    if usage[node] + tp <= free:
                        usage[node] += tp
                        extend(end, [*stages, (start, end, tp, node)], usage)
                        usage[node] -= tp

    extend(0, [], [0] * len(capacities))
    return [c for c in out if c is not None]


def _score(cm: CostModel, stages, usage, mbs: int, max_m: int) -> Candidate | None:
    p = len(stages)
    costs = tuple(cm.planned(s, e, tp, mbs) for s, e, tp, _ in stages)
    for i, c in enumerate(costs):  # memory with p - i micro-batches in flight (any m >= p)
        if sum(c.memory_bytes(in_flight(i, p, p)).values()) > cm.usable_memory_bytes:
            return None
    p2p = [
        cm.exchange_s(
            costs[i], costs[i + 1].tp, costs[i + 1].sequence_parallel, stages[i][3] != stages[i + 1][3]
        )
        for i in range(p - 1)
    ]
    times = {
        m: pipeline_time_s([c.fwd_s for c in costs], [c.bwd_s for c in costs], p2p, m)
        for m in range(p, max_m + 1)
    }
    buckets = [buckets_of(c.param_count, cm.optimizer.bucket_bytes) for c in costs]
    hide = hide_window_s([c.bwd_s for c in costs], p2p, buckets)
    first = cm.planned(0, 1, stages[0][2], mbs).param_count
    return Candidate(stages, usage, times, costs, cm.recompute, hide, first)


def best_plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    micro_batch_sizes: list[int],
    mix_modes: bool = True,
) -> tuple[float, Plan | None]:
    """The fastest plan of the whole search space, by enumeration: (step time, plan). Without
    `mix_modes`, every pipeline of a plan takes the same recompute mode (before the relaxation)."""
    best: tuple[float, Plan | None] = (math.inf, None)
    sizes = [b for b in micro_batch_sizes if global_batch_size % b == 0]
    groups = [RECOMPUTE_PASSES] if mix_modes else [(r,) for r in RECOMPUTE_PASSES]
    modes = [
        mode
        for group in groups
        for mode in sharding_passes(profile, cluster, global_batch_size, sizes, group, "elastor", SHARDING)
    ]
    for mode in modes:
        models = [mode.cost_model(profile, cluster, r) for r in mode.modes]
        score, plan = _best_plan_in(models, cluster, global_batch_size, micro_batch_sizes)
        if plan is not None:
            plan = relax_recompute(CostModel(profile, cluster), plan)
            score = CostModel(profile, cluster).estimate(plan).step_time_s
        if score < best[0]:
            best = (score, plan)
    return best


def _best_plan_in(
    models: list[CostModel], cluster: ClusterSpec, global_batch_size: int, micro_batch_sizes: list[int]
):
    """The fastest plan whose pipelines each take one of the models' recompute modes."""
    cm = models[-1]  # gradient sync, the optimizer layout and the replicas: the same in every mode
    profile = cm.profile
    model = profile.model
    capacities = [len(n.gpus) for n in cluster.nodes]
    tps = [
        t
        for t in profile.tp_degrees()
        if model.num_heads % t == 0 and model.num_kv_heads % t == 0 and t <= max(capacities)
    ]
    best: tuple[float, Plan | None] = (math.inf, None)
    for mbs in micro_batch_sizes:
        if global_batch_size % mbs:
            continue
        N = global_batch_size // mbs
        cands = [c for model in models for c in pipelines(model, capacities, tps, mbs, N)]
        score, chosen, counts = _best_multiset(cm, cands, capacities, N)
        if score < best[0]:
            best = (score, _plan(cm, cluster, global_batch_size, mbs, chosen, counts))
    return best


def _best_multiset(cm: CostModel, cands: list[Candidate], capacities: list[int], N: int):
    """Every multiset of candidate pipelines that fits the nodes, each with its best split.

    Candidates are listed by their GPUs per node, so a run of candidates that does not fit is passed
    over at once (`past[i]`: the first index after i's run)."""
    best: tuple = (math.inf, None, None)
    cands = sorted(cands, key=lambda c: c.usage)
    past = [0] * len(cands)
    for i in reversed(range(len(cands))):
        same = i + 1 < len(cands) and cands[i + 1].usage == cands[i].usage
        past[i] = past[i + 1] if same else i + 1

    def choose(first: int, chosen: list[Candidate], usage: list[int]) -> None:
        nonlocal best
        if len(chosen) >= cm.replicas:  # a ZeRO-1 pass's memory holds with that many pipelines
            score, counts = _best_split(cm, chosen, N)
            if score < best[0]:
                best = (score, chosen, counts)
        i = first
        while i < len(cands):
            c = cands[i]
            if all(u + x <= cap for u, x, cap in zip(usage, c.usage, capacities, strict=True)):
                choose(i, [*chosen, c], [u + x for u, x in zip(usage, c.usage, strict=True)])
                i += 1
            else:
                i = past[i]

    choose(0, [], [0] * len(capacities))
    return best


@functools.lru_cache(maxsize=1 << 16)
def _sync(cm: CostModel, params: int, num_pipelines: int, multi_node: bool, last_params: int):
    """`CostModel.sync` in the model's optimizer layout (the same few arguments recur in every split)."""
    layout = cm.optimizer
    return cm.sync(
        params,
        num_pipelines,
        multi_node,
        last_params=last_params,
        sharding=layout.sharding,
        bucket_bytes=layout.bucket_bytes,
    )


def _best_split(cm: CostModel, chosen: list[Candidate], N: int) -> tuple[float, list[int] | None]:
    """Try every split of N micro-batches (each pipeline at least its stage count)."""
    P = len(chosen)
    nodes = {node for c in chosen for *_, node in c.stages}
    multi_node = len(nodes) > 1
    priced = [
        (_sync(cm, max(cost.param_count for cost in c.costs), P, multi_node, c.last_params), c.hide_s)
        for c in chosen
    ]
    sync = plan_sync_s(priced)
    optimizer = max(cost.optimizer_s for c in chosen for cost in c.costs)
    best: tuple[float, list[int] | None] = (math.inf, None)

    def split(j: int, left: int, counts: list[int], slowest: float) -> None:
        nonlocal best
        if j == P - 1:
            if left in chosen[j].times:
                score = max(slowest, chosen[j].times[left]) + sync + optimizer
                if score < best[0]:
                    best = (score, [*counts, left])
            return
        for m in chosen[j].times:
            if m <= left:
                split(j + 1, left - m, [*counts, m], max(slowest, chosen[j].times[m]))

    split(0, N, [], 0.0)
    return best


def _plan(cm: CostModel, cluster, global_batch_size, mbs, chosen: list[Candidate], counts: list[int]) -> Plan:
    taken = [0] * len(cluster.nodes)
    pipes = []
    for c, m in zip(chosen, counts, strict=True):
        stages = []
        for start, end, tp, node in c.stages:
            name, gpus = cluster.nodes[node].name, cluster.nodes[node].gpus[taken[node] : taken[node] + tp]
            taken[node] += tp
            stages.append(cm.planned_stage((start, end), tuple(f"{name}:{g}" for g in gpus), c.recompute))
        pipes.append(Pipeline(num_microbatches=m, stages=tuple(stages)))
    return Plan(
        model=cm.profile.model,
        global_batch_size=global_batch_size,
        micro_batch_size=mbs,
        seq_len=cm.profile.seq_len,
        dtype=cm.profile.dtype,
        optimizer=cm.optimizer,
        pipelines=tuple(pipes),
    )

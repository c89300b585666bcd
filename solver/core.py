"""Elastor's method: templates (solver.templates, solver.skeletons) and the CP-SAT master
(solver.master), per micro-batch size and link scope, keeping the cheapest plan.

Which templates: the exact program over the whole search space when the instance is small (at most
EXACT_GPUS GPUs and EXACT_LAYERS layers); beyond, the skeleton family for models whose blocks are
identical, else the exact program for pipelines of at most one node's GPUs. The plan's solver block
says which ("complete", "family").

Link scope: the cost model synchronises gradients over inter-node links whenever the plan spans more
than one node. The solver therefore solves two problems and keeps the better: plans on one node (the
largest; intra-node links everywhere), and plans on all nodes priced with inter-node links (a plan of
this kind that happens to use one node is only over-priced, and the first problem covers it).

Two processes: where the templates are skeletal and solver.parallel allows a second process, the
sub-problems of the larger half of the micro-batch sizes run in a forked child while this process
solves the others, and their answers are merged in order (`_fork_jobs`): the same plan and proof
as one process (tests/test_solver.py), in 0.71x-0.90x the time of Elastor's solve on the solver
benchmark's 7B and 61-GPU cases (its 987-GPU case and sweep mostly end the larger sizes at a bound).
The child first works out the plans that seed the search (`search`'s `more_seeds`: Elastor's
baselines) while this process builds its templates, which do not depend on them in the skeleton
family: 0.88x-0.95x on llama2-7b on 8,8,8,7 with and without chunks, the same plans.
"""

import dataclasses
import functools
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from costmodel import ClusterSpec, Pipeline, Plan
from costmodel.cluster import parse_device
from costmodel.estimate import CostModel, HideTerms, SyncCost, steady_period_s
from costmodel.plan import OptimizerLayout
from costmodel.profile import ModelProfile
from solver import parallel
from solver.interleave import offers
from solver.master import MasterResult, lower_bound, solve_master
from solver.memo import IdentityMemo
from solver.parallel import Forked
from solver.placement import place
from solver.skeletons import block_uniform, generate_skeletal, most_runs
from solver.stages import StageTable, exchanges_s, stage_table, sync_terms
from solver.templates import Template, fewest_gpus, generate, prune

# The exact, complete template program runs when the instance is this small (tests/test_solver_*.py);
# beyond it, the searched family is bounded (Limits) and the plan says so ("complete": false).
EXACT_GPUS = 8
EXACT_LAYERS = 12

RECOMPUTE_PASSES = ("none", "selective", "full")  # each stage's activation recomputation, lightest first

# Skeletal templates, across searches (solver.memo), by stage tables, layers, node classes and scope.
_SKELETAL: IdentityMemo[list[Template]] = IdentityMemo(limit=32)


@dataclass(frozen=True)
class Limits:
    """Bounds on the template search; the defaults enumerate the whole search space."""

    max_gpus: int | None = None  # per pipeline, in the exact program
    max_runs: int | None = None  # node runs per pipeline, in the exact program
    max_stages: int | None = None  # per pipeline, in the exact program
    skeletal: bool = False  # solver.skeletons' family instead of the exact program

    @property
    def complete(self) -> bool:
        return (self.max_gpus, self.max_runs, self.max_stages, self.skeletal) == (None, None, None, False)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, False)}


@dataclass(frozen=True)
class Outcome:
    """The best plan found and what is proven about it."""

    plan: Plan | None
    objective_s: float
    bound_s: float  # no plan of the searched space is faster
    proven: bool  # every sub-problem solved to optimality (or shown not to beat the plan)
    num_templates: int
    limits: Limits  # the space searched: complete, or the family it was bounded to
    # the forked child still running the search's `idle` work (its caller takes `idle_answer()` or
    # stops it with `close()`); None where no child took it up
    idle: "_Ahead | None" = None
    seeded: tuple[tuple[float, Plan], ...] = ()  # the (step time, plan) pairs of `search`'s more_seeds


def tp_degrees(profile: ModelProfile, cluster: ClusterSpec) -> list[int]:
    """TP degrees the profile measured that divide the heads and kv heads and fit on a node."""
    model = profile.model
    largest = max(len(n.gpus) for n in cluster.nodes)
    return [
        t
        for t in profile.tp_degrees()
        if model.num_heads % t == 0 and model.num_kv_heads % t == 0 and t <= largest
    ]


def usable_micro_batch_sizes(
    profile: ModelProfile, global_batch_size: int, wanted: Sequence[int] | None
) -> list[int]:
    """The wanted (default: all profiled) micro-batch sizes that were profiled and divide the batch."""
    sizes = profile.micro_batch_sizes() if wanted is None else sorted(set(wanted))
    return [b for b in sizes if global_batch_size % b == 0 and b in profile.micro_batch_sizes()]


def sync(cm: CostModel, inter_node: bool) -> Callable[[int, Template], SyncCost]:
    """The gradient sync of a pipeline of template t in a plan of P pipelines (`CostModel.sync` of
    its widest stage W and first layer L, in the planned optimizer layout); with the template's
    window H, `costmodel.estimate.plan_sync_s` prices a plan. `.key(t)`: templates of one key
    sync alike (the master asks once per key)."""

    @functools.cache
    def priced(num_pipelines: int, params: int, last_params: int, terms: HideTerms) -> SyncCost:
        if terms and num_pipelines > 1:  # chunk terms only raise the floor: price the rest once
            return priced(num_pipelines, params, last_params, ()).with_partial(terms)
        return pipeline_sync(cm, inter_node, num_pipelines, params, last_params, terms)

    def key(template: Template) -> tuple:
        # the sizes it depends on: templates share them (and hashing a template is slow)
        return template.max_params, template.last_params, template.hide_terms

    def cost(num_pipelines: int, template: Template) -> SyncCost:
        return priced(num_pipelines, *key(template))

    cost.key = key
    return cost


def pipeline_sync(
    cm: CostModel,
    inter_node: bool,
    num_pipelines: int,
    params: int,
    last_params: int,
    terms: HideTerms = (),
) -> SyncCost:
    """`CostModel.sync` in the planned optimizer layout (`terms`: an interleaved pipeline's)."""
    layout = cm.optimizer
    return cm.sync(
        params,
        num_pipelines,
        inter_node,
        last_params=last_params,
        sharding=layout.sharding,
        bucket_bytes=layout.bucket_bytes,
        partial=terms,
    )


def plan_limits(profile: ModelProfile, capacities: Sequence[int]) -> Limits:
    """No limits (the exact, complete search) when the instance is small enough for it; beyond, the
    skeleton family for models with identical blocks, else the exact program for pipelines of at
    most a node's GPUs (in at most two runs when the model is deep)."""
    if sum(capacities) <= EXACT_GPUS and profile.model.num_layers <= EXACT_LAYERS:
        return Limits()
    if block_uniform(profile):
        return Limits(skeletal=True)
    runs = 2 if profile.model.num_layers > EXACT_LAYERS else None
    return Limits(max_gpus=max(capacities), max_runs=runs)


def candidates(
    tables: dict[int, StageTable],
    profile: ModelProfile,
    capacities: Sequence[int],
    single_node: bool,
    limits: Limits,
    incumbent: float,
    seeded: Sequence[Template] = (),
    lighter: dict[int, StageTable] | None = None,
) -> list[Template]:
    """Templates of the searched space: skeletons (models with identical blocks) or the exact program
    within `limits`, plus the `seeded` pipelines of other methods' plans. `lighter`: the stage
    tables of the next lighter recompute mode of the search, whose twins of a skeleton's splits
    make the splits that fit there needless in this mode (`solver.skeletons.Splitter.templates`)."""
    L = profile.model.num_layers
    found = list(seeded)
    if limits.skeletal and block_uniform(profile):
        # pruned before the seeds join: pruning the whole again gives the same templates
        found += skeletal_templates(tables, L, capacities, single_node, lighter)
    else:
        found += generate(
            tables,
            L,
            capacities,
            single_node=single_node,
            max_gpus=limits.max_gpus,
            max_runs=limits.max_runs,
            max_stages=limits.max_stages,
            time_bound_s=incumbent,
        )
    return prune(found)


def skeletal_templates(
    tables: dict[int, StageTable],
    num_layers: int,
    capacities: Sequence[int],
    single_node: bool,
    lighter: dict[int, StageTable] | None = None,
) -> list[Template]:
    """The skeleton family's templates (pruned), with runs enough for twice the smallest pipeline
    (at least two). A skeleton of R runs uses at most R nodes, so whether it fits depends only on the
    node classes and up to R nodes of each: clusters that differ beyond that share the templates
    (`_SKELETAL`)."""
    smallest = fewest_gpus(tables, num_layers, sum(capacities))
    runs = max(2, math.ceil(2 * smallest / max(capacities)))
    most = most_runs(runs)
    classes = tuple(
        c for c, n in sorted(Counter(capacities).items(), reverse=True) for _ in range(min(n, most))
    )
    ordered = tuple(tables[t] for t in sorted(tables))
    easier = tuple(lighter[t] for t in sorted(lighter)) if lighter is not None else ()
    key = (num_layers, classes, single_node, runs, len(easier))
    return list(
        _SKELETAL.get(
            ordered + easier,
            key,
            lambda: prune(
                generate_skeletal(
                    tables, num_layers, classes, single_node=single_node, max_runs=runs, lighter=lighter
                )
            ),
        )
    )


def work_bound(tables: dict[int, StageTable], num_layers: int, num_microbatches: int, gpus: int) -> float:
    """A lower bound on the step time before any template is built.

    A pipeline of G GPUs takes A + (m - 1) M with A >= lat (one micro-batch through every layer at
    its fastest TP degree) and G M >= E (a micro-batch's GPU-seconds, each layer at its cheapest
    degree). So tau * sum G >= sum_pipelines G T >= lat sum G + (N - P) E, and with P <= the pipelines
    that fit (each needs the fewest GPUs any pipeline needs): tau >= lat + (N - P_max) E / GPUs.
    """
    layers = range(num_layers)
    lat = sum(min(tab.time_s[i][i + 1] for tab in tables.values()) for i in layers)
    work = sum(min(t * tab.time_s[i][i + 1] for t, tab in tables.items()) for i in layers)
    most = min(num_microbatches, gpus // max(1, fewest_gpus(tables, num_layers, gpus)))
    return lat + max(0, num_microbatches - most) * work / gpus


def template_of(pipe: Pipeline, tables: dict[int, StageTable]) -> Template:
    """The template of a pipeline of a plan: runs are its stages' stretches on one node."""
    stages = tuple((*st.layers, st.tp_degree) for st in pipe.stages)
    nodes = [parse_device(st.devices[0])[0] for st in pipe.stages]
    runs = tuple(itertools.accumulate((a != b for a, b in itertools.pairwise(nodes)), initial=0))
    time = [tables[tp].time_s[s][e] for s, e, tp in stages]
    p2p = exchanges_s(tables, stages, runs)
    return Template(
        stages,
        runs,
        sum(time) + 2 * sum(p2p),
        steady_period_s(time, p2p),
        max(tables[tp].params[s][e] for s, e, tp in stages),
        max(tables[tp].optimizer_s[s][e] for s, e, tp in stages),
        *sync_terms(tables, stages, runs),
    )


@dataclass(frozen=True)
class Pass:
    """One search of the solver: every stage of a pipeline in one recompute mode, `recompute` or one
    of `lighter` (pipelines of one plan may differ), the optimizer layout `sharding`, and under
    ZeRO-1 plans of at least `replicas` pipelines (each stage's state sharded that far)."""

    recompute: str = "none"
    sharding: str = "none"
    replicas: int = 1
    interleave: bool = False  # also search interleaved 1F1B (solver.interleave; block-uniform models)
    lighter: tuple[str, ...] = ()  # further recompute modes the pipelines may take, lightest first

    @property
    def modes(self) -> tuple[str, ...]:
        """The recompute modes searched, lightest first."""
        return (*self.lighter, self.recompute)

    def cost_model(
        self, profile: ModelProfile, cluster: ClusterSpec, recompute: str | None = None
    ) -> CostModel:
        """The cost model of the pass, its stages in `recompute` (default: the pass's heaviest mode)."""
        layout = OptimizerLayout(sharding=self.sharding)
        return CostModel(
            profile, cluster, recompute=recompute or self.recompute, optimizer=layout, replicas=self.replicas
        )

    @property
    def name(self) -> str:
        modes = "+".join(self.modes)
        return modes if self.sharding == "none" else f"{modes} {self.sharding}x{self.replicas}"


@dataclass(frozen=True)
class _JobAnswer:
    """What one sub-problem (micro-batch size, link scope) of a search found."""

    num_templates: int
    bound: float | None  # no plan of the sub-problem is faster (None: it has no template)
    closed: bool  # the master proved its answer (or that nothing beats the incumbent)
    result: MasterResult | None
    solved: bool  # the master ran (else the templates' lower bound settled it)


class _Ahead:
    """What a forked child (solver.parallel) works out for a search, in the order it sends it:
    `seeds()`, the seeds it computed first (`search`'s `more_seeds`); `take(job)`, the answer of
    one of its sub-problems (None for a job it did not answer, or where it died: the caller then
    solves it); `idle_answer()`, what it did after them (`search`'s `idle`)."""

    def __init__(self, child: Forked, jobs: list, seeded: bool):
        self._child = child
        self._jobs = set(jobs)
        self._seeds_due = seeded  # the child sends seeds first
        self._seeds: list | None = None
        self._answers: dict | None = None  # not received yet

    def seeds(self) -> list | None:
        """The seeds the child computed (None where it failed or computes none)."""
        if self._seeds_due:
            self._seeds_due = False
            self._seeds = self._child.result()
        return self._seeds

    def owns(self, job) -> bool:
        """Whether `job` is one of the child's sub-problems."""
        return job in self._jobs

    def take(self, job) -> "_JobAnswer | None":
        if job not in self._jobs:
            return None
        self._receive()
        return self._answers.pop(job, None)

    def idle_answer(self):
        self._receive()
        return self._child.result()

    def close(self) -> None:
        """Stop the child if it still runs (a bound settled its jobs, its idle work is not needed,
        or an error)."""
        self._child.cancel()

    def _receive(self) -> None:
        if self._answers is None:
            self.seeds()
            self._answers = self._child.result() or {}


class _Pending:
    """The seeds `search`'s `more_seeds()` gives, (step time, plan) pairs, worked out on first need:
    by the forked child, which sends them before anything else (`_Ahead.seeds`), or here."""

    def __init__(self, more_seeds: Callable[[], list[tuple[float, Plan]]] | None):
        self._more = more_seeds
        self._pairs = None if more_seeds is not None else []
        self.child: _Ahead | None = None  # the search's forked child, once it has one

    def work_out(self) -> list[tuple[float, Plan]]:
        """Work them out in this process (the child's first step, `_fork_jobs`)."""
        self._pairs = self._more()
        return self._pairs

    def pairs(self) -> list[tuple[float, Plan]]:
        if self._pairs is None:
            sent = self.child.seeds() if self.child is not None else None
            self._pairs = sent if sent is not None else self._more()
        return self._pairs

    def least(self) -> float:
        """The least step time among them, inf before they are known."""
        return min((cost for cost, _ in self._pairs or ()), default=math.inf)


def _fork_jobs(
    jobs,
    limits: Limits,
    upper_bound_s: float,
    quick_bound,
    solve_job,
    deadline: float,
    idle=None,
    more_seeds: Callable[[], list[tuple[float, Plan]]] | None = None,
):
    """Where two processes may run (solver.parallel) and the templates are skeletal (they do not
    depend on the incumbent), the sub-problems of the larger half of the micro-batch sizes, solved
    in a forked child below `upper_bound_s` while the caller solves the rest; else None. The
    caller merges them in order, so the answer is the one-process search's (a child's master,
    bounded less tightly, finds the same optimum or proves the same bound). With `more_seeds`,
    the child first computes those seeds and sends them (they bound its sub-problems too, and
    it leaves out those they settle); with `idle`, it then runs `idle(bound)`, the bound being
    the least of `upper_bound_s`, the seeds' and its own answers."""
    sizes = sorted({mbs for mbs, _ in jobs})
    later = [job for job in jobs if job[0] in sizes[(len(sizes) + 1) // 2 :]]
    later = [job for job in later if quick_bound(*job) < upper_bound_s]
    if not later or not limits.skeletal or parallel.processes() < 2:
        return None

    incumbent = upper_bound_s  # the child's, as it learns of plans

    def work(seeds: list[tuple[float, Plan]] = ()) -> dict:
        nonlocal incumbent
        incumbent = min([incumbent, *(cost for cost, _ in seeds)])
        answers = {}
        for job in later:
            if quick_bound(*job) >= incumbent:
                continue  # so does the caller's own check, and it keeps that bound
            answers[job] = answer = solve_job(*job, incumbent, deadline)
            if answer.result is not None:
                incumbent = min(incumbent, answer.result.objective_s)
        return answers

    def then(_answers: dict):
        return idle(incumbent)

    steps = [more_seeds, work] if more_seeds is not None else [work]
    return _Ahead(Forked(*steps, *([then] if idle is not None else [])), later, more_seeds is not None)


def search(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    *,
    micro_batch_sizes: Sequence[int],
    time_limit_s: float,
    limits: Limits | None = None,
    upper_bound_s: float = math.inf,
    seeds: Sequence[Plan] = (),
    mode: Pass | None = None,
    progress: Callable[[str], None] | None = None,
    idle: Callable[[float], object] | None = None,
    more_seeds: Callable[[], list[tuple[float, Plan]]] | None = None,
) -> Outcome:
    """Solve every (micro-batch size, link scope) sub-problem; keep the cheapest plan. `progress`
    receives a line after each sub-problem solved (its time, proof, and the best plan so far).
    `idle(bound)`: work for the forked child once its sub-problems are answered (`_fork_jobs`),
    which the Outcome hands on (`Outcome.idle`) where a child took it up.

    The pipelines of `seeds` (plans of other methods) join the templates of their micro-batch size,
    so a bounded search never returns a plan slower than any of them. `more_seeds()` gives more,
    (step time, plan) pairs whose best also bounds the search: where a child is forked it works
    them out first while this process builds its templates, which wait for them only to join
    them (`_fork_jobs`); the Outcome gives them back (`Outcome.seeded`).
    """
    started = time.perf_counter()
    mode = mode or Pass()
    models = {r: mode.cost_model(profile, cluster, r) for r in mode.modes}
    cm = models[mode.recompute]  # gradient sync and the optimizer layout: the same in every mode
    tps = tp_degrees(profile, cluster)
    capacities = [len(n.gpus) for n in cluster.nodes if n.gpus]
    limits = limits or plan_limits(profile, capacities)
    scopes = [True, False] if len(capacities) > 1 else [False]  # inter-node links?
    jobs = [(b, s) for b in micro_batch_sizes if global_batch_size % b == 0 for s in scopes]
    L, N_of = profile.model.num_layers, lambda mbs: global_batch_size // mbs
    # micro-batch size -> mode -> TP (all built here: a forked job must share them, not rebuild them)
    tables_for = {
        mbs: {r: {t: stage_table(models[r], t, mbs) for t in tps} for r in mode.modes} for mbs, _ in jobs
    }

    def nodes_of(inter: bool) -> list[int]:
        return capacities if inter else [max(capacities)]

    def quick_bound(mbs: int, inter: bool) -> float:
        """Not even perfect scaling of the work is faster (`work_bound`, no template built)."""
        nodes = nodes_of(inter)
        return min(work_bound(tables_for[mbs][r], L, N_of(mbs), sum(nodes)) for r in mode.modes)

    # Templates of the skeleton family do not depend on the seeds: the seeds join them once built,
    # so that a forked child can work the pending seeds out meanwhile (`_fork_jobs`).
    uniform = block_uniform(profile)
    deferred = limits.skeletal and uniform
    interleaved = mode.interleave and uniform
    pending = _Pending(more_seeds)

    def seed_templates(mbs: int, inter: bool) -> dict[str, list[Template]]:
        """The seeds' pipelines of micro-batch size `mbs` as templates, by recompute mode."""
        seeded, more = {r: [] for r in mode.modes}, pending.pairs()
        for plan in [*(plan for _, plan in more), *seeds] if inter else ():
            if (plan.solver or {}).get("bound_only"):
                continue  # it bounds the search (solver._seeded_search), its pipelines stay out
            for p in plan.pipelines if plan.micro_batch_size == mbs else ():
                r = max((st.recompute for st in p.stages), key=RECOMPUTE_PASSES.index)
                if p.num_chunks == 1 and r in seeded:  # an interleaved pipeline is a variant of its own
                    seeded[r].append(template_of(p, tables_for[mbs][r]))
        return seeded

    def solve_job(mbs: int, inter: bool, incumbent: float, deadline_s: float) -> _JobAnswer:
        """The templates and master of one sub-problem, looking for plans below `incumbent`."""
        tables, nodes = tables_for[mbs], nodes_of(inter)

        def offered(found: list[Template], r: str) -> list[list[Template]]:
            """Each template with its interleaved variants (solver.interleave.offers)."""
            if not interleaved:
                return [[t] for t in found]
            return offers(found, tables[r], N_of(mbs), sum(nodes), sync(cm, inter))

        seeded = {} if deferred else seed_templates(mbs, inter)
        own = {}
        for lighter, r in zip((None, *mode.modes[:-1]), mode.modes, strict=True):
            # (with interleaving this restricts the family a little: solver.skeletons docstring)
            easier = tables[lighter] if lighter is not None else None
            found = candidates(
                tables[r], profile, nodes, not inter, limits, incumbent, seeded.get(r, []), easier
            )
            own[r] = found, offered(found, r)
        if deferred:
            seeded = seed_templates(mbs, inter)
            incumbent = min(incumbent, pending.least())
            quick = quick_bound(mbs, inter)
            if quick >= incumbent:  # the seeds settle it, as the search's own check would have
                return _JobAnswer(0, quick, True, None, False)
        templates = []
        for r in mode.modes:
            found, offer = own[r]
            if deferred and seeded[r]:
                # the templates `candidates` gives with the seeds: it prunes them with the family
                of = {id(t): o for t, o in zip(found, offer, strict=True)}
                kept = prune([*seeded[r], *found])
                fresh = [t for t in kept if id(t) not in of]
                of.update(zip(map(id, fresh), offered(fresh, r), strict=True))
                offer = [of[id(t)] for t in kept]
            templates += [
                t if t.recompute == r else dataclasses.replace(t, recompute=r) for o in offer for t in o
            ]
        if len(mode.modes) > 1:  # a pipeline that fits without recomputation beats its recomputing twin
            templates = prune(templates)
        if not templates:
            return _JobAnswer(0, None, True, None, False)
        bound = lower_bound(templates, nodes, N_of(mbs))
        if bound >= incumbent:
            return _JobAnswer(len(templates), bound, True, None, False)
        result, bound, closed = solve_master(
            templates,
            nodes,
            N_of(mbs),
            sync(cm, inter),
            single_node=not inter,
            time_limit_s=deadline_s - time.perf_counter(),
            upper_bound_s=incumbent,
            min_pipelines=cm.replicas,
        )
        return _JobAnswer(len(templates), bound, closed, result, True)

    deadline = started + time_limit_s
    best: tuple[float, int, MasterResult] | None = None
    bounds, proven, num_templates = [], True, 0
    work_out = pending.work_out if more_seeds is not None else None
    ahead = pending.child = _fork_jobs(
        jobs, limits, upper_bound_s, quick_bound, solve_job, deadline, idle, work_out
    )
    handed = None  # the child, where it runs `idle` on for the caller
    try:
        for mbs, inter in jobs:
            if not deferred or ahead is None or ahead.owns((mbs, inter)):
                pending.pairs()  # they bound the job (a child sends them before its answers)
            incumbent = min(upper_bound_s, pending.least(), best[0] if best else math.inf)
            quick = quick_bound(mbs, inter)
            if quick >= incumbent:
                bounds.append(quick)
                continue
            answer = ahead.take((mbs, inter)) if ahead is not None else None
            if answer is None:
                answer = solve_job(mbs, inter, incumbent, deadline)
            num_templates += answer.num_templates
            if answer.bound is None:
                continue
            bounds.append(answer.bound)
            if not answer.solved:
                continue
            proven = proven and answer.closed
            result = answer.result
            if result is not None and (best is None or result.objective_s < best[0]):
                best = (result.objective_s, mbs, result)
            if progress is not None:
                so_far = f"{best[0]:.4f} s/step" if best else "none"
                proof = "proven" if answer.closed else "time limit, not proven"
                progress(
                    f"pass {mode.name}, micro-batch {mbs}, {'all nodes' if inter else 'one node'}: "
                    f"{answer.num_templates} templates, {proof} "
                    f"(bound {answer.bound:.4f} s/step); best so far {so_far}"
                )
        if best is None:
            outcome = Outcome(None, math.inf, min(bounds, default=math.inf), proven, num_templates, limits)
        else:
            objective, mbs, result = best
            plan = place(cm, cluster, global_batch_size, mbs, result.pipelines, result.nodes)
            outcome = Outcome(plan, objective, min([objective, *bounds]), proven, num_templates, limits)
        outcome = dataclasses.replace(outcome, seeded=tuple(pending.pairs()))
        handed = ahead if idle is not None else None
    finally:
        if ahead is not None and handed is None:
            ahead.close()
    return dataclasses.replace(outcome, idle=handed)

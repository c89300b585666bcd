"""Solver: the fastest plan for ANY set of healthy GPUs under the cost model, and the baselines (torch-free).

    solve(profile, cluster, global_batch_size, method="elastor", micro_batch_sizes=None,
          time_limit_s=30) -> Plan

The plan's `predicted` block is `CostModel.estimate(plan).to_json()`; its `solver` block records the
method, the status (OPTIMAL: proven fastest of the space searched; FEASIBLE: the best found, with the
proven relative `gap` to the best possible in that space, and in `not_proven` why: the time limit,
a search with other memory for NCCL buffers), the wall time, how many templates were
built, and `complete`: whether the space searched is the whole search space (below) or, on large
instances, a family of it (`family`).

Search space: any number of pipelines on disjoint healthy GPUs; per pipeline any number of
stages with contiguous, uneven layer ranges; per stage any TP degree that divides the heads and kv
heads, was profiled and fits on one node (not only powers of two), on one node; an integer number of
micro-batches per pipeline, at least its number of stages, summing to the global batch over the
micro-batch size; any profiled micro-batch size dividing the global batch; GPUs may stay idle.

Objective: the cost model's step time (slowest pipeline under 1F1B + gradient sync of the largest
stage across the pipelines + slowest optimizer step), every device within its usable memory.

Method, a decomposition (exact with respect to the cost model):
  1. Templates: every pipeline that could be part of an optimal plan, with its stages, their TP
     degrees, which consecutive stages share a node ("runs") and its layer split, reduced to its cost
     terms A (warm-up and cool-down), M (the slowest stage: T(m) = A + (m-1) M for m micro-batches), W
     (largest stage's parameters) and O (slowest optimizer step), and its footprint (run sizes).
     solver.templates builds them by an exact dynamic program over the layer list (small instances:
     the whole search space); solver.skeletons by a closed-form block split of pipeline skeletons
     (large models with identical blocks: a family of the search space, reported as such).
  2. Master (solver.master): for a bound tau on the slowest pipeline every template can take at most
     k(tau) micro-batches, and a CP-SAT model picks how many pipelines of each template and packs their
     runs onto node classes by patterns, covering the global batch with the least sync + optimizer;
     a staircase search over tau (the times pipelines can take) finds the least tau + overhead.
  3. One master per micro-batch size and link scope (one node with intra-node links, or all nodes
     with inter-node gradient sync); the cheapest answer wins (solver.core). Those of the larger
     micro-batch sizes run in a forked process where a second core is free (solver.parallel).
  4. solver.placement turns the answer into device names; the cost model prices the final plan and its
     step time equals the master's objective. tests/test_solver_optimality.py holds the solver equal to
     a brute-force enumeration of the whole search space on 200 random small instances.
Symmetry is used throughout: templates see per-run GPU counts, never device names; the master sees node
classes, never nodes; nodes with equal healthy counts and GPUs of one node are interchangeable.

One gap in that exactness: hide windows. A plan's gradient sync waits behind its pipelines' least hide
window H (`costmodel.estimate.plan_sync_s`), so a pipeline slower in A, M, W or O can still make a
faster plan by hiding more of everyone's sync. The template programs and `solver.templates.prune`
compare pipelines by A, M, W, O, stages and first-layer parameters only, and drop such a pipeline;
comparing windows too kept about three times the templates (llama2-7b on 8,8,8,7: 2.7 s -> 7.5 s) and
changed none of the benchmarks' plans. The master does compare windows among the templates it is
given (`Master._undominated`), since it prices their sync, but not an interleaved template's chunk
terms (`Template.hide_terms`, which raise its sync's floor): it can drop a template for one whose
terms leave more of the sync exposed.

Precision, sequence parallelism, recomputation: a plan trains in its profile's dtype; every stage of
TP degree > 1 whose degree divides the sequence is sequence parallel (it moves the bytes of the
all-reduces it replaces, keeps less and computes no more, so it never loses). Recomputation trades
compute for memory. Elastor's search (and node-drop's) offers every pipeline template in each mode
of RECOMPUTE_PASSES, every stage of the pipeline in it, so that one plan may mix pipelines of
different modes (a recomputing template is dropped where its twin without recomputation fits, as it
is slower in everything the plan's cost compares; the skeleton family does not even build a heavier
mode's split where it fits in the next lighter mode, `solver.skeletons`); the grid baselines search
once per mode. Each
answer then gives back the recomputation its stages do not need (`relax_recompute`: the lightest
mode in which the stage still fits, which is never slower), and the fastest answer wins. A mode is
searched only where it lets some stage that is short of memory hold more micro-batches (`helps`);
otherwise it cannot win (`recompute_groups`).


Baselines (solver.baselines), each the best plan of its family under the same cost model: uniform,
node-drop (Elastor's search on the fully healthy nodes) and pow2-greedy.
"""

import dataclasses
import functools
import gc
import json
import math
import time
from collections.abc import Callable, Sequence

from costmodel import ClusterSpec, Plan, communicators
from costmodel.errors import ElastorError
from costmodel.estimate import MEMORY_HEADROOM, CostModel, stage_in_flight
from costmodel.profile import ModelProfile
from costmodel.sharding import state_bytes
from solver import baselines, parallel
from solver.baselines import NO_PINS, Grid
from solver.core import (
    RECOMPUTE_PASSES,
    Limits,
    Outcome,
    Pass,
    plan_limits,
    search,
    tp_degrees,
    usable_micro_batch_sizes,
)
from solver.diagnose import infeasible_reason
from solver.memo import IdentityMemo
from solver.skeletons import block_uniform
from solver.stages import stage_table
from solver.templates import fewest_gpus

METHODS = ("elastor", "uniform", "node-drop", "pow2-greedy")
DEFAULT_TIME_LIMIT_S = 30.0
PROGRESS_AFTER_S = 2.0  # a longer solve reports each pass's result as it ends
NOT_PROVEN_TIME_LIMIT = "the time limit stopped the search"  # a FEASIBLE answer's reason (solver block)
NCCL_RESERVE_ROUNDS = 8  # searches with a growing NCCL reserve before giving up (`_within_nccl_buffers`)
NCCL_BISECTIONS = 2  # then searches between the reserves that did not fit and did (each a whole solve)
_DROPPED: IdentityMemo[Outcome] = IdentityMemo(limit=64)  # node-drop searches, by profile and cluster


def _cycle_collection_paused(solver: Callable) -> Callable:
    """Run `solver` with Python's cyclic garbage collector paused (and resumed after, if it ran).

    A solve allocates millions of small objects (templates, splits, CP-SAT models) and few reference
    cycles; the collector's passes over everything alive, the memoised templates of earlier solves
    included, took 6-18% of a solve (llama2-7b on 8+7 and on 8,8,8,7, llama2-70b on 987 GPUs) for
    6% more peak memory when paused. Reference counting still frees nearly everything at once; the
    few cycles wait for the collector's next pass."""

    @functools.wraps(solver)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return solver(*args, **kwargs)
        gc.disable()
        try:
            return solver(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_cycle_collection_paused
def solve(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    method: str = "elastor",
    micro_batch_sizes: Sequence[int] | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    *,
    limits: Limits | None = None,
    sharding: Sequence[str] = ("none",),
    interleave: bool = False,
    recompute: str | None = None,
    grid: Grid | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest plan of `method`'s family; raises ElastorError (one sentence) when none exists.
    `sharding` lists the optimizer layouts to search; with `interleave`, Elastor's search also offers
    every pipeline template interleaved (solver.interleave: 2 to 8 layer chunks per stage).
    `recompute` pins every stage's recomputation mode (else each pass's answer gives back what its
    stages do not need), and `grid` pins the TP, PP and chunks of the uniform method's grid.
    `progress` receives a line after each pass, and after each sub-problem of Elastor's search,
    once the solve has run PROGRESS_AFTER_S."""
    started, cpu = time.perf_counter(), parallel.cpu_s()
    if method not in METHODS:
        raise ElastorError(f"Unknown method {method!r}; use one of {', '.join(METHODS)}.")
    if global_batch_size < 1:
        raise ElastorError(f"The global batch size must be a positive integer, not {global_batch_size}.")
    grid = grid or NO_PINS
    check_pins(profile, cluster, method, grid, recompute)
    sizes = usable_micro_batch_sizes(profile, global_batch_size, micro_batch_sizes)
    plain = CostModel(profile, cluster)  # prices every pass's answer in its stages' own modes

    def report(line: str) -> None:
        elapsed = time.perf_counter() - started
        if elapsed > PROGRESS_AFTER_S:
            progress(f"[{elapsed:.1f} s] {line}")

    def best_of_passes(planning: ClusterSpec) -> tuple[tuple | None, dict]:
        """The fastest answer of every pass, searched on `planning` (the cluster, or its devices with
        less memory) and priced on the cluster: (step time, plan, info, estimate) or None, and each
        pass's step time."""
        best, passes = None, {}
        for modes in recompute_groups(profile, planning, global_batch_size, sizes, method, recompute, passes):
            for mode in sharding_passes(profile, planning, global_batch_size, sizes, modes, method, sharding):
                mode = dataclasses.replace(mode, interleave=interleave)
                upper = best[0] if best else math.inf  # a later pass only needs to look for faster plans
                found = _solve_pass(
                    profile,
                    planning,
                    global_batch_size,
                    method,
                    sizes,
                    time_limit_s,
                    limits,
                    mode,
                    upper,
                    grid,
                    progress=report if progress is not None else None,
                )
                if found is None:
                    passes[mode.name] = None if best is None else "no faster plan"
                    continue
                plan, info = found
                if recompute is None:
                    plan = relax_recompute(plain, plan)
                estimate = plain.estimate(plan)
                passes[mode.name] = round(estimate.step_time_s, 6)
                if best is None or estimate.step_time_s < best[0]:
                    predicted = dataclasses.replace(plan, predicted=estimate.to_json())
                    best = (estimate.step_time_s, predicted, info, estimate)
                if progress is not None and time.perf_counter() - started > PROGRESS_AFTER_S:
                    progress(
                        f"[{time.perf_counter() - started:.1f} s] pass {mode.name}: "
                        f"{estimate.step_time_s:.4f} s/step ({info['status']}, gap {info['gap']:.2%}); "
                        f"best so far {best[0]:.4f} s/step"
                    )
        return best, passes

    best, passes, reserved, first_s = _within_nccl_buffers(
        best_of_passes, cluster, time_limit_s, report if progress is not None else None
    )
    if best is None:
        if grid.pinned or (method == "uniform" and recompute is not None):
            heaviest = recompute or RECOMPUTE_PASSES[-1]
            raise ElastorError(
                baselines.grid_misfit(
                    profile, cluster, global_batch_size, sizes, grid, heaviest, sharding[-1]
                )
            )
        raise ElastorError(_reason(profile, cluster, global_batch_size, sizes, method))
    _, plan, info, _ = best
    if reserved:  # searched again with other memory: no proof, and the gap is to the first answer
        info["nccl_reserve_bytes"] = reserved  # beyond the planner's own; < 0: given back
        info.update(status="FEASIBLE", gap=max(0.0, (best[0] - first_s) / best[0]))
        info["not_proven"] = [*info.get("not_proven", ()), _nccl_reason(reserved)]
    info["passes"] = passes  # predicted step time of each pass's answer (None: no plan)
    info["wall_s"] = round(time.perf_counter() - started, 4)
    info["cpu_s"] = round(parallel.cpu_s() - cpu, 4)  # this process's and a forked search child's
    return dataclasses.replace(plan, solver=info)


def _nccl_reason(reserved: int) -> str:
    """Why an answer searched with other memory per device (`_within_nccl_buffers`) proves nothing."""
    mib = f"{abs(reserved) / communicators.MIB:,.0f} MiB"
    if reserved > 0:
        return (
            "the first answer did not fit once its NCCL buffers were counted exactly, so this one was "
            f"searched with {mib} less memory per device, and its gap is to that first answer"
        )
    return (
        "the planner's NCCL reserve left no plan, so this one was searched with that reserve "
        f"({mib} per device) given back, and fits with its buffers counted exactly"
    )


def _within_nccl_buffers(
    search: Callable[[ClusterSpec], tuple[tuple | None, dict]],
    cluster: ClusterSpec,
    time_limit_s: float,
    progress: Callable[[str], None] | None = None,
) -> tuple[tuple | None, dict, int, float]:
    """`search(cluster)`'s answer, or where it does not fit once its devices' NCCL buffers are
    counted exactly, the fastest answer found with some bytes less memory per device that fits:
    (answer, passes, bytes reserved, the first answer's step time). An answer is `best_of_passes`'
    (step time, plan, solver block, estimate).

    The planner reserves each stage's buffers for a plan whose pipelines cut alike
    (costmodel.communicators); an answer whose devices belong to more groups can need more. The
    reserve then grows (by the answer's shortfall and at least a quarter communicator, then doubling)
    until an answer fits or none is left, and is bisected NCCL_BISECTIONS times (down to a quarter
    communicator) between the last reserve whose answer did not fit and that one: a smaller reserve
    searches more plans, so an answer that fits there is no slower. The fastest answer that fits
    wins. Each search is a whole solve: a bisection runs only while one more search as long as the
    last still ends within `time_limit_s` of the first search's start. Such an answer proves
    nothing: `solve` reports it FEASIBLE, with its gap to the first answer, which did not fit.
    Where the first search finds no plan at all, one more runs with the largest reserve given back
    (a negative reserve), and its answer is kept if it fits exactly. `progress` hears of each
    search after the first, and why it runs.
    """
    started = time.perf_counter()
    best, passes = search(cluster)
    if best is None:
        # The reserve can exceed what a plan needs (a single GPU needs none of it): search once more
        # with the most a stage reserves given back; its answer counts only if it fits exactly.
        most = communicators.planned_bytes(cluster.device.kind, 2, 2, 1)
        more, more_passes = search(with_less_memory(cluster, -most)) if most else (None, {})
        if more is not None and more[3].fits:
            return more, more_passes, -most, more[0]
    if best is None or best[3].fits:
        return best, passes, 0, 0.0
    first_s = best[0]

    def shortfall(answer) -> int:
        estimate = answer[3]
        return max(s.peak_memory_bytes for s in estimate.stages) - estimate.usable_memory_bytes

    last_s = time.perf_counter() - started  # how long the last search took

    def attempt(reserved: int, why: str) -> tuple[tuple | None, dict]:
        nonlocal last_s
        if progress is not None:
            less = f"{reserved / communicators.MIB:,.0f} MiB"
            progress(f"{why}: searching again with {less} less memory per device")
        began = time.perf_counter()
        smaller = with_less_memory(cluster, reserved)
        answer = search(smaller) if smaller is not None else (None, {})
        last_s = time.perf_counter() - began
        return answer

    step = max(communicators.MIB, communicators.group_bytes(cluster.device.kind) // 4)
    low, high, found = 0, max(step, shortfall(best)), None
    for _ in range(NCCL_RESERVE_ROUNDS):
        short = f"the answer at {best[0]:.4f} s/step needs {shortfall(best) / communicators.MIB:,.0f} MiB"
        best, passes = attempt(high, short + " more than a device has once its NCCL buffers are counted")
        if best is None:  # too much reserved: the answer lies below
            break
        if best[3].fits:
            found = (best, passes, high)
            break
        low, high = high, max(high + shortfall(best), 2 * high)
    else:  # every reserve tried left a plan that does not fit: nothing to bisect
        high = low
    for _ in range(NCCL_BISECTIONS):
        if high - low <= step or time.perf_counter() - started + last_s > time_limit_s:
            break
        middle = (low + high) // 2
        best, passes = attempt(middle, "a smaller reserve may leave a faster plan that fits")
        if best is not None and best[3].fits and (found is None or best[0] <= found[0][0]):
            found = (best, passes, middle)
        if best is None or best[3].fits:
            high = middle
        else:
            low = middle
    if found is None:
        raise ElastorError(
            "No plan fits once NCCL's communicator buffers are counted: the plans found need more than "
            "the planner reserves for them; add GPUs or memory."
        )
    return (*found, first_s)


def with_less_memory(cluster: ClusterSpec, reserved: int) -> ClusterSpec | None:
    """`cluster` with `reserved` bytes less usable memory per device (the cost model keeps
    MEMORY_HEADROOM of the rest free); None when that leaves no memory."""
    if not reserved:
        return cluster
    memory = cluster.device.memory_bytes - math.ceil(reserved / (1 - MEMORY_HEADROOM))
    if memory < 1:
        return None
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory))


def recompute_groups(
    profile, cluster, gbs, sizes, method, recompute=None, skipped=None
) -> list[tuple[str, ...]]:
    """The recompute modes each pass searches: the pinned one; else no recomputation and every mode
    that `helps` (the others are noted in `skipped`), together where pipelines of one plan may differ
    in it (Elastor's search and node-drop), one pass each for the grid baselines, whose pipelines are
    alike."""
    if recompute is not None:
        return [(recompute,)]
    helping = []
    for mode in RECOMPUTE_PASSES[1:]:
        if helps(profile, cluster, gbs, sizes, Pass(), Pass(mode)):
            helping.append(mode)
        elif skipped is not None:
            skipped[mode] = "skipped: recomputation lets no stage hold more micro-batches it needs"
    if method in ("elastor", "node-drop"):
        return [("none", *helping)]
    return [("none",), *((mode,) for mode in helping)]


def sharding_passes(profile, cluster, gbs, sizes, modes, method, sharding):
    """The passes of one group of recompute modes (lightest first): unsharded; then, where
    `sharding` allows ZeRO-1 and the method searches Elastor's space, ZeRO-1 over at least 2
    pipelines, and over at least R, the most pipelines (a power of two) whose stages can fit (R
    times the fewest GPUs a pipeline needs there is at most the GPUs), when R shards more memory
    loose than 2 does (`helps`). A plan of P
    pipelines is priced in the pass of the largest such count not above P, conservatively in
    memory and optimizer step between 2 and R; the final estimate prices it exactly. The ZeRO-1 pass
    over 2 runs where memory frees nothing only for a 16-bit profile: in fp32 the reduce-scatter and
    the gather move the all-reduce's bytes and leave the gather exposed, so only memory (or a smaller
    optimizer step, not searched for) could make ZeRO-1 faster; in 16-bit the gather moves half."""
    recompute, lighter = modes[-1], tuple(modes[:-1])
    if method == "uniform":  # one grid per layout: the family prices its own ZeRO-1 replicas
        yield from (Pass(recompute, layout, lighter=lighter) for layout in sharding)
        return
    if "none" in sharding:
        yield Pass(recompute, lighter=lighter)
    if "zero1" not in sharding or method not in ("elastor", "node-drop"):
        return
    gpus = len(cluster.devices)
    most = min(gpus, gbs // min(sizes, default=gbs))  # pipelines a plan can have
    if most < 2:
        return
    two = Pass(recompute, "zero1", 2, lighter=lighter)
    by_time = profile.dtype != "float32"
    if (by_time or helps(profile, cluster, gbs, sizes, Pass(recompute, lighter=lighter), two)) and (
        2 * _fewest_gpus(profile, cluster, sizes, two) <= gpus
    ):
        yield two
    widest = 4
    while (
        2 * widest <= most
        and 2
        * widest
        * _fewest_gpus(profile, cluster, sizes, Pass(recompute, "zero1", 2 * widest, lighter=lighter))
        <= gpus
    ):
        widest *= 2
    far = Pass(recompute, "zero1", widest, lighter=lighter)
    fits = widest <= most and widest * _fewest_gpus(profile, cluster, sizes, far) <= gpus
    if fits and helps(profile, cluster, gbs, sizes, two, far):
        yield far


def _fewest_gpus(profile, cluster, sizes, mode: Pass) -> int:
    """The fewest GPUs any pipeline of pass `mode` needs (its stages must fit in memory)."""
    gpus, tps = len(cluster.devices), tp_degrees(profile, cluster)
    return min(
        (
            fewest_gpus({t: stage_table(cm, t, mbs) for t in tps}, profile.model.num_layers, gpus)
            for cm in (mode.cost_model(profile, cluster, r) for r in mode.modes)
            for mbs in sizes
        ),
        default=gpus + 1,
    )


def check_pins(profile: ModelProfile, cluster: ClusterSpec, method: str, grid, recompute) -> None:
    """One sentence for pins that cannot apply: grid pins outside the uniform method, a TP degree
    the profile or the nodes do not allow, a PP or chunk count the layers cannot take."""
    if grid.pinned and method != "uniform":
        raise ElastorError(
            "--tp, --pp, a number of --chunks and --split-backward pin a uniform grid; add --method uniform."
        )
    if recompute is not None and recompute not in RECOMPUTE_PASSES:
        raise ElastorError(f"Unknown recompute mode {recompute!r}; use one of {', '.join(RECOMPUTE_PASSES)}.")
    allowed = tp_degrees(profile, cluster)
    if grid.tp is not None and grid.tp not in allowed:
        raise ElastorError(
            f"--tp {grid.tp} is not available for {profile.model.name} on cluster {cluster.short_form()}: "
            "the TP degree must be profiled, divide the heads and fit on a node "
            f"({', '.join(map(str, allowed))})."
        )
    blocks = profile.model.num_blocks
    if grid.pp is not None and not 1 <= grid.pp <= blocks:
        raise ElastorError(f"--pp {grid.pp} must be between 1 and the model's {blocks} blocks.")
    if grid.chunks < 1 or (grid.chunks > 1 and grid.pp == 1):
        raise ElastorError(
            f"--chunks {grid.chunks} needs a positive count, and more than one chunk needs --pp of 2 or more."
        )
    if grid.pp and grid.pp * grid.chunks > blocks:
        raise ElastorError(
            f"--pp {grid.pp} with --chunks {grid.chunks} needs {grid.pp * grid.chunks} virtual stages, "
            f"more than the model's {blocks} blocks."
        )


def _solve_pass(
    profile,
    cluster,
    gbs,
    method,
    sizes,
    time_limit_s,
    limits,
    mode,
    upper_bound_s=math.inf,
    grid=NO_PINS,
    progress=None,
) -> tuple[Plan, dict] | None:
    """The fastest plan of `method`'s family in pass `mode`, and its solver block; Elastor's search
    looks only for plans faster than `upper_bound_s` (None when there is none)."""
    info: dict = {"method": method}
    if method == "elastor":
        outcome = _elastor(profile, cluster, gbs, sizes, time_limit_s, limits, mode, upper_bound_s, progress)
        plan = outcome.plan
    elif method == "node-drop":
        healthy = cluster.whole_nodes()
        if healthy is None:
            raise ElastorError(
                f"node-drop needs a fully healthy node, and no node of cluster {cluster.short_form()} "
                f"has all {cluster.gpus_per_node} GPUs (gpus_per_node)."
            )
        if math.isinf(upper_bound_s):  # memoised: Elastor's searches on these nodes take it as a seed
            outcome = _dropped(profile, healthy, gbs, sizes, time_limit_s, limits, mode)
        else:
            outcome = _elastor(profile, healthy, gbs, sizes, time_limit_s, limits, mode, upper_bound_s)
        plan = outcome.plan
        info["nodes"] = [n.name for n in healthy.nodes]
    elif method == "uniform":
        found = baselines.uniform(
            profile,
            cluster,
            gbs,
            sizes,
            mode.recompute,
            grid=grid,
            sharding=mode.sharding,
        )
        plan = found[1] if found else None
        outcome = None
    else:
        found = baselines.pow2_greedy(profile, cluster, gbs, sizes, mode.recompute)
        plan = found[1] if found else None
        outcome = None
    if plan is None:
        return None
    if outcome is not None:
        gap = (
            0.0 if outcome.proven else max(0.0, (outcome.objective_s - outcome.bound_s) / outcome.objective_s)
        )
        info.update(status="OPTIMAL" if outcome.proven else "FEASIBLE", gap=float(gap))
        if not outcome.proven:
            info["not_proven"] = [NOT_PROVEN_TIME_LIMIT]
        info["templates"] = outcome.num_templates
        info["complete"] = outcome.limits.complete
        if not outcome.limits.complete:
            info["family"] = outcome.limits.to_json()
    else:
        info.update(status="OPTIMAL", gap=0.0)  # each baseline family is enumerated in full
    return plan, info


def helps(
    profile: ModelProfile, cluster: ClusterSpec, gbs: int, sizes: Sequence[int], base: Pass, other: Pass
) -> bool:
    """Whether pass `other` can beat pass `base` by memory: only if some stage that holds fewer
    micro-batches under `base` than 1F1B could ask of it (min(stages after it, micro-batches): at most
    the layers, the GPUs and the micro-batches) holds more under `other` (mode by mode of the
    passes' groups). Otherwise every plan of the pass fits under `base` too, and (for
    recomputation, which only adds time) is as fast or faster there: the pass is skipped, exactly;
    most passes end here when memory does not bind."""
    L = profile.model.num_layers
    for short_mode, more_mode in zip(base.modes, other.modes, strict=True):
        short_cm = base.cost_model(profile, cluster, short_mode)
        more_cm = other.cost_model(profile, cluster, more_mode)
        for mbs in sizes:
            most = min(L, len(cluster.devices), gbs // mbs)
            for tp in tp_degrees(profile, cluster):
                short = stage_table(short_cm, tp, mbs).max_in_flight
                more = stage_table(more_cm, tp, mbs).max_in_flight
                for s in range(L):
                    for e in range(s + 1, L + 1):
                        if short[s][e] < most and more[s][e] > short[s][e]:
                            return True
    return False


def relax_recompute(cm: CostModel, plan: Plan) -> Plan:
    """Each stage in the lightest recompute mode (none before selective before full) in which it still
    fits in memory with the activations its schedule keeps in flight on it (`stage_in_flight`, in
    that mode's own chunk weights when interleaved), beside the optimizer state its devices keep
    under the plan (`costmodel.sharding.state_bytes`): never slower, same memory bound."""
    states = state_bytes(plan, cm.profile.bytes_per_param)
    comms = communicators.device_bytes(plan, cm.cluster.device.kind)
    pipelines = []
    for pipe in plan.pipelines:
        stages = []
        for si, stage in enumerate(pipe.stages):
            for mode in RECOMPUTE_PASSES[: RECOMPUTE_PASSES.index(stage.recompute)]:
                lighter = dataclasses.replace(stage, recompute=mode)
                # in the lighter mode's own weights: an interleaved stage's peak mixes its chunks by
                # what each keeps, and the head's chunk keeps far more without recomputation
                held = stage_in_flight(cm, lighter, si, pipe, plan.micro_batch_size)
                cost = cm.stage_of(lighter, plan.micro_batch_size)
                peak = max(sum(cost.memory_bytes(held, states[d], comms[d]).values()) for d in stage.devices)
                if peak <= cm.usable_memory_bytes:
                    stage = lighter
                    break
            stages.append(stage)
        pipelines.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipelines))


def _elastor(
    profile, cluster, gbs, sizes, time_limit_s, limits, mode: Pass, upper_bound_s=math.inf, progress=None
) -> Outcome:
    """Elastor's search. A bounded search (large instances) might miss a baseline's plan, so the
    uniform and pow2-greedy baselines seed it: their pipelines join the templates, and the best of
    their plans bounds the search, which then only looks for a faster one (and returns that plan,
    proven optimal in the family with its pipelines, when there is none). The grid of any depth
    (`baselines.deep_grids`, which keeps a smaller cluster's grid depth on a bigger cluster) runs
    with them and bounds the search too, but its pipelines stay out of the templates. Where the
    search forks a child (solver.core.search's `more_seeds`), the child works the baselines out
    first while this process builds its templates (the skeleton family does not depend on them),
    which they join once built; else they run first.

    Node-drop too: a family of the search space is not closed under adding GPUs (on 255 full nodes
    and one of 7 GPUs it can miss the plan it finds on the 255 full nodes alone), and Elastor must
    never lose to dropping the partial nodes. Its search is a whole solve, so it looks only for a
    plan faster than Elastor's (bounded that way, most of its sub-problems end at their first
    lower bound): where Elastor's search forks a child for the larger micro-batch sizes, the
    child runs it once those are answered, below the best plan it knows then (a core that would
    sit idle while the parent's master works: llama2-7b on 8,8,8,7 waited 0.33 s for it after the
    search), else it runs after Elastor's search, below its answer. Where it finds a faster plan
    (it finds the same one below either bound), Elastor's search runs again with its pipelines
    joined. A node-drop search memoised by an earlier solve (`_dropped`: a what-if sweep,
    `--compare`) seeds the search from the start instead.

    With interleaving (block-uniform profiles only, solver.interleave) the search with chunks runs
    first (`_searched`)."""
    capacities = [len(n.gpus) for n in cluster.nodes if n.gpus]
    searched = functools.partial(
        _searched, profile, cluster, gbs, sizes, time_limit_s, limits, mode, upper_bound_s=upper_bound_s
    )
    if (limits or plan_limits(profile, capacities)).complete:
        return searched([], progress=progress)
    baselines = functools.partial(_baseline_plans, profile, cluster, gbs, sizes, mode)
    found = []  # (step time, plan) of other searches' plans that seed this one
    whole = cluster.whole_nodes()
    partial = whole is not None and len(whole.nodes) < len(capacities)
    known = (
        _DROPPED.peek((profile,), _dropped_key(whole, gbs, sizes, time_limit_s, limits, mode))
        if partial
        else None
    )
    if known is not None and known.plan is not None:
        found.append((known.objective_s, known.plan))
    ahead = partial and known is None  # node-drop's search, in a forked child's idle time if it can

    def dropped_below(bound: float) -> Outcome:
        return _elastor(profile, whole, gbs, sizes, time_limit_s, limits, mode, min(upper_bound_s, bound))

    outcome = searched(found, progress=progress, idle=dropped_below if ahead else None, pending=baselines)
    found = [*outcome.seeded, *found]
    if not ahead:
        return outcome
    child, outcome = outcome.idle, dataclasses.replace(outcome, idle=None)
    bound = min(upper_bound_s, outcome.objective_s)
    try:
        dropped = child.idle_answer() if child is not None else None
    finally:
        if child is not None:
            child.close()
    if dropped is None:  # no child took it up (or it failed): the search below Elastor's answer
        dropped = dropped_below(bound)
    if dropped.plan is None or dropped.objective_s >= bound:
        return outcome
    found.append((dropped.objective_s, dropped.plan))
    return searched(found, progress=progress)


def _searched(
    profile,
    cluster,
    gbs,
    sizes,
    time_limit_s,
    limits,
    mode: Pass,
    found,
    *,
    upper_bound_s,
    progress,
    idle=None,
    pending=None,
) -> Outcome:
    """Elastor's search of pass `mode`, seeded with the (step time, plan) pairs `found` and those
    `pending()` gives (`_seeded_search`).

    With interleaving the search with chunks runs first. Each template is offered there beside its
    best variant unless the variant is no slower at any micro-batch count (`lower_envelope`), so a
    proven optimum with chunks is no slower than the optimum without. A search with chunks stopped
    by its time limit proves nothing: the search without chunks then runs, seeded with its plan and
    looking only for a faster one, so the answer is never slower than the search without chunks
    would give. `idle` goes to the first search (`solver.core.search`), and its Outcome's child to
    the answer."""
    search_with = functools.partial(
        _seeded_search,
        profile,
        cluster,
        gbs,
        sizes,
        time_limit_s,
        limits,
        upper_bound_s=upper_bound_s,
        progress=progress,
    )
    plain = dataclasses.replace(mode, interleave=False)
    if not mode.interleave or not block_uniform(profile):
        return search_with(plain, found, idle=idle, pending=pending)
    chunked = search_with(mode, found, idle=idle, pending=pending)
    if chunked.proven:
        return chunked
    found = [*chunked.seeded, *found]
    if chunked.plan is not None:
        found = [*found, (chunked.objective_s, chunked.plan)]
    try:
        outcome = search_with(plain, found)
    except BaseException:
        if chunked.idle is not None:
            chunked.idle.close()
        raise
    return dataclasses.replace(
        outcome,
        bound_s=min(outcome.bound_s, chunked.bound_s),
        proven=False,  # the search with chunks was stopped by its time limit
        num_templates=outcome.num_templates + chunked.num_templates,
        idle=chunked.idle,
        seeded=chunked.seeded,
    )


def _seeded_search(
    profile,
    cluster,
    gbs,
    sizes,
    time_limit_s,
    limits,
    mode: Pass,
    found,
    *,
    upper_bound_s,
    progress,
    idle=None,
    pending=None,
) -> Outcome:
    """Elastor's search of pass `mode` seeded with the (step time, plan) pairs `found` and those
    `pending()` gives (the baselines: `solver.core.search` works them out in its forked child
    where it forks one, while this process builds its templates): their pipelines join the
    templates and the best of them bounds the search (`_elastor`)."""
    known = min(found, key=lambda f: f[0], default=None)
    outcome = search(
        profile,
        cluster,
        gbs,
        micro_batch_sizes=sizes,
        time_limit_s=time_limit_s,
        limits=limits,
        seeds=[plan for _, plan in found],
        mode=mode,
        upper_bound_s=min(upper_bound_s, known[0] if known else math.inf),
        progress=progress,
        idle=idle,
        more_seeds=pending,
    )
    best = min([*outcome.seeded, *found], key=lambda f: f[0], default=None)
    # No faster plan: the best baseline is the answer, proven optimal in the family with the seeds'
    # pipelines where every sub-problem closed (a search stopped by the time limit proves nothing).
    if best is not None and best[0] < upper_bound_s:
        cost, plan = best
        if outcome.plan is None or outcome.objective_s > cost * (1 + 1e-12):
            return dataclasses.replace(
                outcome, plan=plan, objective_s=cost, bound_s=min(cost, outcome.bound_s)
            )
    return outcome


def _baseline_plans(profile, cluster, gbs, sizes, mode: Pass) -> list[tuple[float, Plan]]:
    """(step time, plan) of uniform and pow2-greedy in every mode of the pass, and of the grid of
    any depth (`baselines.deep_grids`: what keeps the skeleton family's answer from getting slower
    on a bigger cluster where a smaller one ran a grid)."""
    deep = functools.partial(baselines.deep_grids, interleave=mode.interleave)
    found = [
        family(profile, cluster, gbs, sizes, recompute)
        for family in (baselines.uniform, baselines.pow2_greedy, deep)
        for recompute in mode.modes
    ]
    return [f for f in found if f]


def _dropped(profile, whole: ClusterSpec, gbs, sizes, time_limit_s, limits, mode: Pass) -> Outcome:
    """Node-drop's search (Elastor's on the full nodes `whole`), once per profile and full nodes:
    clusters that differ only in their partial nodes drop to the same ones (a what-if sweep), and
    Elastor's search on any of them takes it as a seed (`_elastor`)."""
    key = _dropped_key(whole, gbs, sizes, time_limit_s, limits, mode)
    return _DROPPED.get(
        (profile,), key, lambda: _elastor(profile, whole, gbs, sizes, time_limit_s, limits, mode)
    )


def _dropped_key(whole: ClusterSpec, gbs, sizes, time_limit_s, limits, mode: Pass) -> tuple:
    return (json.dumps(whole.to_json(), sort_keys=True), gbs, tuple(sizes), time_limit_s, limits, mode)


def _reason(profile, cluster, gbs, sizes, method) -> str:
    reason = infeasible_reason(profile, cluster, gbs, sizes, tp_degrees(profile, cluster))
    if method in ("uniform", "pow2-greedy") and reason.startswith("No pipeline"):
        return f"No {method} plan of {profile.model.name} fits on cluster {cluster.short_form()}: " + (
            "no grid of equal pipelines fits in memory and the batch."
            if method == "uniform"
            else "no choice of nominal TP and pipeline count gives pipelines that fit in memory."
        )
    return reason

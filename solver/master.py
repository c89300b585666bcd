"""The master problem: how many pipelines of each template, how many micro-batches each, on which nodes.

CP-SAT model (OR-Tools), for one micro-batch size and one link scope:

    data        templates t: A_t, M_t, p_t stages, W_t (and O_t), runs (GPU counts); N micro-batches;
                node classes c: capacity cap_c, count n_c; overhead(P, W) = gradient sync of the
                W-parameter stage across P pipelines + its optimizer step (costmodel.estimate).
    variables   n_t   pipelines of template t                      (integer)
                k_t   micro-batches of its busiest pipeline        (integer, p_t..N)
                u_t   micro-batches of all its pipelines           (integer)
                y_cq  nodes of class c packed with run pattern q   (integer; q: a maximal multiset
                      of run sizes that fits cap_c)
                tau   the slowest pipeline's time; P, w the pipeline count and the W level
    constraints sum_t u_t = N;  p_t n_t <= u_t <= n_t k_t       (each pipeline p_t..k_t micro-batches;
                                                                 any total in between is a split)
                tau >= A_t + (k_t - 1) M_t  if n_t >= 1         (1F1B time of the busiest one)
                P = sum_t n_t;  w >= level(W_t) if n_t >= 1
                sum_q y_cq <= n_c;  sum_cq mult_q(d) y_cq >= sum_t n_t mult_t(d) for every run size d
                (every run gets a slot of its size on some node: bin packing by patterns, exact
                because same-size runs are interchangeable and so are nodes of one class)
    objective   minimise tau + overhead(P, w)                   (overhead as a table indexed by P, w)

Times are scaled to integers in one place (`_Scale`): 1e13 units for the incumbent's step time, so
rounding moves the objective by less than 1e-12 of it per term. A greedy plan (the best plan using
copies of one template) is the hint and the upper bound that trims every domain.
"""

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from solver.templates import Template

UNITS_PER_BOUND = 1e13  # integer units for the incumbent's step time
SMALL_MODEL = 400  # template copies up to which one CP-SAT worker without presolve is fastest
WORKERS = 2  # CP-SAT workers for larger models (the machines this runs on have 2 or more cores)


@dataclass(frozen=True)
class MasterResult:
    status: str  # OPTIMAL or FEASIBLE
    objective_s: float  # of the solution, recomputed in floating point
    bound_s: float  # proven lower bound of this master problem
    pipelines: tuple[tuple[Template, int], ...]  # (template, micro-batches) per pipeline
    nodes: tuple[tuple[int, tuple[int, ...]], ...]  # (capacity, run sizes) per node used


@dataclass(frozen=True)
class _Scale:
    unit_s: float

    def __call__(self, seconds: float) -> int:
        return round(seconds / self.unit_s)


def balance(pipes: Sequence[Template], num_microbatches: int) -> list[int] | None:
    """Micro-batches per pipeline minimising the slowest pipeline: each gets p, then one at a time to
    the pipeline that stays fastest with it (optimal for a min-max of increasing linear costs)."""
    counts = [t.num_stages for t in pipes]
    if sum(counts) > num_microbatches:
        return None
    for _ in range(num_microbatches - sum(counts)):
        i = min(range(len(pipes)), key=lambda j: (pipes[j].time_s(counts[j] + 1), j))
        counts[i] += 1
    return counts


def plan_cost_s(pipes: Sequence[Template], counts: Sequence[int], overhead: Callable) -> float:
    widest = max(pipes, key=lambda t: t.max_params)
    slowest = max(t.time_s(m) for t, m in zip(pipes, counts, strict=True))
    return slowest + overhead(len(pipes), widest.max_params, widest.optimizer_s)


def pack_first_fit(runs: Sequence[int], capacities: Sequence[int]) -> list[list[int]] | None:
    """Runs per node (first fit, largest run first) or None: a quick feasible packing for the hint."""
    free = list(capacities)
    placed: list[list[int]] = [[] for _ in capacities]
    for r in sorted(runs, reverse=True):
        for i, room in enumerate(free):
            if room >= r:
                free[i] -= r
                placed[i].append(r)
                break
        else:
            return None
    return placed


def greedy(
    templates: Sequence[Template], capacities: Sequence[int], num_microbatches: int, overhead: Callable
) -> tuple[float, Template, int] | None:
    """The best plan made of copies of one template (first-fit packing): (cost, template, copies)."""
    best = None
    for t in templates:
        copies = 0
        while (copies + 1) * t.num_stages <= num_microbatches and pack_first_fit(
            t.footprint * (copies + 1), capacities
        ):
            copies += 1
        for n in range(1, copies + 1):
            counts = balance([t] * n, num_microbatches)
            cost = plan_cost_s([t] * n, counts, overhead)
            if best is None or cost < best[0]:
                best = (cost, t, n)
    return best


def lower_bound(templates: Sequence[Template], capacities: Sequence[int], num_microbatches: int) -> float:
    """A quick lower bound on any plan's step time from these templates.

    Some pipeline runs at least p micro-batches: tau >= min_t A_t + (p_t - 1) M_t. A pipeline of G
    GPUs finishes m micro-batches no faster than m M, so all of them together no faster than
    N min_t (M_t G_t) / (GPUs in all). The optimizer step of the widest stage follows.
    """
    start = min(t.time_s(t.num_stages) for t in templates)
    fluid = num_microbatches * min(t.bottleneck_s * t.num_gpus for t in templates) / sum(capacities)
    return max(start, fluid) + min(t.optimizer_s for t in templates)


def maximal_patterns(sizes: Sequence[int], capacity: int) -> list[tuple[int, ...]]:
    """Multisets of `sizes` that fit `capacity` and admit no further size."""
    sizes = sorted(set(sizes), reverse=True)
    out = []

    def extend(pattern: list[int], room: int, start: int) -> None:
        grew = False
        for i in range(start, len(sizes)):
            if sizes[i] <= room:
                grew = True
                extend([*pattern, sizes[i]], room - sizes[i], i)
        if not grew and not any(s <= room for s in sizes):
            out.append(tuple(pattern))

    extend([], capacity, 0)
    return out


def solve_master(
    templates: Sequence[Template],
    capacities: Sequence[int],
    num_microbatches: int,
    overhead: Callable[[int, int, float], float],
    *,
    single_node: bool,
    time_limit_s: float,
    upper_bound_s: float = math.inf,
) -> tuple[MasterResult | None, float, bool]:
    """The cheapest plan from `templates` on nodes of `capacities` (module docstring).

    Returns (plan or None, lower bound, closed): closed when the answer is proven optimal or no plan
    beats `upper_bound_s`.
    """
    N = num_microbatches
    start = greedy(templates, capacities, N, overhead)
    if start is None:  # no template has as few stages as there are micro-batches
        return None, math.inf, True
    bound_s = min(upper_bound_s, start[0])
    templates = [t for t in templates if t.time_s(t.num_stages) <= bound_s and t.num_stages <= N]
    if start[1] not in templates:
        templates.append(start[1])
    scale = _Scale(bound_s / UNITS_PER_BOUND)
    total_gpus = sum(capacities)
    p_max = min(N // min(t.num_stages for t in templates), total_gpus // min(t.num_gpus for t in templates))
    levels = sorted({t.max_params for t in templates})
    level_of = {w: i for i, w in enumerate(levels)}
    optimizer_at = {}
    for t in templates:
        optimizer_at[t.max_params] = max(optimizer_at.get(t.max_params, 0.0), t.optimizer_s)

    model = cp_model.CpModel()
    tau = model.NewIntVar(0, scale(bound_s), "tau")
    # One (on, m) pair per possible copy of each template: copy c of template t is used (on) and
    # takes m micro-batches. tau >= (A - M) on + M m is the 1F1B time A + (m - 1) M when the copy is
    # used and the empty bound 0 otherwise (m = 0): linear, no big-M, since A >= M.
    n, used, on, micro, share = {}, {}, {}, [], {}
    for i, t in enumerate(templates):
        copies = min(N // t.num_stages, p_max, total_gpus // t.num_gpus)
        m_max = N
        if t.bottleneck_s > 0:
            m_max = max(t.num_stages, min(N, int((bound_s - t.pipeline_s) / t.bottleneck_s) + 1))
        on[i] = [model.NewBoolVar(f"on{i}_{c}") for c in range(copies)]
        for c, flag in enumerate(on[i]):
            m = model.NewIntVar(0, m_max, f"m{i}_{c}")
            micro.append(m)
            share[i, c] = m
            model.Add(m >= t.num_stages * flag)
            model.Add(m <= m_max * flag)
            model.Add(tau >= (scale(t.pipeline_s) - scale(t.bottleneck_s)) * flag + scale(t.bottleneck_s) * m)
            if c:  # copies in order, busiest first: breaks the symmetry between copies
                model.AddImplication(flag, on[i][c - 1])
                model.Add(micro[-2] >= m)
        n[i] = sum(on[i])
        used[i] = on[i][0] if on[i] else None
    model.Add(sum(micro) == N)

    # Gradient sync and optimizer: a table over (pipelines, widest stage level).
    pipelines = model.NewIntVar(1, p_max, "P")
    model.Add(pipelines == sum(n.values()))
    level = model.NewIntVar(0, len(levels) - 1, "w")
    for i, t in enumerate(templates):
        if used[i] is not None:
            model.Add(level >= level_of[t.max_params]).OnlyEnforceIf(used[i])
    table = [scale(overhead(P, w, optimizer_at[w])) for P in range(1, p_max + 1) for w in levels]
    index = model.NewIntVar(0, len(table) - 1, "overhead_index")
    model.Add(index == (pipelines - 1) * len(levels) + level)
    extra = model.NewIntVar(min(table), max(table), "overhead")
    model.AddElement(index, table, extra)

    # Packing runs onto nodes.
    counts = [Counter(t.run_sizes) for t in templates]
    sizes = sorted({d for c in counts for d in c})
    need = {d: sum(c[d] * n[i] for i, c in enumerate(counts) if d in c) for d in sizes}
    classes = sorted(Counter(capacities).items(), reverse=True)
    patterns: list[tuple[int, tuple[int, ...], cp_model.IntVar]] = []
    if single_node:
        model.Add(sum(d * need[d] for d in sizes) <= max(capacities))
    else:
        for capacity, count in classes:
            fitting = [d for d in sizes if d <= capacity]
            class_vars = []
            for pattern in maximal_patterns(fitting, capacity) if fitting else []:
                y = model.NewIntVar(0, count, f"y{capacity}_{'_'.join(map(str, pattern))}")
                patterns.append((capacity, pattern, y))
                class_vars.append(y)
            if class_vars:
                model.Add(sum(class_vars) <= count)
        for d in sizes:
            model.Add(sum(Counter(p)[d] * y for _, p, y in patterns if d in p) >= need[d])

    model.Minimize(tau + extra)

    # Hint: the greedy plan.
    _, first, copies = start
    split = sorted(balance([first] * copies, N), reverse=True)
    for i, t in enumerate(templates):
        for c, flag in enumerate(on[i]):
            model.AddHint(flag, t is first and c < copies)
            model.AddHint(share[i, c], split[c] if t is first and c < copies else 0)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.05)
    if len(micro) <= SMALL_MODEL:  # presolve and parallel workers cost more than they save here
        solver.parameters.num_workers = 1
        solver.parameters.cp_model_presolve = False
    else:
        solver.parameters.num_workers = WORKERS
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:  # nothing beats the upper bound
        return None, math.inf, True
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # out of time before a solution
        if start[0] >= upper_bound_s:
            return None, 0.0, False
        chosen = [(start[1], start[2])]
        result = _result("FEASIBLE", chosen, N, capacities, single_node, overhead, None, 0.0)
        return result, 0.0, False
    chosen = [
        (t, sum(map(solver.Value, on[i])))
        for i, t in enumerate(templates)
        if on[i] and solver.Value(on[i][0])
    ]
    used_patterns = [(c, p, solver.Value(y)) for c, p, y in patterns]
    bound = solver.BestObjectiveBound() * scale.unit_s
    optimal = status == cp_model.OPTIMAL
    result = _result(
        "OPTIMAL" if optimal else "FEASIBLE",
        chosen,
        N,
        capacities,
        single_node,
        overhead,
        used_patterns,
        bound,
    )
    return result, (result.objective_s if optimal else min(bound, result.objective_s)), optimal


def _result(status, chosen, N, capacities, single_node, overhead, used_patterns, bound) -> MasterResult:
    pipes = [t for t, copies in chosen for _ in range(copies)]
    counts = balance(pipes, N)
    objective = plan_cost_s(pipes, counts, overhead)
    if single_node:
        nodes = ((max(capacities), tuple(r for t in pipes for r in t.run_sizes)),)
    elif used_patterns is None:
        placed = pack_first_fit([r for t in pipes for r in t.run_sizes], capacities)
        nodes = tuple((c, tuple(runs)) for c, runs in zip(capacities, placed, strict=True) if runs)
    else:
        nodes = tuple((c, p) for c, p, count in used_patterns for _ in range(count))
    return MasterResult(
        status=status,
        objective_s=objective,
        bound_s=min(bound, objective),
        pipelines=tuple(zip(pipes, counts, strict=True)),
        nodes=nodes,
    )

"""The master problem: how many pipelines of each template, how many micro-batches each, on which nodes.

For one micro-batch size and one link scope. Data: templates t (A_t, M_t, p_t stages, W_t, H_t and
O_t, run sizes), N micro-batches, node classes c (capacity cap_c, count n_c), and sync(P, t), the
gradient sync a pipeline of template t leaves exposed among P pipelines (its widest stage's reduction
less what its backward hides, H_t, plus a ZeRO-1 gather). A plan's step time is its slowest pipeline
+ max_t sync(P, t) + max O (costmodel.estimate); the last two are its "overhead".

A bound tau on every pipeline's time makes the problem linear: template t can then take at most
k_t(tau) = max{m <= N : A_t + (m - 1) M_t <= tau} micro-batches per pipeline (it needs p_t). CP-SAT
model at fixed tau:

    variables   n_t   pipelines of template t (integer; 0 when k_t(tau) < p_t)
                y_cq  nodes of class c packed with run pattern q (integer; q: a maximal multiset of run
                      sizes that fits cap_c)
                b_P   the plan has P pipelines (one-hot over the P the relaxations leave);
                x, o  its sync and optimizer times
    constraints sum_t p_t n_t <= N <= sum_t k_t(tau) n_t       (a split exists: pipelines of t take
                                                                any number from p_t to k_t(tau))
                sum_t n_t = sum_P P b_P
                x >= sum_P sync(P, t) b_P and o >= O_t  if n_t >= 1
                sum_q y_cq <= n_c;  sum_cq mult_q(d) y_cq >= sum_t mult_t(d) n_t for every run size d
                (every run gets a slot of its size on some node: bin packing by patterns, exact because
                runs of one size are interchangeable, and so are nodes of one class)
                x + o <= s
    objective   minimise x + o                                  -> S*(tau)

The best plan's step time is min over tau of tau + S*(tau), tau ranging over the times
T_t(m) = A_t + (m - 1) M_t a pipeline can take (the best plan's slowest pipeline takes one of them).
S* does not increase with tau, so a staircase search needs few problems:

    tau_0 = the least candidate with any plan (bisection); s_0 = S*(tau_0); best = tau_0 + s_0
    repeat  tau_i+1 = the least candidate with a plan of overhead below min(s_i, best - tau) for the
            next candidate tau (a plan with more cannot beat best there, nor anywhere above it:
            bisection among the candidates whose overhead floor leaves them below best);
            s_i+1 = S*(tau_i+1); best = min(best, tau_i+1 + s_i+1)
    until there is none: best is then optimal.

S*(tau_i+1) is asked only below best - tau_i+1 (a plan with more overhead there cannot beat best,
and the next cap is at most that): where the stair has no such plan, the relaxations mostly prove
it without CP-SAT (llama2-7b on 8,8,8,7: 5 of 6 minimisations settled, the master 0.8x the time).

Most fixed-tau questions that have no plan are settled before CP-SAT by two relaxations, per
pipeline count P: the micro-batches P pipelines can hold at all, and a knapsack of P pipelines over
the cluster's GPUs (`Master.possible_counts`). The counts they leave are the only ones the CP-SAT
model offers (its one-hot b_P and the sync terms weighted by it shrink to them, and so does its LP
relaxation, which is what proves most answers: 0.33x and 0.43x CP-SAT time on llama2-7b on
8,8,8,7 and 8+7). Under an overhead cap, the same relaxations run once more per least hide window
(`Master.coupled_counts`): a plan's sync is priced behind its pipelines' least window, so a template
whose reduction is large cannot join one whose window is small; on llama2-7b 8,8,8,7 that settles 17
of the 22 questions CP-SAT used to prove infeasible. Where the knapsack over GPUs reaches N, a
second one also bounds the runs of more than half a node, one per node (`Master._knapsack`): on
llama2-7b 8,8,8,7 it settles 5 of the 6 questions CP-SAT was left to prove infeasible. Where a
knapsack there reaches N, its pipelines are tried as a plan (`Master.witnessed_plan`: they must
pack and keep the cap), which settles a question that has a plan without CP-SAT; with no cap the
least window admits every template, and the witnesses are tried where the knapsacks are small.
Together: 7 CP-SAT questions instead of 17 on llama2-7b 8,8,8,7, none instead of 4 on llama3-8b
8,8,7 at 256 sequences (0.78x the master's time on the first). The same
relaxations settle most minimisations: S*(tau) is the overhead of a plan already found within
tau when they admit no plan below it (`Master.below`, where a witness of less overhead that makes
a plan is taken and the question asked again); else CP-SAT minimises among the plans below it only
(on llama2-7b 8,8,8,7 they were tight at every one of the 7 minimisations, and settled 2). The
overhead floor per tau (`Master.least_overhead`) keeps the bisection to candidates that could
still beat the best plan.

Where the relaxations leave only plans of one or two pipelines, the question is answered by
enumerating templates and pairs (`Master._pairs_at`: vectorised, packing tested once per pair of
footprints); CP-SAT is left the larger counts. On llama2-70b on 61 GPUs with chunks every question
is of two pipelines over some 600 templates, which CP-SAT took 0.3 s each to decide: the master of
micro-batch 1 takes 2 s instead of 8.7 s.

Where the knapsacks leave a count of more pipelines only because they relax the nodes to a sum
of GPUs, an exact packing of footprint multisets settles it (`Master._none_pack`: llama3-8b on
8,8,7 with chunks, four pipelines that cover 256 micro-batches on 23 GPUs but not on three nodes,
1 ms instead of CP-SAT's 0.06 s for each of five questions).

Only the overhead is an integer in the model, in units of 1e-13 of the incumbent's step time (`_Scale`),
so rounding cannot reorder plans that differ by more than that; tau stays a float. A plan made of copies
of one template (best-fit packing) answers many feasibility questions without CP-SAT and gives the
first incumbent.
"""

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from costmodel.estimate import SyncCost, plan_sync_s
from solver.templates import Packer, Template, packing_matrix

UNITS_PER_BOUND = 1e13  # integer units for the incumbent's step time
# The coupled knapsack (`Master.coupled_counts`) runs where its table updates stay below this many
# cells (windows x GPU sizes x pipelines x GPUs): 8+7 and 8,8,8,7 need thousands; on 987 GPUs the
# knapsack for every count took 6.4 s of a 19 s solve (with chunks), coverage alone 0.45 s.
KNAPSACK_CELLS = 2_000_000
CALL_CELLS = 5000  # a numpy call's overhead in cells updated (`_add_copies`: ~2.6 us, ~0.5 ns a cell)
SAMPLE_EVERY = 16  # Master.least_overhead evaluates its bound at every this many candidates first
SMALL_PLAN_STEPS = 1000  # multisets `Master._none_pack` may extend before it leaves a count to CP-SAT
SMALL_PLAN_NODES = 8  # and the most nodes it packs onto (exact packing: on 128 nodes it took minutes)


class _GaveUp(Exception):
    """`Master._none_pack` went past SMALL_PLAN_STEPS."""


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
    most = [t.max_microbatches or num_microbatches for t in pipes]
    if sum(counts) > num_microbatches or sum(most) < num_microbatches:
        return None
    heap = [(t.time_s(m + 1), i) for i, (t, m) in enumerate(zip(pipes, counts, strict=True)) if m < most[i]]
    heapq.heapify(heap)
    for _ in range(num_microbatches - sum(counts)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < most[i]:  # an interleaved pipeline takes no more than its memory allows
            heapq.heappush(heap, (pipes[i].time_s(counts[i] + 1), i))
    return counts


Sync = Callable[[int, Template], SyncCost]  # (pipelines, template) -> its gradient sync (solver.core)


def plan_cost_s(pipes: Sequence[Template], counts: Sequence[int], sync: Sync) -> float:
    """Step time: slowest pipeline + the slowest pipeline's exposed gradient sync + slowest optimizer step."""
    slowest = max(t.time_s(m) for t, m in zip(pipes, counts, strict=True))
    return slowest + overhead_s(pipes, sync)


def overhead_s(pipes: Sequence[Template], sync: Sync) -> float:
    priced = [(sync(len(pipes), t), t.hide_s) for t in set(pipes)]
    return plan_sync_s(priced) + max(t.optimizer_s for t in pipes)


class Packing:
    """Runs placed on nodes so far, largest first onto the fullest node that takes each (best fit):
    a quick feasible packing (the CP-SAT model packs exactly). Nodes with equal free GPUs are
    interchangeable, so the state is a count of nodes per free-GPU value, and the placements a chain
    that `placed` replays onto node indices only when asked."""

    def __init__(self, capacities: Sequence[int]):
        self.capacities = tuple(capacities)
        self.free = Counter(self.capacities)
        self.chain: tuple | None = None  # (free GPUs, run, runs per node, nodes, earlier chain)

    def add(self, runs: Sequence[int]) -> "Packing | None":
        """A new packing with `runs` added, or None if they do not fit.

        Runs of one size go in bulk: the fullest node that takes one takes as many as it can (best fit
        puts the next on the same node while it has room), and nodes of equal free GPUs alike.
        """
        free, chain = self.free.copy(), self.chain
        for run, left in sorted(Counter(runs).items(), reverse=True):
            while left:
                room = min((f for f, n in free.items() if n and f >= run), default=None)
                if room is None:
                    return None
                per_node = min(left, room // run)
                nodes = min(free[room], left // per_node)
                free[room] -= nodes
                free[room - per_node * run] += nodes
                left -= nodes * per_node
                chain = (room, run, per_node, nodes, chain)
        new = Packing.__new__(Packing)
        new.capacities, new.free, new.chain = self.capacities, free, chain
        return new

    def placed(self) -> list[list[int]]:
        """Runs per node, nodes in the order of the capacities given."""
        steps, chain = [], self.chain
        while chain is not None:
            *step, chain = chain
            steps.append(step)
        by_free: dict[int, list[int]] = {}
        for i, c in enumerate(self.capacities):
            by_free.setdefault(c, []).append(i)
        placed: list[list[int]] = [[] for _ in self.capacities]
        for room, run, per_node, nodes in reversed(steps):
            for _ in range(nodes):
                node = by_free[room].pop()
                placed[node] += [run] * per_node
                by_free.setdefault(room - per_node * run, []).append(node)
        return placed


def pack_best_fit(runs: Sequence[int], capacities: Sequence[int]) -> list[list[int]] | None:
    """Runs per node, or None (module `Packing`)."""
    packing = Packing(capacities).add(runs)
    return None if packing is None else packing.placed()


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
        if not grew:
            out.append(tuple(pattern))

    extend([], capacity, 0)
    return out


class Master:
    """The master problem of one micro-batch size and link scope (module docstring)."""

    def __init__(
        self,
        templates: Sequence[Template],
        capacities: Sequence[int],
        num_microbatches: int,
        sync: Sync,
        *,
        single_node: bool,
        min_pipelines: int = 1,
    ):
        self.N = num_microbatches
        self.p_min = max(1, min_pipelines)  # ZeRO-1 passes: plans of at least this many pipelines
        self.capacities = list(capacities)
        self.single_node = single_node
        self.sync = sync
        gpus = sum(capacities)
        self.templates = [t for t in templates if t.num_stages <= self.N and t.num_gpus <= gpus]
        ts = self.templates
        self.A = np.array([t.pipeline_s for t in ts])
        self.M = np.array([t.bottleneck_s for t in ts])
        self.p = np.array([t.num_stages for t in ts])
        # the most micro-batches a pipeline of each template may take (an interleaved one's memory)
        self.m_max = np.array([t.max_microbatches or self.N for t in ts], dtype=np.int64)
        self.G = np.array([t.num_gpus for t in ts], dtype=np.int64)
        gpus = sum(self.capacities)
        self.copies = np.array([min(self.N // t.num_stages, gpus // t.num_gpus) for t in ts], dtype=np.int64)
        self.p_max = int(self.copies.max(initial=0))
        self.min_overhead = min((t.optimizer_s for t in ts), default=0.0)
        self.runs = [Counter(t.run_sizes) for t in ts]
        prints = sorted({t.footprint for t in ts})
        self.footprint = np.array([prints.index(t.footprint) for t in ts], dtype=np.int64)
        self.packs_into = packing_matrix(prints)
        self.W = np.array([t.max_params for t in ts], dtype=np.int64)
        self.L = np.array([t.last_params for t in ts], dtype=np.int64)
        self.O = np.array([t.optimizer_s for t in ts])
        self.H = np.array([t.hide_s for t in ts])
        self.sync_terms = self._sync_terms()  # reduce, floor, gather [template, pipelines - 1]
        reduce, floor, gather = self.sync_terms
        self.exposed = np.maximum(floor, reduce - self.H[:, None]) + gather  # SyncCost.exposed_s
        self.sizes = sorted({d for c in self.runs for d in c})
        # a run of more than half the largest node takes a node of its own (`_knapsack`)
        big_size = max(self.capacities, default=0) // 2 + 1
        self.big_slots = sum(c >= big_size for c in self.capacities)
        self.big = np.array([sum(r >= big_size for r in t.run_sizes) for t in ts], dtype=np.int64)
        self.scale: _Scale | None = None  # set_scale: solve_master sets it from the incumbent
        self.units = np.zeros((len(ts), 0), dtype=np.int64)
        self.patterns = [] if single_node else self._patterns()
        self._packed: dict[tuple[int, ...], bool] = {}  # _packs, by runs largest first
        self._packer = Packer(self.capacities)  # exact bin packing, memoised (`_pairs_at`, `_none_pack`)
        self._answers: dict[tuple, tuple] = {}  # solve_at's settled answers, by what decides them
        self._index = {id(t): i for i, t in enumerate(ts)}  # template index by identity

    def _sync_terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per template and pipeline count, its SyncCost's reduce, floor and gather seconds. Templates
        of one `sync.key` sync alike (solver.core.sync: by their parameters and window terms), so
        the sync is asked once per key and count (on llama2-7b 8,8,8,7, 125 keys of 577 templates)."""
        key_of = getattr(self.sync, "key", id)
        row_of: dict = {}  # key -> its row
        first: list[Template] = []  # each key's first template
        rows = []
        for t in self.templates:
            key = key_of(t)
            if key not in row_of:
                row_of[key] = len(first)
                first.append(t)
            rows.append(row_of[key])
        terms = np.zeros((len(first), self.p_max, 3))
        for row, t in enumerate(first):
            for P in range(1, self.p_max + 1):
                s = self.sync(P, t)
                terms[row, P - 1] = s.reduce_s, s.floor_s, s.gather_s
        terms = terms[rows]
        return terms[:, :, 0], terms[:, :, 1], terms[:, :, 2]

    def _patterns(self) -> list[tuple[int, int, tuple[int, ...]]]:
        out = []
        for capacity, count in sorted(Counter(self.capacities).items(), reverse=True):
            fitting = [d for d in self.sizes if d <= capacity]
            out += [(capacity, count, q) for q in maximal_patterns(fitting, capacity)] if fitting else []
        return out

    # ---- per-template capacity at a bound tau ------------------------------------------------------
    def capacity(self, tau: float) -> np.ndarray:
        """k_t(tau): the most micro-batches a pipeline of template t takes within tau (0: none)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(self.M > 0, np.floor((tau - self.A) / np.where(self.M > 0, self.M, 1)) + 1, self.N)
        k = np.clip(k, 0, self.m_max).astype(np.int64)
        # Settle floating-point edges with the very expression the candidates were made of
        # (`Template.time_s`: A + (m - 1) M, the same operations in the same order).
        while True:
            over = (k > 0) & (self.A + (k - 1) * self.M > tau)
            if not over.any():
                break
            k -= over
        while True:
            under = (k > 0) & (k < self.m_max) & (self.A + k * self.M <= tau)
            if not under.any():
                break
            k += under
        return np.where(k >= self.p, k, 0)

    def candidates(self, upper_s: float) -> np.ndarray:
        """Every pipeline time T_t(m) in [lowest, upper_s], sorted (computed as Template.time_s does).

        No plan's slowest pipeline is faster than `lowest`: a pipeline of G GPUs and bottleneck M
        takes at least m M for its m micro-batches, so all of them at least N min_t (M_t G_t) / GPUs.
        """
        lowest = self.N * min(t.bottleneck_s * t.num_gpus for t in self.templates) / sum(self.capacities)
        values = []
        for t in self.templates:
            m = np.arange(t.num_stages, (t.max_microbatches or self.N) + 1)
            times = t.pipeline_s + (m - 1) * t.bottleneck_s
            values.append(times[(times <= upper_s) & (times >= lowest)])
        return np.unique(np.concatenate(values)) if values else np.array([])

    def least_overhead(self, taus: np.ndarray) -> np.ndarray:
        """Per bound tau, a lower bound on the overhead of any plan within it.

        Order the templates by W (largest-stage parameters) and take the last one, j, that a plan
        uses: every template of the plan comes before j, so its pipelines hold at most K_j(tau) =
        max k_t(tau) micro-batches each and at most R_j(tau) = max k_t(tau) / G_t per GPU. The plan
        then covers its N micro-batches only if GPUs x R_j >= N, and it has P >= ceil(N / K_j)
        pipelines. Its sync is at least template j's at P (sync grows with pipelines, and the plan's
        hide window is at most j's), and its optimizer step at least O_j. The bound is the least
        over the j that can cover N.

        The bound does not increase with tau (every k_t grows with it), so where it is equal at two
        sampled bounds it is that value at every bound between them: it is computed at every
        SAMPLE_EVERY-th bound and then only inside the intervals where it changes (same values).
        """
        order = np.argsort(self.W, kind="stable")
        ordered = [self.templates[i] for i in order]
        sync = self.exposed[order].T  # [P - 1, template]
        A, M, p, opt, m_max = self.A[order], self.M[order], self.p[order], self.O[order], self.m_max[order]
        gpus_each = np.array([t.num_gpus for t in ordered], dtype=float)
        gpus = sum(self.capacities)

        def at(bounds: np.ndarray) -> np.ndarray:
            least = np.full(len(bounds), np.inf)
            for lo in range(0, len(bounds), 2048):  # chunks keep the [taus x templates] block small
                tau = bounds[lo : lo + 2048, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    k = np.floor((tau - A) / np.where(M > 0, M, 1)) + 2  # one extra: a safe bound
                k = np.minimum(np.where(M > 0, np.clip(k, 0, self.N), self.N), m_max)
                k = np.where(k >= p, k, 0)
                most = np.maximum.accumulate(k, axis=1)  # K_j
                per_gpu = np.maximum.accumulate(k / gpus_each, axis=1)  # R_j
                pipelines = np.where(most > 0, -(-self.N // np.maximum(most, 1)), self.p_max + 1)
                pipelines = np.maximum(pipelines.astype(np.int64), self.p_min)
                over = sync[np.minimum(pipelines, self.p_max) - 1, np.arange(len(order))] + opt
                covers = (pipelines <= self.p_max) & (k > 0) & (gpus * per_gpu >= self.N)
                least[lo : lo + 2048] = np.where(covers, over, np.inf).min(axis=1)
            return least

        n = len(taus)
        sampled = np.unique(np.r_[np.arange(0, n, SAMPLE_EVERY), n - 1]) if n else np.array([], np.int64)
        values = at(taus[sampled])
        least = values[np.searchsorted(sampled, np.arange(n))]  # the next sample's: exact where equal
        changes = np.flatnonzero(values[:-1] != values[1:])
        inside = [np.arange(sampled[i] + 1, sampled[i + 1]) for i in changes]
        if inside:
            exact = np.concatenate(inside)
            least[exact] = at(taus[exact])
        return least

    # ---- one template repeated: quick answers ------------------------------------------------------
    def set_scale(self, scale: _Scale) -> None:
        """Fix the integer unit and tabulate, per template and pipeline count, its overhead alone and
        the two sync terms the CP-SAT model sums (in units)."""
        self.scale = scale
        reduce, floor, gather = self.sync_terms

        def units(seconds: np.ndarray) -> np.ndarray:  # `_Scale`, elementwise (both round half even)
            return np.rint(seconds / scale.unit_s).astype(np.int64)

        self.optimizer_units = units(self.O)
        self.units = units(self.exposed) + self.optimizer_units[:, None]
        self.floor_units = units(floor + gather)
        self.reduce_units = units(reduce + gather)
        self.hide_units = units(self.H)

    def most_pipelines(self, cap: float) -> np.ndarray:
        """Per template, the most pipelines a plan using it can have within overhead cap (units)."""
        return (self.units <= cap).sum(axis=1)  # the overhead grows with the pipeline count

    def copies_plan(self, tau: float, cap: float) -> tuple[int, list[Template]] | None:
        """The cheapest plan of copies of one template within tau and overhead cap (units), if any:
        each template at the fewest copies that cover N (its least overhead), tried for packing in
        order of overhead (the first template of the least)."""
        k = self.capacity(tau)
        (idx,) = np.nonzero(k)
        n = np.maximum(-(-self.N // k[idx]), self.p_min)
        fits = (n * self.p[idx] <= self.N) & (n <= self.copies[idx])
        idx, n = idx[fits], n[fits]
        units = self.units[idx, n - 1]
        within = units <= cap
        idx, n, units = idx[within], n[within], units[within]
        for at in np.argsort(units, kind="stable"):
            pipes = [self.templates[idx[at]]] * int(n[at])
            if self._packs(pipes):
                return int(units[at]), pipes
        return None

    def _packs(self, pipes: Sequence[Template]) -> bool:
        runs = tuple(sorted((r for t in pipes for r in t.run_sizes), reverse=True))
        if self.single_node:
            return sum(runs) <= max(self.capacities)
        if runs not in self._packed:  # templates share footprints: pack each multiset once
            self._packed[runs] = Packing(self.capacities).add(runs) is not None
        return self._packed[runs]

    def _none_pack(self, k: np.ndarray, live: list[int], cap: float, P: int) -> bool:
        """Whether no P pipelines of the live templates that allow P within the cap
        (`most_pipelines`) cover N micro-batches within N stages and pack onto the nodes: a
        relaxation of the model at P (its coupled sync left out) whose packing is exact bin packing
        of the runs, as the model's patterns pack them. Templates of one footprint count as one,
        with the most capacity and the fewest stages of any of them (`_no_cover`); False (not
        refuted) where that search takes more than SMALL_PLAN_STEPS steps or the cluster has more
        than SMALL_PLAN_NODES nodes. On llama3-8b on 8,8,7
        with chunks, where a knapsack over GPUs reaches N = 256 with four pipelines on the 23 GPUs
        but no four pipelines' runs pack onto the three nodes, it settles in 1 ms each the five
        questions CP-SAT took 0.06 s to prove. (Asked per least window as `coupled_counts` asks,
        it settles the five that llama2-7b on 8,8,8,7 with chunks leaves CP-SAT too, but in 36 ms
        each against its 20 ms.)"""
        if len(self.capacities) > SMALL_PLAN_NODES:
            return False  # exact packing of many runs onto many nodes can take exponential time
        allowed = self.most_pipelines(cap)
        kinds: dict[int, list[int]] = {}  # footprint -> [most capacity, fewest stages, a template]
        for i in live:
            if allowed[i] >= P:
                kind = kinds.setdefault(int(self.footprint[i]), [0, self.N + 1, i])
                kind[0], kind[1] = max(kind[0], int(k[i])), min(kind[1], int(self.p[i]))
        try:
            return self._no_cover(sorted(kinds.values(), key=lambda kind: -kind[0]), P)
        except _GaveUp:
            return False

    def _no_cover(self, items: list[list[int]], P: int) -> bool:
        """Whether no multiset of P of these footprints ([capacity, stages, a template], most
        capacity first) covers N within N stages and packs: a depth-first search, cut where the
        rest cannot cover N (by count and by GPUs left) and where what is chosen does not pack (nor
        then does anything holding it); `_GaveUp` past SMALL_PLAN_STEPS steps."""
        if not items:
            return True
        held = [kind[0] for kind in items]
        stages = [kind[1] for kind in items]
        runs = [self.templates[kind[2]].run_sizes for kind in items]
        width = [sum(r) for r in runs]
        # per GPU, the most any footprint from here on holds: what the GPUs left can still add
        dense = list(itertools.accumulate([h / g for h, g in zip(held, width, strict=True)][::-1], max))[::-1]
        fewest, gpus, steps = min(stages), sum(self.capacities), 0

        def extend(start: int, left: int, covered: int, used: int, chosen: tuple[int, ...]) -> bool:
            nonlocal steps
            if left == 0:
                return covered >= self.N
            free = gpus - sum(chosen)
            for j in range(start, len(items)):
                if covered + left * held[j] < self.N or covered + free * dense[j] < self.N * (1 - 1e-12):
                    return False  # no later footprint holds more, nor more per GPU
                if used + stages[j] + (left - 1) * fewest > self.N or width[j] > free:
                    continue
                steps += 1
                if steps > SMALL_PLAN_STEPS:
                    raise _GaveUp
                more = (*chosen, *runs[j])
                if self._runs_pack(more) and extend(j, left - 1, covered + held[j], used + stages[j], more):
                    return True
            return False

        return not extend(0, P, 0, 0, ())

    def _runs_pack(self, runs: tuple[int, ...]) -> bool:
        """Whether these runs pack onto the nodes (exact bin packing)."""
        return sum(runs) <= max(self.capacities) if self.single_node else self._packer.fits(runs)

    def possible_counts(self, k: np.ndarray, live: list[int], cap: float) -> list[int]:
        """The pipeline counts P that two relaxations leave possible within tau and overhead cap
        (empty: no plan). A plan of P pipelines uses only templates that allow P within the cap
        (`most_pipelines`).

        Coverage: its pipelines hold at most P max k micro-batches, at most (GPUs) max k / G, and at
        most what every copy of those templates holds. Knapsack (keeps the integrality coverage
        drops): its pipelines' GPUs sum to at most the cluster's (node boundaries and the coupling
        of the plan's sync relaxed), so P pipelines hold at most the best exactly-P knapsack over
        GPU counts. One table serves every P: templates enter by the most pipelines they allow,
        largest first, so that the row of P is read once every template allowing P is in and no
        other is.
        """
        gpus = sum(self.capacities)
        most = self.most_pipelines(cap)[live]
        top = int(most.max(initial=0))
        if top < self.p_min:
            return []
        order = np.argsort(-most, kind="stable")
        most, kk, width = most[order], k[live][order].astype(float), self.G[live][order]
        # coverage per number of templates entered (those that allow the most pipelines first)
        k_max = np.maximum.accumulate(kk)
        per_gpu_max = np.maximum.accumulate(kk / width)
        all_copies = np.cumsum(np.minimum(self.copies[live][order], most) * kk)
        fewest_stages = np.minimum.accumulate(self.p[live][order])
        # A template enters the knapsack only if it holds more than every one of as many GPUs or
        # fewer entered before it: swapping it for that one leaves a plan on no more GPUs that
        # holds no less, so it raises no row's best.
        g_values, g_of = np.unique(width, return_inverse=True)
        by_width = np.full((len(g_values), len(kk)), -np.inf)
        by_width[g_of, np.arange(len(kk))] = kk
        most_held = np.maximum.accumulate(np.maximum.accumulate(by_width, axis=0), axis=1)
        before = np.r_[-np.inf, most_held[g_of[1:], np.arange(len(kk) - 1)]]  # earlier, as wide or less
        entering = np.flatnonzero(kk > before).tolist()
        allowing = len(most) - np.searchsorted(most[::-1], np.arange(top + 1), side="left")  # most >= P
        held = np.full((top + 1, gpus + 1), -np.inf)  # most micro-batches of c pipelines on g GPUs
        held[0, 0] = 0.0
        at, out = 0, []
        for P in range(top, self.p_min - 1, -1):
            last = int(allowing[P]) - 1  # the templates that allow P
            while at < len(entering) and entering[at] <= last:
                g, value = int(width[entering[at]]), kk[entering[at]]
                at += 1
                _add_copies(held[None, :, None, :], value[None], g, 0, P)  # rows above P are read already
            covered = min(P * k_max[last], gpus * per_gpu_max[last], all_copies[last])
            if covered >= self.N and P * fewest_stages[last] <= self.N and held[P].max() >= self.N:
                out.append(P)
        return out[::-1]

    def coupled_counts(
        self, k: np.ndarray, live: list[int], cap: float, counts: list[int], witnesses: dict | None = None
    ) -> list[int]:
        """Of `counts`, those that the coverage and knapsack relaxations still leave once the plan's
        sync couples its templates (within overhead cap, in units).

        A plan's sync is priced behind its pipelines' least hide window H (`plan_sync_s`, the CP-SAT
        model's h): every template t it uses has H <= hide_t and max(floor_t, reduce_t - H) + O_t
        within the cap, so t is admissible at H only for H in [reduce_t + O_t - cap, hide_t]. A plan
        of P pipelines whose least window is template j's uses only the templates admissible at
        hide_j, so some j must leave a set that covers N micro-batches with P pipelines (the
        relaxations of `possible_counts`, the knapsack over GPU counts exact per set). One template
        alone is checked by `most_pipelines`; mixing a template whose reduction is large with one
        whose window is small is what this rules out (on llama2-7b 8,8,8,7, 17 of the 22 questions
        CP-SAT proved infeasible). Without a cap every template is admissible at the least window,
        which is then the only one asked. The knapsack also counts the nodes the big runs take
        where they could bind (`_knapsack`). `witnesses` receives, per count left, the pipelines of
        a knapsack that reaches N (`witnessed_plan` checks whether they make a plan)."""
        gpus = sum(self.capacities)
        idx = np.array(live)
        kk, width, stages = k[idx].astype(float), self.G[idx], self.p[idx]
        hide, opt = self.hide_units[idx], self.optimizer_units[idx]
        copies = self.copies[idx]
        left = []
        for P in counts:
            row = P - 1
            low = self.reduce_units[idx, row] + opt - cap  # the least window t tolerates
            ok = (self.floor_units[idx, row] + opt <= cap) & (low <= hide)
            windows = np.unique(hide[ok])
            if not len(windows):
                continue
            if not math.isfinite(cap):  # the least window admits every template the others do
                windows = windows[:1]
            # admissible[w, t]: template t is admissible where the least window is windows[w]
            admissible = ok & (low[None, :] <= windows[:, None]) & (hide[None, :] >= windows[:, None])
            held = np.where(admissible, kk, 0.0)
            covers = (
                (P * held.max(axis=1) >= self.N)
                & (gpus * (held / width).max(axis=1) >= self.N)
                & ((np.minimum(copies, P) * held).sum(axis=1) >= self.N)
                & (P * np.where(admissible, stages, self.N + 1).min(axis=1) <= self.N)
            )
            if not covers.any():
                continue
            # Knapsack per window: P pipelines on at most the GPUs (and the nodes, where runs of
            # more than half a node could outnumber them); only the best capacity of each GPU count
            # matters, and windows with the same bests ask the same question.
            rows = np.flatnonzero(covers)
            found = self._knapsack(admissible[rows], kk, width, np.zeros_like(width), 0, P)
            if found is None:  # too large to pay for itself: coverage only
                left.append(P)
                continue
            reached, table, first, items, best = found
            if not reached.any():
                continue
            nodes = not self.single_node and P * int(self.big[idx].max()) > self.big_slots
            if nodes:  # the GPUs leave P: the nodes the big runs take might not
                found = self._knapsack(admissible[rows], kk, width, self.big[idx], self.big_slots, P)
                if found is not None:
                    reached, table, first, items, best = found
                    if not reached.any():
                        continue
                nodes = found is not None
            left.append(P)
            if witnesses is not None:
                r = int(reached.argmax())
                window = windows[rows[first[r]]]
                members = idx[admissible[np.searchsorted(windows, window)]]
                named = [(g, b if nodes else None) for g, b in items]
                witnesses[P] = _knapsack_items(table[r], named, best[r].tolist(), P), members
        return left

    def _knapsack(
        self, admissible: np.ndarray, kk: np.ndarray, width: np.ndarray, big: np.ndarray, slots: int, P: int
    ):
        """Per row of `admissible` (a least window's templates): can P of them, copies allowed,
        reach N micro-batches on at most the cluster's GPUs and at most `slots` big runs?

        A run of more than half the largest node takes a node of its own, so a plan holds at most
        `big_slots` of them (the nodes that large; `big` counts each template's). On llama2-7b
        8,8,8,7 that proves 5 of the 6 questions CP-SAT found infeasible: five pipelines that hold
        the micro-batches on 31 GPUs need five runs of 5 GPUs or more, and there are four nodes.
        With `slots` 0 (and `big` 0) it is the knapsack over GPUs alone. Only the best capacity of
        each (GPUs, big runs) item matters, and rows with the same bests ask the same question.

        Returns None when the table would exceed KNAPSACK_CELLS, else (reached per row asked, the
        tables [row, pipelines, big runs, GPUs] of the most capacity on exactly that many, the
        first row of `admissible` that each asks for, the (GPUs, big runs) items, each row's
        capacity per item), for the distinct rows that no other row holds as much as in every
        item: some row reaches N exactly where one of these does."""
        gpus = sum(self.capacities)
        (kept,) = np.nonzero(big <= slots)
        keys = width[kept] * (slots + 1) + big[kept]  # one item per (GPUs, big runs), in that order
        order = np.argsort(keys, kind="stable")
        kept, keys = kept[order], keys[order]
        starts = np.flatnonzero(np.diff(keys, prepend=-1))
        items = [(int(key) // (slots + 1), int(key) % (slots + 1)) for key in keys[starts]]
        if not items:  # every template has more big runs than the nodes that take them
            return np.zeros(1, dtype=bool), None, None, items, None
        if slots and len(admissible) * len(items) * P * (slots + 1) * (gpus + 1) > KNAPSACK_CELLS:
            return None  # (before the rows are made distinct: the nodes' bound is only worth a little)
        reach = np.where(admissible[:, kept], kk[kept], -np.inf)  # items no admissible template has: none
        best = np.maximum.reduceat(reach, starts, axis=1)
        # distinct rows, in lexicographic order, each with its first row
        rank = np.lexsort(best.T[::-1])
        fresh = np.r_[True, (best[rank[1:]] != best[rank[:-1]]).any(axis=1)]
        best, first = best[rank[fresh]], rank[fresh]
        # A row whose every item holds no more than in another row reaches N only if that one does:
        # the windows' admissible sets are mostly nested (llama2-7b 8,8,8,7: 1-5 of some 30 left).
        covered = (best[:, None, :] <= best[None, :, :]).all(axis=2)
        np.fill_diagonal(covered, False)
        top = ~covered.any(axis=1)
        best, first = best[top], first[top]
        if best.size * P * (slots + 1) * (gpus + 1) > KNAPSACK_CELLS:
            return None
        table = np.full((len(best), P + 1, slots + 1, gpus + 1), -np.inf)
        table[:, 0, 0, 0] = 0.0
        for (g, b), value in zip(items, best.T, strict=True):
            _add_copies(table, value, g, b, P)
        reached = table[:, P].reshape(len(best), -1).max(axis=1) >= self.N
        return reached, table, first, items, best

    def witnessed_plan(self, k: np.ndarray, cap: float, witnesses: dict) -> list[Template] | None:
        """A plan within cap from a knapsack witness of `coupled_counts`, if one packs: its pipelines
        one by one, each the template of its GPU count, capacity (and big runs: `_knapsack`) that
        still packs (best fit) with the fewest stages, then the CP-SAT model's own tests (the
        stages fit the micro-batches, the overhead in units is within the cap). The pipelines go
        largest first, and where that leaves no room, those with runs of more than half a node
        first (a large pipeline spread over small runs can take the nodes they need)."""
        for P, (items, members) in sorted(witnesses.items()):
            orders = [sorted(items, reverse=True)]
            if any(big for _, _, big in items):
                orders.append(sorted(items, key=lambda item: (item[2], item[0], item[1]), reverse=True))
            for order in orders:
                pipes = self._witness_pipes(k, P, order, members)
                if pipes is None or sum(int(self.p[i]) for i in pipes) > self.N:
                    continue
                plan = [self.templates[i] for i in pipes]
                if self.overhead_units(plan) <= cap and (
                    self.single_node or _pack_pipelines(plan, self.capacities) is not None
                ):
                    return plan
        return None

    def _witness_pipes(self, k: np.ndarray, P: int, items: list, members) -> list[int] | None:
        """The templates `witnessed_plan` picks for the knapsack items in this order, or None."""
        kinds: dict[tuple, list[int]] = {}  # (GPUs, capacity, big runs or None) -> fewest stages first
        for i in sorted(members, key=lambda i: (self.p[i], self.units[i, P - 1])):
            kinds.setdefault((int(self.G[i]), int(k[i]), int(self.big[i])), []).append(i)
            kinds.setdefault((int(self.G[i]), int(k[i]), None), []).append(i)
        packing, pipes = Packing(self.capacities), []
        for g, value, big in items:
            for i in kinds.get((g, int(value), big), ()):
                placed = packing if self.single_node else packing.add(self.templates[i].run_sizes)
                if placed is not None:
                    packing = placed
                    pipes.append(i)
                    break
            else:
                return None  # no template of this kind packs beside the others
        return pipes if len(pipes) == P else None

    def _undominated(self, k: np.ndarray, live: list[int]) -> list[int]:
        """Within tau a template is only its capacity k, stages p, W, last-layer parameters, O, hide
        window and footprint: drop one when another is no worse in all of them (more k, fewer p,
        a wider window, ...) and packs wherever it does."""
        idx = np.array(live)
        kk, p, w, o, f = k[idx], self.p[idx], self.W[idx], self.O[idx], self.footprint[idx]
        last, narrow = self.L[idx], -self.hide_units[idx]
        # better[b, a]: template b is no worse than template a in everything; same[b, a]: identical
        better = (kk[:, None] >= kk[None, :]) & self.packs_into[f[:, None], f[None, :]]
        same = (kk[:, None] == kk[None, :]) & (f[:, None] == f[None, :])
        for x in (p, w, o, last, narrow):
            better &= x[:, None] <= x[None, :]
            same &= x[:, None] == x[None, :]
        better &= ~np.tril(same)  # of equal ones the first is kept (and none beats itself)
        return [int(i) for i in idx[~better.any(axis=0)]]

    # ---- the CP-SAT model at fixed tau -------------------------------------------------------------
    def _relaxed_at(self, tau: float, cap: float, witness: bool):
        """What the relaxations say of plans within tau and overhead cap (units): (k, live templates,
        the pipeline counts left (none: no plan), a plan within both found from a knapsack witness
        when `witness` (else None))."""
        k = self.capacity(tau)
        live = list(np.flatnonzero(k))
        counts = self.possible_counts(k, live, cap) if live else []
        plan = None
        # With no cap the windows couple nothing, but the nodes and the witnesses count: where the
        # knapsacks of every count are small (on 987 GPUs they took 1 s and settled nothing).
        small = len(counts) * max(counts, default=0) * (sum(self.capacities) + 1) * len(self.sizes)
        if counts and (math.isfinite(cap) or small <= KNAPSACK_CELLS):
            witnesses: dict = {}
            counts = self.coupled_counts(k, live, cap, counts, witnesses if witness else None)
            plan = self.witnessed_plan(k, cap, witnesses) if witnesses else None
        return k, live, counts, plan

    def below(self, tau: float, cap: float) -> tuple[bool | None, list[Template] | None]:
        """Whether a plan within tau has overhead at most cap (units), as far as the relaxations and
        their witnesses tell without CP-SAT: (False, None): none; (True, its pipelines); (None,
        None): undecided."""
        _, _, counts, plan = self._relaxed_at(tau, cap, witness=True)
        if plan is not None:
            return True, plan
        return (False, None) if not counts else (None, None)

    def overhead_units(self, pipes: Sequence[Template]) -> int:
        """A plan's overhead in units, as the CP-SAT model counts it (x + o)."""
        used = {self._index[id(t)] for t in pipes}
        row, hide = len(pipes) - 1, min(int(self.hide_units[i]) for i in used)
        sync = max(max(int(self.floor_units[i, row]), int(self.reduce_units[i, row]) - hide) for i in used)
        return sync + max(int(self.optimizer_units[i]) for i in used)

    def solve_at(self, tau: float, cap: float, time_limit_s: float, minimise: bool):
        """(status, overhead in units, pipelines, node patterns) of the model at tau, overhead <= cap.

        With `minimise` the cap is no constraint of the model (CP-SAT 9.15's presolve can wrongly
        prove infeasible a model whose objective has a parallel upper-bound constraint); the search
        only asks for the least overhead at a tau where it already knows a plan within the cap
        exists, so the least is within the cap too, and the pipeline counts and templates the cap
        rules out stay out of the model (over all counts, the 13 minimisations of llama2-7b on
        8,8,8,7 took 2.4x as long).
        """
        k, live, counts, plan = self._relaxed_at(tau, cap, witness=not minimise)
        if plan is not None:  # a plan within the cap: the question is settled without CP-SAT
            return cp_model.OPTIMAL, None, plan, None
        if not counts:
            return cp_model.INFEASIBLE, None, None, None
        live = self._undominated(k, live)
        # Within tau a template is only its capacity: bounds whose undominated templates have the
        # same capacities ask the same question (the staircase and its bisections meet them again).
        key = (tuple(live), k[live].tobytes(), cap, minimise)
        if key not in self._answers:
            answer = self._decide(k, live, cap, time_limit_s, minimise, counts)
            if answer[0] not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
                return answer  # not settled within the time limit: not kept
            self._answers[key] = answer
        return self._answers[key]

    def _decide(
        self, k: np.ndarray, live: list[int], cap: float, time_limit_s: float, minimise: bool, counts
    ):
        """The model's answer at tau: plans of one or two pipelines by enumeration (`_pairs_at`),
        those of more by CP-SAT (`_model_at`), the better of the two; where one count of more is
        left and no multiset of templates packs (`_none_pack`), so is CP-SAT."""
        few, rest = [P for P in counts if P <= 2], [P for P in counts if P > 2]
        # CP-SAT is spared only where every count is refuted, which is seldom where there are
        # several (llama2-7b on 8,8,8,7: 7 of 7..13 pipelines; asking them cost it 5%)
        if len(rest) == 1 and self._none_pack(k, live, cap, rest[0]):
            rest = []
        if not few and not rest:
            return cp_model.INFEASIBLE, None, None, None
        pairs = self._pairs_at(k, live, cap, minimise, few) if few else None
        if pairs is None:  # none asked, or the enumeration's plan would not be placed as found
            return self._model_at(k, live, cap, time_limit_s, minimise, [*few, *rest])
        if not rest or (pairs[0] == cp_model.OPTIMAL and not minimise):
            return pairs
        more = self._model_at(k, live, cap, time_limit_s, minimise, rest)
        if more[0] == cp_model.INFEASIBLE or (
            pairs[0] == cp_model.OPTIMAL and more[0] == cp_model.OPTIMAL and pairs[1] <= more[1]
        ):
            return pairs
        return more

    def _pairs_at(self, k: np.ndarray, live: list[int], cap: float, minimise: bool, counts: list[int]):
        """`_model_at` for plans of one or two pipelines, by enumeration: every template and pair
        of templates whose capacities cover N, whose stages fit N and which the cap allows, with
        the overhead the model counts (`overhead_units`), tested for packing in order of overhead
        (exact bin packing, once per pair of footprints). None where the plan found would not
        pack pipeline by pipeline as `_result` places it: the model then decides. On llama2-70b
        on 61 GPUs with chunks every master question is of two pipelines over some 600 templates:
        CP-SAT took 0.3 s for each."""
        allowed = self.most_pipelines(cap)
        idx = np.array([i for i in live if allowed[i] >= counts[0]], dtype=np.int64)
        if not len(idx):
            return cp_model.INFEASIBLE, None, None, None
        kk, p, hide = k[idx], self.p[idx], self.hide_units[idx]
        opt, prints = self.optimizer_units[idx], self.footprint[idx]
        found = []  # per count: (overhead in units, first member, second member or -1), members into idx
        for P in counts:
            use = allowed[idx] >= P
            floor, reduce = self.floor_units[idx, P - 1], self.reduce_units[idx, P - 1]
            if P == 1:
                (a,) = np.nonzero(use & (kk >= self.N) & (p <= self.N))
                units = np.maximum(floor[a], reduce[a] - hide[a]) + opt[a]
                found.append((units, a, np.full(len(a), -1)))
                continue
            a, b = np.triu_indices(len(idx))  # pairs a <= b
            ok = use[a] & use[b] & (kk[a] + kk[b] >= self.N) & (p[a] + p[b] <= self.N)
            a, b = a[ok], b[ok]
            least = np.minimum(hide[a], hide[b])
            sync = np.maximum(
                np.maximum(floor[a], reduce[a] - least), np.maximum(floor[b], reduce[b] - least)
            )
            found.append((sync + np.maximum(opt[a], opt[b]), a, b))
        units, a, b = (np.concatenate(column) for column in zip(*found, strict=True))
        if not minimise and math.isfinite(cap):
            within = units <= cap
            units, a, b = units[within], a[within], b[within]
        # packing, once per pair of footprints (-1: none)
        width = len(self.packs_into)
        pair = prints[a] * (width + 1) + np.where(b >= 0, prints[np.maximum(b, 0)], width)
        keys, first = np.unique(pair, return_index=True)
        packed = np.zeros(len(keys), dtype=bool)
        for i, at in enumerate(first):
            members = [a[at]] if b[at] < 0 else [a[at], b[at]]
            packed[i] = self._runs_pack(tuple(r for m in members for r in self.templates[idx[m]].run_sizes))
        ok = packed[np.searchsorted(keys, pair)]
        if not ok.any():
            return cp_model.INFEASIBLE, None, None, None
        at = int(np.flatnonzero(ok)[np.argmin(units[ok])])  # the least overhead that packs
        plan = [self.templates[idx[m]] for m in ((a[at],) if b[at] < 0 else (a[at], b[at]))]
        if not self.single_node and _pack_pipelines(plan, self.capacities) is None:
            return None  # it packs, but not as `_result` places it
        return cp_model.OPTIMAL, (int(units[at]) if minimise else None), plan, None

    def _joinable(self, k: np.ndarray, live: list[int], counts: list[int], allowed: np.ndarray) -> list[int]:
        """The templates that can be one of P pipelines for some count P left: with the other P - 1
        holding at most the most micro-batches, needing at least the fewest GPUs and stages of the
        templates allowing P (`most_pipelines`), it must still cover N on the cluster's GPUs."""
        idx = np.array(live)
        kk, G, p = k[idx], self.G[idx], self.p[idx]
        keep = np.zeros(len(idx), dtype=bool)
        for P in counts:
            use = allowed[idx] >= P
            if not use.any():
                continue
            others = P - 1
            keep |= (
                use
                & (kk + others * kk[use].max() >= self.N)
                & (G + others * G[use].min() <= sum(self.capacities))
                & (p + others * p[use].min() <= self.N)
            )
        return [int(i) for i in idx[keep]]

    def _model_at(
        self,
        k: np.ndarray,
        live: list[int],
        cap: float,
        time_limit_s: float,
        minimise: bool,
        counts: list[int],
    ):
        allowed = self.most_pipelines(cap)
        live = self._joinable(k, live, counts, allowed)
        if not live:
            return cp_model.INFEASIBLE, None, None, None
        model = cp_model.CpModel()
        upper = {i: min(int(self.copies[i]), int(allowed[i]), counts[-1]) for i in live}
        n = {i: model.NewIntVar(0, upper[i], f"n{i}") for i in live}
        model.Add(sum(int(self.p[i]) * n[i] for i in live) <= self.N)
        model.Add(sum(int(k[i]) * n[i] for i in live) >= self.N)
        # P as one-hot b[P] over the counts the relaxations leave; sync grows with P, and the
        # pipeline that hides least of it sets it.
        b = {P: model.NewBoolVar(f"P{P}") for P in counts}
        b_list = list(b.values())
        model.AddExactlyOne(b_list)
        model.Add(sum(n.values()) == sum(P * b[P] for P in counts))
        rows = [P - 1 for P in counts]
        scale = self.scale
        top = max(int(self.reduce_units[i, rows[-1]] + self.floor_units[i, rows[-1]]) for i in live)
        x = model.NewIntVar(0, top, "sync")
        # the plan's hide window: the least of its pipelines' (costmodel.estimate.plan_sync_s)
        h = model.NewIntVar(0, max(scale(self.templates[i].hide_s) for i in live), "hide")
        o = model.NewIntVar(0, scale(max(self.templates[i].optimizer_s for i in live)), "optimizer")
        for i in live:
            t = self.templates[i]
            used = model.NewBoolVar(f"used{i}")
            model.Add(n[i] <= upper[i] * used)
            model.Add(n[i] >= used)
            banned = [b[P] for P in counts if allowed[i] < P]
            if banned:  # the template rules out more pipelines: one clique with the counts it bans
                model.AddAtMostOne([used, *banned])
            model.Add(h <= scale(t.hide_s)).OnlyEnforceIf(used)
            floor = cp_model.LinearExpr.WeightedSum(b_list, self.floor_units[i, rows].tolist())
            model.Add(x >= floor).OnlyEnforceIf(used)
            reduce = cp_model.LinearExpr.WeightedSum(b_list, self.reduce_units[i, rows].tolist())
            model.Add(x >= reduce - h).OnlyEnforceIf(used)
            model.Add(o >= scale(t.optimizer_s)).OnlyEnforceIf(used)
        extra = x + o
        if math.isfinite(cap) and not minimise:
            model.Add(extra <= int(cap))
        need = {d: sum(self.runs[i][d] * n[i] for i in live if d in self.runs[i]) for d in self.sizes}
        ys = []
        if self.single_node:
            model.Add(sum(d * need[d] for d in self.sizes) <= max(self.capacities))
        else:
            for capacity, count in sorted(Counter(self.capacities).items()):
                of_class = []
                for c, _, q in self.patterns:
                    if c == capacity:
                        y = model.NewIntVar(0, count, "y")
                        ys.append((c, q, y))
                        of_class.append(y)
                if of_class:
                    model.Add(sum(of_class) <= count)
            for d in self.sizes:
                model.Add(sum(Counter(q)[d] * y for _, q, y in ys if d in q) >= need[d])
        if minimise:
            model.Minimize(extra)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(time_limit_s, 0.01)
        solver.parameters.num_workers = 1
        solver.parameters.cp_model_presolve = False
        solver.parameters.linearization_level = 2
        # Probing (fixing each Boolean in turn to learn implications) costs more than it prunes on
        # these small models: CP-SAT's time on the solver benchmark's cases fell by 0.6-0.8x without it.
        solver.parameters.cp_model_probing_level = 0
        status = solver.Solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, None, None, None
        pipes = [self.templates[i] for i in live for _ in range(solver.Value(n[i]))]
        patterns = [(c, q, solver.Value(y)) for c, q, y in ys]
        value = solver.Value(x) + solver.Value(o) if minimise else None
        return status, value, pipes, patterns


def _add_copies(table: np.ndarray, value: np.ndarray, g: int, b: int, P: int) -> None:
    """Add any number of copies of an item of `g` GPUs and `b` big runs, holding `value` per row,
    to the knapsack `table` [row, items, big runs, GPUs] (the most capacity of that many items on
    exactly that many), in place, for rows of at most P items.

    One update per item count c (from c - 1, in order, so copies stack), or one per number j of
    copies at once (from the table before the item): the first does P updates of a row each, the
    second at most the copies that fit, of P + 1 - j rows each. Each is taken where it costs less,
    a numpy call counting as CALL_CELLS cells: on 8,8,8,7 the copies that fit are few (large g),
    on 987 GPUs a count of 100 pipelines makes the second quadratic."""
    slots, gpus = table.shape[2] - 1, table.shape[3] - 1
    most = min(P, gpus // g, slots // b if b else P)
    if most < 1:
        return
    row = len(table) * (slots + 1 - b) * (gpus + 1 - g)  # cells a row's update touches, at most
    by_copies = most * CALL_CELLS + row * (most * (2 * P + 1 - most)) // 2
    if by_copies < P * (CALL_CELLS + row):
        before = table[:, :P, : slots + 1 - b, : gpus + 1 - g].copy()  # what j >= 1 copies read
        for j in range(1, most + 1):
            np.maximum(
                table[:, j : P + 1, j * b :, j * g :],
                before[:, : P + 1 - j, : slots + 1 - j * b, : gpus + 1 - j * g]
                + j * value[:, None, None, None],
                out=table[:, j : P + 1, j * b :, j * g :],
            )
        return
    for c in range(1, P + 1):
        np.maximum(
            table[:, c, b:, g:],
            table[:, c - 1, : slots + 1 - b, : gpus + 1 - g] + value[:, None, None],
            out=table[:, c, b:, g:],
        )


def _knapsack_items(table: np.ndarray, items: list[tuple[int, int | None]], values: list[float], count: int):
    """(GPU count, capacity, big runs or None) of the `count` items behind a knapsack table's best
    entry (table[c, b, g]: the most capacity of c items on exactly g GPUs and b big runs, built
    from `values`; a knapsack over GPUs alone has one b)."""
    b, g = np.unravel_index(int(np.argmax(table[count])), table[count].shape)
    found = []
    for c in range(count, 0, -1):
        for (size, big), value in zip(items, values, strict=True):
            runs = big or 0
            if size <= g and runs <= b and table[c - 1, b - runs, g - size] + value == table[c, b, g]:
                found.append((size, value, big))
                g, b = g - size, b - runs
                break
    return found


def solve_master(
    templates: Sequence[Template],
    capacities: Sequence[int],
    num_microbatches: int,
    sync: Sync,
    *,
    single_node: bool,
    time_limit_s: float,
    upper_bound_s: float = math.inf,
    min_pipelines: int = 1,
) -> tuple[MasterResult | None, float, bool]:
    """The cheapest plan from `templates` on nodes of `capacities` (module docstring).

    Returns (plan or None, lower bound, closed): closed when the answer is proven optimal or no plan
    beats `upper_bound_s`.
    """
    started = time.perf_counter()
    master = Master(
        templates, capacities, num_microbatches, sync, single_node=single_node, min_pipelines=min_pipelines
    )
    if not master.templates or master.p_min > master.p_max:  # too few micro-batches or GPUs
        return None, math.inf, True
    N = master.N

    def left() -> float:
        return time_limit_s - (time.perf_counter() - started)

    # Incumbent: copies of one template.
    best: tuple[float, list[Template], list | None] | None = None
    first = _copies_incumbent(master)
    if first is not None:
        best = first
    upper = min(upper_bound_s, best[0] if best else math.inf)
    if not math.isfinite(upper):
        upper = max(t.time_s(N) for t in master.templates) + overhead_s(
            master.templates, lambda _, t: sync(master.p_max, t)
        )
    master.set_scale(_Scale(upper / UNITS_PER_BOUND))
    taus = master.candidates(upper - master.min_overhead)
    floor = taus + master.least_overhead(taus)  # no plan within taus[j] costs less than floor[j]

    found: list[tuple[int, int]] = []  # (candidate index of its slowest pipeline, overhead in units)

    def offer(pipes: list[Template] | None, patterns) -> int | None:
        """Keep a plan found on the way if it is the best; return the candidate index of its slowest
        pipeline (re-split), where it shows a plan exists."""
        nonlocal best
        if not pipes:
            return None
        counts = balance(pipes, N)
        cost = plan_cost_s(pipes, counts, sync)
        if best is None or cost < best[0]:
            best = (cost, pipes, patterns)
        slowest = max(t.time_s(m) for t, m in zip(pipes, counts, strict=True))
        at = int(np.searchsorted(taus, slowest, side="left"))
        found.append((at, master.overhead_units(pipes)))
        return at

    def worth(j: int, known: int) -> int:
        """The most overhead (units) a plan within taus[j] may have to beat both the known one and
        the best plan."""
        return min(known - 1, master.scale(best[0] - taus[j]))

    def least_known(j: int) -> tuple[int, bool]:
        """The least overhead (units) of the plans found within taus[j] (a plan within the cap is
        known there), and whether the relaxations prove it least (S*(taus[j]), no CP-SAT
        minimisation needed: on the benchmark cases they were tight at every minimisation). A
        witness of less overhead that makes a plan is taken, and the question asked again below it."""
        while True:
            known = min(units for at, units in found if at <= j)
            lower, pipes = master.below(taus[j], worth(j, known))
            if pipes is None:
                return known, lower is False
            if offer(pipes, None) > j:  # a witness is split within taus[j]; if not, CP-SAT decides
                return known, False

    def feasible(j: int, cap: float) -> tuple[bool | None, int | None]:
        """Is there a plan within taus[j] with overhead <= cap (units)? (None: not decided in time),
        and the least candidate index the plan found shows feasible."""
        quick = master.copies_plan(taus[j], cap)
        if quick:
            return True, offer(quick[1], None)
        status, _, pipes, patterns = master.solve_at(taus[j], cap, left(), minimise=False)
        if status == cp_model.INFEASIBLE:
            return False, None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return True, offer(pipes, patterns)
        return None, None

    # Staircase (module docstring): j is the first candidate not yet ruled out for overhead <= cap.
    j, cap, proven = 0, math.inf, True
    while proven:
        useful = np.flatnonzero(floor[j:] < (best[0] if best else upper)) + j
        if not len(useful):
            break
        hi = int(useful[-1])
        top, seen = feasible(hi, cap)
        if not top:
            proven = top is not None
            break
        lo, hi = j, min(hi, seen if seen is not None else hi)
        while lo < hi:  # bisection: feasibility grows with tau
            mid = (lo + hi) // 2
            answer, seen = feasible(mid, cap)
            if answer is None:
                proven = False
                break
            lo, hi = (lo, min(mid, seen if seen is not None else mid)) if answer else (mid + 1, hi)
        if not proven:
            break
        j = lo
        extra, least = least_known(j)
        if not least:  # CP-SAT minimises among the plans below the known one (restricted by that cap)
            status, least, pipes, patterns = master.solve_at(taus[j], worth(j, extra), left(), minimise=True)
            if status == cp_model.OPTIMAL:  # the cap is no constraint there: it may find no less
                offer(pipes, patterns)
                extra = min(extra, least)
            elif status != cp_model.INFEASIBLE:
                proven = False
                break
        j += 1
        # From here on a plan must have strictly less overhead than this one (a slower pipeline with
        # as much cannot win), and less than what the best plan leaves the next bound.
        cap = extra - 1
        if j < len(taus):
            cap = min(cap, master.scale(best[0] - taus[j]))
    if best is None:
        return None, (math.inf if proven else float(floor[min(j, len(taus) - 1)])), proven
    cost, pipes, patterns = best
    bound = cost if proven else min(cost, float(floor[min(j, len(floor) - 1)]))
    return _result("OPTIMAL" if proven else "FEASIBLE", pipes, N, master, patterns, bound), bound, proven


def _copies_incumbent(master: Master) -> tuple[float, list[Template], None] | None:
    """The cheapest plan made of copies of one template (best-fit packing).

    n copies split N micro-batches as evenly as possible, so the slowest takes ceil(N / n).
    """
    best = None
    for i, t in enumerate(master.templates):
        lo, hi = 0, int(master.copies[i])  # copies that pack: the largest such n, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if master._packs([t] * mid) else (lo, mid - 1)
        for n in range(max(master.p_min, -(-master.N // int(master.m_max[i]))), lo + 1):
            cost = t.time_s(-(-master.N // n)) + master.exposed[i, n - 1] + t.optimizer_s
            if best is None or cost < best[0]:
                best = (cost, [t] * n, None)
    return best


def _pack_pipelines(pipes: Sequence[Template], capacities: Sequence[int]) -> list[list[int]] | None:
    """Runs per node of a plan found packed, or None: all runs at once, largest first (best fit),
    or else pipeline by pipeline in the orders `Master.witnessed_plan` tries (the most GPUs first;
    the largest run first), as it packed its witness (the orders can differ in what fits)."""
    placed = pack_best_fit([r for t in pipes for r in t.run_sizes], capacities)
    if placed is not None:
        return placed
    for order in (lambda t: t.num_gpus, lambda t: (max(t.run_sizes), t.num_gpus)):
        packing: Packing | None = Packing(capacities)
        for t in sorted(pipes, key=order, reverse=True):
            packing = packing.add(t.run_sizes) if packing is not None else None
        if packing is not None:
            return packing.placed()
    return None


def _result(status, pipes, N, master: Master, patterns, bound) -> MasterResult:
    counts = balance(pipes, N)
    objective = plan_cost_s(pipes, counts, master.sync)
    if master.single_node:
        nodes = ((max(master.capacities), tuple(r for t in pipes for r in t.run_sizes)),)
    elif patterns is None:
        placed = _pack_pipelines(pipes, master.capacities)
        if placed is None:
            raise AssertionError("a plan the master found does not pack onto the nodes")
        nodes = tuple((c, tuple(runs)) for c, runs in zip(master.capacities, placed, strict=True) if runs)
    else:
        nodes = tuple((c, q) for c, q, count in patterns for _ in range(count))
    return MasterResult(
        status=status,
        objective_s=objective,
        bound_s=min(bound, objective),
        pipelines=tuple(zip(pipes, counts, strict=True)),
        nodes=nodes,
    )

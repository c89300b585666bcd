"""Pipeline templates: every pipeline worth considering, built by an exact dynamic program over layers.

A template is one pipeline's structure: its stages front to back (layer range, TP degree), grouped
into *runs* of consecutive stages that share a node, and the four numbers the plan's cost needs:

    A  = sum_s (F_s + B_s) + 2 sum_s c_s     warm-up and cool-down (c_s: p2p, intra-node inside a
                                             run, inter-node between runs)
    M  = max_s (F_s + B_s + c_s-1 + c_s)     the steady state's pace (a stage waits for its exchange
                                             with each neighbour once per micro-batch)
    W  = max_s params_s                      the largest gradient to synchronise
    O  = max_s optimizer_s                   the slowest optimizer step
    H  = min_s B_s (1 - 1/K_s) + sum_s'<s (B_s' + c_s')   how much of the gradient reduction backward
                                             hides (K_s gradient buckets; solver.stages)
    L  = params of the first stage's first layer  what backward produces last (never hidden)

so that the pipeline takes T(m) = A + (m - 1) M for m >= p micro-batches (costmodel.estimate). Its
footprint is the multiset of its runs' GPU counts: the master problem packs runs onto nodes.

Dynamic program (labels, built from the back of the pipeline, because stage s of p keeps p - s
micro-batches in flight and that count is known from the back):

    state      (l, k, R, u, h): layers [l, L) are covered by k stages; R is the sorted tuple of the
               GPU counts of completed runs, u the GPUs of the run holding the front-most stage so
               far, h that stage's TP degree (the exchange into it depends on it).
    label      (A, M, W, O, E) of one partial pipeline in that state, plus its stages; M covers the
               stages behind the front one, E is the front stage's F + B + c (its exchange with
               the stage behind it; the one in front of it is not known yet).
    base case  the last stage [s, L) at TP t: state (s, 1, (), t, t), label (F+B, 0, params, opt, F+B),
               if its memory with 1 micro-batch in flight fits.
    transition prepend stage [s, l) at TP t whose memory fits with k + 1 micro-batches in flight:
               same node   (s, k+1, R, u+t, t),               c = c_intra(l, t -> h), if u+t fits
               new node    (s, k+1, sorted(R + (u,)), t, t),  c = c_inter(l, t -> h)
               (c: `CostModel.exchange_s`, the busiest rank's bytes across the boundary)
               A += F+B + 2c, M = max(M, E + c), E = F+B + c, W = max(W, params), O = max(O, opt).
    keep       per state, the labels no other label beats in all of A, M, W, O and E (Pareto set): a
               label beaten in all five can only lead to pipelines beaten in all of A, M, W and O.
    result     states with l = 0: footprint R + (u,), p = k stages, M = max(M, E).

Every partial footprint must fit on the cluster's nodes on its own (bin packing), otherwise the state
is dropped. A template is then kept only if, among templates of its footprint and stage count with
W, O and L no larger, its line T(m) = A + (m-1) M is below every other for some m >= p (lower
envelope), and if no template with a footprint that packs wherever its own does is no worse in all
of A, M, W, O, L and stage count (`prune`). H is priced on every template kept but compared nowhere
(comparing it too keeps several times the templates and triples the master's time): a template
beaten in everything else but with more backward to hide its sync behind is dropped, the one place
the search is not exact, and only where the gradient sync outlasts backward
(tests/test_solver_optimality.py finds the optimum on all its instances regardless).
Options `max_gpus`, `max_runs` and `max_stages` bound the search for very large instances; left at
None the program enumerates the whole search space and is exact (`tests/test_solver_optimality.py`).
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from solver.memo import IdentityMemo
from solver.stages import StageTable, sync_terms

PRUNE_BLOCK = 256  # templates `prune` compares at once with the ones kept before them
_FEWEST: IdentityMemo[int] = IdentityMemo(limit=256)  # fewest_gpus, by stage tables (solver.memo)


@dataclass(frozen=True)
class Template:
    """One pipeline's structure and its cost terms (module docstring)."""

    stages: tuple[tuple[int, int, int], ...]  # (start, end, tp), front to back
    runs: tuple[int, ...]  # run index of each stage: stages of one run share a node
    pipeline_s: float  # A
    bottleneck_s: float  # M
    max_params: int  # W
    optimizer_s: float  # O
    hide_s: float = 0.0  # H: how much of its gradient reduction backward hides (solver.stages)
    last_params: int = 0  # the parameters backward produces last (the first layer's)
    # interleaved: the chunks' (share, window) terms of the sync (`costmodel.estimate.chunk_hide`)
    hide_terms: tuple[tuple[float, float], ...] = ()
    # interleaved: the most micro-batches whose live chunks fit (0: any count), solver.interleave
    max_microbatches: int = 0
    chunks: int = 1  # layer chunks per stage: 1 for 1F1B, more for interleaved 1F1B (solver.interleave)
    recompute: str = "none"  # every stage's activation recomputation (its costs are that mode's)
    split_backward: bool = False  # weight gradients deferred (ZB-H1; solver.interleave)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @functools.cached_property
    def run_sizes(self) -> tuple[int, ...]:
        """GPUs of each run, in pipeline order."""
        sizes = [0] * (self.runs[-1] + 1)
        for (_, _, tp), run in zip(self.stages, self.runs, strict=True):
            sizes[run] += tp
        return tuple(sizes)

    @functools.cached_property
    def footprint(self) -> tuple[int, ...]:
        return tuple(sorted(self.run_sizes, reverse=True))

    @functools.cached_property
    def num_gpus(self) -> int:
        return sum(tp for _, _, tp in self.stages)

    def time_s(self, m: int) -> float:
        return self.pipeline_s + (m - 1) * self.bottleneck_s


class Packer:
    """Whether a multiset of runs (GPU counts) fits on nodes of the given capacities: exact bin packing.

    Nodes with the same free capacity are interchangeable, so the search branches on distinct free
    capacities only; results are cached per multiset.
    """

    def __init__(self, capacities: Sequence[int]):
        self.capacities = tuple(sorted(capacities, reverse=True))
        self._known: dict[tuple[int, ...], bool] = {}

    def fits(self, runs: Sequence[int]) -> bool:
        key = tuple(sorted(runs, reverse=True))
        if key not in self._known:
            too_big = sum(key) > sum(self.capacities) or (key and key[0] > self.capacities[0])
            self._known[key] = not too_big and _pack(key, self.capacities)
        return self._known[key]


@functools.lru_cache(maxsize=1 << 16)  # states recur across branches: deep footprints need it
def _pack(runs: tuple[int, ...], free: tuple[int, ...]) -> bool:
    if not runs:
        return True
    if sum(runs) > sum(free):
        return False
    first, rest = runs[0], runs[1:]
    tried = set()
    for i, room in enumerate(free):
        if room >= first and room not in tried:
            tried.add(room)
            left = tuple(sorted((*free[:i], room - first, *free[i + 1 :]), reverse=True))
            if _pack(rest, left):
                return True
    return False


def _insert(labels: list, new: tuple) -> None:
    """Add `new` = (A, M, W, O, E, chain) to a Pareto set over (A, M, W, O, E) unless a label beats it."""
    a, m, w, o, e = new[:5]
    for old in labels:
        if old[0] <= a and old[1] <= m and old[2] <= w and old[3] <= o and old[4] <= e:
            return
    labels[:] = [
        old
        for old in labels
        if not (a <= old[0] and m <= old[1] and w <= old[2] and o <= old[3] and e <= old[4])
    ]
    labels.append(new)


def generate(
    tables: dict[int, StageTable],
    num_layers: int,
    node_capacities: Sequence[int],
    *,
    single_node: bool = False,
    max_gpus: int | None = None,
    max_runs: int | None = None,
    max_stages: int | None = None,
    time_bound_s: float = math.inf,
) -> list[Template]:
    """Templates for pipelines on nodes of `node_capacities` (module docstring).

    With `single_node`, pipelines have one run (the plan lives on one node). `time_bound_s` drops
    partial pipelines that cannot finish within it even with the fewest micro-batches (m = p):
    A + (p - 1) M, bounded below by the partial A, the least time to cover the remaining layers and
    k M, exceeds it.
    """
    L = num_layers
    tps = sorted(tables)
    packer = Packer(node_capacities)
    largest = max(node_capacities)
    gpu_limit = min(max_gpus or sum(node_capacities), largest if single_node else sum(node_capacities))
    run_limit = 1 if single_node else (max_runs or gpu_limit)
    stage_limit = max_stages or gpu_limit
    # Least time to cover layers [0, l) with any stages: bounds what a partial pipeline still needs.
    rest = [0.0] * (L + 1)
    for e in range(1, L + 1):
        rest[e] = min(rest[s] + min(tables[t].time_s[s][e] for t in tps) for s in range(e))

    states: list[dict[tuple, list]] = [{} for _ in range(L + 1)]
    for t in tps:
        if t > gpu_limit:
            continue
        tab = tables[t]
        for s in range(L):
            if tab.max_in_flight[s][L] >= 1:
                time = tab.time_s[s][L]
                if time + rest[s] > time_bound_s:
                    continue
                label = (time, 0.0, tab.params[s][L], tab.optimizer_s[s][L], time, ((s, L, t, True), None))
                _insert(states[s].setdefault((1, (), t, t), []), label)

    for ell in range(L - 1, 0, -1):
        for (k, runs, u, head), labels in states[ell].items():
            if k >= stage_limit:
                continue
            used = sum(runs) + u
            for t in tps:
                if used + t > gpu_limit:
                    continue
                tab = tables[t]
                moves = []
                if u + t <= largest and packer.fits((*runs, u + t)):
                    moves.append(((k + 1, runs, u + t, t), tab.exchange_s[(head, False)][ell], True))
                if len(runs) + 1 < run_limit and packer.fits((*runs, u, t)):
                    key = (k + 1, tuple(sorted((*runs, u), reverse=True)), t, t)
                    moves.append((key, tab.exchange_s[(head, True)][ell], False))
                if not moves:
                    continue
                for s in range(ell):
                    if tab.max_in_flight[s][ell] <= k:
                        continue
                    time, params, opt = tab.time_s[s][ell], tab.params[s][ell], tab.optimizer_s[s][ell]
                    for key, c, same in moves:
                        target = None
                        for a, m, w, o, e, chain in labels:
                            a2, m2, e2 = a + time + 2 * c, max(m, e + c), time + c
                            if a2 + rest[s] + k * max(m2, e2) > time_bound_s:
                                continue
                            if target is None:
                                target = states[s].setdefault(key, [])
                            w2, o2 = (w if w >= params else params), (o if o >= opt else opt)
                            _insert(target, (a2, m2, w2, o2, e2, ((s, ell, t, same), chain)))

    found: dict[tuple, list[Template]] = {}
    for (k, runs, u, _), labels in states[0].items():
        footprint = tuple(sorted((*runs, u), reverse=True))
        for a, m, w, o, e, chain in labels:
            found.setdefault((footprint, k), []).append(_template(tables, chain, a, max(m, e), w, o))
    return prune([t for group in found.values() for t in lower_envelope(group)])


def packing_matrix(footprints: list[tuple[int, ...]]) -> np.ndarray:
    """packs[a, b]: footprint a fits into the runs of footprint b (so a plan can swap b for a)."""
    out = np.zeros((len(footprints), len(footprints)), dtype=bool)
    for j, b in enumerate(footprints):
        into = Packer(b)
        for i, a in enumerate(footprints):
            out[i, j] = sum(a) <= sum(b) and into.fits(a)
    return out


def prune(templates: list[Template]) -> list[Template]:
    """Drop a template when another is no worse in A, M, W, O and stage count and packs wherever it does
    (its runs fit into this one's runs): a plan using the first can use the second instead. Of
    identical templates the first is kept; the kept ones stay in their given order.

    Dominance is transitive (so is packing), so it is enough to test each template against the ones
    kept so far, visited in an order that puts every dominator before what it dominates:
    lexicographic in A, M, W, O, stage count, L and the micro-batch limit (none first), then by the
    footprint's GPUs and, among equal
    GPUs, more runs first (a footprint packs into another of as many GPUs only by splitting its runs).
    """
    if not templates:
        return []
    prints = sorted({t.footprint for t in templates})
    index = {f: i for i, f in enumerate(prints)}
    packs = packing_matrix(prints)
    n = len(templates)
    A = np.array([t.pipeline_s for t in templates])
    M = np.array([t.bottleneck_s for t in templates])
    W = np.array([t.max_params for t in templates])
    opt = np.array([t.optimizer_s for t in templates])
    last = np.array([t.last_params for t in templates])
    P = np.array([t.num_stages for t in templates])
    F = np.array([index[t.footprint] for t in templates])
    gpus = np.array([sum(f) for f in prints])[F]
    runs = np.array([len(f) for f in prints])[F]
    # a template that takes only so many micro-batches (solver.interleave) beats none that takes more
    limit = np.array([-(t.max_microbatches or np.iinfo(np.int64).max) for t in templates])
    order = np.lexsort((np.arange(n), -runs, gpus, limit, last, P, opt, W, M, A))  # last key first
    keys = (A, M, W, opt, P, last, limit)
    kept = np.empty(0, dtype=np.int64)
    for lo in range(0, n, PRUNE_BLOCK):
        # A block at a time: the templates kept before it rule out what they beat at once ...
        block = order[lo : lo + PRUNE_BLOCK]
        if len(kept):
            beaten = packs[F[kept][:, None], F[block][None, :]]
            for x in keys:
                beaten &= x[kept][:, None] <= x[block][None, :]
            block = block[~beaten.any(axis=0)]
        # ... then the rest of the block in order, against the ones it keeps itself.
        inside = packs[F[block][:, None], F[block][None, :]]
        for x in keys:
            inside &= x[block][:, None] <= x[block][None, :]
        mine = np.zeros(len(block), dtype=bool)
        for j in range(len(block)):
            mine[j] = not (inside[:j, j] & mine[:j]).any()
        kept = np.concatenate([kept, block[mine]])
    return [templates[i] for i in sorted(kept.tolist())]


def fewest_gpus(tables: dict[int, StageTable], num_layers: int, limit: int) -> int:
    """The fewest GPUs of any pipeline whose stages fit in memory (limit + 1 if more than limit)."""
    ordered = tuple(tables[t] for t in sorted(tables))
    return _FEWEST.get(ordered, (num_layers, limit), lambda: _fewest_gpus(tables, num_layers, limit))


def _fewest_gpus(tables: dict[int, StageTable], num_layers: int, limit: int) -> int:
    """From the back, stage count by stage count: the fewest GPUs covering layers [l, L) with k stages."""
    L, best = num_layers, limit + 1
    reach = {L: 0}
    for k in range(1, min(limit, L) + 1):
        nxt: dict[int, int] = {}
        for ell, used in reach.items():
            for t, tab in tables.items():
                if used + t >= best:
                    continue
                for s in range(ell):
                    if tab.max_in_flight[s][ell] >= k and used + t < nxt.get(s, best):
                        nxt[s] = used + t
        best = min(best, nxt.get(0, best))
        reach = {ell: used for ell, used in nxt.items() if ell > 0}
    return best


def _template(tables: dict[int, StageTable], chain, a: float, m: float, w: int, o: float) -> Template:
    """Unwind a label's chain (front-most stage first) into a Template."""
    stages, runs, run = [], [], 0
    while chain is not None:
        (s, e, t, same_as_next), chain = chain
        stages.append((s, e, t))
        runs.append(run)
        if not same_as_next:
            run += 1
    return Template(tuple(stages), tuple(runs), a, m, w, o, *sync_terms(tables, stages, runs))


def lower_envelope(group: list[Template]) -> list[Template]:
    """The templates (same footprint and stage count) that are best for some m >= p at their W and O.

    T(m) = A + (m-1) M is a line in lam = m - 1 >= p - 1. A template is kept if its line lies strictly
    below the lower envelope of the other templates with W and O no larger somewhere in [p - 1, inf). The
    difference of a line and a lower envelope is convex and piecewise linear, so it is enough to look
    at lam = p - 1, at the envelope's breakpoints beyond it, and at infinity.
    """
    unique = list(
        {
            (
                t.pipeline_s,
                t.bottleneck_s,
                t.max_params,
                t.optimizer_s,
                t.hide_s,
                t.last_params,
                t.hide_terms,
            ): t
            for t in reversed(group)
        }.values()
    )
    lam0 = unique[0].num_stages - 1
    keep = []
    for cand in unique:
        rivals = [
            (o.pipeline_s, o.bottleneck_s)
            for o in unique
            if o is not cand
            and o.max_params <= cand.max_params
            and o.optimizer_s <= cand.optimizer_s
            and o.last_params <= cand.last_params
        ]
        if _below_somewhere(cand.pipeline_s, cand.bottleneck_s, rivals, lam0):
            keep.append(cand)
    return keep


def _below_somewhere(a: float, m: float, rivals: list[tuple[float, float]], lam0: float) -> bool:
    if not rivals:
        return True
    # At infinity the rival with the smallest slope (then intercept) is lowest.
    if all(m < rm or (m == rm and a < ra) for ra, rm in rivals):
        return True
    points = [lam0, *(x for x in _breakpoints(rivals) if x > lam0)]
    return any(a + x * m < min(ra + x * rm for ra, rm in rivals) for x in points)


def _breakpoints(lines: list[tuple[float, float]]) -> list[float]:
    """Where the lower envelope of lines a + lam m changes line (convex hull trick)."""
    best: dict[float, float] = {}
    for a, m in lines:
        best[m] = min(a, best.get(m, math.inf))
    hull: list[tuple[float, float]] = []  # slopes decreasing: later lines win for larger lam
    for m, a in sorted(best.items(), reverse=True):
        while hull:
            a1, m1 = hull[-1]
            if a <= a1:  # smaller slope and intercept: the previous line never wins again
                hull.pop()
                continue
            if len(hull) >= 2:
                a0, m0 = hull[-2]
                if (a - a1) * (m0 - m1) <= (a1 - a0) * (m1 - m):  # crosses before the last did
                    hull.pop()
                    continue
            break
        hull.append((a, m))
    return [(a2 - a1) / (m1 - m2) for (a1, m1), (a2, m2) in pairwise(hull)]

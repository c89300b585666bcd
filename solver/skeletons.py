"""Templates for large models with identical blocks: pipeline skeletons and a closed-form block split.

The exact dynamic program (solver.templates) grows with layers x stages x footprints; a 70B model on
hundreds of nodes is out of its reach. When every block of the layer list has the same profile row
(as in every preset's analytic profile), a stage's cost depends only on its TP degree, whether it
holds the embedding or the head, and its number of blocks b; the layer split of a pipeline whose
stages' TP degrees are fixed then has a closed form:

    stage s of p (front to back) keeps f = p - s micro-batches in flight; its memory admits at most
    cap_mem(s) blocks, and a bound M on stage time at most cap_time(s, M) (both monotone in b).
    The pipeline fits within M iff sum_s min(cap_mem, cap_time) >= blocks (the first and last stage
    may hold none, the others at least one). The least such M is found by bisection over the stage
    times; at that M, and at up to MAX_EXTRA_THRESHOLDS larger thresholds while A can still drop by
    more than (p - 1) times the rise in M, the blocks go to the stages with the cheapest block first
    (time is linear in b, so this least-cost filling minimises A), and within a TP degree to the
    stage holding the fewest parameters (to keep W small).

Recomputation: each recompute mode of a search has its own splits (its stage times and memory caps
differ). A heavier mode's split is only built where it might not fit in the next lighter mode: a
split whose every stage's most blocks at the threshold fit there with their micro-batches in flight
has a twin in the lighter mode that is faster in A and M and alike in W, O and footprint, so the
heavier template could only be pruned. On llama2-7b on 8,8,8,7 that leaves out nearly every
selective and full split (0.6x the template time; every plan of the solver benchmark unchanged).
Where the search also offers interleaved variants (solver.interleave), leaving the template out
leaves out its variants too, and that restricts the family: a heavier mode's variant keeps its more
micro-batches in flight in less memory and can fit where the twin's variant does not. Measured with
`--chunks auto` on the solver benchmark, against building every split: no plan slower, one faster
(987 GPUs, 0.1%: the master's dominance among chunk terms, solver docstring), 0.53x-0.75x the
time (one run of the script each).

Skeletons (the family searched): a pipeline is a sequence of node runs, each a composition of a
node's GPUs into non-increasing TP degrees (4+2+1 on a 7-GPU node); either one run of any size (a
pipeline inside a node, sharing it with others), or whole-node runs of one or two kinds, each kind
repeated, in either order, up to the runs of twice the smallest pipeline that fits (a whole-node run
has TP groups no smaller than some degree, as many as fit: 4+2+1 or 4+2 on 7 GPUs), and DEEP times
as many runs when the kind is one TP group of a whole node (when the batch is small for the cluster,
the best plans have few, deep pipelines: llama3-70b on 256 nodes of 8 with 512 micro-batches, 9
nodes of TP 8 each), or up to LEFTOVER_RUNS partial runs holding one node's worth of GPUs in all
(leftovers of several nodes joined into one pipeline), larger runs first.
`solver.core` uses this family when the exact program would be too large and says so in the plan's
solver block (`complete: false`).
"""

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from costmodel.estimate import buckets_of, hide_window_s, steady_period_s
from costmodel.profile import ModelProfile
from solver.memo import IdentityMemo
from solver.stages import StageTable, sync_terms
from solver.templates import Packer, Template

MAX_EXTRA_THRESHOLDS = 6  # thresholds above the least M tried per skeleton for a smaller A
LEFTOVER_RUNS = 4  # runs of a pipeline made of several nodes' leftover GPUs
DEEP = 2  # pipelines of one TP group per whole node go up to this many times max_runs
# Splitters (with the skeletons they have split) by stage tables: the searches of one solve (the
# node-drop seed's, the main one's) and the clusters of a sweep ask for the same skeletons again.
# One solve uses a splitter per recompute mode and micro-batch size; the 61-GPU llama2-70b case's
# hold about 60 MB of templates, so the memo keeps few.
_SPLITTERS: IdentityMemo["Splitter"] = IdentityMemo(limit=16)
# Block splits shared by splitters whose stages hold the same parameters (`Splitter._blocks`): by
# (parameters' token, TP degrees cheapest first, skeleton, caps). On llama2-7b 8,8,8,7 the three
# recompute modes ask 7,629 splits of which 3,610 differ. On llama2-70b the modes share none (their
# memory caps differ) and a solve's 41,000 splits would keep 76 MB: the memo is cleared at
# BLOCKS_LIMIT entries, room for a 7b-class solve's.
_PARAMS: dict[tuple, int] = {}  # the stages' parameters of a splitter -> its token
_TOKENS = itertools.count()
_SERIALS = itertools.count()
_BLOCKS: dict[tuple, tuple[tuple, list[int]]] = {}  # -> (stages, blocks)
BLOCKS_LIMIT = 16_384


def splitter_of(tables: dict[int, StageTable], num_layers: int) -> "Splitter":
    """The splitter of these stage tables, shared by the searches of a solve (`_SPLITTERS`)."""
    return _SPLITTERS.get(
        tuple(tables[t] for t in sorted(tables)), num_layers, lambda: Splitter(tables, num_layers)
    )


def most_runs(max_runs: int) -> int:
    """The most node runs of any skeleton of the family bounded by `max_runs`."""
    return max(DEEP * max_runs, LEFTOVER_RUNS)


def block_uniform(profile: ModelProfile) -> bool:
    """Whether every block has the same profile row (then a stage's cost depends on its size only)."""
    blocks = profile.layers[1:-1]
    key = [(b.param_count, b.output_bytes_per_sample, b.costs) for b in blocks]
    return len(blocks) >= 1 and all(k == key[0] for k in key)


@dataclass(frozen=True)
class _Kind:
    """A stage shape at one TP degree (first, middle or last), by number of blocks b."""

    time: list[float]
    params: list[int]
    optimizer: list[float]
    fits: list[int]  # micro-batches in flight that fit
    lo: int  # fewest blocks
    reach: list[int]  # by micro-batches in flight f: the most blocks that fit with f (lo - 1: none)
    buckets: list[int]  # gradient buckets of the stage's parameters


class Splitter:
    """Block splits for skeletons of one model, micro-batch size and set of stage tables."""

    def __init__(self, tables: dict[int, StageTable], num_layers: int):
        self.tables = tables
        self.L = num_layers
        self.n = num_layers - 2
        self.kinds: dict[tuple[int, str], _Kind] = {}
        n, L = self.n, num_layers
        for tp, tab in tables.items():
            shapes = {
                "first": ([0] * (n + 1), [1 + b for b in range(n + 1)], 0),
                "middle": ([1] * (n + 1), [1 + b for b in range(n + 1)], 1),
                "last": ([L - 1 - b for b in range(n + 1)], [L] * (n + 1), 0),
            }
            for kind, (starts, ends, lo) in shapes.items():
                fits = [tab.max_in_flight[s][e] if e > s else -1 for s, e in zip(starts, ends, strict=True)]
                self.kinds[tp, kind] = _Kind(
                    [tab.time_s[s][e] if e > s else 0.0 for s, e in zip(starts, ends, strict=True)],
                    [tab.params[s][e] for s, e in zip(starts, ends, strict=True)],
                    [tab.optimizer_s[s][e] for s, e in zip(starts, ends, strict=True)],
                    fits,
                    lo,
                    [_reach(fits, lo, n, f) for f in range(n + 3)],
                    [
                        buckets_of(tab.params[s][e], tab.bucket_bytes)
                        for s, e in zip(starts, ends, strict=True)
                    ],
                )
        # exchange[front TP, back TP, across nodes][end of the front stage] (`StageTable.exchange_s`)
        self.exchange = {
            (tp, back, inter): tab.exchange_s[back, inter]
            for tp, tab in tables.items()
            for back, inter in tab.exchange_s
        }
        self.serial = next(_SERIALS)  # names the splitter in other splitters' keys (`templates`)
        self._known: dict[tuple, tuple[list[int], list[Template]]] = {}
        self._fit_lighter: dict[tuple, int | None] = {}  # `_first_unfit`, by TP sequence and splitter
        self._by_tps: dict[tuple[int, ...], _Splits | None] = {}
        self._by_degree: dict[tuple[int, ...], tuple[tuple[int, ...], list[list[int]]]] = {}
        # the block splits depend on the stages' parameters, not on time: splitters of tables with
        # equal parameters (recompute modes of one solve) share them (`_blocks`)
        params = tuple((tp, kind, tuple(k.params)) for (tp, kind), k in sorted(self.kinds.items()))
        if params not in _PARAMS:
            if len(_PARAMS) >= _SPLITTERS.limit:  # as many parameter sets as splitters are kept
                _PARAMS.clear()
            _PARAMS[params] = next(_TOKENS)  # never reused, so a cleared token cannot alias
        self._params = _PARAMS[params]

    def templates(
        self, tps: Sequence[int], runs: Sequence[int], lighter: "Splitter | None" = None
    ) -> list[Template]:
        """Templates of the skeleton: stage TP degrees front to back, and the run of each stage
        (each skeleton built once per splitter: the searches of one solve share it, `splitter`).

        With `lighter`, the splitter of a lighter recompute mode (same model and micro-batch size),
        only the splits that might not fit there: a split whose every stage's blocks fit in the
        lighter mode's memory has a twin there that is faster in A and M and alike in W, O and
        footprint, so this mode's template could only be pruned (solver.core). Where every split
        tried fits there, none is built."""
        key = (tuple(tps), tuple(runs))
        if lighter is None:
            return self._tagged(key)[1]
        first = self._first_unfit(key[0], lighter)
        if first is None:
            return []
        thresholds, found = self._tagged(key)
        return [t for j, t in zip(thresholds, found, strict=True) if j >= first]

    def _stage_kinds(self, tps: tuple[int, ...]) -> list[_Kind]:
        """Each stage's kind: the first holds the embedding, the last the head."""
        kinds = [self.kinds[tp, "middle"] for tp in tps]
        kinds[0], kinds[-1] = self.kinds[tps[0], "first"], self.kinds[tps[-1], "last"]
        return kinds

    def _first_unfit(self, tps: tuple[int, ...], lighter: "Splitter") -> int | None:
        """The least threshold of the TP sequence whose split might not fit in `lighter`'s memory
        (below it, each stage's cap there is at least its most blocks here), or None when every
        threshold tried fits; a single stage's one split counts as threshold -1."""
        key = (tps, lighter.serial)
        if key not in self._fit_lighter:
            p, first = len(tps), -1
            if p == 1:
                if lighter.tables[tps[0]].max_in_flight[0][self.L] >= 1:  # the whole model fits
                    first = None
            elif (split := self._splits(tps)) is not None:
                roomy = _memory_caps(lighter._stage_kinds(tps))
                tried = _tried(split)
                # caps only grow with the threshold: the thresholds that fit are a prefix; the front
                # stage, which keeps the most micro-batches in flight, decides most sequences at once
                fit = 0
                if split.stage_cap(split.times[split.lo], 0) <= roomy[0]:
                    fit = sum(
                        1 for _ in itertools.takewhile(lambda j: _within(split.caps_at(j), roomy), tried)
                    )
                first = None if fit == len(tried) else split.lo + fit
            self._fit_lighter[key] = first
        return self._fit_lighter[key]

    def _tagged(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[list[int], list[Template]]:
        """The skeleton's templates, and the threshold of each one's split (-1: one stage)."""
        if key not in self._known:
            found = self._split(*key)
            self._known[key] = [j for j, _ in found], [t for _, t in found]
        return self._known[key]

    def _split(self, tps: tuple[int, ...], runs: tuple[int, ...]) -> list[tuple[int, Template]]:
        p = len(tps)
        if p == 1:
            tab = self.tables[tps[0]]
            if tab.max_in_flight[0][self.L] < 1:
                return []
            t = tab.time_s[0][self.L]
            stages = ((0, self.L, tps[0]),)
            terms = sync_terms(self.tables, stages, (0,))
            alone = Template(stages, (0,), t, t, tab.params[0][self.L], tab.optimizer_s[0][self.L], *terms)
            return [(-1, alone)]
        split = self._splits(tps)
        if split is None:
            return []
        lines = self._lines(tps, runs)

        def p2p(stages: tuple) -> list[float]:  # each boundary's exchange for a split's stages
            return [line[stage[1]] for line, stage in zip(lines, stages, strict=False)]

        at = split.stages_at(split.lo)
        first = self._template(tps, runs, split.kinds, at, p2p(at[0]))
        # the smallest A at any M: only its A is needed
        at = split.stages_at(len(split.times) - 1)
        least = _one_micro_batch_s(at[1], p2p(at[0]))
        found = [(split.lo, first)]
        for j in _tried(split)[1:]:
            if (p - 1) * (split.times[j] - first.bottleneck_s) >= first.pipeline_s - least:
                break  # a larger M can no longer pay for itself with a smaller A
            at = split.stages_at(j)
            exchanges = p2p(at[0])
            if _one_micro_batch_s(at[1], exchanges) < found[-1][1].pipeline_s:
                found.append((j, self._template(tps, runs, split.kinds, at, exchanges)))
        return found

    def forget_splits(self) -> None:
        """Drop the block splits per TP sequence (the templates stay): they serve the skeletons of
        one family, and kept across searches they held a third of a large solve's memory."""
        self._by_tps.clear()

    def _splits(self, tps: tuple[int, ...]) -> "_Splits | None":
        """The block splits of a TP sequence at its time thresholds, shared by the skeletons that
        differ only in their runs (a quarter to a third of them); None when no split fits."""
        if tps not in self._by_tps:
            self._by_tps[tps] = self._thresholds(tps)
        return self._by_tps[tps]

    def _thresholds(self, tps: tuple[int, ...]) -> "_Splits | None":
        p = len(tps)
        if p > self.n + 2:
            return None
        kinds = self._stage_kinds(tps)
        mem = _memory_caps(kinds)
        if any(top < k.lo for k, top in zip(kinds, mem, strict=True)):
            return None
        if sum(mem) < self.n or sum(k.lo for k in kinds) > self.n:
            return None
        # Per distinct kind: its stages' memory caps, sorted, and their prefix sums, so that
        # whether a time threshold's caps cover the blocks takes one bisection per kind.
        position: dict[int, int] = {}  # kind (by identity) -> its place in `distinct`
        distinct: list[_Kind] = []
        held: list[list[int]] = []
        which = []  # each stage's place in `distinct`
        for k, top in zip(kinds, mem, strict=True):
            i = position.setdefault(id(k), len(distinct))
            if i == len(distinct):
                distinct.append(k)
                held.append([])
            held[i].append(top)
            which.append(i)
        for tops in held:
            tops.sort()
        sums = [list(itertools.accumulate(tops, initial=0)) for tops in held]
        ranges = [
            (k, k.lo, tops[-1] + 1, tops, total) for k, tops, total in zip(distinct, held, sums, strict=True)
        ]
        times = sorted({t for k, lo, hi, _, _ in ranges for t in k.time[lo:hi]})
        n = self.n

        def cover(limit: float) -> list[int] | None:
            """Each kind's cap under the time threshold, if the stages' caps cover the blocks."""
            cap, total = [], 0
            for k, lo, hi, tops, prefix in ranges:
                c = bisect.bisect_right(k.time, limit, lo, hi) - 1
                if c < lo:
                    return None
                cap.append(c)
                below = bisect.bisect_right(tops, c)  # stages whose memory caps them lower
                total += prefix[below] + c * (len(tops) - below)
            return cap if total >= n else None

        def caps(limit: float) -> list[int]:
            """Each stage's most blocks under the threshold (it must be one that covers)."""
            cap = cover(limit)
            return [min(top, cap[i]) for i, top in zip(which, mem, strict=True)]

        def stage_cap(limit: float, stage: int) -> int:
            """One stage's entry of `caps(limit)`, without the others'."""
            k, lo, hi, _, _ = ranges[which[stage]]
            return min(mem[stage], bisect.bisect_right(k.time, limit, lo, hi) - 1)

        def shape(limit: float) -> _Shape:
            stages, blocks = self._blocks(tps, kinds, caps(limit))
            return stages, [k.time[b] for k, b in zip(kinds, blocks, strict=True)], blocks

        # The smallest threshold whose caps cover the blocks (the largest always does).
        lo = bisect.bisect_left(
            range(len(times)), True, hi=len(times) - 1, key=lambda i: cover(times[i]) is not None
        )
        return _Splits(kinds, times, lo, shape, caps, stage_cap)

    def _lines(self, tps, runs) -> list[list[float]]:
        """Each boundary's exchange by the end of the stage in front of it, on the skeleton's runs."""
        return [self.exchange[tps[s], tps[s + 1], runs[s] != runs[s + 1]] for s in range(len(tps) - 1)]

    def _blocks(self, tps, kinds: list[_Kind], caps: list[int]) -> tuple[tuple, list[int]]:
        """The stages and blocks of the least-A split within per-stage caps: cheapest blocks first,
        evenly within a TP degree.

        Within one TP degree a block costs the same time anywhere, so each next block goes to the
        stage that holds the fewest parameters with it (the earlier stage of equals): the blocks a
        degree takes are its stages' `left` smallest (parameters after the block, stage) keys. A
        stage's keys grow with its blocks, so they are found at once: the least parameter level
        that admits `left` keys (`_level`), every key below it, then the keys at it front to back.
        Stages of one kind and cap have the same keys: they are handled as one slice.
        """
        order, degrees = self._degrees(tps)
        key = (self._params, order, tps, tuple(caps))
        if key not in _BLOCKS:
            if len(_BLOCKS) >= BLOCKS_LIMIT:
                _BLOCKS.clear()
            blocks = self._fill(kinds, caps, degrees)
            _BLOCKS[key] = self._stages(tps, blocks), blocks
        return _BLOCKS[key]

    def _fill(self, kinds: list[_Kind], caps: list[int], degrees: list[list[int]]) -> list[int]:
        blocks = [k.lo for k in kinds]
        left = self.n - sum(blocks)
        for stages in degrees:
            if not left:
                break
            slices: dict[tuple[int, int], list] = {}  # (kind, cap) -> [params, lo, hi, stages]
            room = 0
            for s in stages:
                k, cap = kinds[s], caps[s]
                if cap > k.lo:
                    room += cap - k.lo
                    alike = slices.get((id(k), cap))
                    if alike is None:
                        slices[id(k), cap] = [k.params, k.lo + 1, cap + 1, [s]]
                    else:
                        alike[3].append(s)
            if room <= left:  # every stage of the degree fills to its cap
                for _, _, hi, members in slices.values():
                    for s in members:
                        blocks[s] = hi - 1
                left -= room
                continue
            level = self._level(list(slices.values()), left)
            at_level = []
            for params, lo, hi, members in slices.values():
                below = bisect.bisect_left(params, level, lo, hi)  # every key below the level
                left -= (below - lo) * len(members)
                at = bisect.bisect_right(params, level, below, hi) - below
                for s in members:
                    blocks[s] = below - 1
                if at:
                    at_level += [(s, at) for s in members]
            for s, at in sorted(at_level):  # the keys at the level, front to back
                taken = min(left, at)
                blocks[s] += taken
                left -= taken
        return blocks

    def _degrees(self, tps: tuple[int, ...]) -> tuple[tuple[int, ...], list[list[int]]]:
        """The TP degrees of the skeleton, the cheapest block first, and the stages of each."""
        if tps not in self._by_degree:
            order = tuple(sorted(set(tps), key=lambda t: self.kinds[t, "middle"].time[1]))
            self._by_degree[tps] = order, [[s for s, t in enumerate(tps) if t == tp] for tp in order]
        return self._by_degree[tps]

    @staticmethod
    def _level(slices: list[list], count: int) -> int:
        """The least value v such that at least `count` keys are <= v, the keys being every slice
        [lo, hi) of a sorted list, once per stage sharing it ([list, lo, hi, stages]): the count
        only grows with v, so each slice's least key that reaches it is found by bisection, and the
        level is the least of those."""

        def enough(v: int) -> bool:
            return sum(len(m) * (bisect.bisect_right(a, v, lo, hi) - lo) for a, lo, hi, m in slices) >= count

        level = None
        for a, lo, hi, _ in slices:
            j = bisect.bisect_left(range(lo, hi), True, key=lambda j: enough(a[j])) + lo
            if j < hi and (level is None or a[j] < level):
                level = a[j]
        return level

    @staticmethod
    def _stages(tps, blocks: list[int]) -> tuple[tuple[int, int, int], ...]:
        """A split's stages (start, end, tp): the first stage holds the embedding and the last the
        head, one layer each beside their blocks."""
        ends = [e + 1 for e in itertools.accumulate(blocks)]
        ends[-1] += 1
        return tuple(zip([0, *ends[:-1]], ends, tps, strict=True))

    def _template(self, tps, runs, kinds: list[_Kind], shape: "_Shape", p2p: list[float]) -> Template:
        stages, time, blocks = shape
        # what `solver.stages.sync_terms` computes, from the tables this splitter already indexed
        bwd = [self.tables[tp].bwd_s[a][e] for a, e, tp in stages]
        buckets = [k.buckets[b] for k, b in zip(kinds, blocks, strict=True)]
        return Template(
            stages,
            tuple(runs),
            _one_micro_batch_s(time, p2p),
            steady_period_s(time, p2p),
            max(k.params[b] for k, b in zip(kinds, blocks, strict=True)),
            max(k.optimizer[b] for k, b in zip(kinds, blocks, strict=True)),
            hide_window_s(bwd, p2p, buckets),
            self.tables[tps[0]].params[0][1],
        )


_Shape = tuple[tuple, list[float], list[int]]  # a split's stages, their times, their blocks


@dataclass
class _Splits:
    """A TP sequence's block splits: its stage kinds, the sorted stage-time thresholds, the least
    threshold whose caps cover the blocks, and the split at each threshold, built on first use."""

    kinds: list[_Kind]
    times: list[float]
    lo: int
    shape: Callable[[float], _Shape]
    caps: Callable[[float], list[int]]  # each stage's most blocks under a threshold
    stage_cap: Callable[[float, int], int]  # one stage's
    _at: dict[int, _Shape] = dataclasses.field(default_factory=dict)

    def stages_at(self, j: int) -> _Shape:
        if j not in self._at:
            self._at[j] = self.shape(self.times[j])
        return self._at[j]

    def caps_at(self, j: int) -> list[int]:
        return self.caps(self.times[j])


def _memory_caps(kinds: list[_Kind]) -> list[int]:
    """The most blocks each stage of a pipeline of these stage kinds holds within its memory, with
    the micro-batches 1F1B keeps in flight there (below a kind's fewest: none)."""
    return [k.reach[len(kinds) - s] for s, k in enumerate(kinds)]


def _within(caps: list[int], roomy: list[int]) -> bool:
    return all(c <= r for c, r in zip(caps, roomy, strict=True))


def _tried(split: _Splits) -> range:
    """The thresholds a skeleton's splits are tried at: the least that covers, and a few above."""
    return range(split.lo, min(split.lo + 1 + MAX_EXTRA_THRESHOLDS, len(split.times)))


def _reach(fits: list[int], lo: int, n: int, in_flight: int) -> int:
    """The most blocks, from `lo` up, that a stage holds with `in_flight` micro-batches (lo - 1: none)."""
    b = lo
    while b <= n and fits[b] >= in_flight:
        b += 1
    return b - 1


def _one_micro_batch_s(time: list[float], p2p: list[float]) -> float:
    """A: every stage's forward and backward, each boundary's exchange both ways."""
    return sum(time) + 2 * sum(p2p)


def compositions(capacity: int, tps: Sequence[int]) -> list[tuple[int, ...]]:
    """Non-increasing TP compositions of a node that leave no room for another stage."""
    smallest = min(tps)
    out = []

    def extend(prefix: tuple[int, ...], room: int) -> None:
        grew = False
        for t in sorted(tps, reverse=True):
            if t <= room and (not prefix or t <= prefix[-1]):
                grew = True
                extend((*prefix, t), room - t)
        if not grew and prefix and room < smallest:
            out.append(prefix)

    extend((), capacity)
    return out


def skeletons(
    capacities: Sequence[int], tps: Sequence[int], max_runs: int, single_node: bool
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(stage TP degrees, run of each stage) of every skeleton of the family (module docstring)."""
    classes = sorted(set(capacities), reverse=True)
    seen = set()

    def once(runs_list: list[tuple[int, ...]]):
        key = (
            tuple(t for rho in runs_list for t in rho),
            tuple(r for r, rho in enumerate(runs_list) for _ in rho),
        )
        if key not in seen:
            seen.add(key)
            yield key

    # Pipelines on one node: any composition that fits, leaving the rest of the node to others.
    for size in range(1, (classes[0] if single_node else max(classes)) + 1):
        for rho in compositions(size, [t for t in tps if t <= size]):
            yield from once([rho])
    if single_node:
        return
    # Across nodes, small: up to LEFTOVER_RUNS runs of any size, one node's worth of GPUs in all
    # (leftovers of several nodes joined into one pipeline), larger runs first.
    pieces = [
        rho
        for size in range(1, max(classes) + 1)
        for rho in compositions(size, [t for t in tps if t <= size])
    ]
    pieces.sort(key=lambda rho: (-sum(rho), [-t for t in rho]))

    def joined(prefix: list[tuple[int, ...]], start: int, room: int):
        if len(prefix) >= 2:
            yield from once(prefix)
        if len(prefix) < LEFTOVER_RUNS:
            for i in range(start, len(pieces)):
                if sum(pieces[i]) <= room:
                    yield from joined([*prefix, pieces[i]], i, room - sum(pieces[i]))

    yield from joined([], 0, max(classes))
    # Across nodes: whole-node runs of one or two kinds, each kind repeated.
    # A node's run: its GPUs in TP groups no smaller than some degree, as many as fit (a 7-GPU node:
    # 4+2+1, or 4+2 leaving one idle when TP 1 stages do not pay).
    kinds = list(
        dict.fromkeys(
            rho
            for c in classes
            for least in tps
            if least <= c
            for rho in compositions(c, [t for t in tps if least <= t <= c])
        )
    )
    for first in kinds:
        deepest = DEEP * max_runs if first[0] in classes else max_runs  # a node, one TP group: deeper
        for count in range(2, deepest + 1):
            yield from once([first] * count)
        for second in kinds:
            if second != first:
                for r1 in range(1, max_runs):
                    for r2 in range(1, max_runs - r1 + 1):
                        yield from once([first] * r1 + [second] * r2)


def generate_skeletal(
    tables: dict[int, StageTable],
    num_layers: int,
    capacities: Sequence[int],
    *,
    single_node: bool,
    max_runs: int,
    lighter: dict[int, StageTable] | None = None,
) -> list[Template]:
    """The family's templates; with `lighter`, the stage tables of a lighter recompute mode, only
    those whose split might not fit there (`Splitter.templates`)."""
    splitter = splitter_of(tables, num_layers)
    easier = splitter_of(lighter, num_layers) if lighter is not None else None
    out = []
    for tps, runs in fitting_skeletons(tuple(capacities), tuple(sorted(tables)), max_runs, single_node):
        out += splitter.templates(tps, runs, easier)
    splitter.forget_splits()
    return out


@functools.lru_cache(maxsize=32)
def fitting_skeletons(
    capacities: tuple[int, ...], tps: tuple[int, ...], max_runs: int, single_node: bool
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The skeletons of the family whose pipeline fits on the nodes on its own (every recompute mode
    and micro-batch size of a solve asks for the same ones)."""
    packer = Packer(capacities)
    found = []
    for stages, runs in skeletons(capacities, tps, max_runs, single_node):
        sizes = [0] * (runs[-1] + 1)
        for t, r in zip(stages, runs, strict=True):
            sizes[r] += t
        if packer.fits(tuple(sizes)):
            found.append((stages, runs))
    return tuple(found)

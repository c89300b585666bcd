"""Interleaved variants of pipeline templates: how the solver chooses the number of layer chunks.

A template's stages hold contiguous layer ranges. Its variant with v chunks keeps every stage's layer
count n_s (at least v), TP degree and node run, and deals the stage's layers into v chunks (n_s // v
each, the first n_s % v one more); virtual pipeline k is chunk k of every stage in order
(`chunk_ranges`). In a profile whose blocks are identical (the solver plans interleaving only there)
the embedding still opens stage 0 and the head still closes the last stage, so every stage keeps
exactly its compute, parameters, optimizer step and the volume of its gradient sync, and only the
schedule changes, and with it how much of the sync backward hides:

- time (`costmodel.schedule.interleaved_time_s` for m >= S, as the master's line A + (m - 1) M):
      M = P + (2v / S) sum_inner c,
      A = sum_s W_s / v + 2 (sum_inner c + (v - 1) c_wrap) + (1 - 1/v) P + (2v / S) sum_inner c
  with W_s = F_s + B_s, P = max_s W_s, c the links of the template (the wrap-around link from the
  last stage to the first is inter-node unless both are in one run);
- memory: stage s keeps its live chunk-forwards' activations, each chunk its own bytes
  (`StageTable.kept_bytes` of the chunk's layers: chunks of unequal layers weigh unequally); their
  most at each micro-batch count m >= S (`stage_peaks`) must fit in what the stage's memory leaves
  for activations (`max_in_flight` times its contiguous range's bytes). Below 2S micro-batches the
  schedule's first group is all of them, so its warm-up, and the chunks alive, grow with m: a
  variant that fits up to some count but not beyond says so (`Template.max_microbatches`), and
  the master gives its pipelines no more (llama3-70b on 256 nodes: 14 TP-4 stages of 5 chunks
  with selective recomputation fit up to 16 micro-batches). Conservative: the plan's own estimate
  counts its m exactly;
- gradient sync: each chunk's buckets reduce while the stage runs its other chunks' backwards
  (`costmodel.estimate.chunk_hide`, the window of each chunk, as the plan's estimate prices it).

Each chunk count, one included, also comes with its backwards split (ZB-H1, `Template.split_backward`,
`costmodel.schedule.split_backward`): the fill and drain cross each stage with W_s - 2 G_s (G_s the
stage's weight-gradient time, `StageTable.wgrad_s`), and memory is checked with what each chunk
holds from its B to its W (`stage_peaks`, exact over m in [S, 6S)).

Per template, one variant joins it: the chunk count (2 to MAX_CHUNKS, at most its smallest stage's
layers; split or not) fastest at the micro-batches the template's pipelines get when the whole
cluster runs copies of it; of the two, `lower_envelope` (solver.templates) keeps those best for
some m >= p, usually the variant alone, since it is never slower where transfers are cheap. So
the master sees at most twice the templates and picks chunks jointly with cuts, TP, recompute and
sharding. Not exact: a chunk count fastest only at a micro-batch count far from that estimate is
not offered.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from costmodel import schedule
from costmodel.estimate import ChunkTerms, HideTerms, SyncCost, buckets_of, hide_window_s
from solver.memo import IdentityMemo
from solver.stages import StageTable, exchanges_s
from solver.templates import Template, lower_envelope

MAX_CHUNKS = 8  # Megatron-LM's interleaved runs use a few chunks; more multiplies the exchanges


@functools.lru_cache(maxsize=1 << 14)
def chunk_ranges(
    stages: tuple[tuple[int, int, int], ...], num_chunks: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each stage's layer chunks when a template of `stages` (start, end, tp) is interleaved
    (memoised: the variants of templates that differ only in their runs share them)."""
    counts = [
        [(e - s) // num_chunks + (1 if k < (e - s) % num_chunks else 0) for k in range(num_chunks)]
        for s, e, _ in stages
    ]
    chunks: list[list[tuple[int, int]]] = [[] for _ in stages]
    at = 0
    for k in range(num_chunks):
        for si in range(len(stages)):
            chunks[si].append((at, at + counts[si][k]))
            at += counts[si][k]
    return tuple(tuple(c) for c in chunks)


def interleaved(
    template: Template,
    tables: dict[int, StageTable],
    num_chunks: int,
    *,
    split: bool = False,
) -> Template | None:
    """`template` run with `num_chunks` chunks per stage (`split`: its backwards split, at one chunk
    too), or None where a stage has fewer layers than chunks or its activations would not fit at S
    micro-batches (module docstring)."""
    stages, v = template.stages, num_chunks
    if len(stages) < 2 or any(e - s < v for s, e, _ in stages) or (v == 1 and not split):
        return None
    most = microbatch_limit(stages, tables, v, split)
    if most is None:
        return None
    links = _links(template, tables)
    return _variant(template, tables, v, split, most, links, _Shape.of(template, tables, links))


def _variant(
    template: Template,
    tables: dict[int, StageTable],
    v: int,
    split: bool,
    most: int,
    links: Sequence[float],
    shape: "_Shape",
) -> Template:
    """`interleaved`'s variant once its memory is checked (`most`), from the template's links and
    shape (`fastest_variant` finds them once for all its variants)."""
    pipeline_s, bottleneck_s = _line(shape, v, split)
    hide, terms = chunk_windows(template.stages, v, split, tables, links)
    return dataclasses.replace(
        template,
        pipeline_s=pipeline_s,
        bottleneck_s=bottleneck_s,
        chunks=v,
        max_microbatches=most,
        split_backward=split,
        hide_s=hide,
        hide_terms=terms,
    )


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What a template's variants' time lines depend on: each stage's work W_s = F_s + B_s, its W_s -
    2 G_s (the split schedule's fill and drain), and the sum of its inner links and its wrap-around."""

    work: tuple[float, ...]
    lean: tuple[float, ...]
    inner: float
    wrap: float

    @staticmethod
    def of(template: Template, tables: dict[int, StageTable], links: Sequence[float]) -> "_Shape":
        work = tuple(tables[tp].time_s[s][e] for s, e, tp in template.stages)
        wgrad = [tables[tp].wgrad_s[s][e] for s, e, tp in template.stages]
        lean = tuple(w - 2 * g for w, g in zip(work, wgrad, strict=True))
        return _Shape(work, lean, sum(links[:-1]), links[-1])


def _line(shape: _Shape, num_chunks: int, split: bool) -> tuple[float, float]:
    """(A, M) of the variant with `num_chunks` chunks (module docstring)."""
    v, work = num_chunks, shape.work
    slowest = max(work)
    steady = 2 * v / len(work) * shape.inner
    if split:  # the fill and drain cross each stage with W - 2G (`schedule.interleaved_time_s`)
        fill = slowest + (sum(shape.lean) - shape.lean[work.index(slowest)]) / v
    else:
        fill = sum(work) / v + (1 - 1 / v) * slowest
    return fill + 2 * (shape.inner + (v - 1) * shape.wrap) + steady, slowest + steady


def microbatch_limit(
    stages: Sequence[tuple[int, int, int]], tables: dict[int, StageTable], num_chunks: int, split: bool
) -> int | None:
    """The most micro-batches whose live chunks fit on every stage of a variant (0: any count; None:
    not even S), each live chunk weighing its own activations (chunks of unequal layers weigh
    unequally) and under `split` what it holds from B to W. Memoised: the grids of one solve ask it
    of the same stages again and again (their pipelines differ only where they change nodes)."""
    used = tuple(tables[tp] for tp in sorted({tp for _, _, tp in stages}))
    return _LIMITS.get(
        used, (tuple(stages), num_chunks, split), lambda: _limit(stages, tables, num_chunks, split)
    )


_LIMITS: IdentityMemo[int | None] = IdentityMemo(limit=1 << 16)


def _limit(
    stages: Sequence[tuple[int, int, int]], tables: dict[int, StageTable], num_chunks: int, split: bool
) -> int | None:
    S, v = len(stages), num_chunks
    most = 0
    for si, ((s, e, tp), chunks) in enumerate(zip(stages, chunk_ranges(stages, v), strict=True)):
        table = tables[tp]
        weights = tuple(table.kept_bytes[a][b] for a, b in chunks)
        held = tuple(table.held_bytes[a][b] for a, b in chunks) if split else None
        room = table.max_in_flight[s][e] * table.kept_bytes[s][e]
        # the most chunks alive at once (at the largest first group) times the heaviest: enough
        # where memory does not bind; else the exact peaks, up to the first count that overflows
        if _quick_peak(si, S, v, max(weights), max(held or (0,))) <= room:
            continue
        over = first_overflow(si, S, v, weights, held, room, below=most + 1 if most else 6 * S)
        if over == S:
            return None
        if over is not None:  # the master gives this variant's pipelines fewer micro-batches
            most = over - 1
    return most


def first_overflow(
    stage: int,
    num_stages: int,
    num_chunks: int,
    weights: tuple[float, ...],
    held: tuple[float, ...] | None,
    room: float,
    below: int,
) -> int | None:
    """The fewest micro-batches m in [S, `below`) (`below` at most 6S) at which the stage's live
    bytes (`stage_peaks`) exceed `room`, or None where none does.

    The peaks are worked out in three spans of m, [S], (S, 2S) and [2S, 6S), each only while the
    ones before overflow nowhere: where memory binds it mostly binds below 2S, where the first group
    is all of the micro-batches and the warm-up grows with m (llama2-70b on 61 GPUs with chunks: 99%
    of the limits found), unsplit peaks there are a closed form, and the last span holds nine
    tenths of the moments to weigh."""
    S = num_stages
    for low, high in ((S, S + 1), (S + 1, 2 * S), (2 * S, 6 * S)):
        high = min(high, below)
        if low >= high:
            break
        alive = stage_peaks(stage, S, num_chunks, weights, counts=(low, high))
        if held is not None:
            # the split peak is at least the unsplit one (B's held bytes come on top), and at most
            # that plus s + 1 chunks held: the exact peaks only between the two
            if alive.max() + (stage + 1) * max(held) <= room:
                continue
            if alive[0] <= room:
                alive = stage_peaks(stage, S, num_chunks, weights, held, (low, high))
        over = np.flatnonzero(alive > room)
        if len(over):
            return low + int(over[0])
    return None


def _quick_peak(stage: int, num_stages: int, num_chunks: int, weight: float, held: float) -> float:
    """An upper bound on a stage's live bytes, chunks weighing at most `weight` alive and `held`
    from B to W (0: not split). Alive chunks number at most the unsplit peak A_u; held ones at most
    s + 1 (`costmodel.schedule.split_backward`); the two together at most A, the split schedule's
    count of chunks from F to W. Counts at the largest first group, where they peak."""
    S, v = num_stages, num_chunks
    alive = schedule.peak_in_flight(stage, S, v, 2 * S - 1)
    if not held:
        return alive * weight
    both = schedule.peak_in_flight(stage, S, v, 2 * S - 1, True)
    kept = min(stage + 1, both)
    if held >= weight:  # as many held as can be, the rest alive
        return kept * held + min(alive, both - kept) * weight
    return alive * weight + min(kept, both - alive) * held


def chunk_windows(
    stages, num_chunks: int, split: bool, tables: dict[int, StageTable], links: Sequence[float]
) -> tuple[float, HideTerms]:
    """The hide window and chunk terms of a variant's gradient sync: each chunk's gradients reduce
    as soon as its backward is done (`costmodel.estimate.chunk_hide`; `links`: the inner ones and
    the wrap-around), or under split backward its W; at one chunk `costmodel.estimate.hide_window_s`."""
    if num_chunks == 1:
        bwd, _, buckets, wgrad = _chunk_terms(stages, num_chunks, tables)
        column = [row[0] for row in wgrad] if split else None
        return hide_window_s([r[0] for r in bwd], links[:-1], [r[0] for r in buckets], column), ()
    return _prepared(stages, num_chunks, split, tables).hide(links)


def _prepared(stages: tuple, num_chunks: int, split: bool, tables: dict[int, StageTable]) -> ChunkTerms:
    """`chunk_hide`'s work before the links, per stages, chunk count and split (templates that
    differ only in their runs share it; pricing a kept one takes 0.4x chunk_hide's time)."""
    used = tuple(tables[tp] for tp in sorted({tp for _, _, tp in stages}))

    def build() -> ChunkTerms:
        bwd, params, buckets, wgrad = _chunk_terms(stages, num_chunks, tables)
        return ChunkTerms.of(bwd, params, buckets, wgrad if split else None)

    return _PREPARED.get(used, (stages, num_chunks, split), build)


_PREPARED: IdentityMemo[ChunkTerms] = IdentityMemo(limit=1 << 14)  # some 3 kB each


def _chunk_terms(stages: tuple, num_chunks: int, tables: dict[int, StageTable]) -> tuple[list, ...]:
    """Per stage and chunk: backward, parameters, gradient buckets and W time (`chunk_windows`).
    Memoised: templates that differ only in their runs (a split's skeletons) share them."""
    used = tuple(tables[tp] for tp in sorted({tp for _, _, tp in stages}))

    def build() -> tuple[list, ...]:
        bwd, params, buckets, wgrad = [], [], [], []
        for (_, _, tp), ranges in zip(stages, chunk_ranges(stages, num_chunks), strict=True):
            table = tables[tp]
            bwd.append([table.bwd_s[a][b] for a, b in ranges])
            params.append([table.params[a][b] for a, b in ranges])
            buckets.append([buckets_of(table.params[a][b], table.bucket_bytes) for a, b in ranges])
            wgrad.append([table.wgrad_s[a][b] for a, b in ranges])
        return bwd, params, buckets, wgrad

    return _TERMS.get(used, (stages, num_chunks), build)


_TERMS: IdentityMemo[tuple[list, ...]] = IdentityMemo(limit=1 << 16)


@functools.lru_cache(maxsize=1 << 14)
def stage_peaks(
    stage: int,
    num_stages: int,
    num_chunks: int,
    weights: tuple[float, ...],
    held: tuple[float, ...] | None = None,
    counts: tuple[int, int] | None = None,
) -> np.ndarray:
    """A stage's most live bytes at each micro-batch count m in [S, 6S), or in the span `counts`
    of them: `costmodel.schedule.peak_live` (each chunk-forward's activation weights[chunk] alive
    until its backward; with `held`, the split schedule of `costmodel.schedule.split_backward`),
    read off weighted prefix sums of the forward table instead of walking 5S programs (the solver
    asks it of every stage of pipelines of up to 82 stages).

    After the warm-up's w forwards, step j runs forward w + j then backward j of the same table with
    its chunks reversed, so the peak comes after the warm-up or after a forward: the first w + j + 1
    forwards' weight less the first j backwards'. Split, B frees a chunk's activation and holds
    held[chunk] until its W, s backwards later on stage s: after a forward the last min(j, s)
    backwards' held bytes are alive too, and the peak can also come after a backward j before its W
    leaves (the last min(j + 1, s + 1) held), drain included.

    Unsplit, below 2S the first group is all m micro-batches, in chunk order: the warm-up runs
    every chunk but the last for all of them and S - s - 1 of the last, and each step of the steady
    state then runs a forward and a backward of the last chunk. Live after each forward are m of
    every chunk but the last and S - s of the last, the peak in closed form: m sum_{k < v-1} w_k +
    (S - s) w_{v-1}.

    Measured, not proven, that [S, 6S) holds the peak of every m: on random shapes (S <= 12,
    v <= 8, unequal chunk weights) it first came at m < 5S (at 4.9S for S = 12, v = 8), later
    groups repeating what earlier ones keep; tests/test_solver_interleave.py holds it to the walk
    for m up to 12S."""
    S, v = num_stages, num_chunks
    low, high = counts or (S, 6 * S)
    if held is None and low < 2 * S:  # one group: closed form (docstring)
        one_group = np.arange(low, min(high, 2 * S)) * sum(weights[:-1]) + (S - stage) * weights[-1]
        if high <= 2 * S:
            return one_group
        return np.concatenate([one_group, stage_peaks(stage, S, v, weights, None, (2 * S, high))])
    weight = np.asarray(weights, dtype=float)
    table = _stacked_prefixes(S, v)[low - S : high - S, : (high - 1) * v + 1]  # [m - low, n, chunk]
    fwd = table @ weight  # weight of the first n forwards
    bwd = table @ weight[::-1]  # ... of the first n backwards (chunks reversed)
    ms = np.arange(low, high)
    n = ms * v
    first = np.where(ms < 2 * S, ms, S + ms % S)  # the first group's size (`schedule.groups`)
    w = np.minimum(S - stage - 1 + (v - 1) * first, n)  # `schedule.warmup`, at every m at once

    peaks = fwd[np.arange(len(ms)), w]  # after the warm-up

    def steps(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(m index, j) for j in [0, lengths[m index]) of every m, in order of m, and where each
        m's run starts."""
        starts = np.cumsum(lengths) - lengths
        at = np.repeat(np.arange(len(lengths)), lengths)
        return at, np.arange(lengths.sum()) - np.repeat(starts, lengths), starts

    def most(values: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> None:
        some = lengths > 0
        peaks[some] = np.maximum(peaks[some], np.maximum.reduceat(values, starts[some]))

    at, j, starts = steps(n - w)
    after_f = fwd[at, w[at] + j + 1] - bwd[at, j]
    if held is None:
        most(after_f, n - w, starts)
        return peaks
    kept = table @ np.asarray(held, dtype=float)[::-1]  # what the first n backwards hold
    most(after_f + kept[at, j] - kept[at, j - np.minimum(j, stage)], n - w, starts)
    at, j, starts = steps(n)
    done = j + 1
    after_b = (
        fwd[at, np.minimum(done + w[at], n[at])]
        - bwd[at, done]
        + kept[at, done]
        - kept[at, done - np.minimum(done, stage + 1)]
    )
    most(after_b, n, starts)
    return peaks


@functools.lru_cache(maxsize=512)  # (S, v) pairs of a solve: about 100 MB at most
def _stacked_prefixes(num_stages: int, num_chunks: int) -> np.ndarray:
    """P_k(n) of the forward table (`costmodel.schedule.table`: group by group, chunk by chunk), the
    forwards of chunk k among its first n entries, as one array [m - S, n, k] for m in [S, 6S),
    each m's padded with its last row: the same for every stage of the pipeline (floats: it is
    only ever weighted)."""
    S, v = num_stages, num_chunks
    out = np.empty((5 * S, (6 * S - 1) * v + 1, v))
    out[:, 0] = 0
    for i, m in enumerate(range(S, 6 * S)):
        sizes = [len(group) for group in schedule.groups(S, m)]
        chunks = np.repeat(np.tile(np.arange(v), len(sizes)), np.repeat(sizes, v))
        np.cumsum(np.eye(v)[chunks], axis=0, out=out[i, 1 : m * v + 1])
        out[i, m * v + 1 :] = out[i, m * v]
    return out


def offers(
    templates: list[Template],
    tables: dict[int, StageTable],
    num_microbatches: int,
    gpus: int,
    sync: Callable[[int, Template], SyncCost],
) -> list[list[Template]]:
    """Per template, what the search offers of it: the template, or its best interleaved variant in
    its place where that is never slower, or both (module docstring). Each list depends on its
    template alone, so a search can work them out before it knows which templates it keeps."""
    out = []
    for template in templates:
        # the micro-batches and pipelines of this template when the whole cluster runs copies of it
        m = max(template.num_stages, math.ceil(num_microbatches * template.num_gpus / gpus))
        copies = max(1, gpus // template.num_gpus)
        plain = sync(copies, dataclasses.replace(template, hide_terms=()))
        best = fastest_variant(template, tables, m, functools.partial(_exposed_s, sync, copies), plain)
        if best is None:
            out.append([template])
        elif best.max_microbatches:  # it takes fewer micro-batches: the 1F1B template stays
            out.append([template, best])
        else:
            out.append(lower_envelope([template, best]))
    return out


def _exposed_s(sync: Callable[[int, Template], SyncCost], copies: int, template: Template) -> float:
    return sync(copies, template).exposed_s(template.hide_s)


def fastest_variant(
    template: Template,
    tables: dict[int, StageTable],
    m: int,
    overhead: Callable[[Template], float] = lambda t: 0.0,
    plain: SyncCost | None = None,
) -> Template | None:
    """The variant of `template` (2 to MAX_CHUNKS chunks, and each chunk count, one included, with
    its backwards split) fastest at `m` micro-batches with its `overhead` (the gradient sync it
    leaves exposed: more chunks hide more of it), or None where no variant is possible.

    `plain`: the template's sync without chunk terms, where `overhead` is what a variant's sync
    leaves exposed. A variant's sync has the same reduction and gather and a floor no lower (its
    chunk terms only raise it, `SyncCost.with_partial`), and its window is at most `_hide_bound`:
    the variants whose time line with floor and gather cannot win end the search (they come in
    order), and a variant whose line with its least exposed sync cannot is skipped before its
    memory check and windows are worked out (the costly parts)."""
    least_overhead = plain.floor_s + plain.gather_s if plain is not None else 0.0
    best, least = None, math.inf
    links = shape = None  # the template's, found for the first variant that needs them
    for chunks, split, a, b in sorted(
        _lines_of(template, tables), key=lambda line: line[2] + (m - 1) * line[3]
    ):
        line = a + (m - 1) * b
        if line + least_overhead >= least:
            break
        if links is None:
            links = _links(template, tables)
        if plain is not None and best is not None:
            hide = _hide_bound(template.stages, chunks, split, tables, links)
            if line + (max(plain.floor_s, plain.reduce_s - hide) + plain.gather_s) >= least:
                continue
        limit = microbatch_limit(template.stages, tables, chunks, split)
        if limit is None or 0 < limit < m:
            continue
        if shape is None:
            shape = _Shape.of(template, tables, links)
        variant = _variant(template, tables, chunks, split, limit, links, shape)
        if (cost := variant.time_s(m) + overhead(variant)) < least:
            best, least = variant, cost
    return best


def _hide_bound(stages, num_chunks: int, split: bool, tables: dict[int, StageTable], links) -> float:
    """An upper bound on the hide window of a variant (`chunk_windows`), the least over its stages:
    the first stage's, which has no cool-down in front nor split delay (`costmodel.estimate.chunk_hide`):
    max(S sum_{k < v-1} b_0k, sum_{k < v-1} (sum_s chain_sk + sum of links)) plus, unsplit,
    b_0,v-1 (1 - 1/K_0,v-1). At one chunk, split, the window is 0 (stage 0's gradients are complete
    with its last W, `hide_window_s`). The sums run in another order than chunk_hide's: the bound is
    widened by a relative 1e-9 to stay above any rounding of theirs."""
    v = num_chunks
    if v == 1:
        return 0.0 if split else math.inf
    bwd, _, buckets, wgrad = _chunk_terms(stages, v, tables)
    chain = sum(sum(row[:-1]) for row in bwd)
    if split:
        chain -= sum(sum(row[:-1]) for row in wgrad)
    window = max(len(stages) * sum(bwd[0][:-1]), chain + (v - 1) * sum(links))
    if not split:
        window += bwd[0][-1] * (1 - 1 / max(1, buckets[0][-1]))
    return window * (1 + 1e-9)


def least_time_s(template: Template, tables: dict[int, StageTable], m: int) -> float:
    """A lower bound on the time of `template` or any variant `fastest_variant` weighs, at `m`
    micro-batches: the fastest of them before their memory check, which only removes variants."""
    return min([template.time_s(m), *(a + (m - 1) * b for _, _, a, b in _lines_of(template, tables))])


def _lines_of(template: Template, tables: dict[int, StageTable]) -> list[tuple[int, bool, float, float]]:
    """(chunks, split, A, M) of every variant `fastest_variant` weighs: 2 to MAX_CHUNKS chunks, each
    chunk count (one included) with its backwards split. Memoised: a solve asks it of the same
    templates at many micro-batch counts (the grids of `solver.baselines.deep_grids`)."""
    used = tuple(tables[tp] for tp in sorted({tp for _, _, tp in template.stages}))
    return _LINES.get((template, *used), None, lambda: _variant_lines(template, tables))


def _variant_lines(template: Template, tables: dict[int, StageTable]) -> list[tuple[int, bool, float, float]]:
    if len(template.stages) < 2:
        return []
    shape = _Shape.of(template, tables, _links(template, tables))
    most = min(MAX_CHUNKS, min(e - s for s, e, _ in template.stages))
    return [
        (k, split, *_line(shape, k, split))
        for k in range(1, most + 1)
        for split in (False, True)
        if k > 1 or split
    ]


_LINES: IdentityMemo[list[tuple[int, bool, float, float]]] = IdentityMemo(limit=1 << 16)


def _links(template: Template, tables: dict[int, StageTable]) -> list[float]:
    """A template's inner links and its wrap-around link (chunk k of the last stage to chunk k + 1 of
    the first: its one-layer chunk's exchange, inter-node unless both ends share a run)."""
    stages = template.stages
    crosses = template.runs[0] != template.runs[-1]
    wrap = tables[stages[-1][2]].exchange_s[(stages[0][2], crosses)][stages[-1][0] + 1]
    return [*exchanges_s(tables, stages, template.runs), wrap]

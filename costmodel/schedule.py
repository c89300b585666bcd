"""The interleaved 1F1B schedule of one pipeline: each stage's order of work, the messages between
stages, and a step-by-step replay of it. Torch-free: the runtime (`runtime.pipeline`) runs exactly
these orders, the cost model prices them and tests hold the two together.

A pipeline of S stages whose stages hold v layer chunks each is a pipeline of S·v virtual stages:
virtual stage k·S + s is chunk k of stage s, so micro-batch i's forward runs chunk 0 on stages 0..S-1,
then chunk 1 on stages 0..S-1 (stage S-1 sends chunk 0's output to stage 0), and so on; backward in
reverse. Each stage runs its chunk-forwards in the order of Megatron-LM's interleaved schedule
(Narayanan et al. 2021, section 2.2.2): micro-batches in groups of S, for each group chunk 0 of every
micro-batch of the group, then chunk 1, ... Micro-batch counts that S does not divide are handled
as Megatron-core's schedule table handles them, by groups of another size, here with the remainder
of m / S joined to the first group (and one group of all m when m < 2S; `groups` says why).
Backwards follow the same table with the chunks reversed. Stage s first runs

    warmup_s = min((S - s - 1) + (v - 1)·g, m·v),   g the first group's size (S when S divides m)

chunk-forwards, then alternates one forward and one backward, then drains the remaining backwards.
At v = 1 this is today's 1F1B (S - s - 1 warm-up forwards). Megatron warms up with 2(S - s - 1) +
(v - 1)·S because its exchanges are blocking and paired step by step; here a stage sends as soon as a
chunk is done and waits only for the input it needs next (`runtime.pipeline`), so the shorter
warm-up suffices and keeps S - s - 1 fewer chunk activations alive (`replay` checks that no order of
arrivals can deadlock and that no backward comes before its forward: it stops with work left).

Split backward (ZB-H1; Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1): with
`split`, every backward becomes its input gradient "B", which the previous stage waits for, and its
weight gradient "W", which nothing waits for; stage s runs each W s backwards after its B
(`deferred`), the last ones at the end, where they fill the drain's waits. The order of F and B is
unchanged, so the messages are the same; the replay prices B and W apart.

Cost: the replay with per-chunk times is the reference; `interleaved_time_s` is the closed form the
cost model and the solver use, tested against the replay in tests/test_interleaved_schedule.py.
"""

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int


def groups(num_stages: int, m: int) -> list[range]:
    """The micro-batch groups of the forward table: groups of S, the remainder of m / S joined to the
    first one (a group smaller than S would leave the wrap-around link's wait unhidden, and a later
    group larger than the first would let backward overtake forward); one group of all m when
    m < 2S."""
    if m < 2 * num_stages:
        return [range(m)]
    first = num_stages + m % num_stages
    return [range(0, first)] + [range(low, low + num_stages) for low in range(first, m, num_stages)]


def table(num_stages: int, num_chunks: int, m: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in forward order: group by group, chunk by chunk."""
    return [(i, k) for group in groups(num_stages, m) for k in range(num_chunks) for i in group]


def warmup(stage: int, num_stages: int, num_chunks: int, m: int) -> int:
    """Chunk-forwards stage `stage` runs before its first backward (module docstring)."""
    first = len(groups(num_stages, m)[0])
    return min(num_stages - stage - 1 + (num_chunks - 1) * first, m * num_chunks)


def program(stage: int, num_stages: int, num_chunks: int, m: int, split: bool = False) -> list[Op]:
    """Stage `stage`'s work in order; `split`: each backward split into its input gradient ("B")
    and its weight gradient ("W"), the weight gradients deferred (`split_backward`)."""
    forwards = [Op("F", i, k) for i, k in table(num_stages, num_chunks, m)]
    backwards = [Op("B", i, num_chunks - 1 - k) for i, k in table(num_stages, num_chunks, m)]
    w = warmup(stage, num_stages, num_chunks, m)
    ops = forwards[:w]
    for j in range(len(forwards) - w):
        ops += [forwards[w + j], backwards[j]]
    ops += backwards[len(forwards) - w :]
    return split_backward(ops, deferred(stage)) if split else ops


def deferred(stage: int) -> int:
    """Weight gradients stage `stage` holds back under the split schedule: s. Stage s of 1F1B (and
    of the interleaved order) runs S - 1 - s fewer warm-up forwards than stage 0, so deferring s
    weight gradients keeps at most stage 0's count of activations alive (until their W) on every
    stage, as ZB-H1 does, and gives the later stages, whose drain waits longest, the most work to
    fill it with. A replay of a 14-stage, 5-chunk pipeline of 15 micro-batches: bubble 15.8% of the
    step unsplit, 12.1% deferring none, 15.3% deferring S - 1 - s, 9.2% deferring s."""
    return stage


def split_backward(ops: list[Op], defer: int) -> list[Op]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1) on any order of
    forwards and backwards: every backward becomes its input gradient B, which the previous stage
    waits for, and its weight gradient W, which nobody waits for and which runs `defer` backwards
    later (the last `defer` at the end, where they fill the drain's wait)."""
    out: list[Op] = []
    held: deque[Op] = deque()
    for op in ops:
        out.append(op)
        if op.kind == "B":
            held.append(Op("W", op.micro_batch, op.chunk))
            if len(held) > defer:
                out.append(held.popleft())
    return out + list(held)


def source(op: Op, stage: int, num_stages: int, num_chunks: int) -> int | None:
    """The stage whose message `op` on `stage` waits for: the previous virtual stage's (forward) or
    the next one's (backward); None where the input is data (first virtual stage's forward) or the
    loss (last virtual stage's backward)."""
    if op.kind == "W":
        return None
    virtual = op.chunk * num_stages + stage
    other = virtual - 1 if op.kind == "F" else virtual + 1
    if not 0 <= other < num_stages * num_chunks:
        return None
    return other % num_stages


def destination(op: Op, stage: int, num_stages: int, num_chunks: int) -> int | None:
    """The stage `op`'s result goes to (the next virtual stage's forward input, the previous one's
    output gradient); None for the loss and for the first virtual stage's input gradient."""
    if op.kind == "W":
        return None
    virtual = op.chunk * num_stages + stage
    other = virtual + 1 if op.kind == "F" else virtual - 1
    if not 0 <= other < num_stages * num_chunks:
        return None
    return other % num_stages


def sends(stage: int, to: int, num_stages: int, num_chunks: int, m: int, split: bool = False) -> list[Op]:
    """The ops whose results `stage` sends to stage `to`, in the order it sends them (its program's):
    the order in which `to` posts its receives from `stage`."""
    return [
        op
        for op in program(stage, num_stages, num_chunks, m, split)
        if destination(op, stage, num_stages, num_chunks) == to
    ]


def peak_live(
    stage: int,
    num_stages: int,
    num_chunks: int,
    m: int,
    weights: Sequence[float],
    held: Sequence[float] | None = None,
) -> float:
    """The most activation a stage keeps at once: each chunk-forward's activation (weights[chunk])
    lives until its backward. Exact: it depends only on the stage's own order. `held`: the split
    schedule, where the input gradient B frees the activation but keeps held[chunk] (what the
    weight gradients read: the projections' inputs and output gradients) until W."""
    live = peak = 0.0
    for op in program(stage, num_stages, num_chunks, m, held is not None):
        if op.kind == "F":
            live += weights[op.chunk]
        elif op.kind == "B":
            live += (0.0 if held is None else held[op.chunk]) - weights[op.chunk]
        else:
            live -= held[op.chunk]
        peak = max(peak, live)
    return peak


@functools.lru_cache(maxsize=1 << 14)  # the solver asks for the same few shapes many times
def peak_in_flight(stage: int, num_stages: int, num_chunks: int, m: int, split: bool = False) -> int:
    """Chunk activations alive at once on `stage` at its peak (`split`: until their weight
    gradients): `peak_live` with unit weights, counted instead of walked. The warm-up's w forwards
    are alive when the first steady forward comes, and each steady step then adds a forward and
    frees a backward's activation; split, a backward frees nothing until its W, s backwards later
    on stage s (`deferred`), so the count grows through the first s steady steps."""
    n, w = m * num_chunks, warmup(stage, num_stages, num_chunks, m)
    if w == n:  # no steady step: every forward before the first backward
        return n
    return w + 1 + (min(deferred(stage), n - w - 1) if split else 0)


def replay(
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    p2p: Sequence[float],
    m: int,
    wgrad: Sequence[Sequence[float]] | None = None,
) -> list[float]:
    """Each stage's finish time when every stage runs its program, each op as soon as its stage is
    free and its input has arrived (the producer's end plus the link's transfer time).

    fwd[s][k], bwd[s][k]: chunk k's times on stage s; p2p[s]: the link from stage s to stage s + 1
    (p2p[S - 1]: from the last stage back to the first, which carries chunk k's output to chunk
    k + 1; unused at v = 1), the same time in both directions. `wgrad[s][k]`: the part of bwd[s][k]
    that is weight gradient, for the split schedule (`program(..., split=True)`; None: not split)."""
    return replay_ops(fwd, bwd, p2p, m, wgrad)[0]


def replay_ops(
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    p2p: Sequence[float],
    m: int,
    wgrad: Sequence[Sequence[float]] | None = None,
) -> tuple[list[float], dict[tuple[int, Op], float]]:
    """`replay`, with the end time of every (stage, op) as well."""
    S, v = len(fwd), len(fwd[0])
    split = wgrad is not None
    programs = [program(s, S, v, m, split) for s in range(S)]
    if split:  # B is the input gradient alone
        times = {
            "F": fwd,
            "B": [[b - w for b, w in zip(*sw, strict=True)] for sw in zip(bwd, wgrad, strict=True)],
            "W": wgrad,
        }
    else:
        times = {"F": fwd, "B": bwd}
    ends: dict[tuple[int, Op], float] = {}
    clock, cursor = [0.0] * S, [0] * S
    progressed = True
    while progressed:
        progressed = False
        for s in range(S):
            while cursor[s] < len(programs[s]):
                op = programs[s][cursor[s]]
                start = clock[s]
                if op.kind == "B" and (s, Op("F", op.micro_batch, op.chunk)) not in ends:
                    break  # its own forward has not run: the order is broken
                src = source(op, s, S, v)
                if src is not None:
                    virtual = op.chunk * S + s
                    before = virtual - 1 if op.kind == "F" else virtual + 1
                    key = (src, Op(op.kind, op.micro_batch, before // S))
                    if key not in ends:
                        break
                    link = p2p[min(s, src)] if abs(s - src) == 1 else p2p[S - 1]
                    start = max(start, ends[key] + link)
                clock[s] = start + times[op.kind][s][op.chunk]
                ends[(s, op)] = clock[s]
                cursor[s] += 1
                progressed = True
    if any(c < len(p) for c, p in zip(cursor, programs, strict=True)):
        raise RuntimeError(f"the interleaved schedule deadlocks: {S} stages, {v} chunks, {m} micro-batches")
    return clock, ends


def interleaved_time_s(
    fwd: Sequence[float],
    bwd: Sequence[float],
    p2p: Sequence[float],
    m: int,
    num_chunks: int,
    wgrad: Sequence[float] | None = None,
) -> float:
    """The closed form of one interleaved pipeline's time, from stage totals fwd[s], bwd[s] (over its
    chunks) and p2p as in `replay` (S entries, the last the wrap-around link). With W_s = F_s + B_s,
    P = max_s W_s and v chunks:

        max( sum_s W_s / v + (m - 1/v) P,   sum_s W_s + (m - 1) P / v )
        + 2 (sum_{s < S-1} c_s + (v - 1) c_wrap) + m (2 v / S) sum_{s < S-1} c_s

    The first term is Megatron's (m + (S - 1)/v)(F + B) generalised to unequal stages: the fill and
    drain cross every stage at chunk granularity, the rest runs at the slowest stage's pace; it binds
    once m >= S. With fewer micro-batches than stages every micro-batch crosses all S·v virtual
    stages and the next follows one chunk behind: the second term. Transfers: the fill and the drain
    cross the inner links once and the wrap-around link v - 1 times each; in the steady state each
    group of S micro-batches waits for the inner links 2v times (a stage's next input is produced by
    a neighbour that was itself waiting), which the replay of equal stages shows exactly. Exact
    against `replay` for equal stages and chunks; tests/test_interleaved_schedule.py states the
    bounds for unequal ones.

    Split backward (`wgrad[s]`, the weight-gradient part of bwd[s]; `split_backward`): the fill and
    the drain cross each stage with W_s - 2 G_s instead of W_s (G_s = wgrad[s]: B no longer waits
    for it, and the deferred W fill the drain), as ZB-H1's (S - 1)(F + B - W) for equal stages, so
    the first term becomes m P + (sum_s (W_s - 2 G_s) - (W - 2 G) of the slowest stage) / v. Below S
    micro-batches it is at least one micro-batch's crossing of every stage with F + B alone, stage
    0's last weight gradient after it (stage 0 defers none), and each further micro-batch's F + B on
    the slowest stage: sum_s (W_s - G_s) + G_0 / v + (m - 1)(P - G_P) / v, exact for equal stages
    at v = 1."""
    S, v = len(fwd), num_chunks
    work = [f + b for f, b in zip(fwd, bwd, strict=True)]
    slowest = max(work)
    if wgrad is None:
        compute = max(sum(work) / v + (m - 1 / v) * slowest, sum(work) + (m - 1) * slowest / v)
    else:
        lean = [w - 2 * g for w, g in zip(work, wgrad, strict=True)]
        compute = m * slowest + (sum(lean) - lean[work.index(slowest)]) / v
        if m < S:
            bottleneck = work.index(slowest)
            crossing = sum(work) - sum(wgrad) + wgrad[0] / v
            compute = max(compute, crossing + (m - 1) * (slowest - wgrad[bottleneck]) / v)
    inner, wrap = sum(p2p[: S - 1]), p2p[S - 1]
    return compute + 2 * (inner + (v - 1) * wrap) + m * 2 * v * inner / S

"""The interleaved 1F1B schedule (costmodel/schedule.py): its orders, that they cannot deadlock, the
activations they keep alive, and the closed form of its time against the step-by-step replay.

Bounds of the closed form (`interleaved_time_s`) against `replay`, over random pipelines of 2-8
stages, 2-4 chunks, 1-4S micro-batches, stage times within +-30% of each other, chunks of a stage
within +-10% of each other (the solver's chunks are balanced to a layer) and links up to a tenth of
a chunk: it never predicts more than UNDER below the replay nor OVER above it; with equal stages and
chunks and no transfer time it is exact (Megatron's (m + (S - 1)/v)(F + B) once m >= S).
"""

import random

import pytest

from costmodel import schedule as sc

UNDER, OVER = 0.04, 0.12


def test_every_chunk_of_every_micro_batch_runs_forward_then_backward_once():
    for S in range(2, 7):
        for v in range(1, 5):
            for m in range(1, 3 * S + 2):
                for s in range(S):
                    ops = sc.program(s, S, v, m)
                    assert len(ops) == 2 * m * v
                    assert len(set(ops)) == len(ops)
                    seen = set()
                    for op in ops:
                        if op.kind == "F":
                            seen.add((op.micro_batch, op.chunk))
                        else:
                            assert (op.micro_batch, op.chunk) in seen


def test_one_chunk_is_1f1b():
    """v = 1: S - s - 1 warm-up forwards, then one forward one backward: today's schedule."""
    for S in range(2, 6):
        for m in range(1, 9):
            for s in range(S):
                assert sc.warmup(s, S, 1, m) == min(S - s - 1, m)
                assert sc.peak_in_flight(s, S, 1, m) == min(S - s, m)


def test_no_order_of_arrivals_deadlocks():
    """The replay runs every op of every stage whatever the times (it raises on a cycle of waits)."""
    rng = random.Random(1)
    for S in range(2, 9):
        for v in range(2, 5):
            for m in range(1, 4 * S + 1):
                fwd = [[rng.uniform(0.1, 1) for _ in range(v)] for _ in range(S)]
                bwd = [[rng.uniform(0.1, 2) for _ in range(v)] for _ in range(S)]
                sc.replay(fwd, bwd, [rng.uniform(0, 0.5) for _ in range(S)], m)


def test_messages_pair_up():
    """What stage a sends stage b is exactly what b's ops wait for from a, micro-batch by chunk."""
    for S in (2, 3, 5):
        for v in (2, 3):
            for m in (1, 4, 7):
                for b in range(S):
                    wanted = {}
                    for op in sc.program(b, S, v, m):
                        src = sc.source(op, b, S, v)
                        if src is not None:
                            wanted.setdefault(src, set()).add(op)
                    for a, ops in wanted.items():
                        sent = sc.sends(a, b, S, v, m)
                        assert len(sent) == len(ops)


def test_equal_stages_match_megatron_exactly():
    for S in range(2, 8):
        for v in range(1, 5):
            for m in range(1, 4 * S + 1):
                f, b = 1.0, 2.0
                got = max(sc.replay([[f / v] * v] * S, [[b / v] * v] * S, [0.0] * S, m))
                assert got == pytest.approx(
                    sc.interleaved_time_s([f] * S, [b] * S, [0.0] * S, m, v), rel=1e-12
                )
                if m >= S and m % S == 0:
                    assert got == pytest.approx((m + (S - 1) / v) * (f + b), rel=1e-12)


def test_transfers_on_equal_stages_are_priced_within_one_percent_above():
    for S in (2, 4, 6):
        for v in (2, 3):
            for m in (S, 2 * S + 1, 3 * S, 4 * S):
                got = max(sc.replay([[1.0 / v] * v] * S, [[2.0 / v] * v] * S, [0.02] * S, m))
                want = sc.interleaved_time_s([1.0] * S, [2.0] * S, [0.02] * S, m, v)
                assert got <= want <= 1.01 * got, (S, v, m)


def test_closed_form_within_bounds_of_replay():
    rng = random.Random(0)
    errors = []
    for _ in range(1500):
        S, v = rng.randint(2, 8), rng.randint(2, 4)
        m = rng.randint(1, 4 * S)
        pace = [rng.uniform(0.7, 1.3) for _ in range(S)]
        fwd = [[pace[s] * rng.uniform(0.9, 1.1) for _ in range(v)] for s in range(S)]
        bwd = [[2 * x for x in row] for row in fwd]
        p2p = [rng.uniform(0, 0.1) * rng.choice((0, 1, 1)) for _ in range(S)]
        got = max(sc.replay(fwd, bwd, p2p, m))
        want = sc.interleaved_time_s([sum(r) for r in fwd], [sum(r) for r in bwd], p2p, m, v)
        errors.append((want - got) / got)
    assert min(errors) >= -UNDER and max(errors) <= OVER, (min(errors), max(errors))


def test_interleaving_cuts_the_bubble():
    """The reason for it: 4 stages, 8 micro-batches, bubble (S - 1)/(v m) of the ideal time."""
    S, m = 4, 8
    one = max(sc.replay([[1.0]] * S, [[2.0]] * S, [0.0] * S, m))
    two = max(sc.replay([[0.5, 0.5]] * S, [[1.0, 1.0]] * S, [0.0] * S, m))
    assert one == pytest.approx((m + S - 1) * 3) and two == pytest.approx((m + (S - 1) / 2) * 3)


def test_peak_live_counts_each_chunk_until_its_backward():
    """Stage 0 of 4 with 2 chunks and 8 micro-batches runs F0.0-F3.0, F0.1-F3.1, then B0.1 F4.0 B1.1
    F5.0 B2.1 F6.0 B3.1 F7.0: 8 chunk activations at most, all 8 of chunk 0 at once; the last stage
    keeps 5 (its 4 warm-up forwards and the one before its first backward)."""
    assert sc.peak_in_flight(0, 4, 2, 8) == 8
    assert sc.peak_in_flight(3, 4, 2, 8) == 5
    assert sc.peak_live(0, 4, 2, 8, [3.0, 1.0]) == pytest.approx(8 * 3.0)
    assert sc.peak_live(0, 4, 2, 8, [1.0, 3.0]) == pytest.approx(4 * 1.0 + 4 * 3.0)


# ---- split backward (ZB-H1) -----------------------------------------------------------------------
# Bounds of `interleaved_time_s(..., wgrad)` against the split replay over the same random pipelines
# with v from 1 and weight gradients 30-50% of each backward: from m >= 2S on (where the solver's
# large plans sit) never more than STEADY_UNDER below nor STEADY_OVER above; below 2S micro-batches
# within FEW_UNDER and FEW_OVER (measured envelopes over 8,000 pipelines: -4.3%/+8.7% and
# -10.4%/+13.2%).
STEADY_UNDER, STEADY_OVER = 0.05, 0.10
FEW_UNDER, FEW_OVER = 0.12, 0.16


def _random_split_pipeline(rng: random.Random):
    S, v = rng.randint(2, 8), rng.randint(1, 4)
    m = rng.randint(1, 4 * S)
    pace = [rng.uniform(0.7, 1.3) for _ in range(S)]
    fwd = [[pace[s] * rng.uniform(0.9, 1.1) for _ in range(v)] for s in range(S)]
    bwd = [[2 * x for x in row] for row in fwd]
    wgrad = [[b * rng.uniform(0.3, 0.5) for b in row] for row in bwd]
    p2p = [rng.uniform(0, 0.1) * rng.choice((0, 1, 1)) for _ in range(S)]
    return S, v, m, fwd, bwd, wgrad, p2p


def test_split_program_defers_each_weight_gradient_by_the_stage_index():
    """Every F, B and W once; each W after its B, `s` backwards later on stage s (or at the end);
    the F/B order is the unsplit program's."""
    for S in range(2, 7):
        for v in range(1, 4):
            for m in range(1, 3 * S + 2):
                for s in range(S):
                    ops = sc.program(s, S, v, m, split=True)
                    assert [op for op in ops if op.kind != "W"] == sc.program(s, S, v, m)
                    assert len(ops) == 3 * m * v and len(set(ops)) == len(ops)
                    backwards = [op for op in ops if op.kind == "B"]
                    for op in ops:
                        if op.kind != "W":
                            continue
                        b = backwards.index(sc.Op("B", op.micro_batch, op.chunk))
                        done = sum(1 for o in ops[: ops.index(op)] if o.kind == "B")
                        assert done == min(b + 1 + s, len(backwards)), (S, v, m, s, op)


def test_split_messages_pair_up_and_never_deadlock():
    rng = random.Random(2)
    for S in (2, 3, 5):
        for v in (1, 2, 3):
            for m in (1, 4, 7):
                for b in range(S):
                    wanted = {}
                    for op in sc.program(b, S, v, m, split=True):
                        src = sc.source(op, b, S, v)
                        if src is not None:
                            wanted.setdefault(src, []).append(op)
                    for a, ops in wanted.items():
                        assert len(sc.sends(a, b, S, v, m, split=True)) == len(ops)
    for _ in range(300):
        S, v, m, fwd, bwd, wgrad, p2p = _random_split_pipeline(rng)
        sc.replay(fwd, bwd, p2p, m, wgrad)  # raises on a cycle of waits


def test_split_equal_stages_match_zb_h1():
    """Equal stages at v = 1 and m >= S: m (F + B) + (S - 1)(F + B - 2G), ZB-H1's bubble (S - 1)(F +
    B' - W) with its B' = B - G and W = G; the closed form is exact for equal stages at every m for
    v = 1, and from m = S on for v > 1."""
    f, b, g = 1.0, 2.0, 0.8
    for S in range(2, 8):
        for v in range(1, 4):
            for m in range(1, 4 * S + 1):
                got = max(sc.replay([[f / v] * v] * S, [[b / v] * v] * S, [0.0] * S, m, [[g / v] * v] * S))
                want = sc.interleaved_time_s([f] * S, [b] * S, [0.0] * S, m, v, [g] * S)
                if v == 1 or m >= S:
                    assert got == pytest.approx(want, rel=1e-12), (S, v, m)
                if v == 1 and m >= S:
                    assert got == pytest.approx(m * (f + b) + (S - 1) * (f + b - 2 * g), rel=1e-12)


def test_split_closed_form_within_bounds_and_split_never_slower():
    rng = random.Random(3)
    errors: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(1500):
        S, v, m, fwd, bwd, wgrad, p2p = _random_split_pipeline(rng)
        got = max(sc.replay(fwd, bwd, p2p, m, wgrad))
        assert got <= max(sc.replay(fwd, bwd, p2p, m)) * (1 + 1e-12)
        totals = [[sum(r) for r in x] for x in (fwd, bwd, wgrad)]
        want = sc.interleaved_time_s(totals[0], totals[1], p2p, m, v, totals[2])
        errors[m >= 2 * S].append((want - got) / got)
    steady, few = errors[True], errors[False]
    assert min(steady) >= -STEADY_UNDER and max(steady) <= STEADY_OVER, (min(steady), max(steady))
    assert min(few) >= -FEW_UNDER and max(few) <= FEW_OVER, (min(few), max(few))


def test_split_cuts_the_bubble_of_the_70b_shape():
    """14 stages of 5 chunks, 15 micro-batches, F 22.4, B 50.2 (W 18 of it) ms per micro-batch: the
    bubble (the step beyond m (F + B) of one stage) falls from 15.8% to 9.2% of the step."""
    S, v, m, f, b, g = 14, 5, 15, 22.4, 50.18, 18.0

    def bubble(wgrad):
        fwd, bwd = [[f / v] * v] * S, [[b / v] * v] * S
        step = max(sc.replay(fwd, bwd, [0.3] * S, m, wgrad))
        return 1 - m * (f + b) / step

    assert bubble(None) == pytest.approx(0.158, abs=0.001)
    assert bubble([[g / v] * v] * S) == pytest.approx(0.092, abs=0.001)


def test_the_counted_peak_is_the_walked_one():
    """`peak_in_flight` counts what `peak_live` walks with unit weights, split or not, on every
    shape up to 9 stages and 5 chunks, from one micro-batch to beyond 4S."""
    for S in range(1, 10):
        for v in range(1, 6):
            ones = [1.0] * v
            for m in range(1, 4 * S + 2):
                for s in range(S):
                    assert sc.peak_in_flight(s, S, v, m) == sc.peak_live(s, S, v, m, ones), (s, S, v, m)
                    walked = sc.peak_live(s, S, v, m, ones, held=ones)
                    assert sc.peak_in_flight(s, S, v, m, split=True) == walked, (s, S, v, m)


def test_split_keeps_at_most_stage_zeros_activations():
    """Deferring s weight gradients on stage s keeps what W reads until then: counted as whole
    activations no stage holds more than stage 0 does unsplit; `held` is what B leaves for W."""
    for S in range(2, 7):
        for v in range(1, 4):
            for m in range(1, 3 * S + 1):
                most = sc.peak_in_flight(0, S, v, m)
                for s in range(S):
                    assert sc.peak_in_flight(s, S, v, m) <= sc.peak_in_flight(s, S, v, m, split=True) <= most
    # stage 3 of 4, 1F1B, 8 micro-batches: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 ...: with all of an
    # activation held until W, four alive; holding half of it, at F3 one activation and three halves
    assert sc.peak_live(3, 4, 1, 8, [1.0], held=[1.0]) == 4.0
    assert sc.peak_live(3, 4, 1, 8, [1.0], held=[0.5]) == pytest.approx(1.0 + 3 * 0.5)

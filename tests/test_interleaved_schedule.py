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

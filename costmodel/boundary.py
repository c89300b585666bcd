"""Who sends which part of a stage boundary's activations to whom: the same rule for runtime and cost model.

A stage of TP degree t holds its output (and, in backward, its input gradient) either whole on every
rank or, with sequence parallelism, split along the sequence: rank r holds tokens
[r·s/t, (r+1)·s/t). Across a boundary each rank that needs a range of tokens (`needs`) gets every token
of it exactly once, from some rank that holds it (`holds`): its range is cut at the holders' edges and
each piece comes from one of the holders covering it, chosen round-robin by the needer's index so that
replicas share the sending. Forward, the front stage holds and the back stage needs; backward, the
roles swap. So a TP1 stage feeding a sequence-parallel TP4 stage sends each receiver its quarter
(s tokens in all, where four full copies went before), and a whole-holding TP A stage feeding a
whole-needing TP B stage sends receiver j everything from rank j mod A.

Torch-free: the runtime posts exactly these transfers, and tests/test_runtime_bytes.py holds the bytes
on the sockets to them. The cost model prices a boundary by its busiest rank (`busiest_shares`): the
most any one rank sends or receives of it, since a rank's link carries its own messages one after
another, and the exchange ends when the busiest rank's does.
"""

import functools
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class Transfer:
    src: int  # index of the holder in its stage's device list
    dst: int  # index of the needer in its stage's device list
    start: int  # global token range [start, stop)
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


def token_range(seq_len: int, tp_degree: int, tp_rank: int, sequence_parallel: bool) -> tuple[int, int]:
    """The tokens a rank holds of a [batch, seq, hidden] activation: all, or its sequence slice."""
    if not sequence_parallel:
        return 0, seq_len
    size = seq_len // tp_degree
    return tp_rank * size, (tp_rank + 1) * size


def routes(holds: list[tuple[int, int]], needs: list[tuple[int, int]]) -> list[Transfer]:
    """Every transfer that gives each needer its range from the holders (module docstring), needers
    in order, each needer's pieces in token order."""
    transfers = []
    edges = sorted({e for lo, hi in holds for e in (lo, hi)})
    for j, (lo, hi) in enumerate(needs):
        cuts = [lo, *(e for e in edges if lo < e < hi), hi]
        for a, b in pairwise(cuts):
            covering = [i for i, (h_lo, h_hi) in enumerate(holds) if h_lo <= a and b <= h_hi]
            if not covering:
                raise ValueError(f"no holder has tokens [{a}, {b})")
            transfers.append(Transfer(covering[j % len(covering)], j, a, b))
    return transfers


def stage_ranges(seq_len: int, tp_degree: int, sequence_parallel: bool) -> list[tuple[int, int]]:
    return [token_range(seq_len, tp_degree, r, sequence_parallel) for r in range(tp_degree)]


@functools.lru_cache(maxsize=4096)
def busiest_shares(seq_len: int, front: tuple[int, bool], back: tuple[int, bool]) -> tuple[float, float]:
    """The share of one boundary activation that its busiest rank sends or receives, forward (front
    stage to back) and backward (the gradient, back to front), for stages of (TP degree, sequence
    parallel). Equal sequence-parallel stages move a 1/t slice per rank; a TP 4 stage feeding TP 1
    has the receiver take the whole activation (1, where the sender's slice is 1/4); a whole-holding
    TP 1 stage feeding whole-needing TP 4 sends it four times (4)."""
    holds, needs = stage_ranges(seq_len, *front), stage_ranges(seq_len, *back)
    return _busiest(holds, needs) / seq_len, _busiest(needs, holds) / seq_len


def _busiest(holds: list[tuple[int, int]], needs: list[tuple[int, int]]) -> int:
    sent, received = [0] * len(holds), [0] * len(needs)
    for t in routes(holds, needs):
        sent[t.src] += t.tokens
        received[t.dst] += t.tokens
    return max(*sent, *received)

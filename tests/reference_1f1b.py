"""A step-by-step simulation of the 1F1B schedule: the reference the cost model's formula is tested against.

Stage s (of p) runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward
until its m forwards are done, then drains the remaining backwards (PipeDream-Flush). An operation
starts when its stage is free and its input has arrived: a forward needs the previous stage's forward
of the same micro-batch plus the transfer time, a backward needs the next stage's backward (or, on the
last stage, its own forward) plus the transfer time. Sends do not block the sender.
"""


def stage_order(stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    warmup = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < m:
        order += [("F", forwards), ("B", backwards)]
        forwards, backwards = forwards + 1, backwards + 1
    order += [("B", i) for i in range(backwards, m)]
    return order


def simulate_1f1b(fwd: list[float], bwd: list[float], p2p: list[float], m: int) -> float:
    """Finish time of the last operation of one training step's pipeline phase."""
    p = len(fwd)
    orders = [stage_order(s, p, m) for s in range(p)]
    finished: dict[tuple[str, int, int], float] = {}
    free_at = [0.0] * p
    cursor = [0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else finished.get(("F", s - 1, i))
                    if ready is None:
                        break
                    ready += p2p[s - 1] if s > 0 else 0.0
                    duration = fwd[s]
                else:
                    upstream = ("F", s, i) if s == p - 1 else ("B", s + 1, i)
                    ready = finished.get(upstream)
                    if ready is None:
                        break
                    ready += p2p[s] if s < p - 1 else 0.0
                    duration = bwd[s]
                start = max(free_at[s], ready)
                finished[(kind, s, i)] = free_at[s] = start + duration
                cursor[s] += 1
                progressed = True
    assert all(c == len(o) for c, o in zip(cursor, orders, strict=True)), "schedule deadlocked"
    return max(finished.values())

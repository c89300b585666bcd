"""A step-by-step simulation of the runtime's 1F1B schedule: the reference the cost model's formula is
tested against.

Stage s (of p) runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward
until its m forwards are done, then drains the remaining backwards (PipeDream-Flush). Between its
computations it exchanges with a neighbour exactly where `runtime.pipeline.PipelineSchedule.run` does,
and as there every exchange is waited for: the k-th exchange of stage s with the stage after it and
the k-th exchange of that stage with the stage before it are one event, which ends the transfer time
after the later of the two stages reaches it. A stage with no neighbour on a side skips that exchange.
"""


def stage_program(stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    """Stage `stage`'s operations in order: ("F", i), ("B", i), ("X", -1) with the stage before it,
    ("X", +1) with the stage after it (the runtime's `_recv_forward` and `_exchange` calls)."""
    warmup = min(num_stages - stage - 1, m)
    has_prev, has_next = stage > 0, stage < num_stages - 1
    program: list[tuple[str, int]] = []

    def exchange(side: int) -> None:
        if (side < 0 and has_prev) or (side > 0 and has_next):
            program.append(("X", side))

    for i in range(warmup):
        exchange(-1)  # receive the input
        program.append(("F", i))
        exchange(+1)  # send the output
    if warmup < m:
        exchange(-1)
    for i in range(warmup, m):
        program.append(("F", i))
        exchange(+1)  # send the output, receive the gradient of an earlier micro-batch
        program.append(("B", i - warmup))
        exchange(-1)  # send the input's gradient, receive the next input
    for i in range(m - warmup, m):
        exchange(+1)  # receive a gradient
        program.append(("B", i))
        exchange(-1)  # send the input's gradient
    return program


def simulate_1f1b(fwd: list[float], bwd: list[float], p2p: list[float], m: int) -> float:
    """Finish time of the last operation of one training step's pipeline phase."""
    return max(_run(fwd, bwd, p2p, m)[0])


def simulate_1f1b_backward_ends(fwd: list[float], bwd: list[float], p2p: list[float], m: int) -> list[float]:
    """When each stage finishes its last backward (its gradients are complete from then on)."""
    return _run(fwd, bwd, p2p, m)[1]


def _run(fwd: list[float], bwd: list[float], p2p: list[float], m: int) -> tuple[list[float], list[float]]:
    """Each stage's finish time and the end of its last backward."""
    p = len(fwd)
    programs = [stage_program(s, p, m) for s in range(p)]
    clock, cursor, ends = [0.0] * p, [0] * p, [0.0] * p

    def at(s: int) -> tuple[str, int] | None:
        return programs[s][cursor[s]] if cursor[s] < len(programs[s]) else None

    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while (op := at(s)) is not None and op[0] != "X":
                clock[s] += fwd[s] if op[0] == "F" else bwd[s]
                if op == ("B", m - 1):
                    ends[s] = clock[s]
                cursor[s] += 1
                progressed = True
        for s in range(p - 1):
            if at(s) == ("X", +1) and at(s + 1) == ("X", -1):
                clock[s] = clock[s + 1] = max(clock[s], clock[s + 1]) + p2p[s]
                cursor[s] += 1
                cursor[s + 1] += 1
                progressed = True
    assert all(c == len(prog) for c, prog in zip(cursor, programs, strict=True)), "schedule deadlocked"
    return clock, ends

"""Sub-problems of a search solved in a forked process while this one solves the others.

A search solves one master problem per micro-batch size and link scope (solver.core), each over
templates built for it alone; the sub-problems of the larger micro-batch sizes take a fifth to a
third of a solve (llama2-70b on 61 GPUs: 2.3 s of 6.8 s), on a core that sits idle. `Forked`
runs such work in a child process started by fork, as steps that each hand their answer back
through a pipe as soon as it is known: Elastor's search has its child work out the baselines that
seed it while the parent builds its templates, then its sub-problems, then, while the parent still
solves its own, node-drop's search (solver._elastor).

Why by hand rather than concurrent.futures: a pool would pickle the work's inputs (stage tables,
splitters, cost models, memoised templates) into workers that import the solver again; a fork
shares them as they are, and only the answer (each sub-problem's bound and the plan its master
found) travels back. The child's memos die with it, so the parent keeps only what it built itself.

Forking a process that runs other threads is only safe while they hold no lock the child needs. The
solver's own process (the command line, the benchmarks, a what-if sweep) runs none; a process that
has loaded torch (a training worker re-planning, with its thread pools and perhaps a CUDA context)
or runs other Python threads (an agent's heartbeats) is not assumed to be safe, and there the
search runs in one process, as it does in a daemonic process (a pool's worker, which may not start
children) and on systems other than Linux. ELASTOR_SOLVER_PROCESSES (1 or 2) overrides the choice
but for the last two.
"""

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

ENV = "ELASTOR_SOLVER_PROCESSES"


def processes() -> int:
    """How many processes a search may use (1 or 2; module docstring)."""
    # fork on Linux only (macOS's system libraries do not survive it); a daemonic process (a pool's
    # worker) may not start children
    if not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
        return 1
    wanted = os.environ.get(ENV, "").strip()
    if wanted:
        try:
            return 2 if int(wanted) >= 2 else 1
        except ValueError:
            return 1
    if "torch" in sys.modules or threading.active_count() > 1:
        return 1
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (a forked search's child
    is waited for before its search returns), for reports beside wall time."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


class Forked:
    """Steps running in turn in a forked child: `first()`, then each of `then` on the value before
    it (work for a core that would sit idle once the parent has what it needs most). The child
    sends each value as soon as it has it; `result()` waits for the next one, in order (None for a
    step that failed and for every step after it: the caller then does that work itself), and
    `cancel()` stops the child wherever it is."""

    def __init__(self, first: Callable[[], object], *then: Callable[[object], object]):
        for stream in (sys.stdout, sys.stderr):  # the child flushes its copy of them when it exits
            if stream is not None:
                stream.flush()
        context = multiprocessing.get_context("fork")
        self._answer, sender = context.Pipe(duplex=False)
        self._child = context.Process(target=_serve, args=(first, then, sender), daemon=True)
        self._child.start()
        sender.close()  # the child holds the only sending end: its exit ends the pipe
        self._left = 1 + len(then)  # values still to come

    def result(self) -> object | None:
        """The next step's value (None where it or an earlier step failed, or none is left)."""
        if not self._left:
            return None
        ok, value = self._receive()
        self._left = self._left - 1 if ok else 0
        if not self._left:
            self._end()
        return value if ok else None

    def cancel(self) -> None:
        """Stop the child (its answers are not needed)."""
        if self._child.is_alive():
            self._child.kill()
        self._left = 0
        self._end()

    def _receive(self) -> tuple[bool, object]:
        try:
            return self._answer.recv()
        except (EOFError, OSError):  # the child died without an answer
            return False, None

    def _end(self) -> None:
        self._answer.close()
        self._child.join()


def _serve(first: Callable[[], object], then: tuple[Callable[[object], object], ...], sender) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the child
    ok, value = _attempt(first)
    sender.send((ok, value))
    for step in then if ok else ():
        ok, value = _attempt(lambda step=step, value=value: step(value))
        sender.send((ok, value))
        if not ok:
            break
    sender.close()


def _attempt(step: Callable[[], object]) -> tuple[bool, object]:
    try:
        return True, step()
    except Exception as error:  # the parent redoes the work and meets the error itself
        return False, repr(error)

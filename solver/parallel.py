"""Sub-problems of a search solved in a forked process while this one solves the others.

A search solves one master problem per micro-batch size and link scope (solver.core), each over
templates built for it alone; the sub-problems of the larger micro-batch sizes take a fifth to a
third of a solve (llama2-70b on 61 GPUs: 2.3 s of 6.8 s), on a core that sits idle. `Forked`
runs such work in a child process started by fork and hands its answer back through a pipe; the
child can go on with more work while the parent still solves its own sub-problems (node-drop's
search: solver._elastor), and send that answer after the first.

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
from typing import Generic, TypeVar

Value = TypeVar("Value")
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


class Forked(Generic[Value]):
    """`work()` running in a forked child; `result()` waits for its value (None if it failed, and
    the caller then does the work itself). With `then`, the child goes on to run `then(value)`
    once it has sent the value (work for a core that would sit idle), and `then_result()` waits
    for that answer in turn (None if it failed); `cancel()` stops the child wherever it is."""

    def __init__(self, work: Callable[[], Value], then: Callable[[Value], object] | None = None):
        for stream in (sys.stdout, sys.stderr):  # the child flushes its copy of them when it exits
            if stream is not None:
                stream.flush()
        context = multiprocessing.get_context("fork")
        self._answer, sender = context.Pipe(duplex=False)
        self._child = context.Process(target=_serve, args=(work, then, sender), daemon=True)
        self._child.start()
        sender.close()  # the child holds the only sending end: its exit ends the pipe
        self._more = then is not None  # a second answer may follow the first

    def result(self) -> Value | None:
        ok, value = self._receive()
        if not ok:
            self._more = False  # no `then` runs after a failed work
        if not self._more:
            self._end()
        return value if ok else None

    def then_result(self) -> object | None:
        """`then`'s answer (after `result()`), or None where it failed or there is none."""
        if not self._more:
            return None
        self._more = False
        ok, value = self._receive()
        self._end()
        return value if ok else None

    def cancel(self) -> None:
        """Stop the child (its answers are not needed)."""
        if self._child.is_alive():
            self._child.kill()
        self._end()

    def _receive(self) -> tuple[bool, object]:
        try:
            return self._answer.recv()
        except (EOFError, OSError):  # the child died without an answer
            return False, None

    def _end(self) -> None:
        self._answer.close()
        self._child.join()


def _serve(work: Callable[[], object], then: Callable[[object], object] | None, sender) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the child
    ok, value = _attempt(work)
    sender.send((ok, value))
    if ok and then is not None:
        sender.send(_attempt(lambda: then(value)))
    sender.close()


def _attempt(step: Callable[[], object]) -> tuple[bool, object]:
    try:
        return True, step()
    except Exception as error:  # the parent redoes the work and meets the error itself
        return False, repr(error)

"""Every process of a run dies with its parent: launcher -> supervisors -> torchrun -> workers.

`python -m runtime.elastic.lifeline [--grace-s S] MODULE ARGS...` runs `python -m MODULE ARGS...` in
this process under a lifeline to the parent named by $ELASTOR_PARENT_PID, and names itself the parent
of whatever it starts. The launcher starts each supervisor so, the supervisor its torchrun, and
torchrun its workers (it passes its environment on), so the chain reaches every process of a round.

A lifeline is two guards, both needed:
- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): the kernel signals this process the moment
  the thread that started it exits, SIGKILL included. Popen forks from the calling thread; every
  process of the chain starts its children from its main thread, which lives as long as the process.
- a watchdog thread that compares `os.getppid()` with the parent every POLL_S: it covers the parent
  dying before the first guard was set, and systems without prctl.

With `--grace-s 0` (torchrun, workers) the process is SIGKILLed at once: a process whose parent is
gone has no one to report to. With a grace (a supervisor) it gets SIGTERM, stops its own children,
and is SIGKILLed if it is still alive `grace` seconds later, which bounds how long any orphan lives.
"""

import argparse
import contextlib
import ctypes
import os
import runpy
import signal
import sys
import threading
import time

ENV_PARENT = "ELASTOR_PARENT_PID"  # the pid a process of the chain must outlive
POLL_S = 0.2  # how often the watchdog looks at os.getppid()

# How long each level may take to stop the one below it, from the bottom up.
TORCH_CLOSE_GRACE_S = 30.0  # torchrun's own SIGTERM -> SIGKILL grace for its workers (PContext.close)
# A supervisor stopping its torchrun (SIGTERM) waits this long before SIGKILL: longer than torchrun's
# own grace, so that torchrun is never killed while it is still stopping its workers.
TORCHRUN_STOP_S = TORCH_CLOSE_GRACE_S + 5.0
# A stop request (SIGTERM, SIGINT to a supervisor): its workers finish their step and save within
# this, or are stopped as a failed round's are (runtime/stopping.py).
STOP_REQUEST_S = 30.0
# The launcher's wait for a supervisor it told to stop: a stop request, then stopping torchrun.
SUPERVISOR_STOP_S = STOP_REQUEST_S + TORCHRUN_STOP_S + 10.0
# A supervisor whose launcher is gone has this long to stop its torchrun before its lifeline kills it
# (a round's workers die on SIGTERM at once; if they do not, their lifelines kill them).
SUPERVISOR_GRACE_S = 5.0
# No process of the tree outlives the SIGKILL of its parent by more than this: a supervisor's grace,
# plus one watchdog poll per level below the launcher where prctl is missing, rounded up.
ORPHAN_BOUND_S = 6.0

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36


def guard(parent: int, *, grace_s: float = 0.0) -> None:
    """End this process when `parent` is gone: SIGKILL at once when `grace_s` is 0, else SIGTERM and
    SIGKILL `grace_s` seconds later."""
    first = signal.SIGKILL if grace_s <= 0 else signal.SIGTERM
    _prctl(_PR_SET_PDEATHSIG, int(first))
    watchdog = threading.Thread(target=_watch, args=(parent, first, grace_s), name="lifeline", daemon=True)
    watchdog.start()


def _watch(parent: int, first: signal.Signals, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), first)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants (Linux): a worker whose torchrun died becomes this
    process's child, so that `kill_children` can find it."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def children() -> list[int]:
    """The pids of this process's children (those `subprocess` has reaped excluded); Linux only."""
    me, found = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and _ppid(entry.name) == me:
                found.append(int(entry.name))
    return found


def kill_children(timeout_s: float = 5.0) -> list[int]:
    """SIGKILL and reap every child of this process until none is left or `timeout_s` passed (a
    process in uninterruptible sleep cannot be reaped). Returns the pids killed."""
    killed, deadline = [], time.monotonic() + timeout_s
    while (left := children()) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                    time.sleep(0.01)
    return sorted(set(killed))


def _ppid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...; comm may hold spaces and parentheses, so split after the last ')'
    return int(stat.rpartition(b")")[2].split()[1])


def _prctl(option: int, value: int) -> None:
    if not sys.platform.startswith("linux"):
        return  # the watchdog alone guards the process
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.elastic.lifeline", description=__doc__)
    parser.add_argument("--grace-s", type=float, default=0.0, help="SIGTERM, then SIGKILL after this")
    parser.add_argument("module", help="run as `python -m MODULE`")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    parent = os.environ.get(ENV_PARENT)
    if parent:
        guard(int(parent), grace_s=args.grace_s)
    os.environ[ENV_PARENT] = str(os.getpid())  # what this process starts must outlive it
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

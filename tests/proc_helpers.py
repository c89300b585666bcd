"""Processes seen through /proc (Linux): a process tree, command lines, and who is still alive."""

import contextlib
import os
import signal
import time
from pathlib import Path

MARK = "ELASTOR_TEST_PROCESS_TREE"  # in the environment of every process a test starts, for cleanup


def gone_within(pids: set[int], seconds: float) -> set[int]:
    """The pids of `pids` still alive (zombies count as gone) after waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name: state, ppid, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    fields = stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := stat(int(p))) and int(s[1]) == pid]


def descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        frontier = [c for p in frontier for c in children(p)]
        found.update(frontier)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def marked(mark: str) -> list[int]:
    """Every process whose environment carries this test's mark."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and needle in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"):
                found.append(int(p))
        except OSError:
            pass
    return found


def end_launch(launcher, mark: str) -> None:
    """SIGKILL `launcher` if it still runs, and every process whose environment carries `mark`."""
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait()
    for pid in marked(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

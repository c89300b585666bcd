"""Hang detection: every worker publishes its progress, and its supervisor declares a rank hung when it
stops.

Worker side. The training loop marks each step and each micro-batch's forward and backward
(`mark`), and brackets the waits on its peers (`waiting()`: point-to-point exchanges, the gradient
reductions, the step's all-reduce). Marking is two assignments; a thread of the worker's own writes
the record to `$ELASTOR_PROGRESS_DIR/<device>.json` every PUBLISH_S (a bounded rate, whatever the step
time), stamped with the time it wrote it.

Supervisor side (`hung`), over every rank of the round (its own node's records, the others' from their
heartbeats), with `--hang-timeout-s` T:
- a rank of this node whose record has not been rewritten for T is frozen (SIGSTOP, a process stuck
  with the interpreter held): its thread no longer runs;
- when no rank anywhere has moved for T (the supervisor times this on its own clock) although every
  one's thread still writes, the ranks not waiting on a peer are hung (stuck in their own compute,
  a GPU that stopped answering); the others are only waiting for them. When every rank waits, or
  none does, nobody can be blamed and the round is stalled as a whole.
Until every rank of the round has finished its first step no stall is judged: loading a checkpoint
and the first step's warm-up take as long as they take (the collective timeout still bounds them).
"""

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ENV_DIR = "ELASTOR_PROGRESS_DIR"  # where a round's workers publish (set by their supervisor)
PUBLISH_S = 0.5  # how often a worker's record is rewritten
# A stall nobody can be blamed for is declared this much later than one with a culprit: time for the
# culprit's own supervisor (which sees its records first) to act, and for its verdict to arrive.
BLAME_GRACE_S = 5.0


class Progress:
    """This worker's progress; `start` begins publishing it (a no-op outside `elastor run`)."""

    def __init__(self) -> None:
        self.step, self.seq, self.phase, self.waits = 0, 0, "start", 0
        self.done = 0  # steps this process completed
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.seq += 1

    def step_done(self, step: int) -> None:
        self.step, self.done = step, self.done + 1
        self.mark("step done")

    @contextlib.contextmanager
    def waiting(self):
        """Around a wait on peers: a rank that stalls inside one is a victim, not the cause."""
        self.waits += 1
        try:
            yield
        finally:
            self.waits -= 1

    def start(self, device: str) -> None:
        folder = os.environ.get(ENV_DIR)
        if not folder or self._thread is not None:
            return
        path = Path(folder) / f"{device.replace(':', '_')}.json"
        self._thread = threading.Thread(
            target=self._publish, args=(device, path), name="progress", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _publish(self, device: str, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        while not self._stopped.is_set():
            record = {
                "device": device,
                "step": self.step,
                "done": self.done,
                "seq": self.seq,
                "phase": self.phase,
                "waiting": self.waits > 0,
                "time_s": time.time(),
            }
            with contextlib.suppress(OSError):
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path)
            self._stopped.wait(PUBLISH_S)


current = Progress()  # the one progress of this process


def read(folder: Path) -> dict[str, dict]:
    """The records the workers of this node published, by device."""
    found = {}
    for path in Path(folder).glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict) and isinstance(record.get("device"), str):
                found[record["device"]] = record
    return found


@dataclass(frozen=True)
class Verdict:
    devices: tuple[str, ...]  # this node's hung devices (empty: the whole round stalled)
    why: str
    since_s: float  # wall-clock time the hang began, as this node estimates it


class HangWatch:
    """A supervisor's judgement over one round (module docstring)."""

    def __init__(self, devices: list[str], mine: list[str], timeout_s: float):
        self.devices, self.mine, self.timeout_s = devices, mine, timeout_s
        self._last: tuple | None = None
        self._moved_at = time.monotonic()
        self._moved_wall = time.time()

    def hung(self, records: dict[str, dict]) -> Verdict | None:
        now, wall = time.monotonic(), time.time()
        frozen = [
            d
            for d in self.mine
            if d in records and wall - float(records[d].get("time_s", wall)) > self.timeout_s
        ]
        if frozen:
            since = min(float(records[d]["time_s"]) for d in frozen)
            return Verdict(
                tuple(frozen), f"no progress report for more than --hang-timeout-s {self.timeout_s:g}", since
            )
        if any(d not in records for d in self.devices):
            return None  # still starting
        state = tuple((records[d].get("step"), records[d].get("seq")) for d in self.devices)
        if state != self._last:
            self._last, self._moved_at, self._moved_wall = state, now, wall
            return None
        if now - self._moved_at <= self.timeout_s or min(records[d].get("done", 0) for d in self.devices) < 1:
            return None
        busy = [d for d in self.devices if not records[d].get("waiting")]
        where = ", ".join(f"{d} at step {records[d].get('step')} ({records[d].get('phase')})" for d in busy)
        if 0 < len(busy) < len(self.devices):
            mine = tuple(d for d in busy if d in self.mine)
            if not mine:
                return None  # another node's rank is to blame; its supervisor acts
            why = f"stuck in its own work for more than --hang-timeout-s {self.timeout_s:g} ({where})"
            return Verdict(mine, why, self._moved_wall)
        if now - self._moved_at <= self.timeout_s + BLAME_GRACE_S:
            return None  # give the supervisor of a rank to blame the time to act first
        why = f"every rank stalled for more than --hang-timeout-s {self.timeout_s:g}"
        return Verdict((), why, self._moved_wall)

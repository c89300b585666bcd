"""Injected faults: `--inject-failure n1:3@20` and `--inject-recovery n1:3@40`.

A failure `D@S` SIGKILLs the worker playing device D when its training reaches global step S (right
after step S completes, or at start-up when it resumes at step S: a failure during recovery).
Failures form a script, in the order given: one is armed once every failure listed before it has
fired or is due no later than it. So `n1:0@6 n0:1@4` kills n1:0 at step 6 and then n0:1 when the
survivors resume from the checkpoint of step 4, during the recovery. Before
dying, the worker appends a `failure_injected` event to the metrics file, which is how the simulated
cluster learns that D is gone (a real cluster probes its GPUs instead). A recovery `D@S` brings D back
at the first checkpoint boundary at or after step S: the supervisors stop that round there, cleanly,
and the next round's plan includes D again.
"""

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from costmodel.cluster import parse_device
from costmodel.errors import ElastorError

ENV_FAILURES = "ELASTOR_INJECT_FAILURES"  # pending failures handed to the workers of a round


@dataclass(frozen=True, order=True)
class Fault:
    step: int
    device: str

    @classmethod
    def parse(cls, text: str, flag: str) -> "Fault":
        device, sep, step = text.partition("@")
        if not sep or not step.isdigit():
            raise ElastorError(f"{flag} {text!r} is not DEVICE@STEP, like n1:3@20.")
        parse_device(device)
        return cls(step=int(step), device=device)

    def __str__(self) -> str:
        return f"{self.device}@{self.step}"


def encode(faults: list[Fault]) -> str:
    return ",".join(str(f) for f in faults)


def decode(text: str) -> list[Fault]:
    return [Fault.parse(part, ENV_FAILURES) for part in text.split(",") if part]


def fired(metrics_path: Path) -> list[tuple[Fault, float]]:
    """Failures the workers reported before dying, with the wall-clock time of each."""
    if not metrics_path.is_file():
        return []
    found = []
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if record.get("event") == "failure_injected":
            found.append((Fault(step=record["step"], device=record["device"]), record["time_s"]))
    return found


def armed(failures: tuple[Fault, ...], fired_: list[tuple[Fault, float]]) -> list[Fault]:
    """The failures that may fire in the next round (see the module docstring)."""
    done = {f for f, _ in fired_}
    out = []
    for i, f in enumerate(failures):
        earlier = [g for g in failures[:i] if g not in done]
        if f not in done and all(g.step <= f.step for g in earlier):
            out.append(f)
    return out


def maybe_fail(device: str, step: int, pending: list[Fault], metrics_path: Path) -> None:
    """Kill this process with SIGKILL if a failure of `device` is due at `step` (called by workers)."""
    if not any(f.device == device and f.step == step for f in pending):
        return
    record = {"event": "failure_injected", "device": device, "step": step, "time_s": time.time()}
    with open(metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

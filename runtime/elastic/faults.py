"""Injected faults: `--inject-failure n1:3@20` and `--inject-recovery n1:3@40`.

A failure `D@S` SIGKILLs the worker playing device D when its training reaches global step S (right
after step S completes, or at start-up when it resumes at step S: a failure during recovery). Two
more kinds test the control plane: `hang:D@S` freezes that worker (it SIGSTOPs itself, as a GPU that
stops answering leaves its process: the supervisors' hang detection must find it), and `host:D@S`
takes down D's whole node (the worker SIGKILLs its supervisor, whose torchrun and workers die with
it: a lost host, which the others find by its heartbeat). `commit:D@S` kills D inside step S's
commit all-reduce (runtime/trainer.py) after it has contributed, with the state that leaves made
deterministic: D SIGKILLs itself as soon as its all-reduce returns, and the next device of the plan
in rank order acts as a rank whose all-reduce had not delivered the totals when the failure struck
(it holds them back and waits in the step until its communication is aborted, then fails as on a
lost peer), while the others complete the step. The in-process recovery must then finish that step
on the rank that missed its totals (`runtime.elastic.inprocess.Recovery._agree`).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from costmodel.cluster import parse_device
from costmodel.errors import ElastorError

ENV_FAILURES = "ELASTOR_INJECT_FAILURES"  # pending failures handed to the workers of a round
ENV_SUPERVISOR = "ELASTOR_SUPERVISOR_PID"  # the supervisor a `host:` failure takes down
KINDS = ("kill", "hang", "host", "commit")
HOLD_TIMEOUT_S = 120.0  # how long a `commit:` fault's next device waits for the abort


@dataclass(frozen=True, order=True)
class Fault:
    step: int
    device: str
    kind: str = "kill"

    @classmethod
    def parse(cls, text: str, flag: str) -> "Fault":
        kind, sep, rest = text.partition(":")
        if text.count(":") >= 2 and kind not in KINDS[1:]:
            raise ElastorError(
                f"{flag} {text!r}: {kind!r} is not a kind of failure; [hang:|host:|commit:]DEVICE@STEP, "
                "like hang:n1:3@20 (no kind: the worker is killed)."
            )
        if kind not in KINDS[1:]:
            kind, rest = "kill", text
        device, sep, step = rest.partition("@")
        if not sep or not step.isdigit():
            raise ElastorError(f"{flag} {text!r} is not [hang:|host:|commit:]DEVICE@STEP, like n1:3@20.")
        parse_device(device)
        return cls(step=int(step), device=device, kind=kind)

    def __str__(self) -> str:
        prefix = "" if self.kind == "kill" else f"{self.kind}:"
        return f"{prefix}{self.device}@{self.step}"


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
            fault = Fault(step=record["step"], device=record["device"], kind=record.get("kind", "kill"))
            found.append((fault, record["time_s"]))
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


def at_commit(
    devices: list[str], me: str, pending: list[Fault], metrics_path: Path, aborted
) -> Callable[[int], None] | None:
    """The `commit:` faults' part on device `me` of a plan with `devices`: a function the trainer
    calls once a step's commit all-reduce has returned (with the step's number), or None. The dying
    device SIGKILLs itself there; the next one waits until `aborted` (a threading.Event: the watch
    of runtime/elastic/inprocess.py has aborted its communication) and raises a peer failure."""
    faults = [f for f in pending if f.kind == "commit" and f.device in devices]
    if not faults:
        return None

    def fault(step: int) -> None:
        for f in faults:
            if f.step != step:
                continue
            if f.device == me:
                maybe_fail(me, step, [f], metrics_path, kinds=("commit",))
            after = devices[(devices.index(f.device) + 1) % len(devices)]
            if after == me and after != f.device:
                import torch.distributed as dist

                if not aborted.wait(HOLD_TIMEOUT_S):
                    raise ElastorError(f"{f}: no abort came within {HOLD_TIMEOUT_S:.0f} s")
                raise dist.DistError(f"injected: step {step}'s totals were held back when {f.device} died")

    return fault


def maybe_fail(
    device: str, step: int, pending: list[Fault], metrics_path: Path, *, kinds=("kill", "hang", "host")
) -> None:
    """Fail as a fault of `device` due at `step` says, if there is one (called by workers): SIGKILL
    this process, SIGSTOP it, or SIGKILL its supervisor and then this process (`commit:` faults fire
    inside the step instead, `at_commit`)."""
    due = [f for f in pending if f.device == device and f.step == step and f.kind in kinds]
    if not due:
        return
    kind = due[0].kind
    record = {
        "event": "failure_injected",
        "device": device,
        "step": step,
        "kind": kind,
        "time_s": time.time(),
    }
    with open(metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # only if someone sends SIGCONT: then the round goes on as if nothing had happened
    if kind == "host" and (supervisor := os.environ.get(ENV_SUPERVISOR)):
        os.kill(int(supervisor), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

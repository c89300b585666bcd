"""The recovery breakdown, read back from the metrics file: every second between a failure and the
first step after it, and throughput before and after.

For each failure, in file order: an injected one (a `failure_injected` event), or one the supervisors
found themselves, a lost node or a hung GPU (a `failure_detected` event whose `failed_since_s` says
when it happened: the node's last heartbeat, the hung rank's last progress):
    detect     = failure_detected - the failure       (torchrun notices, or the lease or the hang
                                                        timeout runs out, and the supervisor reports it)
    rendezvous = replanned - failure_detected - solve  (every node's health report gathered)
    plan       = the solver's wall time
    restart    = (restored - load) - replanned           (processes started, rendezvous, model built)
    load       = the checkpoint load, resharded          (measured by the workers)
    first step = resumed - restored                       (the first training step after the restart)
    total      = resumed - failure_injected
An in-process recovery (`elastor run --recovery in-process`: the `restored` event says `path`
"in-process") has no restart and no load; the survivors' own phases (their `restored` event's
`phases_s`, from noticing the failure) split the time from the decision to the restored state:
    detect, rendezvous, plan  as above (the supervisor that hosts the round's store decides)
    re-form    = restored - replanned - transfer       (the decision reaches the survivors, they
                                                        leave the old groups, join the new ones,
                                                        agree on the step, build the new stages)
    transfer   = the state's point-to-point transfers from the survivors' memory
    first step = resumed - restored
A scale-up (a `replanned` event with more devices than the previous one) is timed from the round's
clean stop to the first step after it.
"""

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.table import format_table


@dataclass(frozen=True)
class Recovery:
    kind: str  # "failure" or "scale-up"
    cause: str | None  # a failure's, as the supervisors found it: "worker", "lost" (a host) or "hung"
    step: int  # the step training resumed from
    devices_before: int
    devices_after: int
    phases_s: dict[str, float]  # detect, plan, restart, load, first step (failures); stop to resume
    total_s: float
    samples_per_s_before: float | None
    samples_per_s_after: float | None
    path: str = "restart"  # how the survivors went on: "restart" (from the checkpoint) or "in-process"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed writer
            continue
    return records


def recoveries(records: list[dict[str, Any]]) -> list[Recovery]:
    found: list[Recovery] = []
    devices = None
    for i, rec in enumerate(records):
        event = rec.get("event")
        if event == "failure_injected":
            found += _failure(records, i, devices, rec["time_s"])
        elif (
            event == "failure_detected"
            and rec.get("failed_since_s")
            and not _since_replanned(records, i, "failure_injected")
        ):
            found += _failure(records, i, devices, rec["failed_since_s"])
        elif event == "replanned":
            if (
                devices is not None
                and rec["devices"] > devices
                and not _since_replanned(records, i, "failure_detected")
            ):
                found += _scale_up(records, i, devices)
            devices = rec["devices"]
    return found


def _next(records, start: int, event: str) -> int | None:
    return next((j for j in range(start, len(records)) if records[j].get("event") == event), None)


def _since_replanned(records, i: int, event: str) -> bool:
    """Whether `event` happened between the last replanning before `i` and `i`: for a replanning,
    whether it answers a failure (failure_detected); for a detected failure, whether it was injected
    (failure_injected)."""
    for j in range(i - 1, -1, -1):
        seen = records[j].get("event")
        if seen == event:
            return True
        if seen == "replanned":
            return False
    return False


def _throughput(records, lo: int, hi: int) -> float | None:
    rates = [
        r["samples_per_s"]
        for r in records[lo:hi]
        if "step" in r and "samples_per_s" in r and not r.get("event")
    ]
    return statistics.median(rates) if rates else None


def _previous(records, i: int, event: str) -> int:
    return next((j for j in range(i - 1, -1, -1) if records[j].get("event") == event), 0)


def _failure(records, i: int, devices: int | None, failed_s: float) -> list[Recovery]:
    detected = _next(records, i, "failure_detected")
    replanned = _next(records, detected or i, "replanned")
    restored = _next(records, replanned or i, "restored")
    resumed = _next(records, restored or i, "resumed")
    if None in (detected, replanned, restored, resumed):
        return []  # the run ended before it recovered (e.g. not enough memory left)
    t = {
        k: records[j]["time_s"]
        for k, j in (
            ("det", detected),
            ("plan", replanned),
            ("rest", restored),
            ("res", resumed),
        )
    }
    t["fail"] = failed_s
    load = records[restored].get("load_s", 0.0)
    solve = records[replanned]["solve_s"]
    path = records[restored].get("path", "restart")
    phases = {"detect": t["det"] - t["fail"], "rendezvous": t["plan"] - t["det"] - solve, "plan": solve}
    if path == "in-process":
        own = records[restored]["phases_s"]
        transfer = own["transferred"] - own["joined"]
        phases |= {"re-form": t["rest"] - t["plan"] - transfer, "transfer": transfer}
    else:
        phases |= {"restart": t["rest"] - load - t["plan"], "load": load}
    phases["first step"] = t["res"] - t["rest"]
    return [
        Recovery(
            kind="failure",
            cause=records[detected].get("cause"),
            step=records[restored]["step"],
            devices_before=devices or 0,
            devices_after=records[replanned]["devices"],
            phases_s=phases,
            total_s=t["res"] - t["fail"],
            samples_per_s_before=_throughput(records, _previous(records, i, "resumed"), i),
            samples_per_s_after=_throughput(
                records, resumed, _next(records, resumed + 1, "failure_injected") or len(records)
            ),
            path=path,
        )
    ]


def _scale_up(records, i: int, devices: int) -> list[Recovery]:
    stopped = _previous(records, i, "done")
    resumed = _next(records, i, "resumed")
    if resumed is None:
        return []
    restored = _next(records, i, "restored")
    return [
        Recovery(
            kind="scale-up",
            cause=None,
            step=records[i]["step"],
            devices_before=devices,
            devices_after=records[i]["devices"],
            phases_s={
                "plan": records[i]["solve_s"],
                "load": records[restored].get("load_s", 0.0) if restored else 0.0,
            },
            total_s=records[resumed]["time_s"] - records[stopped]["time_s"],
            samples_per_s_before=_throughput(records, _previous(records, stopped, "resumed"), stopped),
            samples_per_s_after=_throughput(
                records, resumed, _next(records, resumed + 1, "failure_injected") or len(records)
            ),
        )
    ]


def format_recoveries(found: list[Recovery]) -> str:
    if not found:
        return "no recovery happened"
    phases = ("detect", "rendezvous", "plan", "restart", "load", "re-form", "transfer", "first step")
    if not any(r.path == "in-process" for r in found):
        phases = tuple(p for p in phases if p not in ("re-form", "transfer"))
    header = (
        "event",
        "path",
        "resumed at step",
        "devices",
        *(f"{p} s" for p in phases),
        "total s",
        "samples/s",
    )
    rows = [header]
    for r in found:
        cell = {k: f"{v:.2f}" for k, v in r.phases_s.items()}
        rate = [f"{v:.1f}" if v else "-" for v in (r.samples_per_s_before, r.samples_per_s_after)]
        rows.append(
            (
                r.kind,
                r.path if r.kind == "failure" else "restart",
                r.step,
                f"{r.devices_before} -> {r.devices_after}",
                *(cell.get(k, "-") for k in phases),
                f"{r.total_s:.2f}",
                f"{rate[0]} -> {rate[1]}",  # before -> after
            )
        )
    return format_table(rows)


def measured_costs(records: list[dict[str, Any]]) -> dict[str, float]:
    """What this run measured of the costs `elastor simulate --costs` reads (goodput.costs), medians
    over its failure recoveries and checkpoints; fields with nothing measured are left out:
        detect_s          = detect of a failed or hung worker
        detect_node_s     = detect of a lost host
        plan_s            = plan (the solver)
        restart_s         = rendezvous + restart + first step (from the decision to training again)
        reshard_load_s    = load (every recovery loads into a new plan)
        reform_s          = rendezvous + re-form + first step, of in-process recoveries
        transfer_s        = transfer, of in-process recoveries (the state from the survivors' memory)
        ckpt_stall_s      = the steps' `ckpt_stall_s` where a save blocked them
        ckpt_background_s = `checkpoint_saved`'s save_s (from the snapshot to the commit)
    """
    failures = [r for r in recoveries(records) if r.kind == "failure"]
    costs: dict[str, float] = {}
    if failures:
        ph = [r.phases_s for r in failures]
        for field, found in (
            ("detect_s", [r for r in failures if r.cause != "lost"]),
            ("detect_node_s", [r for r in failures if r.cause == "lost"]),
        ):
            if found:
                costs[field] = statistics.median(r.phases_s["detect"] for r in found)
        costs["plan_s"] = statistics.median(p["plan"] for p in ph)
        if restarts := [p for r, p in zip(failures, ph, strict=True) if r.path == "restart"]:
            costs["restart_s"] = statistics.median(
                p["rendezvous"] + p["restart"] + p["first step"] for p in restarts
            )
            costs["reshard_load_s"] = statistics.median(p["load"] for p in restarts)
        if in_process := [p for r, p in zip(failures, ph, strict=True) if r.path == "in-process"]:
            costs["reform_s"] = statistics.median(
                p["rendezvous"] + p["re-form"] + p["first step"] for p in in_process
            )
            costs["transfer_s"] = statistics.median(p["transfer"] for p in in_process)
    stalls = [r["ckpt_stall_s"] for r in records if not r.get("event") and r.get("ckpt_stall_s", 0) > 0]
    if stalls:
        costs["ckpt_stall_s"] = statistics.median(stalls)
    saves = [r["save_s"] for r in records if r.get("event") == "checkpoint_saved" and "save_s" in r]
    if saves:
        costs["ckpt_background_s"] = statistics.median(saves)
    return {k: max(0.0, v) for k, v in costs.items()}

"""One node's share of a round with in-process recovery: the workers started and watched one by one.

Under `elastor run --recovery in-process` (the default) a supervisor starts one `elastor train`
process per device of its node in the round's plan, not torchrun: torchrun would stop every worker
of the node as soon as one fails, and the point is that the survivors live on. Each worker gets what
torchrun would have given it (RANK, LOCAL_RANK, WORLD_SIZE; the round's store at ELASTOR_MASTER) and
ELASTOR_RECOVERY=in-process. Their output goes to the round's log, one file per node.

While the round runs, the supervisor watches each worker:
- a worker that exits 0 has finished (or was left out of a new generation of the plan);
- a worker that dies otherwise is a *loss*: the supervisor reports it on the round's store
  (runtime/elastic/inprocess.py) and keeps the others running;
- a worker that exits with `inprocess.FALLBACK_EXIT` says the in-process path cannot be taken: the
  supervisor stops the rest, and the round fails as under torchrun (the restart path).
The supervisor that hosts the round's store (the plan's first node) also decides each new
generation: for every loss it solves a plan for the devices still running (`solver.solve`, the same
solver as between rounds) and publishes it, or a restart when no plan fits or a loss is reported
while a generation is forming; it writes the `failure_detected` (path `in-process`) and `replanned`
events. Every supervisor follows the generations to know which of its devices the plan holds now,
for hang detection (runtime/elastic/progress.py), and keeps a loss open until a generation covers it.

Whatever else ends a round (a peer node's failure or loss, a hang, a stop request) ends it as it
does under torchrun: the workers are stopped, and the next round restarts from the checkpoint.
"""

import contextlib
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from costmodel.cluster import NodeSpec, parse_device
from costmodel.errors import ElastorError
from costmodel.plan import Plan
from runtime.elastic import inprocess, lifeline, progress
from runtime.metrics import MetricsWriter
from runtime.stopping import request_stop


class Workers:
    """Round `round_` on this node (`sup`: its NodeSupervisor), with the round's store at `address`
    (`hosted`: the store itself when this node hosts it)."""

    def __init__(self, sup, round_: int, plan: Plan, decision: dict, address: str, hosted):
        self.sup, self.round, self.plan, self.decision = sup, round_, plan, decision
        self.node = sup.node
        host, _, port = address.rpartition(":")
        self.hosts = hosted is not None
        self.store = hosted or dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=sup.rdzv.timeout_s)
        )
        self.address = address
        self.procs: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.open_losses: set[str] = set()  # this node's lost devices no generation covers yet
        self.generation, self.decided_losses = 0, 0  # the newest generation; losses answered

    # ---- start ----------------------------------------------------------------------------------
    def _start(self, plan_path: Path, progress_dir: Path, log: Path) -> None:
        sup, plan = self.sup, self.plan
        on_node = [d for d in plan.devices if parse_device(d)[0] == self.node]
        env = sup._worker_env(self.round, plan, on_node, self.decision, progress_dir, self.address)
        env[inprocess.ENV_RECOVERY] = "in-process"
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it: one process per device shares the host
        command = sup._train_command(plan_path, self.decision)
        with open(log, "w") as out:
            for local, device in enumerate(on_node):
                rank_env = {
                    "RANK": str(plan.devices.index(device)),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(plan.world_size),
                    "LOCAL_WORLD_SIZE": str(len(on_node)),
                }
                self.procs[device] = subprocess.Popen(
                    command,
                    env={**env, **rank_env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    # ---- the watch ------------------------------------------------------------------------------
    def run(self, plan_path: Path, progress_dir: Path, log: Path):
        from runtime.elastic.supervisor import LOOK_S, POLL_S, RoundExit, _remote, _say

        sup, cfg = self.sup, self.sup.config
        self._start(plan_path, progress_dir, log)
        devices = list(self.plan.devices)
        watch = progress.HangWatch(devices, self._mine(devices), cfg.hang_timeout_s)
        failed, stopped, verdict, looked_at, asked_at = None, False, None, 0.0, None
        try:
            while self._running():
                time.sleep(POLL_S)
                if sup.stop_signal and asked_at is None:
                    request_stop(progress_dir, sup.stop_signal)  # the workers poll for it
                    asked_at = time.monotonic()
                elif asked_at is not None and time.monotonic() - asked_at > lifeline.STOP_REQUEST_S:
                    _say(f"the workers on {self.node} did not stop within {lifeline.STOP_REQUEST_S:.0f} s")
                    break
                try:
                    for device, proc in self.procs.items():
                        if device in self.codes or (code := proc.poll()) is None:
                            continue
                        self.codes[device] = code
                        if code == 0:
                            continue
                        if code == inprocess.FALLBACK_EXIT or asked_at is not None:
                            failed = failed or device
                            continue
                        _say(f"the worker of {device} exited with {code}; the others re-plan in-process")
                        self.open_losses.add(device)
                        inprocess.report_lost(self.store, device, code)
                    if failed:
                        break
                    if self.hosts:
                        self._decide_generations()
                    if (decision := inprocess.decision_now(self.store, self.generation + 1)) is not None:
                        self.generation += 1
                        if "restart" in decision:
                            _say(f"round {self.round}: the restart path is taken: {decision['restart']}")
                            failed = failed or next(iter(self.open_losses), None)
                            stopped = failed is None  # another node's loss: these workers are only stopped
                            break
                        devices = Plan.from_json(decision["plan"]).devices
                        self.open_losses -= set(decision["lost"])
                        watch = progress.HangWatch(list(devices), self._mine(devices), cfg.hang_timeout_s)
                except dist.DistError:  # the round's store is gone: its host was lost
                    _say(f"round {self.round}: its store is unreachable; stopping the workers on {self.node}")
                    stopped = True
                    break
                if time.monotonic() - looked_at < LOOK_S:
                    continue
                looked_at = time.monotonic()
                if sup.rdzv.peer_failed(self.round, self.plan.nodes()):
                    stopped = True
                    break
                sup.rdzv.progress = progress.read(progress_dir)
                records = {**_remote(sup.rdzv.peer_progress()), **sup.rdzv.progress}
                if verdict := watch.hung({d: r for d, r in records.items() if d in devices}):
                    self._stop_all()  # a hung worker may not answer SIGTERM
                    break
        finally:
            sup.rdzv.progress = {}
            self._stop_all()
            if left := lifeline.kill_children():  # none of the round may outlive it
                _say(f"killed {len(left)} process(es) of round {self.round} that outlived the workers")
        if verdict is not None:
            which = ", ".join(verdict.devices) or "the round"
            _say(f"{which} hung ({verdict.why}); killed the workers on {self.node}")
            return RoundExit(
                code=-9,
                error=f"{which} hung: {verdict.why}",
                log=str(log),
                hung=verdict.devices,
                since_s=verdict.since_s,
            )
        covered = self._covered()
        bad = {d: c for d, c in self.codes.items() if c != 0 and d not in covered}
        if not bad and not failed and not stopped:
            return RoundExit(code=0, stop_signal=sup.stop_signal)
        code = next(iter(bad.values()), 1)
        return RoundExit.failed(self.node, code, log, stopped=stopped, stop_signal=sup.stop_signal)

    def _running(self) -> bool:
        """Whether the round goes on for this node: a worker runs, a loss of its awaits a decision,
        or (the store's host) another node still runs its share."""
        if any(d not in self.codes for d in self.procs) or self.open_losses:
            return True
        if self.hosts:
            others = [n for n in self.plan.nodes() if n != self.node]
            return not self.sup.rdzv.round_over(self.round, others)
        return False

    def _mine(self, devices) -> list[str]:
        return [d for d in devices if d in self.procs and d not in self.codes]

    def _covered(self) -> set[str]:
        """The devices whose loss a published generation answered (none if the store is gone)."""
        covered = set()
        try:
            for g in range(1, self.generation + 1):
                decision = inprocess.decision_now(self.store, g) or {}
                covered |= set(decision.get("lost", ()))
        except dist.DistError:
            return set()
        return covered

    def _stop_all(self) -> None:
        """SIGKILL every worker still running: the next round restarts from the checkpoint, which a
        kill cannot damage (saves are crash-safe), and a worker blocked on a dead peer would not
        answer a gentler signal soon anyway."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # ---- the store host's decisions -------------------------------------------------------------
    def _decide_generations(self) -> None:
        """Answer each newly reported loss with the next generation (a plan for the devices that
        still run, or a restart)."""
        new = inprocess.losses(self.store, self.decided_losses)
        if not new:
            return
        self.decided_losses += len(new)
        current = self.plan if self.generation == 0 else self._plan_of(self._published())
        lost = [loss["device"] for loss in new]
        g = self._published() + 1
        if g > 1 and not inprocess.formed(self.store, g - 1, current.world_size):
            decision = {"restart": "a worker was lost while the survivors were re-forming"}
        else:
            decision = self._replan(current, lost, min(loss["time_s"] for loss in new))
        inprocess.publish(self.store, g, decision)

    def _published(self) -> int:
        g = self.generation
        while inprocess.decision_now(self.store, g + 1) is not None:
            g += 1
        return g

    def _plan_of(self, g: int) -> Plan:
        return Plan.from_json(inprocess.decision_now(self.store, g)["plan"])

    def _replan(self, current: Plan, lost: list[str], failed_s: float) -> dict:
        """The next generation after `lost` left `current`: a plan for the rest, or a restart (no
        survivor, no plan fits them, or some rows of the new plan's state are held by none of them:
        `runtime.elastic.peers.plan_transfers`, which every survivor would otherwise find itself)."""
        from runtime.elastic.peers import plan_transfers
        from runtime.elastic.snapshots import buddies, needed
        from runtime.elastic.supervisor import _say

        cfg = self.sup.config
        survivors = [d for d in current.devices if d not in lost]
        detected_s = time.time()
        plan, wall, why = None, 0.0, None
        if not survivors:
            why = "no worker survived"
        else:
            by_node: dict[str, list[int]] = {}
            for d in survivors:
                node, gpu = parse_device(d)
                by_node.setdefault(node, []).append(gpu)
            started = time.perf_counter()
            try:
                plan = cfg.solve(tuple(NodeSpec(name=n, gpus=tuple(g)) for n, g in by_node.items()))
            except ElastorError as e:
                why = f"no plan fits the survivors ({str(e).rstrip('.')})"
            wall = time.perf_counter() - started
        source = "peers"
        if plan is not None and not (transfers := plan_transfers(current, plan, survivors)).complete:
            # Rows only a lost worker kept: its peer snapshot's keeper stands in for it, if it survived.
            keepers = buddies(current) if cfg.peer_snapshot_every and needed(current) else {}
            stand_ins = {d: keepers[d] for d in lost if keepers.get(d) in survivors}
            if keepers and plan_transfers(current, plan, survivors, stand_ins=stand_ins).complete:
                source = "peer snapshot"
            else:
                first = transfers.missing[0][1]
                why = (
                    f"{len(transfers.missing)} run(s) of rows of the new plan's state are held by no "
                    f"survivor (the first: rows [{first.start}, {first.stop}) of {first.name}, "
                    f"{current.optimizer.sharding} optimizer state)"
                    + (
                        ", and the keeper of the lost worker's peer snapshot was lost too"
                        if keepers
                        else "; peer snapshots are off (--peer-snapshot-every 0)"
                    )
                )
        metrics = MetricsWriter(cfg.metrics)
        try:
            if why is not None:
                metrics.event("in_process_declined", round=self.round, lost=sorted(lost), why=why)
                _say(f"round {self.round}: lost {', '.join(lost)}; no in-process recovery: {why}")
                return {"restart": why}
            metrics.event(
                "failure_detected",
                round=self.round,
                dead=sorted(lost),
                lost=[],
                cause="worker",
                path="in-process",
                source=source,
                time_s=detected_s,
                failed_since_s=failed_s,
            )
            metrics.event(
                "replanned",
                round=self.round,
                leader=self.node,
                path="in-process",
                healthy=len(survivors),
                devices=plan.world_size,
                pipelines=len(plan.pipelines),
                solve_s=wall,
                predicted_samples_per_s=(plan.predicted or {}).get("samples_per_s", 0.0),
                plan=plan.to_json(),
            )
        finally:
            metrics.close()
        _say(
            f"round {self.round}: lost {', '.join(lost)}; the {len(survivors)} survivors go on "
            f"in-process under a plan of {len(plan.pipelines)} pipeline(s) on {plan.world_size} GPUs "
            f"(solved in {wall:.2f} s)"
        )
        order = [*plan.devices, *(d for d in survivors if d not in plan.devices)]
        return {
            "plan": plan.to_json(),
            "order": order,
            "stop_at": self.decision["stop_at"],
            "lost": lost,
            "losses": self.decided_losses,  # every loss of the round answered so far
        }

"""One node's supervisor: report health, agree on a plan, run this node's share under torchrun, watch it.

Every node runs one (`elastor run --node NAME ...`); the first node of `--nodes` also leads. A round:

1. each supervisor reports its healthy GPUs (CUDA: every GPU is probed in a subprocess; simulated
   nodes: the GPUs they were given, less those an injected failure killed);
2. the leader builds the live cluster, solves the plan (`solver.solve`, the same for every node since
   only the leader solves), picks the step to stop at (a checkpoint boundary where a failed GPU comes
   back) and publishes the decision; an infeasible cluster ends the run with one sentence, the
   checkpoints untouched;
3. every node in the plan starts `torchrun` with static rendezvous (its node rank is its place in the
   plan's node order, so global ranks follow the plan's device order; the master is the plan's first
   node, on port rendezvous port + 1 + round) running `elastor train`, which resumes from the newest
   complete checkpoint, resharding it to the new plan;
4. a node whose workers die reports it; the others stop their own workers at once instead of waiting
   for a collective to time out. The leader records `failure_detected` and the next round begins.

Events the leader appends to the metrics file: `failure_detected`, `replanned` (with the plan and the
solver's wall time); the workers' rank 0 adds `start`, `restored`, `resumed`, `checkpoint_saved`, `done`.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from costmodel.cluster import ClusterSpec, NodeSpec
from costmodel.errors import ElastorError
from costmodel.plan import Plan
from costmodel.profile import ModelProfile
from runtime.elastic import faults
from runtime.elastic.faults import Fault
from runtime.elastic.rendezvous import Rendezvous
from runtime.metrics import MetricsWriter

POLL_S = 0.05
STOP_GRACE_S = 10.0  # after SIGTERM, how long torchrun may take before it is killed
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every supervisor of a run is given (the same on every node)."""

    profile: ModelProfile
    cluster: ClusterSpec  # device kind and links; in simulation also the nodes and their GPUs
    global_batch_size: int
    steps: int
    ckpt_dir: Path
    ckpt_every: int
    metrics: Path
    method: str = "elastor"
    device: str = "cpu"
    train_args: tuple[str, ...] = ()  # passed through to `elastor train`
    failures: tuple[Fault, ...] = ()
    recoveries: tuple[Fault, ...] = ()

    @property
    def log_dir(self) -> Path:
        """Where each round's worker output goes: `<metrics stem>-logs/round-<r>-<node>.log`."""
        return self.metrics.with_name(f"{self.metrics.stem}-logs")


@dataclass
class _LeaderState:
    """What the leader remembers between rounds."""

    recovered: set[Fault] = field(default_factory=set)
    stop_at: int = 0
    failed_at: float | None = None  # when the first non-zero exit of the last round was reported


class NodeSupervisor:
    def __init__(self, config: RunConfig, rendezvous: Rendezvous, gpus: list[int], host: str = "127.0.0.1"):
        self.config, self.rdzv, self.gpus, self.host = config, rendezvous, gpus, host
        self.node = rendezvous.node
        self.state = _LeaderState()

    # ---- the round loop -------------------------------------------------------------------------
    def run(self) -> int:
        round_ = 0
        while True:
            self.rdzv.report_health(round_, self.probe(), self.host)
            if self.rdzv.is_leader:
                self.rdzv.decide(round_, self._decide(round_, self.rdzv.health(round_)))
            decision = self.rdzv.decision(round_)
            if decision.get("error") or decision.get("done"):
                self.rdzv.finish(round_)
            if decision.get("error"):
                if self.rdzv.is_leader:
                    print(f"elastor: error: {decision['error']}", file=sys.stderr)
                return 2
            if decision.get("done"):
                return 0
            code = self._run_round(round_, Plan.from_json(decision["plan"]), decision)
            self.rdzv.report_exit(round_, code)
            if self.rdzv.is_leader:
                self._after_round(round_, self.rdzv.exits(round_))
            round_ += 1

    # ---- health ---------------------------------------------------------------------------------
    def probe(self) -> list[int]:
        """This node's usable GPUs: on CUDA each is probed in its own process (a broken GPU can hang
        or crash the process that touches it); simulated GPUs are all present (injected failures are
        subtracted by the leader, who reads them from the metrics file)."""
        if self.config.device != "cuda":
            return list(self.gpus)
        return [g for g in self.gpus if _probe_cuda(g)]

    # ---- the leader's decision ------------------------------------------------------------------
    def _decide(self, round_: int, health: dict[str, dict]) -> dict:
        cfg, st = self.config, self.state
        step = checkpointed_step(cfg.ckpt_dir)
        if step >= cfg.steps:
            return {"done": True}
        dead = self._dead()
        nodes = tuple(
            NodeSpec(name=n, gpus=tuple(g for g in h["gpus"] if f"{n}:{g}" not in dead))
            for n, h in health.items()
        )
        healthy = sum(len(n.gpus) for n in nodes)
        metrics = MetricsWriter(cfg.metrics)
        try:
            if st.failed_at is not None:
                metrics.event(
                    "failure_detected", round=round_, dead=sorted(dead), step=step, time_s=st.failed_at
                )
            intact = f"the last checkpoint (step {step}) is intact in {cfg.ckpt_dir}."
            if healthy == 0:
                return {"error": f"No healthy GPU is left; {intact}"}
            cluster = ClusterSpec(device=cfg.cluster.device, nodes=nodes, links=cfg.cluster.links)
            from solver import solve  # the solver is only needed by the leader

            started = time.perf_counter()
            try:
                plan = solve(cfg.profile, cluster, cfg.global_batch_size, method=cfg.method)
            except ElastorError as e:
                return {"error": f"{str(e).rstrip('.')}; {intact}"}
            wall = time.perf_counter() - started
            st.stop_at = self._stop_at(step, dead)
            predicted = (plan.predicted or {}).get("samples_per_s", 0.0)
            _say(
                f"round {round_}: {healthy} healthy GPUs on {sum(1 for n in nodes if n.gpus)} node(s); "
                f"plan: {len(plan.pipelines)} pipeline(s) on {plan.world_size} GPUs, {predicted:.1f} "
                f"samples/s predicted (solved in {wall:.2f} s); steps {step} -> {st.stop_at}"
            )
            metrics.event(
                "replanned",
                round=round_,
                step=step,
                healthy=healthy,
                devices=plan.world_size,
                pipelines=len(plan.pipelines),
                solve_s=wall,
                predicted_samples_per_s=predicted,
                plan=plan.to_json(),
            )
        finally:
            metrics.close()
        pending = [
            f for f in faults.armed(cfg.failures, faults.fired(cfg.metrics)) if f.device in plan.devices
        ]
        pending = [f for f in pending if f.step >= step]
        return {
            "plan": plan.to_json(),
            "stop_at": st.stop_at,
            "failures": faults.encode(pending),
            "master_addr": health[plan.nodes()[0]]["host"],
        }

    def _dead(self) -> set[str]:
        """Devices an injected failure killed and no recovery has brought back yet."""
        dead = set()
        for fault, _ in faults.fired(self.config.metrics):
            back = [r for r in self.state.recovered if r.device == fault.device and r.step >= fault.step]
            if not back:
                dead.add(fault.device)
        return dead

    def _stop_at(self, step: int, dead: set[str]) -> int:
        """The first checkpoint boundary at which a dead device comes back, or the end of training."""
        cfg = self.config
        stops = [cfg.steps]
        for r in cfg.recoveries:
            if r.device in dead and r not in self.state.recovered:
                at = max(r.step, step + 1)
                stops.append(-(-at // cfg.ckpt_every) * cfg.ckpt_every)
        return min(stops)

    def _after_round(self, round_: int, exits: dict[str, dict]) -> None:
        st = self.state
        failures = [e["time_s"] for e in exits.values() if e["code"] != 0]
        st.failed_at = min(failures) if failures else None
        if not failures:  # a clean stop: the recoveries due by now take effect
            step = checkpointed_step(self.config.ckpt_dir)
            st.recovered |= {r for r in self.config.recoveries if r.step <= step}

    # ---- one round on this node -----------------------------------------------------------------
    def _run_round(self, round_: int, plan: Plan, decision: dict) -> int:
        if self.node not in plan.nodes():  # idle this round: wait for the others to finish
            while not all(self.rdzv.store.check([f"{round_}/exit/{n}"]) for n in plan.nodes()):
                time.sleep(POLL_S)
            return 0
        cfg = self.config
        with tempfile.TemporaryDirectory(prefix="elastor-round-") as tmp:
            plan_path = Path(tmp) / "plan.json"
            plan_path.write_text(json.dumps(plan.to_json()))
            on_node = [d for d in plan.devices if d.split(":")[0] == self.node]
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(plan.nodes())}",
                f"--node-rank={plan.nodes().index(self.node)}",
                f"--nproc-per-node={len(on_node)}",
                f"--master-addr={decision['master_addr']}",
                f"--master-port={self.rdzv.store.port + 1 + round_}",
                "--max-restarts=0",
                "--monitor-interval=0.1",
                "-m",
                "elastor",
                "train",
                f"--plan={plan_path}",
                f"--steps={cfg.steps}",
                f"--stop-at={decision['stop_at']}",
                f"--ckpt-dir={cfg.ckpt_dir}",
                f"--ckpt-every={cfg.ckpt_every}",
                f"--metrics={cfg.metrics}",
                f"--device={cfg.device}",
                *cfg.train_args,
            ]
            env = {**os.environ, faults.ENV_FAILURES: decision.get("failures", "")}
            if decision["master_addr"].startswith("127.") and sys.platform.startswith("linux"):
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a simulated cluster talks over loopback only
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            log = cfg.log_dir / f"round-{round_}-{self.node}.log"
            with open(log, "w") as out:
                worker = subprocess.Popen(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            try:
                while worker.poll() is None:
                    if self.rdzv.peer_failed(round_):
                        _stop(worker)
                        break
                    time.sleep(POLL_S)
                code = worker.wait()
                if code != 0:
                    _say(f"workers on {self.node} exited with {code}; their output is in {log}")
                return code
            finally:
                if worker.poll() is None:
                    _stop(worker)


def _say(line: str) -> None:
    print(f"elastor run: {line}", flush=True)


def checkpointed_step(ckpt_dir: Path) -> int:
    """The step of the newest complete checkpoint in `ckpt_dir` (0 when there is none)."""
    from runtime.checkpoint import checkpoint_meta, latest_checkpoint

    path = latest_checkpoint(ckpt_dir)
    return 0 if path is None else int(checkpoint_meta(path)[1]["step"])


def _stop(worker: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group (it stops its workers), then SIGKILL after a grace period."""
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    except ProcessLookupError:
        pass


def _probe_cuda(gpu: int) -> bool:
    code = (
        f"import torch; d = torch.device('cuda', {gpu}); x = torch.ones(1 << 20, device=d); "
        "assert float(x @ x) == float(1 << 20)"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0

"""One node's supervisor: report health, agree on a plan, run this node's share under torchrun, watch it.

Every node runs one (`elastor run --node NAME ...`); one of them also leads (the first node of
`--nodes`; on etcd the first living one, runtime.elastic.rendezvous). A round:

1. each supervisor reports its healthy GPUs (CUDA: every GPU is probed at once, each in a process of
   its own that sees only that GPU, with a bounded wait; simulated nodes: the GPUs they were given,
   less those an injected failure killed or a hang took out);
2. the leader waits for the reports (runtime.elastic.rendezvous: until every node has reported or is
   lost, or the round's deadline), builds the live cluster, solves the plan (`solver.solve`, the same
   for every node since only the leader solves), picks the step to stop at (a checkpoint boundary
   where a failed GPU comes back) and publishes the decision; an infeasible cluster ends the run
   with one sentence, the checkpoints untouched;
3. every node in the plan starts `torchrun` running `elastor train`, which resumes from the newest
   complete checkpoint, resharding it to the new plan. The supervisor of the plan's first node hosts
   the round's store on its --host (a free port, announced on the rendezvous): torchrun's own
   rendezvous and the workers' process group use it. The workers take their ranks from the plan (so
   global ranks follow the plan's device order); on CUDA each worker sees only its node's GPUs of the
   plan, and PyTorch's NCCL flight recorder dumps beside the round's log;
4. a node whose workers die reports it, with the error it found in their output; a node whose worker
   hangs (runtime.elastic.progress: no progress for --hang-timeout-s) kills its workers at once and
   reports the hung GPU, which the plans leave out from then on; a node that is lost (its heartbeat
   stopped) is reported by the leader. The others stop their own workers at once instead of waiting
   for a collective to time out. The leader records
   `failure_detected` and the next round begins, unless restarting cannot help: the round failed with
   the same error as the one before, on the same GPUs, without a newer checkpoint; or more rounds
   failed than `--max-restarts` allows. Then the run stops with that error in one sentence (exit 2).

Recovery (`--recovery`): with `in-process` (the default) step 3 starts the workers directly, one
process per device, instead of torchrun (runtime/elastic/workers.py), and a dead worker does not end
the round: its survivors re-plan in their own processes and fetch their state from each other's
memory (runtime/elastic/inprocess.py); only what that path cannot recover (a lost host, a hang, a
lost ZeRO-1 slice, a plan without replicas, a failure while re-forming) ends the round as in step 4.
With `restart` every failure ends the round under torchrun, as described above.

Stopping: the first SIGTERM or SIGINT to a supervisor asks its round's workers to stop after their
step (runtime/stopping.py: the request reaches every rank of the job through the step's all-reduce),
and they save a checkpoint and exit; the supervisor reports the stop, and the leader ends the run
(every supervisor exits 128 + the signal) instead of starting another round. Workers that have not
stopped within lifeline.STOP_REQUEST_S are stopped as a failed round's are; a second signal stops
the supervisor at once.

Processes: torchrun and each of its workers run under `runtime.elastic.lifeline`, so they die with
their parent; the supervisor is a child subreaper (Linux), so a worker that outlives its torchrun
becomes its child, and it kills whatever is left of a round when the round ends. Stopping a round
gives torchrun longer than torch's own grace for its workers (lifeline.TORCHRUN_STOP_S).

Events the leader appends to the metrics file: `failure_detected` (with the cause: `worker`, `lost`
or `hung`, and when the failure happened as far as it can tell), `replanned` (with the plan and the
solver's wall time); the workers' rank 0 adds `start`, `restored`, `resumed`, `checkpoint_saved`, `done`.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from costmodel.cluster import ClusterSpec, NodeSpec
from costmodel.errors import ElastorError
from costmodel.plan import Plan
from costmodel.profile import ModelProfile
from runtime.checkpoint import CheckpointError, checkpoint_meta
from runtime.checkpoint.lock import ENV_JOB, lock_directory
from runtime.checkpoint.store import committed
from runtime.distributed import ENV_FIRST_RANK, ENV_MASTER, ENV_VISIBLE_GPUS
from runtime.elastic import faults, lifeline, progress
from runtime.elastic.faults import Fault
from runtime.elastic.launch import NO_TORCHRUN_LOGS
from runtime.elastic.rendezvous import NotLeader, Rendezvous
from runtime.metrics import MetricsWriter
from runtime.stopping import DUPLICATE_S, request_stop

POLL_S = 0.05
# How often a running round looks at its peers' exits and heartbeats and at its workers' progress:
# a store read per peer (etcd: one request) and a file per worker each time.
LOOK_S = 0.2
PROBE_TIMEOUT_S = 60.0  # a GPU whose probe has not passed by then is left out
# The NCCL flight recorder (torch.distributed's trace of recent collectives, dumped when a collective
# times out): entries kept per process, on CUDA unless the environment already says otherwise.
NCCL_TRACE_ENTRIES = 2000
LOG_TAIL_BYTES = 64 << 10  # how much of a failed round's worker output is searched for its error
_UNDER_LIFELINE = (sys.executable, "-m", "runtime.elastic.lifeline")


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
    max_restarts: int  # rounds that may follow a failed round; one more failure ends the run
    method: str = "elastor"
    device: str = "cpu"
    train_args: tuple[str, ...] = ()  # passed through to `elastor train`
    failures: tuple[Fault, ...] = ()
    recoveries: tuple[Fault, ...] = ()
    hang_timeout_s: float = 20.0  # a rank without progress for this long is hung
    # "in-process": the supervisors start the workers themselves and the survivors of a lost worker
    # re-plan in their processes (runtime/elastic/inprocess.py); "restart": under torchrun, every
    # failure restarts the round from the newest checkpoint.
    recovery: str = "in-process"
    sharding: tuple[str, ...] = ("none",)  # the optimizer layouts the plans may use (solver.solve)
    # In-process recovery: every this many steps the workers copy the state only one of them keeps to
    # a peer (runtime/elastic/snapshots.py), and a loss of such state rolls back to that copy; 0: never.
    peer_snapshot_every: int = 0

    def solve(self, nodes: tuple[NodeSpec, ...]) -> Plan:
        """The plan for these nodes' GPUs on the run's device kind and links (`solver.solve`);
        raises ElastorError (one sentence) when none fits."""
        from solver import solve  # only the deciding supervisor needs the solver

        cluster = ClusterSpec(
            device=self.cluster.device,
            nodes=nodes,
            links=self.cluster.links,
            gpus_per_node=self.cluster.gpus_per_node,
        )
        batch = self.global_batch_size
        return solve(self.profile, cluster, batch, method=self.method, sharding=self.sharding)

    @property
    def log_dir(self) -> Path:
        """Where each round's worker output goes: `<metrics stem>-logs/round-<r>-<node>.log`."""
        return self.metrics.with_name(f"{self.metrics.stem}-logs")


@dataclass
class _LeaderState:
    """What the leader remembers between rounds; saved on the rendezvous after every change, so that
    a successor (an elected one, on etcd) goes on where it stopped."""

    job: str = field(default_factory=lambda: os.urandom(6).hex())  # the --ckpt-dir lock's job id
    closed: int = -1  # the last round whose exits were read
    recovered: set[Fault] = field(default_factory=set)
    stop_at: int = 0
    failed_at: float | None = None  # when the last round's first failure was noticed (wall clock)
    failed_since: float | None = None  # when it happened, where that is known (a lost node, a hang)
    cause: str | None = None  # what it was: "worker", "lost" or "hung"
    hung: set[str] = field(default_factory=set)  # devices a hang took out: never planned again
    failures: int = 0  # failed rounds so far
    # The last round's (error, plan devices, checkpointed step after it) if it failed, else None.
    last_failure: tuple[str, tuple[str, ...], int] | None = None
    stop: str | None = None  # why the run must end at the next decision
    stop_signal: int = 0  # a supervisor was asked to stop (SIGTERM, SIGINT): end the run, no error
    stop_node: str | None = None  # which one

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "recovered": sorted(str(f) for f in self.recovered),
            "hung": sorted(self.hung),
        }

    @classmethod
    def from_json(cls, d: dict) -> "_LeaderState":
        last = d.get("last_failure")
        return cls(
            **{k: v for k, v in d.items() if k not in ("recovered", "hung", "last_failure")},
            recovered={Fault.parse(f, "leader state") for f in d.get("recovered", [])},
            hung=set(d.get("hung", [])),
            last_failure=(last[0], tuple(last[1]), last[2]) if last else None,
        )


@dataclass(frozen=True, kw_only=True)
class RoundExit:
    """How one node's share of a round ended, as reported to the leader."""

    code: int  # torchrun's exit code (negative: the signal that ended it)
    error: str | None = None  # the workers' error, found in their output
    log: str | None = None  # where their output is
    stopped: bool = False  # this supervisor stopped the workers because a peer's had failed
    hung: tuple[str, ...] = ()  # this node's devices found hung (the workers were killed for it)
    since_s: float | None = None  # when the hang began (wall clock)
    stop_signal: int = 0  # this supervisor was asked to stop by this signal (its workers saved and exited)

    @classmethod
    def failed(cls, node: str, code: int, log: Path, *, stopped: bool, stop_signal: int) -> "RoundExit":
        """Workers that exited with `code`: said, and their error found in their output `log`."""
        _say(f"workers on {node} exited with {code}; their output is in {log}")
        return cls(
            code=code, error=worker_error(log, code), log=str(log), stopped=stopped, stop_signal=stop_signal
        )


class NodeSupervisor:
    def __init__(self, config: RunConfig, rendezvous: Rendezvous, gpus: list[int], host: str = "127.0.0.1"):
        self.config, self.rdzv, self.gpus, self.host = config, rendezvous, gpus, host
        self.node = rendezvous.node
        self.state = _LeaderState()
        self.ckpt_lock = None  # the leader's hold on --ckpt-dir, for the whole job
        self.stop_signal = 0  # the signal that asked this supervisor to stop (0: none)
        self._stop_asked_at = 0.0

    def request_stop(self, signum: int, _frame=None) -> None:
        """SIGTERM/SIGINT handler: the first asks the workers to stop after their step and save; the
        second stops this supervisor at once (its round's workers with it)."""
        if self.stop_signal:
            if time.monotonic() - self._stop_asked_at >= DUPLICATE_S:
                raise SystemExit(128 + signum)
            return  # the same request by another path
        self.stop_signal, self._stop_asked_at = signum, time.monotonic()
        _say(
            f"{signal.Signals(signum).name}: the workers finish their step and save a checkpoint "
            f"(within {lifeline.STOP_REQUEST_S:.0f} s); signal again to stop at once"
        )

    # ---- the round loop -------------------------------------------------------------------------
    def run(self) -> int:
        lifeline.become_subreaper()  # a worker that outlives its torchrun becomes ours to kill
        try:
            return self._rounds()
        finally:
            if self.ckpt_lock is not None:
                self.ckpt_lock.release()

    def _rounds(self) -> int:
        round_ = 0
        while True:
            self.rdzv.report_health(round_, self.probe())
            decision = self._agree(round_)
            if decision.get("error") or decision.get("done") or decision.get("stopped"):
                self.rdzv.finish(round_)
            if decision.get("error"):
                if self.rdzv.is_leader:
                    print(f"elastor: error: {decision['error']}", file=sys.stderr)
                return 2
            if decision.get("stopped"):
                if self.rdzv.is_leader:
                    print(f"elastor run: {decision['stopped']}", file=sys.stderr)
                return 128 + decision["signal"]
            if decision.get("done"):
                return 0
            plan = Plan.from_json(decision["plan"])
            self.rdzv.report_exit(round_, **asdict(self._run_round(round_, plan, decision)))
            if self.rdzv.is_leader:
                self._take_office(round_ + 1)
            round_ += 1

    def _agree(self, round_: int) -> dict:
        """Round `round_`'s decision: the leader's, or this node's if it leads (or comes to lead
        while it waits: the office fell vacant and it won the election)."""
        while True:
            if self.rdzv.is_leader:
                self._take_office(round_)
                with contextlib.suppress(NotLeader):  # deposed meanwhile: read the successor's
                    self.rdzv.decide(round_, self._lead(round_))
            if (decision := self.rdzv.decision(round_)) is not None:
                return decision

    def _take_office(self, round_: int) -> None:
        """Before leading round `round_`: take over what a predecessor left (its state, the
        --ckpt-dir's lock for the job) and close every round before `round_` that it did not (read
        their exits: a failure ends up counted and its cause left out, whoever led)."""
        if self.ckpt_lock is None:
            if saved := self.rdzv.load_state():
                self.state = _LeaderState.from_json(saved)
            # The lock's holder may be a predecessor that is not quite dead: this job's id lets
            # the new leader go on beside it (runtime/checkpoint/lock.py), another job is refused.
            os.environ[ENV_JOB] = self.state.job
            try:
                self.ckpt_lock = lock_directory(self.config.ckpt_dir)
            except CheckpointError as e:
                self.state.stop = str(e)
        for past in range(self.state.closed + 1, round_):
            decision = self.rdzv.past_decision(past)
            if decision and decision.get("plan"):
                plan = Plan.from_json(decision["plan"])
                self._after_round(past, plan, self.rdzv.exits(past, plan.nodes()))
            self.state.closed = past
        with contextlib.suppress(NotLeader):
            self.rdzv.save_state(self.state.to_json())

    def _lead(self, round_: int) -> dict:
        """The leader's decision for `round_`. Every round's workers, on every node, get the job's id
        and so go on under the leader's lock on --ckpt-dir, while another job is refused."""
        decision = {**self._decide(round_, self.rdzv.health(round_)), "ckpt_job": self.state.job}
        self.rdzv.save_state(self.state.to_json())
        return decision

    # ---- health ---------------------------------------------------------------------------------
    def probe(self) -> list[int]:
        """This node's usable GPUs: on CUDA each is probed in its own process (a broken GPU can hang
        or crash the process that touches it), all at once; simulated GPUs are all present (injected
        failures are subtracted by the leader, who reads them from the metrics file)."""
        if self.config.device != "cuda":
            return list(self.gpus)
        return probe_cuda(self.gpus)

    # ---- the leader's decision ------------------------------------------------------------------
    def _decide(self, round_: int, health: dict[str, dict]) -> dict:
        cfg, st = self.config, self.state
        step = checkpointed_step(cfg.ckpt_dir)
        if step >= cfg.steps:
            return {"done": True}
        if self.stop_signal and not st.stop_signal:  # asked between rounds: nothing runs to stop
            st.stop_signal, st.stop_node = self.stop_signal, self.node
        if st.stop_signal:
            return {
                "stopped": f"stopped by {signal.Signals(st.stop_signal).name} to {st.stop_node}'s "
                f"supervisor; the checkpoint of step {step} in {cfg.ckpt_dir} resumes the run (rerun it).",
                "signal": st.stop_signal,
            }
        dead = self._dead() | st.hung
        nodes = tuple(
            NodeSpec(name=n, gpus=tuple(g for g in h["gpus"] if f"{n}:{g}" not in dead))
            for n, h in health.items()
        )
        healthy = sum(len(n.gpus) for n in nodes)
        metrics = MetricsWriter(cfg.metrics)
        try:
            if st.failed_at is not None:
                metrics.event(
                    "failure_detected",
                    path="restart",
                    round=round_,
                    dead=sorted(dead),
                    lost=sorted(set(self.rdzv.nodes) - set(health)),
                    cause=st.cause,
                    step=step,
                    time_s=st.failed_at,
                    failed_since_s=st.failed_since,
                )
            intact = f"the last checkpoint (step {step}) is intact in {cfg.ckpt_dir}."
            if st.stop:
                return {"error": st.stop}
            if healthy == 0:
                return {"error": f"No healthy GPU is left; {intact}"}
            started = time.perf_counter()
            try:
                plan = cfg.solve(nodes)
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
                leader=self.node,
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

    def _after_round(self, round_: int, plan: Plan, exits: dict[str, dict]) -> None:
        cfg, st = self.config, self.state
        failed = [e for e in exits.values() if e["code"] != 0]
        step = checkpointed_step(cfg.ckpt_dir)
        if asked := [(name, e["stop_signal"]) for name, e in exits.items() if e.get("stop_signal")]:
            st.stop_node, st.stop_signal = asked[0]
        for e in failed:
            st.hung |= set(e.get("hung") or ())
        if not failed:  # a clean stop: the recoveries due by now take effect
            st.failed_at = st.failed_since = st.cause = None
            st.recovered |= {r for r in cfg.recoveries if r.step <= step}
            st.last_failure = None
            return
        st.failures += 1
        # The root cause: a node whose workers failed on their own (or that was lost), the first.
        root = min(failed, key=lambda e: (e.get("stopped", False), e.get("since_s") or e["time_s"]))
        st.failed_at, st.failed_since = root["time_s"], root.get("since_s")
        st.cause = "lost" if root.get("lost") else "hung" if root.get("hung") else "worker"
        error = root.get("error") or _exit_error(root["code"])
        seen = f"{error.rstrip('.')}, in {root['log']}" if root.get("log") else error.rstrip(".")
        rerun = (
            f"rerun to resume from step {step}, whose checkpoint in {cfg.ckpt_dir} is intact"
            if step
            else "rerun"
        )
        failure = (_error_key(error), tuple(plan.devices), step)
        if failure == st.last_failure:
            st.stop = (
                f"Rounds {round_ - 1} and {round_} failed with the same error on the same GPUs without a "
                f"newer checkpoint, so restarting cannot help ({seen}); fix that and {rerun}."
            )
        elif st.failures > cfg.max_restarts:
            st.stop = (
                f"The workers failed in {st.failures} round(s), more than --max-restarts {cfg.max_restarts} "
                f"allows (the last time: {seen}); fix the cause or raise --max-restarts, and {rerun}."
            )
        st.last_failure = failure

    # ---- one round on this node -----------------------------------------------------------------
    def _run_round(self, round_: int, plan: Plan, decision: dict) -> RoundExit:
        if self.node not in plan.nodes():  # idle this round: wait for the others to finish
            while not self.rdzv.round_over(round_, plan.nodes()):
                time.sleep(POLL_S)
            return RoundExit(code=0)
        cfg = self.config
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        log = cfg.log_dir / f"round-{round_}-{self.node}.log"
        on_node = [d for d in plan.devices if d.split(":")[0] == self.node]
        first, hosted = plan.nodes()[0], None
        try:
            if self.node == first:  # the round's store: torchrun's rendezvous and the workers'
                address, hosted = self.rdzv.host_round_store(round_, self.host)
            else:
                address = self.rdzv.round_store(round_, first)
        except ElastorError as e:
            return RoundExit(code=1, error=str(e), stopped=True)
        with tempfile.TemporaryDirectory(prefix="elastor-round-") as tmp:
            plan_path = Path(tmp) / "plan.json"
            plan_path.write_text(json.dumps(plan.to_json()))
            progress_dir = Path(tmp) / "progress"
            progress_dir.mkdir()
            if cfg.recovery == "in-process":
                from runtime.elastic.workers import Workers  # it uses this module's helpers

                try:
                    return Workers(self, round_, plan, decision, address, hosted).run(
                        plan_path, progress_dir, log
                    )
                finally:
                    del hosted
            with open(log, "w") as out:
                worker = subprocess.Popen(
                    self._torchrun(round_, plan, on_node, plan_path, decision, address),
                    env=self._worker_env(round_, plan, on_node, decision, progress_dir, address),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            watch = progress.HangWatch(plan.devices, on_node, cfg.hang_timeout_s)
            stopped, verdict, looked_at, asked_at = False, None, 0.0, None
            try:
                while worker.poll() is None:
                    time.sleep(POLL_S)
                    if self.stop_signal and asked_at is None:
                        request_stop(progress_dir, self.stop_signal)  # the workers poll for it
                        asked_at = time.monotonic()
                    elif asked_at is not None and time.monotonic() - asked_at > lifeline.STOP_REQUEST_S:
                        _say(
                            f"the workers on {self.node} did not stop within {lifeline.STOP_REQUEST_S:.0f} s"
                        )
                        _stop(worker)
                        break
                    if time.monotonic() - looked_at < LOOK_S:
                        continue  # the workers' own exit is noticed every POLL_S, the rest every LOOK_S
                    looked_at = time.monotonic()
                    if self.rdzv.peer_failed(round_, plan.nodes()):
                        _stop(worker)
                        stopped = True
                        break
                    self.rdzv.progress = progress.read(progress_dir)
                    if verdict := watch.hung({**_remote(self.rdzv.peer_progress()), **self.rdzv.progress}):
                        _kill(worker)  # a hung worker may not answer SIGTERM; nothing of the round is kept
                        break
                code = worker.wait()
            finally:
                self.rdzv.progress = {}
                if worker.poll() is None:
                    _stop(worker)
                if left := lifeline.kill_children():  # none of the round may outlive it
                    _say(f"killed {len(left)} process(es) of round {round_} that outlived torchrun")
                del hosted  # the round's store closes with the round
        if verdict is not None:
            which = ", ".join(verdict.devices) or "the round"
            _say(f"{which} hung ({verdict.why}); killed the workers on {self.node}")
            error = f"{which} hung: {verdict.why}"
            return RoundExit(
                code=-9, error=error, log=str(log), hung=verdict.devices, since_s=verdict.since_s
            )
        if code == 0:
            return RoundExit(code=0, stop_signal=self.stop_signal)
        return RoundExit.failed(self.node, code, log, stopped=stopped, stop_signal=self.stop_signal)

    def _torchrun(
        self, round_: int, plan: Plan, on_node: list[str], plan_path: Path, decision: dict, store: str
    ) -> list[str]:
        """torchrun for this node's devices `on_node` of the round: a client of the round's store for
        its own rendezvous (which only gathers the round's nodes; the workers' ranks come from the plan)."""
        return [
            *_UNDER_LIFELINE,
            "torch.distributed.run",
            f"--nnodes={len(plan.nodes())}",
            f"--nproc-per-node={len(on_node)}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={store}",
            f"--rdzv-id=elastor-{decision.get('ckpt_job', '')}-round-{round_}",
            "--rdzv-conf=is_host=false",
            f"--local-addr={self.host}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            f"--log-dir={NO_TORCHRUN_LOGS}",
            *self._train_command(plan_path, decision)[1:],
        ]

    def _train_command(self, plan_path: Path, decision: dict) -> list[str]:
        """One worker's command: `elastor train` for the round under a lifeline to its parent."""
        cfg = self.config
        return [
            *_UNDER_LIFELINE,
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

    def _worker_env(
        self, round_: int, plan: Plan, on_node: list[str], decision: dict, progress_dir: Path, store: str
    ) -> dict[str, str]:
        cfg = self.config
        env = {
            **os.environ,
            faults.ENV_FAILURES: decision.get("failures", ""),
            lifeline.ENV_PARENT: str(os.getpid()),
            faults.ENV_SUPERVISOR: str(os.getpid()),
            ENV_JOB: decision.get("ckpt_job", ""),
            ENV_MASTER: store,
            ENV_FIRST_RANK: str(plan.devices.index(on_node[0])),
            progress.ENV_DIR: str(progress_dir),
            # torchrun's rank-0 agent would otherwise host a second store, on every interface.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        if store.startswith("127.") and sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a simulated cluster talks over loopback only
        if cfg.device == "cuda":
            gpus = ",".join(d.split(":")[1] for d in on_node)
            env["CUDA_VISIBLE_DEVICES"] = env[ENV_VISIBLE_GPUS] = gpus
            env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(NCCL_TRACE_ENTRIES))
            env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            trace = cfg.log_dir / f"nccl-trace-round-{round_}-{self.node}-rank"  # torch appends the rank
            env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace))
        return env


def _remote(progress_by_node: dict[str, dict]) -> dict[str, dict]:
    """Every rank's progress record from the nodes' heartbeats, by device."""
    return {d: r for records in progress_by_node.values() for d, r in records.items() if isinstance(r, dict)}


def _say(line: str) -> None:
    print(f"elastor run: {line}", flush=True)


def _error_key(error: str) -> str:
    """An error with what changes from round to round blanked out (ports, pids, addresses, temporary
    paths are numbers or hold them), so that the same failure in two rounds compares equal."""
    error = re.sub(re.escape(tempfile.gettempdir()) + r"/\S*", "<tmp>", error)
    return re.sub(r"\d+", "#", error)


def checkpointed_step(ckpt_dir: Path) -> int:
    """The step of the newest checkpoint in `ckpt_dir` whose manifest passes its checks (0 when there
    is none). Only the manifest is read: a checkpoint whose data is damaged counts here until the
    workers' resume finds the damage and sets it aside (`runtime.checkpointing.resume`)."""
    try:
        candidates = committed(ckpt_dir)
    except CheckpointError:  # a planted link: the workers' resume reports it
        return 0
    for path in reversed(candidates):
        try:
            return int(checkpoint_meta(path)[2])
        except CheckpointError:
            continue
    return 0


# A line of a worker's output as torch prefixes it ("[rank3]: "), a user error of `elastor train`
# (from its handler or from argparse), an exception's last line, and torchrun's line on the first
# worker to fail ("... failed (exitcode: -9) local_rank: 1 (pid: 123) of binary: ...").
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
_USER_ERROR = re.compile(r"^elastor(?: train)?: error: (.+)$")
_EXCEPTION = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception)(?::.*)?$")
_FIRST_FAILURE = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: \d+")
_TORCHRUN_OWN = ("ChildFailedError", "SignalException")  # torchrun reporting on its workers


def worker_error(log: Path, code: int) -> str:
    """What a failed round's workers died of, in one line, from the end of their output: the last
    `elastor` user error; else, if the first worker to fail was killed by a signal, that signal (the
    others' exceptions only follow from it); else the last exception that torchrun did not raise
    about its workers; else the exit code of the first worker to fail (`code`, torchrun's, if none)."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        tail = f.read().decode(errors="replace")
    lines = [_RANK_PREFIX.sub("", line).strip() for line in reversed(tail.splitlines())]
    for line in lines:
        if m := _USER_ERROR.match(line):
            return m[1]
    first = [int(m[1]) for m in map(_FIRST_FAILURE.search, lines) if m]
    if first and first[-1] < 0:
        return _exit_error(first[-1])
    for line in lines:
        if _EXCEPTION.match(line) and not any(name in line for name in _TORCHRUN_OWN):
            return line
    return _exit_error(first[-1] if first else code)


def _exit_error(code: int) -> str:
    if code < 0:
        try:
            return f"a worker was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"a worker exited with code {code}"


def _stop(worker: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group (it stops its workers, which run in their own sessions), then
    SIGKILL it after TORCHRUN_STOP_S (its workers' lifelines then kill them)."""
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=lifeline.TORCHRUN_STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    except ProcessLookupError:
        pass


def _kill(worker: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group at once (its workers' lifelines take them down with it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()


_PROBE = (
    "import torch; d = torch.device('cuda', 0); x = torch.ones(1 << 20, device=d); "
    "assert float(x @ x) == float(1 << 20)"
)


def probe_cuda(gpus: list[int], *, timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
    """The GPUs of `gpus` that pass a small matrix product, each probed at the same time in a process
    of its own that sees only that GPU (CUDA_VISIBLE_DEVICES), so that one broken GPU takes out
    itself only; a probe still running after `timeout_s` fails and is killed."""
    probes = {
        g: subprocess.Popen(
            [sys.executable, "-c", _PROBE],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(g)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for g in gpus
    }
    deadline = time.monotonic() + timeout_s
    healthy = []
    for g, probe in probes.items():
        try:
            if probe.wait(timeout=max(0.0, deadline - time.monotonic())) == 0:
                healthy.append(g)
        except subprocess.TimeoutExpired:
            _kill(probe)
            _say(f"GPU {g}'s probe did not finish in {timeout_s:.0f} s; it is left out")
    return healthy

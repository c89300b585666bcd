"""Discrete-event simulation of one training run under failures, for one recovery policy.

Events, in a heap by time: failures and repairs (from the shared `FailureTrace`), and the job's own
events: a checkpoint falls due, a phase ends, a checkpoint becomes durable. Between events the job is
in one phase and nothing changes, so training is integrated exactly: progress advances at the current
plan's steps per second. Job events carry the job's epoch; a failure that hits the job bumps the epoch,
which cancels every job event scheduled before it.

Phases: train -> (checkpoint due) stall -> train ...; a failure of a GPU the job uses (or of its node,
or a job-scope crash on it) rolls progress back to the newest *durable* checkpoint and runs
detect -> [wait] -> plan -> restart -> load -> train, detection taking a lost host's time or a GPU's
and a job's (goodput.costs). A failure during plan/restart/load of a GPU the new configuration uses
starts recovery over from detect. Scale-up (policies that grow back) happens at
a checkpoint: a blocking save (stall, then the background write), then plan -> restart -> load. It is
taken when the throughput gained over one mean time between failures exceeds what the restart costs.

Checkpoints fall every K steps, K = the interval in seconds times the policy's failure-free steps per
second, rounded (at least 1). At most one save is in flight: a save that falls due while the previous
one is still being written stalls until it is durable, as runtime/checkpointing.py does.

Accounting, with X0 the failure-free throughput of the reference plan (the whole cluster) and G the
global batch, over the horizon T (an exact identity, checked by the tests):
    X0 * T = useful + recomputed + X0 * stall_s + X0 * (restart phases) + X0 * wait_s + degraded
where recomputed = G x steps rolled back and degraded = integral of (X0 - X(t)) over training time.
Progress at the horizon counts as useful: the run would write a final checkpoint.
"""

import heapq
import math
from dataclasses import dataclass, field

from costmodel import ElastorError
from goodput.costs import RecoveryCosts
from goodput.failures import GPU, JOB, NODE, FailureTrace
from goodput.policies import Config, Hardware, Policy

# Events; ties at equal times resolve in push order.
FAIL, REPAIR, CKPT_DUE, PHASE_END, CKPT_DURABLE = range(5)
RESTART_PHASES = ("detect", "plan", "restart", "load", "save", "re-form", "transfer")
PHASES = ("train", "stall", "wait", *RESTART_PHASES)


@dataclass
class RunResult:
    policy: str
    horizon_s: float
    reference_samples_per_s: float
    global_batch_size: int
    interval_steps: int | None
    useful_samples: float
    recomputed_samples: float
    degraded_samples: float
    phase_s: dict[str, float]
    counts: dict[str, int]
    timeline: list[tuple[float, str, float]] = field(default_factory=list)  # (start_s, phase, samples/s)

    @property
    def goodput_samples_per_s(self) -> float:
        return self.useful_samples / self.horizon_s

    @property
    def goodput_fraction(self) -> float:
        return self.goodput_samples_per_s / self.reference_samples_per_s

    def lost_samples(self) -> dict[str, float]:
        """Work lost against the failure-free run, by cause, in samples (they sum to X0*T - useful)."""
        x0 = self.reference_samples_per_s
        return {
            "recompute": self.recomputed_samples,
            "stall": x0 * self.phase_s["stall"],
            "restart": x0 * sum(self.phase_s[p] for p in RESTART_PHASES),
            "wait": x0 * self.phase_s["wait"],
            "degraded": self.degraded_samples,
        }

    def to_row(self) -> dict[str, float | int | str | None]:
        x0_total = self.reference_samples_per_s * self.horizon_s
        row: dict[str, float | int | str | None] = {
            "policy": self.policy,
            "goodput_samples_per_s": self.goodput_samples_per_s,
            "goodput_fraction": self.goodput_fraction,
            "interval_steps": self.interval_steps,
        }
        for cause, samples in self.lost_samples().items():
            row[f"lost_{cause}"] = samples / x0_total
        for phase, seconds in self.phase_s.items():
            row[f"{phase}_h"] = seconds / 3600
        row.update(self.counts)
        return row


class Simulation:
    def __init__(
        self,
        trace: FailureTrace,
        policy: Policy,
        hardware: Hardware,
        costs: RecoveryCosts,
        *,
        global_batch_size: int,
        reference_samples_per_s: float,
        ckpt_interval_s: float | None,
        mtbf_s: float = math.inf,
        record_timeline: bool = False,
    ):
        self.trace, self.policy, self.hw, self.costs = trace, policy, hardware, costs
        self.G = global_batch_size
        self.x0 = reference_samples_per_s
        self.mtbf_s = mtbf_s
        self.record = record_timeline
        self.heap: list[tuple[float, int, int, int, float]] = []
        self.seq = 0
        self.t = 0.0
        self.epoch = 0
        self.phase = "train"
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        counted = ("failures", "interruptions", "restarts", "in_process", "scale_ups", "checkpoints")
        self.counts = dict.fromkeys(counted, 0)
        self.timeline: list[tuple[float, str, float]] = []
        self.progress = 0.0  # steps done, including those not yet in a durable checkpoint
        self.durable = 0.0  # steps in the newest durable checkpoint
        self.in_flight_until = 0.0  # when the save in flight (if any) becomes durable
        self.recomputed_steps = 0.0
        self.degraded = 0.0
        self.pending_phases: list[tuple[str, float]] = []
        self.starting: Config | None = None
        self.scale_up = False

        config = policy.choose()
        if config is None:
            raise ElastorError(
                f"Policy {policy.name} finds no plan that fits on the healthy cluster; give it more GPUs."
            )
        self.config = config
        self.rate = config.samples_per_s / self.G  # steps per second
        self.K = None if ckpt_interval_s is None else max(1, round(ckpt_interval_s * self.rate))
        self.next_ckpt = self.K
        self._enter("train")

    # ---- the event loop -------------------------------------------------------------------------
    def run(self) -> RunResult:
        for i in range(len(self.trace)):
            self._push(float(self.trace.time_s[i]), FAIL, i)
        self._schedule_checkpoint()
        horizon = self.trace.horizon_s
        while self.heap and self.heap[0][0] <= horizon:
            t, _, kind, epoch, arg = heapq.heappop(self.heap)
            if kind in (CKPT_DUE, PHASE_END, CKPT_DURABLE) and epoch != self.epoch:
                continue  # scheduled before an interruption
            self._advance(t)
            if kind == FAIL:
                self._on_failure(int(arg))
            elif kind == REPAIR:
                self._on_repair(int(arg))
            elif kind == CKPT_DUE:
                self._on_checkpoint_due()
            elif kind == PHASE_END:
                self._on_phase_end()
            else:
                self.durable = arg
                self.counts["checkpoints"] += 1
        self._advance(horizon)
        return RunResult(
            policy=self.policy.name,
            horizon_s=horizon,
            reference_samples_per_s=self.x0,
            global_batch_size=self.G,
            interval_steps=self.K,
            useful_samples=self.progress * self.G,
            recomputed_samples=self.recomputed_steps * self.G,
            degraded_samples=self.degraded,
            phase_s=self.phase_s,
            counts=self.counts,
            timeline=self.timeline,
        )

    def _push(self, t: float, kind: int, arg: float = 0.0) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, self.epoch, arg))
        self.seq += 1

    def _advance(self, t: float) -> None:
        dt = t - self.t
        if self.phase == "train":
            self.progress += self.rate * dt
            self.degraded += (self.x0 - self.config.samples_per_s) * dt
        self.phase_s[self.phase] += dt
        self.t = t

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if self.record:
            running = self.config.samples_per_s if phase == "train" else 0.0
            self.timeline.append((self.t, phase, running))

    # ---- training and checkpoints ----------------------------------------------------------------
    def _schedule_checkpoint(self) -> None:
        if self.next_ckpt is not None:
            self._push(self.t + (self.next_ckpt - self.progress) / self.rate, CKPT_DUE)

    def _on_checkpoint_due(self) -> None:
        self.progress = float(self.next_ckpt)  # exact, whatever the rounding of the event time
        self.next_ckpt += self.K
        stall_end = max(self.t, self.in_flight_until) + self.costs.ckpt_stall_s
        self.in_flight_until = stall_end + self.costs.ckpt_background_s
        self._push(self.in_flight_until, CKPT_DURABLE, self.progress)
        # Before a scale-up the save blocks until it is durable (its background part is a restart cost).
        self.pending_phases = [("save", self.costs.ckpt_background_s)] if self.scale_up else []
        self._enter("stall")
        self._push(stall_end, PHASE_END)

    # ---- failures and repairs --------------------------------------------------------------------
    def _on_failure(self, i: int) -> None:
        tr = self.trace
        scope, node, gpu = int(tr.scope[i]), int(tr.node[i]), int(tr.gpu[i])
        self.counts["failures"] += 1
        if scope == GPU:
            self.hw.gpu_down[node, gpu] = True
        elif scope == NODE:
            self.hw.node_down[node] = True
        if scope != JOB:
            self._push(self.t + float(tr.repair_s[i]), REPAIR, i)
        active = self._active_config()
        if active is None:
            return
        hit = active.in_use[node].any() if scope == NODE else active.in_use[node, gpu]
        if not hit:
            return
        running = self.phase in ("train", "stall", "save")
        if scope == GPU and running and (survivors := self.policy.survivors(self.config)) is not None:
            self._recover_in_process(survivors)
        else:
            self._interrupt(self.costs.detect_node_s if scope == NODE else self.costs.detect_s)

    def _active_config(self) -> Config | None:
        """The configuration a failure can hit now: running, being saved, or being started."""
        if self.phase in ("train", "stall", "save"):
            return self.config
        if self.phase in ("plan", "restart", "load", "re-form", "transfer"):
            return self.starting
        return None  # detect or wait: already down

    def _interrupt(self, detect_s: float) -> None:
        self.counts["interruptions"] += 1
        self.recomputed_steps += self.progress - self.durable
        self.progress = self.durable
        self.next_ckpt = None if self.K is None else self.durable + self.K
        self.in_flight_until = self.t
        self.scale_up = False
        self.epoch += 1
        self.pending_phases = []
        self._enter("detect")
        self._push(self.t + detect_s, PHASE_END)

    def _recover_in_process(self, survivors: Config) -> None:
        """The in-process path (policies.ElastorInProcess): only the step in flight is redone, the
        save in flight is abandoned, and the survivors detect, re-plan, re-form and fetch their state."""
        self.counts["interruptions"] += 1
        self.recomputed_steps += self.progress - math.floor(self.progress)
        self.progress = float(math.floor(self.progress))
        self.in_flight_until = self.t
        self.scale_up = False
        self.epoch += 1
        c = self.costs
        self.starting = survivors
        self.pending_phases = [("plan", c.plan_s), ("re-form", c.reform_s), ("transfer", c.transfer_s)]
        self._enter("detect")
        self._push(self.t + c.detect_s, PHASE_END)

    def _on_repair(self, i: int) -> None:
        tr = self.trace
        if int(tr.scope[i]) == GPU:
            self.hw.gpu_down[int(tr.node[i]), int(tr.gpu[i])] = False
        else:
            self.hw.node_down[int(tr.node[i])] = False
        if self.phase == "wait":
            self._try_start()
        elif self.phase in ("train", "stall") and self.K is not None:
            self.scale_up = self.scale_up or self._worth_scaling_up()

    def _worth_scaling_up(self) -> bool:
        candidate = self.policy.better(self.config)
        if candidate is None:
            return False
        c = self.costs
        cost_s = c.ckpt_stall_s + c.ckpt_background_s + c.plan_s + c.restart_s + c.reshard_load_s
        gain = (candidate.samples_per_s - self.config.samples_per_s) * self.mtbf_s
        return gain > candidate.samples_per_s * cost_s

    # ---- recovery --------------------------------------------------------------------------------
    def _on_phase_end(self) -> None:
        if self.pending_phases:
            phase, seconds = self.pending_phases.pop(0)
            self._enter(phase)
            self._push(self.t + seconds, PHASE_END)
        elif self.phase == "stall":
            self._resume()
        elif self.phase == "save":  # durable now (its event came first): scale up if still faster
            self.scale_up = False
            candidate = self.policy.better(self.config)
            if candidate is None:
                self._resume()
            else:
                self.counts["scale_ups"] += 1
                self._start(candidate)
        elif self.phase == "detect":
            self._try_start()
        else:  # plan, restart and load (or re-form and transfer) are done: run the new configuration
            self.config, self.starting = self.starting, None
            self.rate = self.config.samples_per_s / self.G
            self.counts["in_process" if self.phase == "transfer" else "restarts"] += 1
            self._resume()
            self.scale_up = self.K is not None and self._worth_scaling_up()

    def _resume(self) -> None:
        self._enter("train")
        self._schedule_checkpoint()

    def _try_start(self) -> None:
        config = self.policy.choose()
        if config is None:
            self._enter("wait")
        else:
            self._start(config)

    def _start(self, config: Config) -> None:
        new_layout = config.layout != self.config.layout
        c = self.costs
        self.starting = config
        self.pending_phases = [
            ("plan", c.plan_s if (new_layout and self.policy.replans) else 0.0),
            ("restart", c.restart_s),
            ("load", c.reshard_load_s if new_layout else c.load_s),
        ]
        self._on_phase_end()


def simulate(
    trace: FailureTrace,
    policy: Policy,
    hardware: Hardware,
    costs: RecoveryCosts,
    **kwargs,
) -> RunResult:
    """One run; see `Simulation` for the keyword arguments."""
    return Simulation(trace, policy, hardware, costs, **kwargs).run()

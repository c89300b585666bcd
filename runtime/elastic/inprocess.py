"""Recovery without restarting the survivors: the protocol, and the worker's half of it.

Under `elastor run` (recovery `in-process`, the default) every node's supervisor starts its workers
itself, one process per device, rather than under torchrun: torchrun stops every worker of a node
when one fails, which is exactly what this path avoids. When a worker dies, its supervisor reports
the loss on the round's store (the TCPStore a supervisor hosts for the round, which every worker of
the round already uses), and the supervisor hosting that store decides the next *generation* of the
round: a plan for the surviving devices (`solver.solve`) or, when the in-process path cannot be
taken, a restart. Keys, under `inprocess/`:

- `lost` counts the losses; `lost/<i>` is the i-th: `{"device", "code", "time_s"}`;
- `formed/<g>` counts the ranks of generation g's plan that have restored (a loss before all have
  is answered with a restart);
- `gen/<g>` is generation g's decision (g >= 1; generation 0 is the round's own plan):
  `{"plan", "order", "stop_at", "lost", "losses"}`, where `order` lists the survivors that take
  part (the new plan's devices first, in its rank order, then the survivors it leaves out) and
  `losses` counts every loss answered so far; or `{"restart": why}`.

A surviving worker notices the failure in one of two ways: an operation with a peer that died or
left fails (`is_peer_failure`; gloo raises a RuntimeError of its transport, NCCL a DistError), or
its watch thread sees a loss reported on the store (every WATCH_S) and aborts its communication
(`abort_communication`), which makes the operation it waits in, or its next one, fail at once. The
watch matters for a rank that waits on a live peer which itself never posts its part (it left the
job first): without it that rank would wait out the collective timeout. Then (`Recovery.leave`,
`Recovery.rejoin`):

1. it aborts its own communication (so that every peer that has not noticed yet does now), waits
   for its pending reductions to fail, takes its training state (`runtime.state.training_state`:
   live views of the fp32 masters and AdamW moments of the rows it keeps, and the step it
   completed), abandons a checkpoint save that can no longer be committed, closes its trainer and
   leaves the job (`runtime.distributed.leave_job`: the process groups are destroyed and freed on
   the main thread);
2. it waits for the decision of the next generation on the round's store;
3. joins the new generation's process group under the prefix `inprocess/gen<g>/` of the same store,
   with its rank in `order`;
4. agrees on the step (the commit check, `Recovery._agree`: when the failure struck inside a step's
   final all-reduce, which some survivors completed, the others finish that step with their
   totals, as every rank contributed to them after its gradients were reduced) and fetches the new
   plan's state from the survivors' memory (`runtime.elastic.peers.fetch_state`); no checkpoint
   file is read (`runtime.checkpoint.load.files_opened()` counts them; the `restored` event reports
   the count);
5. a survivor that the new plan leaves out exits once the transfers are done; the others re-form
   the job over the plan's devices alone when that differs (prefix `inprocess/gen<g>/train/`),
   build the new plan's trainer and restore the state into it. The step in flight is redone.

Rows that only a lost worker kept (its ZeRO-1 slices; any row of a plan without replicas) are taken
from its peer snapshot instead (runtime/elastic/snapshots.py): in step 4 every survivor agrees on the
newest snapshot step they can all restore (`Recovery._agree_snapshot`), rolls back to its own
snapshot of that step, and the keeper of the lost worker's copy passes it on; the steps since the
snapshot are redone.

When the path cannot be taken (the decision says restart, the survivors stopped on different
steps, some rows of the new plan are held by no survivor and no surviving snapshot) every survivor exits
with `FALLBACK_EXIT` and one line saying why, and the supervisors take the restart path: the round
fails, the next one restarts the workers from the newest checkpoint.

Why not torch's own pieces: torchrun's elastic agent restarts every local worker on any failure,
and `torch.distributed.checkpoint` reshards through storage; the state here lives in the survivors'
memory, and the new layout is a different heterogeneous plan, which neither can express.
"""

import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from costmodel.errors import ElastorError
from costmodel.plan import Plan
from runtime.distributed import ENV_MASTER, DistContext, all_gather_single, leave_job
from runtime.elastic import progress
from runtime.elastic.peers import MissingRows, fetch_state, plan_transfers
from runtime.elastic.snapshots import buddies, rollback_step
from runtime.state import restore_training_state, training_state

ENV_RECOVERY = "ELASTOR_RECOVERY"  # "in-process" when the supervisor lets its workers recover so
FALLBACK_EXIT = 75  # a worker that cannot recover in-process exits with this: restart the round
PREFIX = "inprocess/"
DECISION_TIMEOUT_S = 60.0  # how long a survivor waits for the next generation's decision
WATCH_S = 0.05  # how often a worker looks for a reported loss (one store request)
# What gloo's TCP transport says when a peer's connection breaks or times out.
_GLOO_PEER_ERRORS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_key(i: int) -> str:
    return f"{PREFIX}lost/{i}"


def generation_key(g: int) -> str:
    return f"{PREFIX}gen/{g}"


def report_lost(store: dist.Store, device: str, code: int) -> None:
    """A supervisor's report that the worker of `device` died with exit `code`."""
    i = store.add(f"{PREFIX}lost", 1)
    store.set(lost_key(i), json.dumps({"device": device, "code": code, "time_s": time.time()}))


def losses(store: dist.Store, seen: int) -> list[dict]:
    """The losses reported after the first `seen` ones."""
    count = store.add(f"{PREFIX}lost", 0)
    return [json.loads(store.get(lost_key(i))) for i in range(seen + 1, count + 1)]


def publish(store: dist.Store, generation: int, decision: dict) -> None:
    store.set(generation_key(generation), json.dumps(decision))


def decision_now(store: dist.Store, generation: int) -> dict | None:
    """Generation `generation`'s decision if it has been published, else None (no waiting)."""
    if not store.check([generation_key(generation)]):
        return None
    return json.loads(store.get(generation_key(generation)))


def formed(store: dist.Store, generation: int, world_size: int) -> bool:
    """Whether every rank of generation `generation`'s plan (`world_size` of them) has restored."""
    return store.add(f"{PREFIX}formed/{generation}", 0) >= world_size


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a communication failure with a peer (one died, left, or timed out)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _GLOO_PEER_ERRORS)


def abort_communication(backend: str, store_address: tuple[str, int]) -> int:
    """Make every pending and future operation of this process's process groups fail now, from any
    thread: the way out of a collective that waits on a peer which will never come (a survivor that
    left the job without ever posting its part). NCCL: each group's communicators are aborted, as
    torch documents for this purpose (unverified here: no GPU). Gloo has no abort that reaches its
    pending operations (`ProcessGroup.abort` leaves them waiting until the timeout), so this process's
    TCP connections to its peers are shut down (`shutdown(2)` on each connected socket, except those
    to the round's store at `store_address`): every wait on them fails at once with gloo's
    "Connection closed", and the groups are then destroyed as usual. Returns the sockets shut down."""
    if backend == "nccl":
        from torch.distributed import distributed_c10d as c10d

        for group in list(c10d._world.pg_map):  # torch has no public list of a process's groups
            group.abort()
        return 0
    host = socket.gethostbyname(store_address[0])
    closed = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                peer_host, peer_port = sock.getpeername()[:2]
                if (peer_host.removeprefix("::ffff:"), peer_port) != (host, store_address[1]):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
        except OSError:  # not connected (a listening socket)
            pass
        finally:
            sock.close()
    return closed


class CannotRecover(ElastorError):
    """The in-process path cannot be taken here; the run restarts from the checkpoint instead."""


@dataclass
class Rejoined:
    """What `Recovery.recover` hands back to a survivor that trains on."""

    plan: Plan
    ctx: Any  # runtime.distributed.DistContext
    trainer: Any  # runtime.trainer.Trainer, restored
    phases_s: dict[str, float]  # seconds from noticing the failure to the end of each phase
    received_bytes: int
    lost: list[str]
    generation: int
    last: Any  # runtime.trainer.StepResult of the agreed step, if this process knows it
    record_missing: bool  # the old plan's metrics writer did not live to record that step
    source: str = "peers"  # the survivors' live state, or "peer snapshot" (rolled back to it)
    rolled_back_steps: int = 0  # steps this survivor had done beyond the snapshot it restored


@dataclass
class Left:
    """A survivor's state between leaving the failed job and joining the next generation."""

    pieces: list  # runtime.state.StatePiece, live views of the fp32 masters and moments it kept
    meta: dict[str, Any]
    last: Any  # runtime.trainer.StepResult of the last step it completed, or None
    totals: Any  # that step's all-reduced totals (torch.Tensor), or None
    trainer: Any  # the old trainer while its step awaits its totals (see Recovery._agree), else None
    plan: Plan
    device_name: str
    device: Any  # torch.device
    noticed: float  # perf_counter when the failure was noticed
    held: list  # references to the old process groups, dropped once they are destroyed


class Recovery:
    """One worker's in-process recovery, generation after generation of its round."""

    def __init__(self, address: str, *, backend: str, timeout_s: float):
        host, _, port = address.rpartition(":")
        self.address = (host, int(port))
        self.store = self._client()
        self.backend, self.timeout_s = backend, timeout_s
        self.generation = 0
        # The watch: a thread that aborts this process's communication when a loss is reported
        # beyond the `answered` ones while `armed` (the current generation is training).
        self._lock = threading.Lock()
        self._armed, self._answered = True, 0
        self.aborted = threading.Event()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="inprocess-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop the watch (before the process exits: a daemon thread inside a store request when the
        interpreter finalises takes the process down with SIGABRT)."""
        self._closed.set()
        self._watcher.join()

    def _client(self) -> dist.TCPStore:
        host, port = self.address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=DECISION_TIMEOUT_S))

    def _watch(self) -> None:
        store = self._client()  # a connection of this thread's own
        while not self._closed.wait(WATCH_S):
            with self._lock:
                if not self._armed or store.add(f"{PREFIX}lost", 0) <= self._answered:
                    continue
                self._armed = False
            closed = abort_communication(self.backend, self.address)
            self.aborted.set()
            print(
                f"elastor train: a peer was lost; this process's communication is aborted ({closed} "
                "connection(s) shut down)",
                file=sys.stderr,
                flush=True,
            )

    @classmethod
    def from_env(cls, environ, backend: str, timeout_s: float) -> "Recovery | None":
        """The recovery a supervisor enabled for this worker (None outside `elastor run` or with
        `--recovery restart`); a client of the round's store of its own."""
        if environ.get(ENV_RECOVERY) != "in-process" or ENV_MASTER not in environ:
            return None
        return cls(environ[ENV_MASTER], backend=backend, timeout_s=timeout_s)

    def leave(self, trainer, snapshots=None) -> "Left":
        """Step 1 up to leaving: this survivor's state (live views) and who it is, its trainer closed
        (and its peer snapshots' exchange ended, `runtime.elastic.snapshots.PeerSnapshots`, their
        copies kept). The caller then drops every reference to the trainer (and to anything holding
        it) and calls `rejoin`, which leaves the job first."""
        with self._lock:
            self._armed = False  # this generation's groups are going; the next one re-arms
        held = [*trainer.groups.all(), dist.group.WORLD]  # freed by leave_job, on this thread
        # Every pending operation fails now, and every peer that has not noticed yet notices.
        abort_communication(self.backend, self.address)
        trainer.main.drain()
        if snapshots is not None:
            held += snapshots.stop()
        self.aborted.clear()
        pieces, meta = training_state(trainer)
        trainer.close()
        return Left(
            held=held,
            pieces=pieces,
            meta=meta,
            last=trainer.last,
            totals=trainer.last_totals,
            trainer=trainer if trainer.awaiting_commit else None,
            plan=trainer.plan,
            device_name=trainer.ctx.device_name,
            device=trainer.ctx.device,
            noticed=time.perf_counter(),
        )

    def rejoin(
        self,
        left: "Left",
        failure: str,
        build: Callable[[Plan, Any], Any],
        *,
        say: Callable[[str], None],
        snapshots=None,
    ) -> Rejoined | None:
        """Steps 1-5 of the module docstring for a survivor that `leave` has prepared: the restored
        trainer of the next generation, or None when this survivor is left out of it (it has passed
        on its state and should exit). `build(plan, ctx)` makes a trainer. When some rows of the new
        plan's state are held by no survivor, `snapshots` (this rank's `PeerSnapshots` of the old
        plan) supply them: every survivor rolls back to the newest snapshot step they can all
        restore (`_agree_snapshot`). Raises CannotRecover when the restart path must be taken."""
        me = left.device_name
        leave_job(left.held)
        marks = {"left": time.perf_counter()}
        self.generation += 1
        g = self.generation
        say(f"{me}: a peer failed ({failure}); waiting for generation {g} of the round")
        with progress.current.waiting():
            decision = self._wait(g)
        marks["decided"] = time.perf_counter()
        if "restart" in decision:
            raise CannotRecover(f"the supervisors chose the restart path: {decision['restart']}")
        new = Plan.from_json(decision["plan"]).validate()
        order: list[str] = decision["order"]
        if me not in order:
            raise CannotRecover(f"{me} is not among the survivors of generation {g}")
        self._join(f"gen{g}/", order.index(me), len(order))
        transfers = plan_transfers(left.plan, new, order)
        source, rolled_back, stand_ins = "peers", 0, None
        if not transfers.complete and snapshots is not None and snapshots.plan == left.plan:
            # Rows only a lost rank held: every survivor rolls back to a snapshot that has them.
            lost = [d for d in left.plan.devices if d not in order]
            step = self._agree_snapshot(left, order, snapshots, lost)
            rolled_back = int(left.meta["step"]) - step
            left.pieces, left.meta = snapshots.held_at(step)
            keepers = buddies(left.plan)
            stand_ins = {d: keepers[d] for d in lost}
            transfers = plan_transfers(left.plan, new, order, stand_ins=stand_ins)
            last, record_missing, source = None, False, "peer snapshot"
            left.trainer = None
            say(f"{me}: rolled back {rolled_back} step(s) to the peer snapshot of step {step}")
        else:
            last, record_missing = self._agree(left, order)
        marks["joined"] = time.perf_counter()  # and agreed: what follows is the transfer alone
        try:
            tensors, _, received = fetch_state(
                left.pieces,
                left.plan,
                new,
                order,
                me,
                rank_of={d: i for i, d in enumerate(order)},
                device=left.device,
                stand_ins=stand_ins,
                transfers=transfers,
            )
        except MissingRows as e:
            raise CannotRecover(f"{str(e).rstrip('.')}: the storage checkpoint must supply them") from None
        left.pieces = []
        if snapshots is not None:
            snapshots.release()  # of the old plan; the new plan's trainer takes its own
        marks["transferred"] = time.perf_counter()
        if len(order) > new.world_size:  # the survivors the plan leaves out go; the others re-form
            leave_job()
            if me not in new.devices:
                return None
            self._join(f"gen{g}/train/", new.devices.index(me), new.world_size)
        ctx = DistContext(
            rank=new.devices.index(me),
            world_size=new.world_size,
            device_name=me,
            device=left.device,
            backend=self.backend,
        )
        trainer = build(new, ctx)
        restore_training_state(trainer, tensors, left.meta)
        marks["restored"] = time.perf_counter()
        self.store.add(f"{PREFIX}formed/{g}", 1)
        with self._lock:
            self._armed, self._answered = True, int(decision["losses"])
        return Rejoined(
            plan=new,
            ctx=ctx,
            trainer=trainer,
            phases_s={k: v - left.noticed for k, v in marks.items()},
            received_bytes=received,
            lost=list(decision.get("lost", [])),
            generation=g,
            last=last,
            record_missing=record_missing,
            source=source,
            rolled_back_steps=rolled_back,
        )

    def _agree_snapshot(self, left: "Left", order: list[str], snapshots, lost: list[str]) -> int:
        """The step to roll back to, on the new generation's group: every survivor's snapshot steps
        (`PeerSnapshots.summary`) gathered, and the newest step that every survivor holds and whose
        copy of every lost device reached its keeper (`runtime.elastic.snapshots.rollback_step`);
        every rank reaches the same answer from the same numbers."""
        mine = torch.tensor(snapshots.summary(), dtype=torch.float64, device=left.device)
        everyone = torch.empty(3 * len(order), dtype=torch.float64, device=left.device)
        all_gather_single(everyone, mine)
        summaries = everyone.view(len(order), 3).cpu().tolist()
        step = rollback_step(left.plan, order, summaries, lost)
        if step is None:
            raise CannotRecover(
                f"no peer snapshot is held by every survivor with the copy of {', '.join(lost)} "
                "(its keeper was lost too, or no snapshot had been exchanged yet)"
            )
        return step

    def _agree(self, left: "Left", order: list[str]) -> tuple[Any, bool]:
        """The commit check, on the new generation's group: every survivor's step, whether it stopped
        inside its step's final all-reduce (its gradients reduced, the totals not received) and its
        last totals, gathered. All on one step: done. Some one step further: they completed the
        all-reduce that the others were inside, so every rank had contributed to it, and the others
        finish that step with its totals (`Trainer.commit`, local). Anything else cannot be
        reconciled. Every rank reaches the same verdict from the same gathered numbers. Returns the
        agreed step's result (if known here) and whether the old metrics writer missed it."""
        step = int(left.meta["step"])
        mine = torch.zeros(5, dtype=torch.float64, device=left.device)
        mine[0], mine[1] = step, float(left.trainer is not None)
        if left.totals is not None:
            mine[2:] = left.totals.to(mine)
        everyone = torch.empty(5 * len(order), dtype=torch.float64, device=left.device)
        all_gather_single(everyone, mine)
        everyone = everyone.view(len(order), 5).cpu()
        steps = everyone[:, 0].long().tolist()
        high, low = max(steps), min(steps)
        if high != low and (
            high != low + 1 or not all(everyone[i, 1] == 1 for i, s in enumerate(steps) if s == low)
        ):
            raise CannotRecover(
                f"the survivors stopped on steps {sorted(set(steps))}, which cannot be reconciled"
            )
        last = left.last
        if step < high:
            donor = everyone[steps.index(high), 2:].float()  # a step's totals are fp32
            trainer = left.trainer
            print(
                f"elastor train: {left.device_name}: finishing step {high} with a peer's totals "
                "(the failure struck inside its commit all-reduce)",
                file=sys.stderr,
                flush=True,
            )
            last = trainer.commit(donor.to(left.device))
            left.pieces, left.meta = training_state(trainer)
        left.trainer = None
        writer = left.plan.devices[0]
        record_missing = writer not in order or steps[order.index(writer)] < high
        return last, record_missing

    def _wait(self, g: int) -> dict:
        deadline = time.monotonic() + DECISION_TIMEOUT_S
        while (decision := decision_now(self.store, g)) is None:
            if time.monotonic() > deadline:
                raise CannotRecover(f"no decision for generation {g} within {DECISION_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        return decision

    def _join(self, prefix: str, rank: int, world_size: int) -> None:
        store = dist.PrefixStore(PREFIX + prefix, self.store)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=self.timeout_s),
        )

"""The supervisors' rendezvous: where rounds are agreed, over a store every supervisor reaches.

A round is one torchrun job on a fixed set of devices. For round r each node's supervisor publishes
its healthy GPUs (`r/health/<node>`); the leader waits for them until every node has
reported or is lost, or the round's deadline (`--round-deadline-s`) has passed, solves the plan for
those that reported (the round's members) and publishes the decision (`r/decision`: the plan, the
step to stop at, or an error, or "done"); after the job each supervisor publishes its exit code
(`r/exit/<node>`). Keys are never reused across rounds, so a slow supervisor can never read a stale
decision, and every value is signed with the job's token (runtime.elastic.store).

Liveness. Every supervisor beats a heartbeat (`hb/<node>`: a counter, and the progress of its
workers) every HEARTBEAT_S from a thread of its own. A node whose counter has not moved for
`--lease-s` on this node's clock is lost: it is out of the next round, a round it was in counts as
failed (its peers stop their workers at once instead of waiting for a collective to time out), and
nobody waits for its reports. Clocks are never compared across nodes.

Two stores. The default (`--rdzv-backend tcp`) is a TCPStore hosted by the first node's process,
which leads for the whole run: zero set-up, but a single point of failure. When the leader's host is
lost, the store goes with it and the other supervisors stop their workers and end with an error that
says so. With `--rdzv-backend etcd` the store is an etcd cluster (runtime.elastic.etcd) and the leader
is elected (candidates in --nodes order): when it is lost, the next node takes the office
(`campaign`), reads what its predecessor left (`load_state`), and the run goes on; decisions are
written only by the office's holder.

Each round's torchrun and workers use a store of their own, hosted by the supervisor of the plan's
first node on its --host (`host_round_store`, announced under `r/round-store`).
"""

import contextlib
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from costmodel.errors import ElastorError
from runtime.elastic.store import SignedStore, host_store

POLL_S = 0.05  # how often a node waiting for a key looks for it
HEARTBEAT_S = 1.0  # how often a supervisor beats; a lease is several beats long
MIN_LEASE_S = 3 * HEARTBEAT_S  # a shorter lease would expire between two healthy beats
OBSERVE_S = 0.2  # how often the others' heartbeats are read
REACH_S = 2.0  # how long a supervisor tries to reach etcd at start-up


@dataclass
class _Peer:
    seq: int = -1  # the last heartbeat counter seen
    seen_at: float | None = None  # monotonic time on this node when it last moved; None: never seen
    seen_wall: float | None = None  # the same, wall-clock time (for the metrics)
    progress: dict | None = None  # what its workers reported last


class StoreLost(ElastorError):
    """The store went away: the leader's process, which hosts the embedded one, or the etcd cluster."""


class NotLeader(ElastorError):
    """This node's office lapsed (its lease ran out) and another node leads now."""


class Rendezvous:
    def __init__(
        self,
        store: SignedStore,
        nodes: list[str],
        node: str,
        *,
        endpoint: str,
        beat_store: SignedStore | None = None,
        elects: bool = False,
        lease_s: float = 10.0,
        deadline_s: float = 60.0,
        timeout_s: float = 900.0,
    ):
        """Use `tcp_rendezvous` or `etcd_rendezvous`. `beat_store` is the heartbeat thread's own
        connection (the same store); `elects`: the leader is elected (etcd) rather than nodes[0];
        `deadline_s` bounds how long the leader waits for a round's health reports, `timeout_s` how
        long anyone waits for a decision."""
        if node not in nodes:
            raise ElastorError(f"Node {node!r} is not one of --nodes {','.join(nodes)}.")
        if lease_s < MIN_LEASE_S:
            raise ElastorError(f"--lease-s {lease_s:g} is shorter than {MIN_LEASE_S:g} s (three heartbeats).")
        self.store, self._beat_store = store, beat_store or store
        self.nodes, self.node, self.endpoint, self.elects = nodes, node, endpoint, elects
        self.timeout_s, self.lease_s, self.deadline_s = timeout_s, lease_s, deadline_s
        self.progress: dict = {}  # this node's workers' progress, published with each heartbeat
        self._peers = {n: _Peer() for n in nodes}
        self._observed_at = 0.0
        self._started = time.monotonic()
        self._leader: str | None = None
        self._leader_read_at = -1.0
        self._office: str | None = None  # the envelope of this node's `leader` key, while it leads
        self._lease = self._grant() if elects else None
        self._stopped = threading.Event()
        self._beat = 0
        self._heart = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self._heart.start()

    def close(self) -> None:
        """Stop beating; on etcd give the lease back, which drops this node's keys and office."""
        self._stopped.set()
        if self._lease is not None:
            with contextlib.suppress(OSError):  # etcd gone: the lease lapses by itself
                self._beat_store.raw.lease_revoke(self._lease)

    # ---- liveness -------------------------------------------------------------------------------
    def _grant(self):
        return self._call(self._beat_store.raw.lease_grant, self.lease_s)

    def _beat_forever(self) -> None:
        while not self._stopped.is_set():
            self._beat += 1
            try:
                if self._lease is not None and not self._beat_store.raw.lease_refresh(self._lease):
                    self._office = None  # the lease lapsed (a long pause): so did the office
                    self._lease = self._beat_store.raw.lease_grant(self.lease_s)
                beat = {"seq": self._beat, "progress": self.progress}
                self._beat_store.put(f"hb/{self.node}", beat, lease=self._lease)
            except (RuntimeError, OSError):
                if not self.elects:
                    return  # the store is gone: the main thread finds out on its next call
            self._stopped.wait(HEARTBEAT_S)

    def observe(self) -> None:
        """Read the peers' heartbeats (at most every OBSERVE_S)."""
        now = time.monotonic()
        if now - self._observed_at < OBSERVE_S:
            return
        self._observed_at = now
        beats = self._get_each("hb/{}", self.nodes)
        for n, beat in beats.items():
            peer = self._peers[n]
            if isinstance(beat, dict) and isinstance(beat.get("seq"), int) and beat["seq"] > peer.seq:
                peer.seq, peer.seen_at, peer.seen_wall = beat["seq"], now, time.time()
                peer.progress = beat.get("progress") if isinstance(beat.get("progress"), dict) else None

    def lost(self) -> set[str]:
        """Nodes seen beating once whose heartbeat has not moved for the lease (this node excluded)."""
        self.observe()
        now = time.monotonic()
        return {
            n
            for n, p in self._peers.items()
            if n != self.node and p.seen_at is not None and now - p.seen_at > self.lease_s
        }

    def last_seen(self, node: str) -> float | None:
        """Wall-clock time at which `node`'s heartbeat last moved, as this node saw it."""
        return self._peers[node].seen_wall

    def peer_progress(self) -> dict[str, dict]:
        """Every node's last published worker progress (this node's own included)."""
        self.observe()
        found = {n: p.progress for n, p in self._peers.items() if p.progress}
        if self.progress:
            found[self.node] = self.progress
        return found

    # ---- leadership -----------------------------------------------------------------------------
    def leader(self) -> str | None:
        """The node that leads now (None: the office is vacant), read at most every OBSERVE_S."""
        if not self.elects:
            return self.nodes[0]
        now = time.monotonic()
        if now - self._leader_read_at > OBSERVE_S:
            value = self._get_now("leader")
            self._leader = value.get("node") if isinstance(value, dict) else None
            self._leader_read_at = now
        return self._leader

    @property
    def is_leader(self) -> bool:
        return self.leader() == self.node and (not self.elects or self._office is not None)

    def campaign(self) -> bool:
        """Take the office if it is vacant (etcd); whether this node leads now."""
        if self.elects and self._office is None:
            self._office = self._call(self.store.create, "leader", {"node": self.node}, self._lease)
            self._leader_read_at = -1.0
        return self.is_leader

    def _my_turn(self) -> bool:
        """Whether this node may run for the vacant office: the nodes are candidates in --nodes
        order, so the first node leads from the start and the next living one succeeds it (etcd's
        transaction alone keeps two from holding it; the order only makes the outcome predictable).
        A node before this one that was never seen stands aside after a lease from this one's start."""
        now = time.monotonic()
        for n in self.nodes[: self.nodes.index(self.node)]:
            peer = self._peers[n]
            never_seen = peer.seen_at is None and now - self._started > self.lease_s
            if not (never_seen or n in self.lost()):
                return False
        return True

    def save_state(self, state: dict) -> None:
        """What the leader must remember between rounds, for a successor to pick up."""
        self._guarded_put("leader/state", state)

    def load_state(self) -> dict | None:
        state = self._get_now("leader/state")
        return state if isinstance(state, dict) else None

    # ---- health and decision --------------------------------------------------------------------
    def report_health(self, round_: int, gpus: list[int]) -> None:
        self._put(f"{round_}/health/{self.node}", {"gpus": gpus})

    def health(self, round_: int) -> dict[str, dict[str, Any]]:
        """The round's members: every node that reported its health before the others were either
        reported or lost, or the round's deadline passed. Nodes missing at the deadline sit the round
        out (they learn of it from the decision) and may join the next."""
        deadline = time.monotonic() + self.deadline_s
        while True:
            found = self._get_each(f"{round_}/health/{{}}", self.nodes)
            reported = {n: h for n, h in found.items() if isinstance(h, dict)}
            pending = [n for n in self.nodes if n not in reported and n not in self.lost()]
            if not pending or time.monotonic() > deadline:
                if pending:
                    print(
                        f"elastor run: round {round_} goes on without {', '.join(pending)}: no health "
                        f"report within --round-deadline-s {self.deadline_s:g}",
                        flush=True,
                    )
                return reported
            time.sleep(POLL_S)

    def decide(self, round_: int, decision: dict[str, Any]) -> None:
        self._guarded_put(f"{round_}/decision", decision)

    def decision(self, round_: int) -> dict[str, Any] | None:
        """The leader's decision for `round_`; None when the office fell vacant while this node
        waited and this node took it (it must decide)."""
        deadline = time.monotonic() + self.timeout_s
        while (value := self._get_now(f"{round_}/decision")) is None:
            leader = self.leader()
            if leader == self.node and self.is_leader:
                return None
            if leader is None or leader in self.lost():
                if not self.elects:
                    raise ElastorError(
                        f"The leader {leader} was lost while this node waited for its decision."
                    )
                if self._my_turn() and self.campaign():
                    return None
            if time.monotonic() > deadline:
                raise ElastorError(
                    f"No decision for round {round_} on the rendezvous in {self.timeout_s:.0f} s; check "
                    "that every node's supervisor is running."
                )
            time.sleep(POLL_S)
        return value

    def past_decision(self, round_: int) -> dict[str, Any] | None:
        """The decision of a round that has begun (None if there was none)."""
        value = self._get_now(f"{round_}/decision")
        return value if isinstance(value, dict) else None

    def host_round_store(self, round_: int, host: str) -> tuple[str, TCPStore]:
        """Host the store of this round's torchrun and workers on `host`, any free port; announce
        it. Returns (HOST:PORT, the store): the store serves until it is dropped."""
        store = host_store(host, 0, timeout_s=self.timeout_s)
        address = f"{host}:{store.port}"
        self._put(f"{round_}/round-store", address)
        return address, store

    def round_store(self, round_: int, host_node: str) -> str:
        """HOST:PORT of the round's store that `host_node` hosts (waiting for its announcement)."""
        deadline = time.monotonic() + self.timeout_s
        while not isinstance(value := self._get_now(f"{round_}/round-store"), str):
            if host_node in self.lost():
                raise ElastorError(f"Node {host_node}, which hosts round {round_}'s store, was lost.")
            if time.monotonic() > deadline:
                raise ElastorError(f"Node {host_node} did not announce round {round_}'s store in time.")
            time.sleep(POLL_S)
        return value

    def finish(self, round_: int, *, timeout_s: float = 60.0) -> None:
        """Leave after a final decision: the leader waits until every other node that is not lost
        has read the decision (or `timeout_s` passed) before it goes, since on tcp it hosts the
        store; on etcd it then removes the run's keys."""
        if not self.is_leader:
            self._put(f"{round_}/read/{self.node}", True)
            return
        deadline = time.monotonic() + timeout_s
        others = [n for n in self.nodes if n != self.node]
        while time.monotonic() < deadline:
            read, lost = self._get_each(f"{round_}/read/{{}}", others), self.lost()
            if all(n in lost or read[n] for n in others):
                break
            time.sleep(POLL_S)
        if self.elects:  # etcd outlives the run: leave nothing of it behind
            self._call(self.store.raw.delete_all)

    # ---- the end of a round ---------------------------------------------------------------------
    def report_exit(self, round_: int, code: int, **details: Any) -> None:
        """This node's exit code for the round, with what the leader needs to know about a failure."""
        self._put(f"{round_}/exit/{self.node}", {"code": code, "time_s": time.time(), **details})

    def peer_failed(self, round_: int, nodes: list[str]) -> str | None:
        """Why this node should stop its round's workers, or None: a node of `nodes` reported a
        non-zero exit, or is lost."""
        others = [n for n in nodes if n != self.node]
        lost, done = self.lost(), self._get_each(f"{round_}/exit/{{}}", others)
        for n in others:
            if n in lost:
                return f"node {n} was lost"
            if isinstance(done[n], dict) and done[n].get("code") != 0:
                return f"the workers of node {n} failed"
        return None

    def exits(self, round_: int, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """Every node of `nodes`'s exit report; a node lost before reporting gets one written for it
        (code -9, `lost`, and since when: the time its heartbeat last moved)."""
        found: dict[str, dict[str, Any]] = {}
        while True:
            pending = [n for n in nodes if n not in found]
            lost, done = self.lost(), self._get_each(f"{round_}/exit/{{}}", pending)
            for n in pending:
                if isinstance(done[n], dict):
                    found[n] = done[n]
                elif n in lost:
                    found[n] = {
                        "code": -9,
                        "lost": True,
                        "time_s": time.time(),
                        "since_s": self.last_seen(n),
                        "error": f"node {n} was lost: its heartbeat stopped for more than --lease-s "
                        f"{self.lease_s:g}",
                    }
            if len(found) == len(nodes):
                return found
            time.sleep(POLL_S)

    def round_over(self, round_: int, nodes: list[str]) -> bool:
        """Whether every node of `nodes` has reported its exit or is lost."""
        lost, done = self.lost(), self._get_each(f"{round_}/exit/{{}}", nodes)
        return all(n in lost or done[n] is not None for n in nodes)

    # ---- helpers --------------------------------------------------------------------------------
    def _put(self, key: str, value: Any) -> None:
        self._call(self.store.put, key, value)

    def _get_now(self, key: str) -> Any:
        return self._call(self.store.get, key)

    def _get_each(self, pattern: str, nodes: list[str]) -> dict[str, Any]:
        """`pattern.format(node)`'s value for each of `nodes`, by node (etcd: one request)."""
        keys = [pattern.format(n) for n in nodes]
        values = self._call(self.store.get_many, keys) if keys else {}
        return {n: values[k] for n, k in zip(nodes, keys, strict=True)}

    def _guarded_put(self, key: str, value: Any) -> None:
        """Write as the leader: on etcd only while this node still holds the office."""
        if not self.elects:
            self._put(key, value)
        elif self._office is None or not self._call(self.store.put_if, key, value, "leader", self._office):
            self._office = None
            raise NotLeader(f"Node {self.node} no longer leads (its lease lapsed); another node does.")

    def _call(self, op, *args):
        try:
            return op(*args)
        except (RuntimeError, OSError) as e:  # torch raises DistNetworkError (a RuntimeError)
            if self.elects:
                raise StoreLost(
                    f"Lost the etcd cluster at {self.endpoint} ({e}); rerun to resume from the newest "
                    "checkpoint once it answers."
                ) from None
            raise StoreLost(
                f"Lost the rendezvous store at {self.endpoint}, which the leader {self.nodes[0]} hosts "
                f"({type(e).__name__}); the embedded store is a single point of failure (--rdzv-backend "
                "etcd is not), so the run cannot go on: rerun to resume from the newest checkpoint."
            ) from None


def tcp_rendezvous(
    host: str, port: int, nodes: list[str], node: str, *, token: bytes, bind_host: str | None = None, **kw
) -> Rendezvous:
    """The embedded store at `host:port`, hosted by the first node (on `bind_host`, its --host)."""
    timeout_s = kw.get("timeout_s", 900.0)
    leads = node == nodes[0]
    try:
        if leads:
            raw = host_store(bind_host or host, port, timeout_s=timeout_s)
        else:
            raw = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        role = "host" if leads else "reach"
        raise ElastorError(f"Cannot {role} the rendezvous endpoint {host}:{port} ({e}).") from None
    return Rendezvous(SignedStore(raw, token, node), nodes, node, endpoint=f"{host}:{port}", **kw)


def etcd_rendezvous(
    endpoints: str, run_id: str, nodes: list[str], node: str, *, token: bytes, tls=None, **kw
) -> Rendezvous:
    """The rendezvous on the etcd cluster at `endpoints` (HOST:PORT,...), keys under `run_id`."""
    from runtime.elastic.etcd import EtcdStore, parse_endpoints

    parsed = parse_endpoints(endpoints)
    store, beat = (EtcdStore(list(parsed), run_id, tls=tls) for _ in range(2))
    try:
        store.retry_s = REACH_S  # at start-up, an etcd that does not answer is most likely not there
        store.fetch("leader")
        store.retry_s = beat.retry_s
    except ConnectionError as e:
        raise ElastorError(
            f"Cannot reach etcd at {endpoints} ({e}); start it or fix --rdzv-endpoint."
        ) from None
    return Rendezvous(
        SignedStore(store, token, node),
        nodes,
        node,
        endpoint=endpoints,
        beat_store=SignedStore(beat, token, node),
        elects=True,
        **kw,
    )

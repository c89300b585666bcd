"""The supervisors' rendezvous: where rounds are agreed, over a store the leader (the first node) hosts.

A round is one torchrun job on a fixed set of devices. For round r each node's supervisor publishes
its healthy GPUs and its address (`r/health/<node>`); the leader waits for them until every node has
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

The store is a TCPStore hosted by the leader's process: zero set-up, but a single point of failure.
When the leader's host is lost, the store goes with it and the other supervisors stop their workers
and end with an error that says so.
"""

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


@dataclass
class _Peer:
    seq: int = -1  # the last heartbeat counter seen
    seen_at: float | None = None  # monotonic time on this node when it last moved; None: never seen
    seen_wall: float | None = None  # the same, wall-clock time (for the metrics)
    progress: dict | None = None  # what its workers reported last


class StoreLost(ElastorError):
    """The store went away: the leader's process, which hosts it, is gone."""


class Rendezvous:
    def __init__(
        self,
        host: str,
        port: int,
        nodes: list[str],
        node: str,
        *,
        token: bytes,
        bind_host: str | None = None,
        lease_s: float = 10.0,
        deadline_s: float = 60.0,
        timeout_s: float = 900.0,
    ):
        """`host:port` is the leader's store (the leader binds it on `bind_host`, its --host);
        `deadline_s` bounds how long the leader waits for a round's health reports, `timeout_s` how
        long anyone waits for a decision."""
        if node not in nodes:
            raise ElastorError(f"Node {node!r} is not one of --nodes {','.join(nodes)}.")
        if lease_s < MIN_LEASE_S:
            raise ElastorError(f"--lease-s {lease_s:g} is shorter than {MIN_LEASE_S:g} s (three heartbeats).")
        self.nodes, self.node, self.timeout_s = nodes, node, timeout_s
        self.lease_s, self.deadline_s = lease_s, deadline_s
        self.is_leader = node == nodes[0]
        self.endpoint = f"{host}:{port}"
        self._socket = None
        try:
            if self.is_leader:
                raw, self._socket = host_store(bind_host or host, port, timeout_s=timeout_s)
            else:
                raw = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as e:
            role = "host" if self.is_leader else "reach"
            raise ElastorError(f"Cannot {role} the rendezvous endpoint {host}:{port} ({e}).") from None
        self.port = port
        self.store = SignedStore(raw, token, node)
        self.progress: dict = {}  # this node's workers' progress, published with each heartbeat
        self._peers = {n: _Peer() for n in nodes}
        self._observed_at = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._beat = 0
        self._heart = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self._heart.start()

    def close(self) -> None:
        self._stopped.set()

    # ---- liveness -------------------------------------------------------------------------------
    def _beat_forever(self) -> None:
        while not self._stopped.is_set():
            self._beat += 1
            try:
                self.store.put(f"hb/{self.node}", {"seq": self._beat, "progress": self.progress})
            except (RuntimeError, OSError):
                return  # the store is gone: the main thread finds out on its next call
            self._stopped.wait(HEARTBEAT_S)

    def observe(self) -> None:
        """Read the peers' heartbeats (at most every OBSERVE_S)."""
        now = time.monotonic()
        if now - self._observed_at < OBSERVE_S:
            return
        self._observed_at = now
        for n in self.nodes:
            beat = self._call(self.store.get, f"hb/{n}")
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

    # ---- health and decision --------------------------------------------------------------------
    def report_health(self, round_: int, gpus: list[int], host: str) -> None:
        self._put(f"{round_}/health/{self.node}", {"gpus": gpus, "host": host})

    def health(self, round_: int) -> dict[str, dict[str, Any]]:
        """The round's members: every node that reported its health before the others were either
        reported or lost, or the round's deadline passed. Nodes missing at the deadline sit the round
        out (they learn of it from the decision) and may join the next."""
        deadline = time.monotonic() + self.deadline_s
        while True:
            reported = {
                n: h for n in self.nodes if isinstance(h := self._get_now(f"{round_}/health/{n}"), dict)
            }
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
        self._put(f"{round_}/decision", decision)

    def decision(self, round_: int) -> dict[str, Any]:
        return self._wait(f"{round_}/decision", watch=self.nodes[0])

    def finish(self, round_: int, *, timeout_s: float = 60.0) -> None:
        """Leave after a final decision: the leader hosts the store, so it waits until every other
        node that is not lost has read the decision (or `timeout_s` passed) before it goes."""
        if not self.is_leader:
            self._put(f"{round_}/read/{self.node}", True)
            return
        deadline = time.monotonic() + timeout_s
        others = [n for n in self.nodes if n != self.node]
        while time.monotonic() < deadline:
            if all(n in self.lost() or self._get_now(f"{round_}/read/{n}") for n in others):
                return
            time.sleep(POLL_S)

    # ---- the end of a round ---------------------------------------------------------------------
    def report_exit(self, round_: int, code: int, **details: Any) -> None:
        """This node's exit code for the round, with what the leader needs to know about a failure."""
        self._put(f"{round_}/exit/{self.node}", {"code": code, "time_s": time.time(), **details})

    def peer_failed(self, round_: int, nodes: list[str]) -> str | None:
        """Why this node should stop its round's workers, or None: a node of `nodes` reported a
        non-zero exit, or is lost."""
        lost = self.lost()
        for n in nodes:
            if n == self.node:
                continue
            if n in lost:
                return f"node {n} was lost"
            done = self._get_now(f"{round_}/exit/{n}")
            if isinstance(done, dict) and done.get("code") != 0:
                return f"the workers of node {n} failed"
        return None

    def exits(self, round_: int, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """Every node of `nodes`'s exit report; a node lost before reporting gets one written for it
        (code -9, `lost`, and since when: the time its heartbeat last moved)."""
        found: dict[str, dict[str, Any]] = {}
        while len(found) < len(nodes):
            lost = self.lost()
            for n in nodes:
                if n in found:
                    continue
                if isinstance(done := self._get_now(f"{round_}/exit/{n}"), dict):
                    found[n] = done
                elif n in lost:
                    found[n] = {
                        "code": -9,
                        "lost": True,
                        "time_s": time.time(),
                        "since_s": self.last_seen(n),
                        "error": f"node {n} was lost: its heartbeat stopped for more than --lease-s "
                        f"{self.lease_s:g}",
                    }
            time.sleep(POLL_S)
        return found

    def round_over(self, round_: int, nodes: list[str]) -> bool:
        """Whether every node of `nodes` has reported its exit or is lost."""
        lost = self.lost()
        return all(n in lost or self._get_now(f"{round_}/exit/{n}") is not None for n in nodes)

    # ---- helpers --------------------------------------------------------------------------------
    def _put(self, key: str, value: Any) -> None:
        self._call(self.store.put, key, value)

    def _get_now(self, key: str) -> Any:
        return self._call(self.store.get, key)

    def _wait(self, key: str, *, watch: str) -> Any:
        """The value of `key`, waiting for it in Python rather than inside the store's blocking get, so
        that a signal's handler (SIGTERM: stop) runs while a node waits; gives up when `watch`, the
        node that writes it, is lost, or after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while (value := self._get_now(key)) is None:
            if watch in self.lost():
                raise ElastorError(f"Node {watch} was lost while this node waited for {key!r}.")
            if time.monotonic() > deadline:
                raise ElastorError(
                    f"No answer on the rendezvous for {key!r} in {self.timeout_s:.0f} s; check that every "
                    "node's supervisor is running."
                )
            time.sleep(POLL_S)
        return value

    def _call(self, op, *args):
        try:
            return op(*args)
        except (RuntimeError, OSError) as e:  # torch raises DistNetworkError (a RuntimeError)
            raise StoreLost(
                f"Lost the rendezvous store at {self.endpoint}, which the leader {self.nodes[0]} hosts "
                f"({type(e).__name__}); the embedded store is a single point of failure, so the run "
                "cannot go on without the leader: rerun to resume from the newest checkpoint."
            ) from None

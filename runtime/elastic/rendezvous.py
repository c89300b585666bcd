"""The supervisors' rendezvous: a TCPStore hosted by the leader (the first node) where rounds are agreed.

A round is one torchrun job on a fixed set of devices. For round r each node's supervisor publishes
its healthy GPUs and its address (`r/health/<node>`); the leader reads them all, solves the plan and
publishes the decision (`r/decision`: the plan, the step to stop at, or an error, or "done"); after
the job each supervisor publishes its exit code (`r/exit/<node>`) and bumps `r/failed` if it was
non-zero, which is how healthy nodes learn at once that a peer's workers died and stop their own.
Keys are never reused across rounds, so a slow supervisor can never read a stale decision.
"""

import json
import time
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from costmodel.errors import ElastorError

POLL_S = 0.05  # how often a node waiting for a key looks for it


class Rendezvous:
    def __init__(self, host: str, port: int, nodes: list[str], node: str, *, timeout_s: float = 900.0):
        if node not in nodes:
            raise ElastorError(f"Node {node!r} is not one of --nodes {','.join(nodes)}.")
        self.nodes, self.node, self.timeout_s = nodes, node, timeout_s
        self.is_leader = node == nodes[0]
        try:
            self.store = TCPStore(
                host,
                port,
                is_master=self.is_leader,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:
            role = "host" if self.is_leader else "reach"
            raise ElastorError(f"Cannot {role} the rendezvous endpoint {host}:{port} ({e}).") from None

    # ---- health and decision --------------------------------------------------------------------
    def report_health(self, round_: int, gpus: list[int], host: str) -> None:
        self._set(f"{round_}/health/{self.node}", {"gpus": gpus, "host": host})

    def health(self, round_: int) -> dict[str, dict[str, Any]]:
        """Every node's healthy GPUs and address (blocks until all have reported)."""
        return {n: self._get(f"{round_}/health/{n}") for n in self.nodes}

    def decide(self, round_: int, decision: dict[str, Any]) -> None:
        self._set(f"{round_}/decision", decision)

    def decision(self, round_: int) -> dict[str, Any]:
        return self._get(f"{round_}/decision")

    def finish(self, round_: int, *, timeout_s: float = 60.0) -> None:
        """Leave after a final decision: the leader hosts the store, so it waits until every other
        node has read the decision (or `timeout_s` passed) before it goes."""
        if not self.is_leader:
            self.store.add(f"{round_}/read", 1)
            return
        deadline = time.monotonic() + timeout_s
        while self.store.add(f"{round_}/read", 0) < len(self.nodes) - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)

    # ---- the end of a round ---------------------------------------------------------------------
    def report_exit(self, round_: int, code: int, **details: Any) -> None:
        """This node's exit code for the round, with what the leader needs to know about a failure."""
        self._set(f"{round_}/exit/{self.node}", {"code": code, "time_s": time.time(), **details})
        if code != 0:
            self.store.add(f"{round_}/failed", 1)

    def peer_failed(self, round_: int) -> bool:
        return self.store.add(f"{round_}/failed", 0) > 0

    def exits(self, round_: int) -> dict[str, dict[str, Any]]:
        return {n: self._get(f"{round_}/exit/{n}") for n in self.nodes}

    # ---- helpers --------------------------------------------------------------------------------
    def _set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> Any:
        """The value of `key`, waiting for it in Python rather than inside the store's blocking get, so
        that a signal's handler (SIGTERM: stop) runs while a node waits for its peers."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise ElastorError(
                    f"No answer on the rendezvous for {key!r} in {self.timeout_s:.0f} s; check that every "
                    "node's supervisor is running."
                )
            time.sleep(POLL_S)
        return json.loads(self.store.get(key))

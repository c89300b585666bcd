"""Recovery policies: on which GPUs the job restarts after a failure, and whether it grows back.

- `elastor`: re-plan for exactly the healthy GPUs (a node with 7 of 8 healthy keeps its 7), and scale
  back up at a checkpoint once a repair makes a faster plan available.
- `node-drop`: the same solver on fully healthy nodes only (what Oobleck-style node-granular systems
  do: any node with a failed GPU is dropped until it is repaired), scaling back up the same way.
- `elastor-in-process`: `elastor`, and a lost GPU of a plan with data parallelism (at least two
  pipelines: every row of state it kept lives on in a replica) is recovered without a restart
  (`elastor run --recovery in-process`, runtime/elastic/inprocess.py): the survivors of the running
  plan re-plan among themselves, re-form and fetch their new state from each other's memory, and
  only the step in flight is redone. A lost node, a job failure, a plan without replicas and a
  failure during a recovery take the restart path.
- `wait-for-repair`: stop until every GPU of the original layout is healthy again, then restart on it.
- `spare-nodes:K`: train on all but K nodes; a node with a failure is swapped for a healthy spare and
  training restarts on the same layout. With no healthy spare left it waits for a repair. The repaired
  node becomes a spare. (The spares come out of the same cluster, so the comparison is at equal
  hardware; their idle capacity shows up as degraded throughput.)

Every policy restarts on the same GPUs after a `job`-scope failure (nothing is broken).
"""

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from costmodel import ElastorError
from goodput.plans import Oracle, PlanPoint, place, signature, signature_order

POLICIES = ("elastor", "elastor-in-process", "node-drop", "wait-for-repair", "spare-nodes")
# The default spare-nodes policy holds 1% of the nodes (at least one) as hot spares: under the Llama 3
# rates and the default repair times a 2,048-node cluster has about 6 nodes down at a time.
SPARE_FRACTION = 0.01


def default_policies(gpus_per_node: list[int]) -> tuple[list[str], list[str]]:
    """The policies that apply to a cluster of these nodes, and a note for each one left out:
    spare-nodes swaps whole nodes of one size, so it needs two nodes or more, all of one size."""
    policies, notes = ["elastor", "elastor-in-process", "node-drop", "wait-for-repair"], []
    if len(gpus_per_node) < 2:
        notes.append("spare-nodes skipped: it needs a node to spare beside the ones that train.")
    elif len(set(gpus_per_node)) > 1:
        sizes = ", ".join(str(g) for g in sorted(set(gpus_per_node), reverse=True))
        notes.append(f"spare-nodes skipped: it swaps nodes of one size, and these have {sizes} GPUs.")
    else:
        policies.append(f"spare-nodes:{max(1, math.ceil(len(gpus_per_node) * SPARE_FRACTION))}")
    return policies, notes


@dataclass(frozen=True, eq=False)
class Config:
    """What the job runs: a layout (equal layouts load a checkpoint without resharding) and its GPUs."""

    layout: Hashable
    samples_per_s: float
    num_pipelines: int
    in_use: np.ndarray  # nodes x GPU positions


class Hardware:
    """The physical cluster's state: which GPUs exist and which are down (a GPU, or its whole node)."""

    def __init__(self, gpus_per_node: list[int]):
        width = max(gpus_per_node)
        self.exists = np.arange(width)[None, :] < np.asarray(gpus_per_node)[:, None]
        self.gpu_down = np.zeros_like(self.exists)
        self.node_down = np.zeros(len(gpus_per_node), dtype=bool)

    @property
    def healthy(self) -> np.ndarray:
        return self.exists & ~self.gpu_down & ~self.node_down[:, None]

    def full_nodes(self, healthy: np.ndarray) -> np.ndarray:
        return healthy.sum(axis=1) == self.exists.sum(axis=1)


class Policy:
    name = "policy"
    replans = False  # whether a change of layout costs a solver call (plan_s)
    in_process = False  # whether a lost GPU of a plan with replicas is recovered without a restart

    def __init__(self, hardware: Hardware, oracle: Oracle):
        self.hw = hardware
        self.oracle = oracle

    def choose(self) -> Config | None:
        """The configuration to (re)start on now, or None to wait for a repair."""
        raise NotImplementedError

    def better(self, current: Config) -> Config | None:
        """A faster configuration than `current` on the healthy GPUs now, if the policy scales up."""
        return None

    def survivors(self, current: Config) -> Config | None:
        """The in-process path's configuration after a GPU of `current` failed, or None to restart."""
        return None


class Elastor(Policy):
    name = "elastor"
    replans = True

    def _counts(self, healthy: np.ndarray) -> np.ndarray:
        return healthy.sum(axis=1)

    def choose(self) -> Config | None:
        healthy = self.hw.healthy
        return self._plan_on(healthy, self._counts(healthy))

    def _plan_on(self, usable: np.ndarray, counts: np.ndarray) -> Config | None:
        """The oracle's plan for `counts` GPUs per node, placed on the `usable` ones."""
        nodes = signature_order(counts)
        sig = signature(counts[nodes])
        point = self.oracle(sig) if sig else None
        if point is None:
            return None
        return Config(
            layout=sig,
            samples_per_s=point.samples_per_s,
            num_pipelines=point.num_pipelines,
            in_use=place(point, nodes, usable),
        )

    def better(self, current: Config) -> Config | None:
        candidate = self.choose()
        if candidate is not None and candidate.samples_per_s > current.samples_per_s:
            return candidate
        return None


class ElastorInProcess(Elastor):
    name = "elastor-in-process"
    in_process = True

    def survivors(self, current: Config) -> Config | None:
        """The plan for the GPUs of `current` that are still healthy (the in-process path cannot add
        GPUs), if it has replicas to recover from and the survivors fit a plan."""
        if current.num_pipelines < 2:
            return None
        alive = current.in_use & self.hw.healthy
        return self._plan_on(alive, alive.sum(axis=1))


class NodeDrop(Elastor):
    name = "node-drop"

    def _counts(self, healthy: np.ndarray) -> np.ndarray:
        return np.where(self.hw.full_nodes(healthy), healthy.sum(axis=1), 0)


class WaitForRepair(Policy):
    name = "wait-for-repair"

    def __init__(self, hardware: Hardware, oracle: Oracle):
        super().__init__(hardware, oracle)
        self.original = Elastor(hardware, oracle).choose()

    def choose(self) -> Config | None:
        if self.original is None or not self.hw.healthy[self.original.in_use].all():
            return None
        return self.original


class SpareNodes(Policy):
    name = "spare-nodes"

    def __init__(self, hardware: Hardware, oracle: Oracle, spares: int):
        super().__init__(hardware, oracle)
        sizes = set(hardware.exists.sum(axis=1).tolist())
        num_nodes = len(hardware.node_down)
        if len(sizes) != 1:
            raise ElastorError("The spare-nodes policy needs nodes with equal GPU counts.")
        if not 0 < spares < num_nodes:
            raise ElastorError(f"spare-nodes needs between 1 and {num_nodes - 1} spares, not {spares}.")
        self.name = f"spare-nodes:{spares}"
        self.training = np.arange(num_nodes) < num_nodes - spares  # the nodes that train
        self.point: PlanPoint | None = oracle(signature([sizes.pop()] * (num_nodes - spares)))

    def choose(self) -> Config | None:
        if self.point is None:
            return None
        healthy = self.hw.healthy
        full = self.hw.full_nodes(healthy)
        keep = full & self.training
        spares = np.flatnonzero(full & ~self.training)
        need = int(self.training.sum() - keep.sum())
        if len(spares) < need:
            return None
        keep[spares[:need]] = True
        self.training = keep
        return Config(
            layout="spare-nodes",
            samples_per_s=self.point.samples_per_s,
            num_pipelines=self.point.num_pipelines,
            in_use=place(self.point, np.flatnonzero(keep), healthy),
        )


def make_policy(spec: str, hardware: Hardware, oracle: Oracle) -> Policy:
    """`elastor`, `node-drop`, `wait-for-repair` or `spare-nodes:K`."""
    name, _, arg = spec.partition(":")
    if name == "spare-nodes":
        if not arg.isdigit():
            raise ElastorError(f"Policy {spec!r} needs a number of spare nodes, like spare-nodes:16.")
        return SpareNodes(hardware, oracle, int(arg))
    simple = {
        "elastor": Elastor,
        "elastor-in-process": ElastorInProcess,
        "node-drop": NodeDrop,
        "wait-for-repair": WaitForRepair,
    }
    if name not in simple or arg:
        raise ElastorError(
            f"Unknown policy {spec!r}; use elastor, elastor-in-process, node-drop, wait-for-repair or "
            "spare-nodes:K."
        )
    return simple[name](hardware, oracle)

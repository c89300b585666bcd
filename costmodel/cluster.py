"""The cluster a plan runs on: nodes, their healthy GPUs, the device kind and the links.

Devices are named `"<node>:<gpu>"` (`"n1:3"`). A node's healthy GPUs may be any subset of 0..k-1:
that is the case Elastor exists for. The short form `"8,8,7"` means nodes n0, n1, n2 with GPUs
0..7, 0..7 and 0..6; it takes the device kind and links from the profile it is planned against.

A cluster also knows how many GPUs a node has when all are healthy, `gpus_per_node` (the nominal
count): a node with fewer is degraded. The node-drop baseline keeps only whole nodes by it, so it is
stated rather than guessed from what is healthy now: a cluster file may give it (otherwise it is the
highest GPU id any node lists, plus one), and the short form takes the largest count given, or
`--gpus-per-node` (`--cluster 7,7 --gpus-per-node 8` is two nodes that each lost a GPU).
"""

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.errors import ElastorError
from costmodel.hardware import device_kind
from costmodel.jsonio import (
    SCHEMA_VERSION,
    check_schema,
    is_integer,
    is_number,
    read_json,
    require,
    shown,
    text,
)

# The most GPUs a cluster may have: eight times the 16,384 of the largest study here and past the
# largest clusters reported (about 100,000 GPUs); the planner's tables grow with it, so a typo such
# as --cluster 1000000000 is refused before it fills memory.
MAX_CLUSTER_GPUS = 131_072
# The most GPUs of one node, and one more than its highest GPU id: a node is one tensor-parallel
# (NVLink) domain, and the largest shipped is a GB200 NVL72 rack's 72 GPUs.
MAX_GPUS_PER_NODE = 72
# Bounds on a device's and a link's figures, each a thousand times or more today's largest (an H200's
# 141 GB, a B200's 2.25 PFLOP/s dense, NVLink 5's 900 GB/s), so a typo in a cluster file fails here
# instead of overflowing the cost model's arithmetic. 2^60 bytes (an exbibyte) is also what the
# runtime's memory accounting passes for "no bound".
MAX_MEMORY_BYTES = 1 << 60
MAX_PEAK_FLOPS = 1e18
MAX_LINK_GBPS = 1e6

_SHORT_FORM = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")
_DEVICE = re.compile(r"([^:]+):([0-9]+)")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    kind: str
    memory_bytes: int
    peak_flops: float

    def __post_init__(self) -> None:
        text(self.kind, "The cluster's device kind")
        if not (
            is_integer(self.memory_bytes, 1, MAX_MEMORY_BYTES)
            and is_number(self.peak_flops, above=0, high=MAX_PEAK_FLOPS)
        ):
            raise ElastorError(
                f"Device kind {self.kind!r} needs positive memory_bytes (an integer up to 2^60) and "
                f"peak_flops (a finite number up to {MAX_PEAK_FLOPS:g}), not {shown(self.memory_bytes)} "
                f"and {shown(self.peak_flops)}."
            )


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    name: str
    gpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ElastorError(f"Node name {shown(self.name)} must be non-empty and contain no ':'.")
        if not all(is_integer(g, 0, MAX_GPUS_PER_NODE - 1) for g in self.gpus):
            raise ElastorError(
                f"Node {self.name} lists GPU ids that are not non-negative integers below "
                f"{MAX_GPUS_PER_NODE}: {shown(list(self.gpus))}."
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ElastorError(f"Node {self.name} lists a GPU twice.")
        object.__setattr__(self, "gpus", tuple(sorted(self.gpus)))

    @property
    def devices(self) -> list[str]:
        return [f"{self.name}:{g}" for g in self.gpus]


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """Per-GPU bandwidth in GB/s (1e9 bytes/s) per direction, plus measured collective fits."""

    intra_node_gbps: float
    inter_node_gbps: float
    # Latency + bandwidth fits per collective and scope, written by `elastor profile --comm`.
    collectives: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        links = (self.intra_node_gbps, self.inter_node_gbps)
        if not all(is_number(gbps, above=0, high=MAX_LINK_GBPS) for gbps in links):
            raise ElastorError(
                "Cluster links need positive intra_node_gbps and inter_node_gbps (finite numbers up to "
                f"{MAX_LINK_GBPS:,.0f}), not {shown(self.intra_node_gbps)} and {shown(self.inter_node_gbps)}."
            )
        if not isinstance(self.collectives, dict):
            raise ElastorError("The cluster's links.collectives must be an object of fits per collective.")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    device: DeviceSpec
    nodes: tuple[NodeSpec, ...]
    links: LinkSpec
    # GPUs of a node when all are healthy; 0: not stated, so the highest GPU id listed, plus one
    gpus_per_node: int = 0

    def __post_init__(self) -> None:
        _check_counts([len(n.gpus) for n in self.nodes])
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ElastorError("The cluster names a node twice.")
        if not self.devices:
            raise ElastorError("The cluster has no healthy GPU.")
        listed = self._highest_listed()
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", listed)
        elif not is_integer(self.gpus_per_node, 1, MAX_GPUS_PER_NODE) or self.gpus_per_node < listed:
            raise ElastorError(
                f"The cluster's gpus_per_node must be a whole number of GPUs in 1..{MAX_GPUS_PER_NODE} "
                f"and above every GPU id a node lists (the highest is {listed - 1}), "
                f"not {shown(self.gpus_per_node)}."
            )

    def _highest_listed(self) -> int:
        """The highest GPU id a node lists, plus one: `gpus_per_node` when not stated."""
        return max((g + 1 for n in self.nodes for g in n.gpus), default=0)

    # ---- queries --------------------------------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        """Healthy devices in rank order: nodes in order, GPUs ascending within a node."""
        return [d for n in self.nodes for d in n.devices]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def short_form(self) -> str:
        return ",".join(str(len(n.gpus)) for n in self.nodes)

    def without(self, failed: set[str]) -> "ClusterSpec":
        """The same cluster with the devices in `failed` marked unhealthy."""
        nodes = tuple(
            NodeSpec(name=n.name, gpus=tuple(g for g in n.gpus if f"{n.name}:{g}" not in failed))
            for n in self.nodes
        )
        return dataclasses.replace(self, nodes=nodes)

    def whole_nodes(self) -> "ClusterSpec | None":
        """The cluster restricted to its nodes with all `gpus_per_node` GPUs healthy (None if none is)."""
        nodes = tuple(n for n in self.nodes if len(n.gpus) == self.gpus_per_node)
        if not nodes:
            return None
        return dataclasses.replace(self, nodes=nodes)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts: list[int], kind: str, gpus_per_node: int | None = None) -> "ClusterSpec":
        """Nodes n0, n1, ... with GPUs 0..count-1 each, links and device from the kind's table; a node
        has `gpus_per_node` GPUs when whole (default: the largest count)."""
        _check_counts(counts)
        hw = device_kind(kind)
        return cls(
            device=DeviceSpec(kind=hw.kind, memory_bytes=hw.memory_bytes, peak_flops=hw.peak_flops),
            nodes=tuple(NodeSpec(name=f"n{i}", gpus=tuple(range(c))) for i, c in enumerate(counts)),
            links=LinkSpec(intra_node_gbps=hw.intra_node_gbps, inter_node_gbps=hw.inter_node_gbps),
            gpus_per_node=gpus_per_node or max(counts, default=0),
        )

    @classmethod
    def parse(cls, spec: str, kind: str = "H100-80GB", gpus_per_node: int | None = None) -> "ClusterSpec":
        """`"8,8,7"` (with the device `kind` of the profile) or the path of a cluster JSON file;
        `gpus_per_node`, when given, is the nominal count of either (it overrides the file's)."""
        if _SHORT_FORM.match(spec):
            counts = spec.split(",")
            if any(len(c.strip()) > 9 for c in counts):  # past every bound: no need to read it exactly
                raise ElastorError(f"Cluster {shown(spec)} names a node of more GPUs than any node has.")
            return cls.from_counts([int(c) for c in counts], kind, gpus_per_node)
        if Path(spec).suffix == ".json" or Path(spec).is_file():
            cluster = cls.from_json(read_json(spec, "cluster"))
            if gpus_per_node is None:
                return cluster
            return dataclasses.replace(cluster, gpus_per_node=gpus_per_node)
        raise ElastorError(
            f"Cluster {shown(spec)} is neither healthy GPUs per node like 8,8,7 nor a cluster JSON file."
        )

    def to_json(self) -> dict[str, Any]:
        links: dict[str, Any] = {
            "intra_node_gbps": self.links.intra_node_gbps,
            "inter_node_gbps": self.links.inter_node_gbps,
        }
        if self.links.collectives:
            links["collectives"] = self.links.collectives
        return {
            "schema_version": SCHEMA_VERSION,
            "device": {
                "kind": self.device.kind,
                "memory_bytes": self.device.memory_bytes,
                "peak_flops": self.device.peak_flops,
            },
            "nodes": [{"name": n.name, "gpus": list(n.gpus)} for n in self.nodes],
            **({"gpus_per_node": self.gpus_per_node} if self.gpus_per_node != self._highest_listed() else {}),
            "links": links,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClusterSpec":
        check_schema(data, "cluster")
        require(data, "cluster", "device", "nodes", "links")
        dev, links = data["device"], data["links"]
        require(dev, "cluster's device block", "kind", "memory_bytes", "peak_flops")
        require(links, "cluster's links block", "intra_node_gbps", "inter_node_gbps")
        if not isinstance(data["nodes"], list):
            raise ElastorError("The cluster's nodes must be a list of {name, gpus} objects.")
        for n in data["nodes"]:
            require(n, "cluster node", "name", "gpus")
            if not isinstance(n["gpus"], list):
                raise ElastorError(
                    f"Cluster node {n['name']}'s gpus must be a list of GPU ids like [0, 1, 2], "
                    f"not {n['gpus']!r}."
                )
        if not isinstance(links.get("collectives", {}), dict):  # before dict() would take a list or text
            raise ElastorError("The cluster's links.collectives must be an object of fits per collective.")
        return cls(
            device=DeviceSpec(
                kind=dev["kind"], memory_bytes=_whole(dev["memory_bytes"]), peak_flops=dev["peak_flops"]
            ),
            nodes=tuple(NodeSpec(name=n["name"], gpus=tuple(n["gpus"])) for n in data["nodes"]),
            links=LinkSpec(
                intra_node_gbps=links["intra_node_gbps"],
                inter_node_gbps=links["inter_node_gbps"],
                collectives=dict(links.get("collectives", {})),
            ),
            gpus_per_node=data.get("gpus_per_node", 0),  # files written before it: from the GPU ids
        )


def _whole(value):
    """A byte count as written by hand: `8e10` is the integer it spells (files that loaded before
    the field was checked keep loading); anything else is left for the field's check to refuse."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


def check_size(num_nodes: int, most_per_node: int, total: int) -> None:
    """Refuse, in one sentence and before anything is built, a cluster of more than MAX_GPUS_PER_NODE
    GPUs on a node, or more than MAX_CLUSTER_GPUS GPUs (or nodes) in all."""
    if num_nodes > MAX_CLUSTER_GPUS:
        raise ElastorError(
            f"The cluster has {num_nodes:,} nodes; Elastor plans at most {MAX_CLUSTER_GPUS:,}."
        )
    if most_per_node > MAX_GPUS_PER_NODE:
        raise ElastorError(
            f"A node of {most_per_node:,} GPUs has more than the {MAX_GPUS_PER_NODE} a node may have."
        )
    if total > MAX_CLUSTER_GPUS:
        raise ElastorError(f"The cluster has {total:,} GPUs; Elastor plans at most {MAX_CLUSTER_GPUS:,}.")


def _check_counts(counts: list[int]) -> None:
    check_size(len(counts), max(counts, default=0), sum(counts))


def of_kind(cluster: ClusterSpec, kind: str, spec: str) -> ClusterSpec:
    """`cluster` (given as `spec`) if its devices are of `kind`, the profile's: a profile prices its
    own device only, so planning another's with it would mix their speeds and memories unseen."""
    if cluster.device.kind != kind:
        raise ElastorError(
            f"The profile is for {kind} devices but cluster {shown(spec)} has {cluster.device.kind} devices; "
            f"profile that device (elastor profile --analytic --device-kind {cluster.device.kind}, or "
            f"measured on it) or give a cluster of {kind} devices."
        )
    return cluster


def parse_device(device: str) -> tuple[str, int]:
    """`"n1:3"` -> `("n1", 3)`."""
    match = _DEVICE.fullmatch(device)
    if not match:
        raise ElastorError(f"Device {device!r} is not of the form <node>:<gpu>, like n1:3.")
    return match[1], int(match[2])

"""The cluster a plan runs on: nodes, their healthy GPUs, the device kind and the links.

Devices are named `"<node>:<gpu>"` (`"n1:3"`). A node's healthy GPUs may be any subset of 0..k-1:
that is the case Elastor exists for. The short form `"8,8,7"` means nodes n0, n1, n2 with GPUs
0..7, 0..7 and 0..6; it takes the device kind and links from the profile it is planned against.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.errors import ElastorError
from costmodel.hardware import device_kind
from costmodel.jsonio import SCHEMA_VERSION, check_schema, read_json, require

_SHORT_FORM = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")
_DEVICE = re.compile(r"([^:]+):([0-9]+)")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    kind: str
    memory_bytes: int
    peak_flops: float

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.peak_flops <= 0:
            raise ElastorError(f"Device kind {self.kind!r} needs positive memory_bytes and peak_flops.")


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    name: str
    gpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name:
            raise ElastorError(f"Node name {self.name!r} must be non-empty and contain no ':'.")
        if any(not isinstance(g, int) or g < 0 for g in self.gpus):
            raise ElastorError(f"Node {self.name} lists GPU ids that are not non-negative integers.")
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
        if self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise ElastorError("Cluster links need positive intra_node_gbps and inter_node_gbps.")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    device: DeviceSpec
    nodes: tuple[NodeSpec, ...]
    links: LinkSpec

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ElastorError("The cluster names a node twice.")
        if not self.devices:
            raise ElastorError("The cluster has no healthy GPU.")

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
        return ClusterSpec(device=self.device, nodes=nodes, links=self.links)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts: list[int], kind: str) -> "ClusterSpec":
        """Nodes n0, n1, ... with GPUs 0..count-1 each, links and device from the kind's table."""
        hw = device_kind(kind)
        return cls(
            device=DeviceSpec(kind=hw.kind, memory_bytes=hw.memory_bytes, peak_flops=hw.peak_flops),
            nodes=tuple(NodeSpec(name=f"n{i}", gpus=tuple(range(c))) for i, c in enumerate(counts)),
            links=LinkSpec(intra_node_gbps=hw.intra_node_gbps, inter_node_gbps=hw.inter_node_gbps),
        )

    @classmethod
    def parse(cls, text: str, kind: str = "H100-80GB") -> "ClusterSpec":
        """`"8,8,7"` (with the device `kind` of the profile) or the path of a cluster JSON file."""
        if _SHORT_FORM.match(text):
            return cls.from_counts([int(c) for c in text.split(",")], kind)
        if Path(text).suffix == ".json" or Path(text).is_file():
            return cls.from_json(read_json(text, "cluster"))
        raise ElastorError(
            f"Cluster {text!r} is neither healthy GPUs per node like 8,8,7 nor a cluster JSON file."
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
        return cls(
            device=DeviceSpec(
                kind=dev["kind"], memory_bytes=int(dev["memory_bytes"]), peak_flops=float(dev["peak_flops"])
            ),
            nodes=tuple(NodeSpec(name=n["name"], gpus=tuple(n["gpus"])) for n in data["nodes"]),
            links=LinkSpec(
                intra_node_gbps=float(links["intra_node_gbps"]),
                inter_node_gbps=float(links["inter_node_gbps"]),
                collectives=dict(links.get("collectives", {})),
            ),
        )


def parse_device(device: str) -> tuple[str, int]:
    """`"n1:3"` -> `("n1", 3)`."""
    match = _DEVICE.fullmatch(device)
    if not match:
        raise ElastorError(f"Device {device!r} is not of the form <node>:<gpu>, like n1:3.")
    return match[1], int(match[2])

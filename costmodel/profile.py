"""The profile of a model on a device kind: what the profiler measures and the cost model reads.

One row per entry of the layer list. Each row holds its parameter count, the bytes it sends to the
next stage per sample, and one `LayerCost` per (micro-batch size, tensor-parallel degree) profiled:
forward and backward time of the per-rank shard and the activation bytes that shard keeps for
backward per micro-batch. Identical blocks are measured once by the profiler and share the numbers.
A measured profile also holds the per-step optimizer work on the shard's parameters (`optimizer_s`,
the same at every micro-batch size); where it is absent the cost model derives it from bandwidth.
"""

from dataclasses import dataclass, field
from typing import Any

from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.jsonio import SCHEMA_VERSION, check_schema, require

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SOURCES = ("cpu", "cuda", "analytic")


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Cost of one TP shard of a layer at one micro-batch size."""

    micro_batch_size: int
    tp_degree: int
    fwd_s: float
    bwd_s: float
    activation_bytes: int  # kept for backward, per micro-batch, per rank
    fwd_spread_s: float = 0.0  # interquartile range of the repeated measurements
    bwd_spread_s: float = 0.0
    fwd_flops: float = 0.0  # forward FLOPs of the shard (costmodel.analytic); backward is twice that
    transient_bytes: int = 0  # allocator peak above the kept activations in fwd + bwd (CUDA only)
    # Measured seconds per step of gradient zeroing, norm, clipping and AdamW on the shard's
    # parameters; None where not measured (analytic profiles, profiles from before the field).
    optimizer_s: float | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.tp_degree < 1:
            raise ElastorError("A layer cost needs micro_batch_size and tp_degree of at least 1.")
        if min(self.fwd_s, self.bwd_s, self.activation_bytes, self.optimizer_s or 0.0) < 0:
            raise ElastorError("A layer cost has a negative time or byte count.")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LayerCost":
        require(data, "layer cost", "micro_batch_size", "tp_degree", "fwd_s", "bwd_s", "activation_bytes")
        return cls(
            micro_batch_size=int(data["micro_batch_size"]),
            tp_degree=int(data["tp_degree"]),
            fwd_s=float(data["fwd_s"]),
            bwd_s=float(data["bwd_s"]),
            activation_bytes=int(data["activation_bytes"]),
            fwd_spread_s=float(data.get("fwd_spread_s", 0.0)),
            bwd_spread_s=float(data.get("bwd_spread_s", 0.0)),
            fwd_flops=float(data.get("fwd_flops", 0.0)),
            transient_bytes=int(data.get("transient_bytes", 0)),
            optimizer_s=None if data.get("optimizer_s") is None else float(data["optimizer_s"]),
        )


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    name: str
    param_count: int
    output_bytes_per_sample: int = 0  # what a stage ending after this layer sends per sample
    costs: tuple[LayerCost, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "param_count": self.param_count,
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "costs": [c.to_json() for c in self.costs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LayerProfile":
        require(data, "profile layer", "name", "param_count")
        return cls(
            name=data["name"],
            param_count=int(data["param_count"]),
            output_bytes_per_sample=int(data.get("output_bytes_per_sample", 0)),
            costs=tuple(LayerCost.from_json(c) for c in data.get("costs", [])),
        )


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    model: ModelConfig
    device_kind: str
    seq_len: int
    layers: tuple[LayerProfile, ...]
    dtype: str = "float32"
    source: str = "analytic"  # cpu, cuda (measured) or analytic
    # How the numbers were made: repeats, timer, memory method, or the analytic constants used.
    method: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ElastorError(f"Profile dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}.")
        if self.source not in SOURCES:
            raise ElastorError(f"Profile source {self.source!r} is not one of {', '.join(SOURCES)}.")
        names = [layer.name for layer in self.layers]
        if names != self.model.layer_names():
            raise ElastorError(
                f"The profile's layers do not match model {self.model.name!r}: expected "
                f"{self.model.num_layers} rows embed, blocks.0..{self.model.num_blocks - 1}, head."
            )
        for i, layer in enumerate(self.layers):
            if layer.param_count != self.model.layer_param_count(i):
                raise ElastorError(
                    f"The profile says {layer.name} has {layer.param_count} parameters but model "
                    f"{self.model.name!r} gives it {self.model.layer_param_count(i)}."
                )

    @property
    def bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def cost(self, layer: int, micro_batch_size: int, tp_degree: int) -> LayerCost:
        for c in self.layers[layer].costs:
            if c.micro_batch_size == micro_batch_size and c.tp_degree == tp_degree:
                return c
        raise ElastorError(
            f"The profile has no measurement of {self.layers[layer].name} at micro-batch size "
            f"{micro_batch_size} and TP degree {tp_degree}; profile it with those settings."
        )

    def micro_batch_sizes(self) -> list[int]:
        return sorted({c.micro_batch_size for c in self.layers[0].costs})

    def tp_degrees(self) -> list[int]:
        return sorted({c.tp_degree for c in self.layers[0].costs})

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_json(),
            "device_kind": self.device_kind,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "source": self.source,
            "method": self.method,
            "layers": [layer.to_json() for layer in self.layers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelProfile":
        check_schema(data, "profile")
        require(data, "profile", "model", "device_kind", "seq_len", "layers")
        return cls(
            model=ModelConfig.from_json(data["model"]),
            device_kind=data["device_kind"],
            seq_len=int(data["seq_len"]),
            dtype=data.get("dtype", "float32"),
            source=data.get("source", "analytic"),
            method=dict(data.get("method", {})),
            layers=tuple(LayerProfile.from_json(layer) for layer in data["layers"]),
        )

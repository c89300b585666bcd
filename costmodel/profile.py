"""The profile of a model on a device kind: what the profiler measures and the cost model reads.

One row per entry of the layer list. Each row holds its parameter count, the bytes it sends to the
next stage per sample, and one `LayerCost` per (micro-batch size, tensor-parallel degree) profiled:
forward and backward time of the per-rank shard and the activation bytes that shard keeps for
backward per micro-batch. Identical blocks are measured once by the profiler and share the numbers.
A measured profile also holds the per-step optimizer work on the shard's parameters (`optimizer_s`,
the same at every micro-batch size); where it is absent the cost model derives it from bandwidth.
Its blocks also carry their time under full recomputation (`full_fwd_s`, `full_bwd_s`); where that
is absent the cost model charges the rerun forward's time.
"""

from dataclasses import dataclass, field
from typing import Any

from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.jsonio import SCHEMA_VERSION, check_schema, is_integer, is_number, require, shown, text

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SOURCES = ("cpu", "cuda", "analytic")

# The attention kernel a plan runs (`Plan.attention`, `ModelProfile.attention`):
#   fused  what scaled_dot_product_attention dispatches by default: flash attention on CPU and on CUDA
#          in 16 bit, memory-efficient attention on CUDA in fp32; no s x s matrix is materialised.
#   math   the unfused composition (`SDPBackend.MATH`, 16-bit reductions allowed): the scores q k^T
#          scaled, the causal mask added, the softmax, then the product with v, each a kernel of its
#          own with the b x H x s x s scores in memory. The attention of Megatron-LM before
#          FlashAttention (Narayanan et al. 2021 fused only the scale, mask and softmax; their runs
#          also kept a dropout mask, which Elastor's model has no use for).
ATTENTION_KERNELS = ("fused", "math")
# Bounds on one layer's figures, far past any real layer's (llama3-70b's block: milliseconds, and
# gigabytes of activations at the largest micro-batches), so a typo fails here instead of
# overflowing the cost model's arithmetic.
MAX_LAYER_BYTES = 1 << 50
MAX_LAYER_S = 1e6
MAX_LAYER_FLOPS = 1e24


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
    # A block's measured forward and backward under full recomputation (torch.utils.checkpoint,
    # whose backward reruns the forward): the checkpoint's own work rides on top of the rerun, and
    # where launches bound a step it costs the host more than the forward it reruns. None: not
    # measured (analytic profiles, layers that are not blocks, profiles from before the field).
    full_fwd_s: float | None = None
    full_bwd_s: float | None = None

    def __post_init__(self) -> None:
        if not (is_integer(self.micro_batch_size, 1) and is_integer(self.tp_degree, 1)):
            raise ElastorError(
                "A layer cost needs integer micro_batch_size and tp_degree of at least 1, not "
                f"{shown(self.micro_batch_size)} and {shown(self.tp_degree)}."
            )
        counts = {"activation_bytes": self.activation_bytes, "transient_bytes": self.transient_bytes}
        for name, value in counts.items():
            if not is_integer(value, 0, MAX_LAYER_BYTES):
                raise ElastorError(f"A layer cost has {name} {shown(value)}, not an integer in 0..2^50.")
        figures = {"fwd_flops": MAX_LAYER_FLOPS, "optimizer_s": MAX_LAYER_S}
        optional = ("optimizer_s", "full_fwd_s", "full_bwd_s")
        for name in ("fwd_s", "bwd_s", "fwd_spread_s", "bwd_spread_s", "fwd_flops", *optional):
            value, high = getattr(self, name), figures.get(name, MAX_LAYER_S)
            if not (value is None and name in optional) and not is_number(value, 0, high):
                raise ElastorError(
                    f"A layer cost has {name} {shown(value)}, not a finite number in 0..{high:g}."
                )
        if (self.full_fwd_s is None) != (self.full_bwd_s is None):
            raise ElastorError("A layer cost gives both full_fwd_s and full_bwd_s, or neither.")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LayerCost":
        require(data, "layer cost", "micro_batch_size", "tp_degree", "fwd_s", "bwd_s", "activation_bytes")
        return cls(
            micro_batch_size=data["micro_batch_size"],
            tp_degree=data["tp_degree"],
            fwd_s=data["fwd_s"],
            bwd_s=data["bwd_s"],
            activation_bytes=data["activation_bytes"],
            fwd_spread_s=data.get("fwd_spread_s", 0.0),
            bwd_spread_s=data.get("bwd_spread_s", 0.0),
            fwd_flops=data.get("fwd_flops", 0.0),
            transient_bytes=data.get("transient_bytes", 0),
            optimizer_s=data.get("optimizer_s"),
            full_fwd_s=data.get("full_fwd_s"),
            full_bwd_s=data.get("full_bwd_s"),
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
        output_bytes, costs = data.get("output_bytes_per_sample", 0), data.get("costs", [])
        if not is_integer(output_bytes, 0, MAX_LAYER_BYTES) or not isinstance(costs, list):
            raise ElastorError(
                f"The profile layer {shown(data['name'])} needs an integer output_bytes_per_sample of at "
                "least 0 and a list of costs."
            )
        return cls(
            name=data["name"],
            param_count=data["param_count"],
            output_bytes_per_sample=output_bytes,
            costs=tuple(LayerCost.from_json(c) for c in costs),
        )


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    model: ModelConfig
    device_kind: str
    seq_len: int
    layers: tuple[LayerProfile, ...]
    dtype: str = "float32"
    source: str = "analytic"  # cpu, cuda (measured) or analytic
    attention: str = "fused"  # the attention kernel measured or priced (ATTENTION_KERNELS)
    # How the numbers were made: repeats, timer, memory method, or the analytic constants used.
    method: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        text(self.device_kind, "The profile's device_kind")
        if not is_integer(self.seq_len, 1, self.model.max_seq_len):
            raise ElastorError(
                f"The profile's seq_len must be an integer in 1..{self.model.max_seq_len} (the model's "
                f"maximum), not {shown(self.seq_len)}."
            )
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ElastorError(f"Profile dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}.")
        if self.source not in SOURCES:
            raise ElastorError(f"Profile source {self.source!r} is not one of {', '.join(SOURCES)}.")
        if self.attention not in ATTENTION_KERNELS:
            raise ElastorError(
                f"Profile attention {shown(self.attention)} is not one of {', '.join(ATTENTION_KERNELS)}."
            )
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
        data = {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_json(),
            "device_kind": self.device_kind,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "source": self.source,
            "method": self.method,
            "layers": [layer.to_json() for layer in self.layers],
        }
        if self.attention != "fused":  # absent: the fused kernel, as every profile before the field
            data["attention"] = self.attention
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelProfile":
        check_schema(data, "profile")
        require(data, "profile", "model", "device_kind", "seq_len", "layers")
        if not isinstance(data["layers"], list) or not isinstance(data.get("method", {}), dict):
            raise ElastorError("The profile's layers must be a list and its method an object.")
        return cls(
            model=ModelConfig.from_json(data["model"]),
            device_kind=data["device_kind"],
            seq_len=data["seq_len"],
            dtype=data.get("dtype", "float32"),
            source=data.get("source", "analytic"),
            attention=data.get("attention", "fused"),
            method=dict(data.get("method", {})),
            layers=tuple(LayerProfile.from_json(layer) for layer in data["layers"]),
        )

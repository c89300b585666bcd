"""A training plan: pipelines on disjoint devices, their stages, and the split of the global batch.

Pipelines are data-parallel replicas that may differ in stage boundaries, tensor-parallel degree per
stage and number of micro-batches. `Plan.validate(cluster)` checks every invariant of docs/DESIGN.md and
works on hand-written plans; the runtime trusts nothing else.

Rank order (how torchrun's ranks map to devices): nodes in natural name order (n2 before n10), and
on a node the plan's devices by ascending GPU id, so local rank i is the i-th device of that node.
"""

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from costmodel.cluster import ClusterSpec, parse_device
from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.jsonio import SCHEMA_VERSION, check_schema, is_integer, is_number, require, shown
from costmodel.profile import ATTENTION_KERNELS
from costmodel.table import format_table


class PlanInvalid(ElastorError):
    """A plan that breaks invariants; the message has one sentence per problem, one per line."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


DTYPES = ("float32", "bfloat16")  # the plan's parameter and activation dtype; masters stay fp32
RECOMPUTE = ("none", "selective", "full")  # activation recomputation of a stage's blocks
SHARDING = ("none", "zero1")  # optimizer state: on every holder, or sliced over each bucket's holders
# Gradient buckets hold at most this many bytes of fp32 main gradient (DDP's default bucket cap,
# 25 MiB): small enough that reductions start early in backward, large enough to fill the links.
BUCKET_BYTES = 25 << 20
# The most samples a step may have: 256 times the 4,096 of the largest study here; the planner and the
# cost model build tables that grow with the batch, so 10^9 is refused here rather than after
# gigabytes of them.
MAX_GLOBAL_BATCH_SIZE = 1 << 20


@dataclass(frozen=True)
class OptimizerLayout:
    """How the optimizer's state and the gradient reduction are laid out (costmodel/sharding.py).

    `sharding` "zero1": each gradient bucket is reduce-scattered over its holders, each holder keeps
    fp32 masters and AdamW moments of its own slice only, and the updated slices are all-gathered
    back in the plan's dtype (Rajbhandari et al. 2020, ZeRO stage 1). "none": the bucket is
    all-reduced and every holder updates all of it. `bucket_bytes` caps a bucket's fp32 gradient.
    """

    sharding: str = "none"
    bucket_bytes: int = BUCKET_BYTES

    def problems(self) -> list[str]:
        found = []
        if self.sharding not in SHARDING:
            found.append(f"optimizer.sharding {self.sharding!r} is not one of {', '.join(SHARDING)}.")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 4:
            found.append(
                f"optimizer.bucket_bytes must be an integer of at least 4, not {self.bucket_bytes!r}."
            )
        return found

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"sharding": self.sharding}
        if self.bucket_bytes != BUCKET_BYTES:
            data["bucket_bytes"] = self.bucket_bytes
        return data

    @classmethod
    def from_json(cls, data: Any) -> "OptimizerLayout":
        if not isinstance(data, dict):
            raise ElastorError(
                f'The plan\'s optimizer must be an object such as {{"sharding": "zero1"}}, not {data!r}.'
            )
        return cls(sharding=data.get("sharding", "none"), bucket_bytes=data.get("bucket_bytes", BUCKET_BYTES))


@dataclass(frozen=True, kw_only=True)
class Stage:
    """A group of devices that runs some layers of a pipeline as one tensor-parallel group.

    `chunks` are the stage's layer ranges: one for today's 1F1B, several for the interleaved schedule
    (Narayanan et al. 2021, section 2.2.2), where chunk k of every stage of a pipeline, in stage
    order, forms virtual pipeline k, and the virtual pipelines follow each other through the layers.
    `recompute` is one setting for all chunks, or one per chunk."""

    chunks: tuple[tuple[int, int], ...]  # half-open ranges [start, end) of the layer list
    devices: tuple[str, ...]  # its tensor-parallel group, in TP-rank order
    # Norms, residual stream and boundary activations split along the sequence across the TP group
    # (Korthikanti et al. 2022, section 4.2.2); only meaningful at TP degree > 1.
    sequence_parallel: bool = False
    recompute: str | tuple[str, ...] = "none"  # none | selective (the attention core) | full (each block)

    def __post_init__(self):
        # one spelling per meaning, so equal stages compare equal
        if isinstance(self.recompute, tuple) and len(set(self.recompute)) == 1:
            object.__setattr__(self, "recompute", self.recompute[0])

    @property
    def tp_degree(self) -> int:
        return len(self.devices)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def layers(self) -> tuple[int, int]:
        """The layer range of a stage of one chunk (an interleaved stage has several: use `chunks`)."""
        if len(self.chunks) != 1:
            raise ValueError(f"an interleaved stage has {len(self.chunks)} layer ranges; use .chunks")
        return self.chunks[0]

    @property
    def num_layers(self) -> int:
        return sum(end - start for start, end in self.chunks)

    def chunk_recompute(self, chunk: int) -> str:
        return self.recompute if isinstance(self.recompute, str) else self.recompute[chunk]

    def to_json(self) -> dict[str, Any]:
        """The stage's JSON; the optional fields only where they differ from their defaults, so a
        plan written before them reads back as it was."""
        layers = list(self.chunks[0]) if len(self.chunks) == 1 else [list(c) for c in self.chunks]
        data: dict[str, Any] = {"layers": layers, "devices": list(self.devices)}
        if self.sequence_parallel:
            data["sequence_parallel"] = True
        if self.recompute != "none":
            data["recompute"] = self.recompute if isinstance(self.recompute, str) else list(self.recompute)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Stage":
        require(data, "stage", "layers", "devices")
        layers, devices = data["layers"], data["devices"]

        def is_range(x) -> bool:
            return isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)

        if is_range(layers):
            chunks = ((layers[0], layers[1]),)
        elif isinstance(layers, list) and layers and all(is_range(c) for c in layers):
            chunks = tuple((c[0], c[1]) for c in layers)
        else:
            raise ElastorError(
                f"A stage's layers must be [start, end) integers or a list of such chunks, not {layers!r}."
            )
        if not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
            raise ElastorError(f'A stage\'s devices must be a list of names like "n0:1", not {devices!r}.')
        sp, recompute = data.get("sequence_parallel", False), data.get("recompute", "none")
        if not isinstance(sp, bool):
            raise ElastorError(f"A stage's sequence_parallel must be true or false, not {sp!r}.")
        settings = recompute if isinstance(recompute, list) else [recompute]
        if any(r not in RECOMPUTE for r in settings) or (
            isinstance(recompute, list) and len(recompute) != len(chunks)
        ):
            raise ElastorError(
                f"A stage's recompute must be one of {', '.join(RECOMPUTE)}, or a list of them with one "
                f"per layer chunk ({len(chunks)}), not {recompute!r}."
            )
        return cls(
            chunks=chunks,
            devices=tuple(devices),
            sequence_parallel=sp,
            recompute=tuple(recompute) if isinstance(recompute, list) else recompute,
        )


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    num_microbatches: int
    stages: tuple[Stage, ...]
    # Each backward split into its input gradient and its weight gradient, the latter deferred as
    # ZB-H1 does (`costmodel.schedule.split_backward`); absent from older plans: false.
    split_backward: bool = False

    @property
    def devices(self) -> list[str]:
        return [d for s in self.stages for d in s.devices]

    @property
    def num_chunks(self) -> int:
        """Layer chunks per stage: 1 for 1F1B, v > 1 for the interleaved schedule."""
        return self.stages[0].num_chunks

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_microbatches": self.num_microbatches}
        if self.split_backward:
            out["split_backward"] = True
        return out | {"stages": [s.to_json() for s in self.stages]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Pipeline":
        require(data, "pipeline", "num_microbatches", "stages")
        if not is_integer(data["num_microbatches"], high=MAX_GLOBAL_BATCH_SIZE) or not isinstance(
            data["stages"], list
        ):
            raise ElastorError(
                f"A pipeline needs an integer num_microbatches of at most {MAX_GLOBAL_BATCH_SIZE:,} and a "
                "list of stages."
            )
        split = data.get("split_backward", False)
        if not isinstance(split, bool):
            raise ElastorError(f"A pipeline's split_backward is true or false, not {split!r}.")
        return cls(
            num_microbatches=data["num_microbatches"],
            stages=tuple(Stage.from_json(s) for s in data["stages"]),
            split_backward=split,
        )


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelConfig
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    pipelines: tuple[Pipeline, ...]
    dtype: str = "float32"  # parameters and activations; master weights, main grads, moments are fp32
    attention: str = "fused"  # the attention kernel every block runs (costmodel.profile.ATTENTION_KERNELS)
    optimizer: OptimizerLayout = OptimizerLayout()
    predicted: dict[str, Any] | None = None  # the cost model's estimate, if a solver made the plan
    solver: dict[str, Any] | None = None  # method, status, wall_s

    # ---- derived --------------------------------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        """The plan's devices in rank order (see the module docstring)."""
        return sorted(
            (d for p in self.pipelines for d in p.devices),
            key=lambda d: (_natural_key(parse_device(d)[0]), parse_device(d)[1]),
        )

    @property
    def world_size(self) -> int:
        return sum(len(p.devices) for p in self.pipelines)

    def nodes(self) -> list[str]:
        """Node names in rank order."""
        return list(dict.fromkeys(parse_device(d)[0] for d in self.devices))

    def placement(self, device: str) -> tuple[int, int]:
        """(pipeline index, stage index) of `device`."""
        return self._placements[device]

    @cached_property
    def _placements(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for pi, pipe in enumerate(self.pipelines):
            for si, stage in enumerate(pipe.stages):
                for device in stage.devices:
                    found.setdefault(device, (pi, si))
        return found

    # ---- validation -----------------------------------------------------------------------------
    def violations(self, cluster: ClusterSpec | None = None) -> list[str]:
        """Every broken invariant, one sentence each; the cluster checks need `cluster`."""
        problems: list[str] = []
        model, L = self.model, self.model.num_layers
        if self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be at least 1, not {self.micro_batch_size}.")
        if not 1 <= self.seq_len <= model.max_seq_len:
            problems.append(f"seq_len {self.seq_len} is outside 1..{model.max_seq_len}, the model's maximum.")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}.")
        if self.attention not in ATTENTION_KERNELS:
            problems.append(
                f"attention {shown(self.attention)} is not one of {', '.join(ATTENTION_KERNELS)}."
            )
        problems.extend(self.optimizer.problems())
        if not self.pipelines:
            problems.append("The plan has no pipeline.")
        total_mb = sum(p.num_microbatches for p in self.pipelines)
        if total_mb * self.micro_batch_size != self.global_batch_size:
            problems.append(
                f"The pipelines' micro-batches ({total_mb}) times micro_batch_size "
                f"({self.micro_batch_size}) make {total_mb * self.micro_batch_size} samples, "
                f"not global_batch_size {self.global_batch_size}."
            )
        healthy = set(cluster.devices) if cluster else None
        owner: dict[str, str] = {}
        for pi, pipe in enumerate(self.pipelines):
            where = f"Pipeline {pi}"
            if pipe.num_microbatches < 1:
                problems.append(f"{where} has {pipe.num_microbatches} micro-batches; it needs at least 1.")
            if not pipe.stages:
                problems.append(f"{where} has no stage.")
                continue
            chunks = {stage.num_chunks for stage in pipe.stages}
            if len(chunks) > 1:
                problems.append(
                    f"{where}'s stages hold different numbers of layer chunks ({sorted(chunks)}); chunk k "
                    "of every stage forms virtual pipeline k, so all need the same number."
                )
            if max(chunks) > 1 and len(pipe.stages) == 1:
                problems.append(f"{where} has one stage; interleaving its layer chunks would change nothing.")
            if pipe.split_backward and len(pipe.stages) == 1:
                problems.append(f"{where} has one stage; splitting its backward would change nothing.")
            expected_start = 0
            for k in range(max(chunks)):
                for si, stage in enumerate(pipe.stages):
                    if k >= stage.num_chunks:
                        continue
                    where = f"Pipeline {pi} stage {si}" + (f" chunk {k}" if max(chunks) > 1 else "")
                    start, end = stage.chunks[k]
                    if start != expected_start:
                        gap = "overlaps the previous stage" if start < expected_start else "leaves a gap"
                        problems.append(
                            f"{where} starts at layer {start} but the previous stage ends at "
                            f"{expected_start}, so it {gap}."
                        )
                    if end <= start:
                        problems.append(f"{where} has the empty or reversed layer range [{start}, {end}).")
                    expected_start = max(end, expected_start)
            for si, stage in enumerate(pipe.stages):
                problems += self._stage_device_problems(f"Pipeline {pi} stage {si}", stage, healthy, owner)
            if expected_start != L:
                problems.append(
                    f"Pipeline {pi} ends at layer {expected_start} but model {model.name!r} has {L} layers."
                )
        return problems

    def _stage_device_problems(
        self, where: str, stage: Stage, healthy: set[str] | None, owner: dict[str, str]
    ) -> list[str]:
        problems: list[str] = []
        tp, model = stage.tp_degree, self.model
        if tp == 0:
            return [f"{where} has no device."]
        nodes = set()
        for device in stage.devices:
            try:
                nodes.add(parse_device(device)[0])
            except ElastorError as e:
                problems.append(f"{where}: {e}")
                continue
            if healthy is not None and device not in healthy:
                problems.append(f"{where} uses {device}, which is not a healthy device of the cluster.")
            if device in owner:
                problems.append(f"{where} uses {device}, which {owner[device]} already uses.")
            owner[device] = where.lower()
        if len(nodes) > 1:
            problems.append(
                f"{where} spans nodes {', '.join(sorted(nodes))}; "
                "a tensor-parallel group must sit on one node."
            )
        if stage.sequence_parallel and tp == 1:
            problems.append(f"{where} asks for sequence_parallel at TP degree 1, where it means nothing.")
        if stage.sequence_parallel and self.seq_len % tp:
            problems.append(
                f"{where} asks for sequence_parallel, but its TP degree {tp} does not divide seq_len "
                f"{self.seq_len}."
            )
        if model.num_heads % tp or model.num_kv_heads % tp:
            problems.append(
                f"{where} has TP degree {tp}, which does not divide the model's {model.num_heads} "
                f"attention heads and {model.num_kv_heads} key/value heads."
            )
        return problems

    def validate(self, cluster: ClusterSpec | None = None) -> "Plan":
        problems = self.violations(cluster)
        if problems:
            raise PlanInvalid(problems)
        return self

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_json(),
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "pipelines": [p.to_json() for p in self.pipelines],
        }
        if self.attention != "fused":  # absent: the fused kernel, as in every plan before the field
            data["attention"] = self.attention
        if self.optimizer != OptimizerLayout():
            data["optimizer"] = self.optimizer.to_json()
        if self.predicted is not None:
            data["predicted"] = self.predicted
        if self.solver is not None:
            data["solver"] = self.solver
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        check_schema(data, "plan")
        require(data, "plan", "model", "global_batch_size", "micro_batch_size", "seq_len", "pipelines")
        for key in ("global_batch_size", "micro_batch_size", "seq_len"):
            if not is_integer(data[key]):
                raise ElastorError(f"The plan's {key} must be an integer, not {shown(data[key])}.")
        for key in ("global_batch_size", "micro_batch_size"):
            if data[key] > MAX_GLOBAL_BATCH_SIZE:
                raise ElastorError(
                    f"The plan's {key} {shown(data[key])} is more than the {MAX_GLOBAL_BATCH_SIZE:,} "
                    "samples a step may have."
                )
        if not isinstance(data["pipelines"], list):
            raise ElastorError("The plan's pipelines must be a list.")
        for key in ("predicted", "solver"):
            if not isinstance(data.get(key, {}), dict | None):
                raise ElastorError(f"The plan's {key} must be an object, not {shown(data[key])}.")
        recorded = (data.get("predicted") or {}).get("step_time_s")
        if recorded is not None and not is_number(recorded, above=0):
            raise ElastorError(
                f"The plan's predicted step_time_s must be a positive finite number, not {shown(recorded)}."
            )
        return cls(
            model=ModelConfig.from_json(data["model"]),
            global_batch_size=data["global_batch_size"],
            micro_batch_size=data["micro_batch_size"],
            seq_len=data["seq_len"],
            dtype=data.get("dtype", "float32"),
            attention=data.get("attention", "fused"),
            optimizer=OptimizerLayout.from_json(data.get("optimizer", {})),
            pipelines=tuple(Pipeline.from_json(p) for p in data["pipelines"]),
            predicted=data.get("predicted"),
            solver=data.get("solver"),
        )

    # ---- display --------------------------------------------------------------------------------
    def summary(self) -> str:
        """A per-stage table: pipeline, stage, layer range and names, TP degree, devices."""
        names = self.model.layer_names()
        rows = [
            ("pipe", "stage", "layers", "first..last", "tp", "sp", "recompute", "micro-batches", "devices")
        ]
        for pi, pipe in enumerate(self.pipelines):
            for si, st in enumerate(pipe.stages):
                ranges = ",".join(f"[{a},{b})" for a, b in st.chunks)
                span = " ".join(
                    f"{names[a]}..{names[b - 1]}" if 0 <= a < b <= len(names) else "?" for a, b in st.chunks
                )
                recompute = st.recompute if isinstance(st.recompute, str) else ",".join(st.recompute)
                rows.append(
                    (
                        str(pi),
                        str(si),
                        ranges,
                        span,
                        str(st.tp_degree),
                        "yes" if st.sequence_parallel else "",
                        recompute if recompute != "none" else "",
                        str(pipe.num_microbatches) if si == 0 else "",
                        ",".join(st.devices),
                    )
                )
        head = (
            f"{self.model.name}: {len(self.pipelines)} pipeline(s) on {self.world_size} device(s), "
            f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size} x "
            f"{self.global_batch_size // max(self.micro_batch_size, 1)}, seq_len {self.seq_len}, {self.dtype}"
            + (f", {self.attention} attention" if self.attention != "fused" else "")
            + (f", optimizer {self.optimizer.sharding}" if self.optimizer.sharding != "none" else "")
        )
        return f"{head}\n{format_table(rows)}"

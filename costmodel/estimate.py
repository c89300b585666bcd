"""Predicted step time and per-device peak memory of a plan: the cost model the solver optimises.

Pure functions of a profile, a cluster and a plan's structure. Every term is named, and
`Estimate.explain()` prints them per stage.

Step time (the runtime does not overlap these three phases):
    step = max over pipelines of pipeline_time + gradient sync + optimizer step

Pipeline time under 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 2.2). With F_s, B_s the forward and
backward time of stage s per micro-batch (compute + tensor-parallel collectives), c_s the
point-to-point time between stages s and s+1 (c_-1 = c_p-1 = 0), p stages and m micro-batches:
    warm-up + cool-down:  sum_s (F_s + B_s) + 2 sum_s c_s     (one micro-batch through and back)
    steady state:         (m - 1) * max_s (F_s + B_s + c_s-1 + c_s)
The runtime waits for every exchange with a neighbour (runtime/pipeline.py: a send and the paired
receive go out together and both are waited for), so in the steady state each micro-batch costs a
stage its compute plus one exchange with each neighbour, and the slowest stage paces the rest.
Against a step-by-step simulation of the runtime's schedule (tests/reference_1f1b.py) it is exact
for two stages when the back one is the slower, at most one transfer above for equal stages, and
within 10% above for balanced ones (tests state the bounds); with c = 0 it is the textbook
(m + p - 1)(F + B).

Gradient sync: every segment of every parameter has one holder per pipeline (costmodel.layout), and
each holder reduces its segments with the other pipelines' holders by ring all-reduce. A device
holding B bytes of gradients therefore moves 2(P-1)/P * B over its link (P pipelines); stages
work in parallel, the slowest device sets the time. Links cross nodes whenever the plan does.

Optimizer step: what the runtime does to a stage's gradients besides the sync (zero them, sum their
squares for the global norm, clip, AdamW). Measured profiles carry its time per layer shard
(`LayerCost.optimizer_s`) and a stage's is the sum over its layers: on a CPU it is several times the
bandwidth bound below, as torch's AdamW runs a handful of kernels per tensor, each with a fixed cost
(gpt-tiny on one core: 2.3 ms measured against 1.0 ms from bandwidth). Without a measurement, AdamW
is taken as memory-bound: per parameter it reads the parameter, gradient and two moments and writes
three of them (7 fp32 words), plus one read of the gradient for clipping.

Peak memory per device: fp32 parameters, gradients and AdamW moments of the shard it holds;
activations of the micro-batches in flight under 1F1B (stage s of p holds min(p - s, m));
the flattened gradient-sync buffer; the send/receive buffers of the stage boundary; the largest
transient working memory of one of its layers (measured by the profiler on CUDA). A plan fits when
this peak is at most the device memory less MEMORY_HEADROOM.
"""

from dataclasses import dataclass

from costmodel.cluster import ClusterSpec, parse_device
from costmodel.comm import Link, all_reduce_s, link, p2p_s
from costmodel.hardware import DEVICE_KINDS
from costmodel.layout import shard_box, stage_params
from costmodel.plan import Pipeline, Plan
from costmodel.profile import ModelProfile
from costmodel.table import format_table

FP32_BYTES = 4
# fp32 master parameters, gradients, AdamW exp_avg and exp_avg_sq (Loshchilov & Hutter 2019).
STATE_WORDS_PER_PARAM = 4
# AdamW step traffic per parameter in fp32 words: read p, g, m, v; write p, m, v; read g to clip.
OPTIMIZER_WORDS_PER_PARAM = 8
# Fraction of device memory kept free for the allocator's fragmentation, the CUDA context and
# library workspaces (cuBLAS, NCCL): measured peaks on GPUs run 3-7% above the tensors' bytes.
MEMORY_HEADROOM = 0.08
# Memory bandwidth for the optimizer step when the device kind is not in the hardware table.
DEFAULT_MEMORY_BANDWIDTH_GBPS = 20.0
# Tensor-parallel all-reduces of a [micro-batch, seq, hidden] activation per layer kind
# (Megatron-LM's f/g operators): a block reduces after attention and after the MLP in the forward
# pass and the two inputs' gradients in the backward pass; the vocabulary-parallel embedding
# reduces its output; the vocabulary-parallel head reduces its input's gradient.
TP_ALL_REDUCES = {"embed": (1, 0), "block": (2, 2), "head": (0, 1)}
# The vocabulary-parallel cross-entropy (runtime.tensor_parallel) also all-reduces, in the forward
# pass, each token's largest logit, then its sum of exponentials with its target's logit: fp32, 4 and
# 8 bytes per token. Small, but on a CPU each collective costs milliseconds whatever its size.
CROSS_ENTROPY_ALL_REDUCE_BYTES_PER_TOKEN = (4, 8)


@dataclass(frozen=True)
class StageCost:
    """Per-device cost of one stage: layers [start, end) at TP degree tp and one micro-batch size."""

    start: int
    end: int
    tp: int
    compute_fwd_s: float
    compute_bwd_s: float
    tp_comm_fwd_s: float
    tp_comm_bwd_s: float
    param_count: int  # parameters this device holds (TP rank 0: the largest shard)
    activation_bytes: int  # kept for backward per micro-batch
    transient_bytes: int  # the largest layer's working memory above what it keeps (layers run one by one)
    boundary_bytes: int  # sent to the next stage per micro-batch
    optimizer_s: float

    @property
    def fwd_s(self) -> float:
        return self.compute_fwd_s + self.tp_comm_fwd_s

    @property
    def bwd_s(self) -> float:
        return self.compute_bwd_s + self.tp_comm_bwd_s

    @property
    def grad_bytes(self) -> int:
        return self.param_count * FP32_BYTES

    def memory_bytes(self, in_flight: int) -> dict[str, int]:
        """Peak memory by kind when `in_flight` micro-batches' activations are held."""
        return {
            "params": self.param_count * FP32_BYTES,
            "grads": self.param_count * FP32_BYTES,
            "optimizer": 2 * self.param_count * FP32_BYTES,
            "activations": self.activation_bytes * in_flight,
            "comm_buffers": self.grad_bytes + 2 * self.boundary_bytes,
            "transient": self.transient_bytes,
        }


def pipeline_time_s(fwd_s: list[float], bwd_s: list[float], p2p: list[float], m: int) -> float:
    """1F1B time of one pipeline (module docstring); p2p[s] is the stage s -> s+1 transfer time."""
    per_stage = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    return sum(per_stage) + 2 * sum(p2p) + (m - 1) * steady_period_s(per_stage, p2p)


def steady_period_s(per_stage: list[float], p2p: list[float]) -> float:
    """The steady state's time per micro-batch: the slowest stage's F + B and its two exchanges."""
    c = [0.0, *p2p, 0.0]
    return max(t + c[s] + c[s + 1] for s, t in enumerate(per_stage))


def in_flight(stage: int, num_stages: int, m: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B."""
    return min(num_stages - stage, m)


@dataclass(frozen=True)
class StagePrediction:
    pipeline: int
    stage: int
    devices: tuple[str, ...]
    cost: StageCost
    p2p_s: float  # to the next stage, per micro-batch
    bubble_s: float  # time this stage is idle within its pipeline's time
    sync_s: float
    memory: dict[str, int]

    @property
    def peak_memory_bytes(self) -> int:
        return sum(self.memory.values())


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    global_batch_size: int
    pipeline_times_s: tuple[float, ...]
    sync_s: float
    optimizer_s: float
    stages: tuple[StagePrediction, ...]
    memory_capacity_bytes: int
    usable_memory_bytes: int

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.step_time_s

    @property
    def peak_memory_bytes(self) -> dict[str, int]:
        return {d: s.peak_memory_bytes for s in self.stages for d in s.devices}

    @property
    def fits(self) -> bool:
        return all(s.peak_memory_bytes <= self.usable_memory_bytes for s in self.stages)

    def to_json(self) -> dict:
        """The plan file's `predicted` block."""
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "pipeline_times_s": list(self.pipeline_times_s),
            "sync_s": self.sync_s,
            "optimizer_s": self.optimizer_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "usable_memory_bytes": self.usable_memory_bytes,
        }

    def explain(self) -> str:
        """Per-stage breakdown of every term of the prediction."""
        rows = [
            (
                "pipe",
                "stage",
                "layers",
                "tp",
                "fwd ms",
                "bwd ms",
                "tp comm ms",
                "p2p ms",
                "bubble ms",
                "sync ms",
                "opt ms",
                "params MiB",
                "grad+opt MiB",
                "activ MiB",
                "buffers MiB",
                "peak / usable",
            )
        ]
        mib = 1 << 20
        for s in self.stages:
            c, mem = s.cost, s.memory
            rows.append(
                (
                    s.pipeline,
                    s.stage,
                    f"[{c.start},{c.end})",
                    c.tp,
                    f"{c.compute_fwd_s * 1e3:.2f}",
                    f"{c.compute_bwd_s * 1e3:.2f}",
                    f"{(c.tp_comm_fwd_s + c.tp_comm_bwd_s) * 1e3:.2f}",
                    f"{s.p2p_s * 1e3:.2f}",
                    f"{s.bubble_s * 1e3:.2f}",
                    f"{s.sync_s * 1e3:.2f}",
                    f"{c.optimizer_s * 1e3:.2f}",
                    f"{mem['params'] / mib:.1f}",
                    f"{(mem['grads'] + mem['optimizer']) / mib:.1f}",
                    f"{mem['activations'] / mib:.1f}",
                    f"{mem['comm_buffers'] / mib:.1f}",
                    f"{s.peak_memory_bytes / self.usable_memory_bytes:.0%}",
                )
            )
        pipes = ", ".join(f"{t * 1e3:.1f}" for t in self.pipeline_times_s)
        return "\n".join(
            [
                format_table(rows),
                f"pipeline times (ms): {pipes}",
                f"step {self.step_time_s * 1e3:.1f} ms = slowest pipeline "
                f"{max(self.pipeline_times_s) * 1e3:.1f} + gradient sync {self.sync_s * 1e3:.1f} "
                f"+ optimizer {self.optimizer_s * 1e3:.1f}; {self.samples_per_s:.2f} samples/s",
            ]
        )


class CostModel:
    """Predictions for one profile on one cluster; stage costs are cached by (range, tp, mbs)."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec):
        self.profile = profile
        self.cluster = cluster
        self.model = profile.model
        self.usable_memory_bytes = int(cluster.device.memory_bytes * (1 - MEMORY_HEADROOM))
        kind = DEVICE_KINDS.get(cluster.device.kind)
        self.memory_bandwidth_gbps = kind.memory_bandwidth_gbps if kind else DEFAULT_MEMORY_BANDWIDTH_GBPS
        self._stage_cache: dict[tuple[int, int, int, int], StageCost] = {}

    # ---- links ----------------------------------------------------------------------------------
    def link(self, collective: str, inter_node: bool) -> Link:
        return link(self.cluster.links, collective, inter_node)

    # ---- one stage ------------------------------------------------------------------------------
    def stage(self, start: int, end: int, tp: int, micro_batch_size: int) -> StageCost:
        key = (start, end, tp, micro_batch_size)
        if key not in self._stage_cache:
            self._stage_cache[key] = self._stage(start, end, tp, micro_batch_size)
        return self._stage_cache[key]

    def _stage(self, start: int, end: int, tp: int, mbs: int) -> StageCost:
        prof, model = self.profile, self.model
        costs = [prof.cost(i, mbs, tp) for i in range(start, end)]
        activation_bytes = mbs * prof.seq_len * model.hidden_size * prof.bytes_per_param
        tp_link = self.link("all_reduce", inter_node=False)
        tp_fwd = tp_bwd = 0.0
        if tp > 1:
            for i in range(start, end):
                n_fwd, n_bwd = TP_ALL_REDUCES[model.layer_kind(i)]
                one = all_reduce_s(activation_bytes, tp, tp_link)
                tp_fwd += n_fwd * one
                tp_bwd += n_bwd * one
                if model.layer_kind(i) == "head":
                    tokens = mbs * prof.seq_len
                    tp_fwd += sum(
                        all_reduce_s(tokens * b, tp, tp_link)
                        for b in CROSS_ENTROPY_ALL_REDUCE_BYTES_PER_TOKEN
                    )
        params = sum(
            shard_box(spec, tp, 0).numel for spec in stage_params(model, start, end)
        )  # TP rank 0 holds the largest shard of every uneven split
        measured = [c.optimizer_s for c in costs]
        if all(t is not None for t in measured):
            optimizer_s = sum(measured)
        else:
            optimizer_s = params * OPTIMIZER_WORDS_PER_PARAM * FP32_BYTES / (self.memory_bandwidth_gbps * 1e9)
        return StageCost(
            start=start,
            end=end,
            tp=tp,
            compute_fwd_s=sum(c.fwd_s for c in costs),
            compute_bwd_s=sum(c.bwd_s for c in costs),
            tp_comm_fwd_s=tp_fwd,
            tp_comm_bwd_s=tp_bwd,
            param_count=params,
            activation_bytes=sum(c.activation_bytes for c in costs),
            transient_bytes=max(c.transient_bytes for c in costs),
            boundary_bytes=prof.layers[end - 1].output_bytes_per_sample * mbs,
            optimizer_s=optimizer_s,
        )

    def p2p_s(self, stage: StageCost, inter_node: bool) -> float:
        """Sending one micro-batch's boundary activation (or its gradient) to the next stage."""
        return p2p_s(stage.boundary_bytes, self.link("p2p", inter_node))

    def sync_s(self, stage: StageCost, num_pipelines: int, inter_node: bool) -> float:
        """Ring all-reduce of this device's gradients with the other pipelines' holders."""
        return all_reduce_s(stage.grad_bytes, num_pipelines, self.link("all_reduce", inter_node))

    # ---- a whole plan ---------------------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        mbs = plan.micro_batch_size
        multi_node = len(plan.nodes()) > 1
        P = len(plan.pipelines)
        stages: list[StagePrediction] = []
        pipeline_times = []
        for pi, pipe in enumerate(plan.pipelines):
            costs = [self.stage(*st.layers, st.tp_degree, mbs) for st in pipe.stages]
            p2p = [self.p2p_s(costs[si], _crosses_nodes(pipe, si)) for si in range(len(pipe.stages) - 1)]
            m = pipe.num_microbatches
            pipeline_times.append(pipeline_time_s([c.fwd_s for c in costs], [c.bwd_s for c in costs], p2p, m))
            for si, (st, cost) in enumerate(zip(pipe.stages, costs, strict=True)):
                held = in_flight(si, len(pipe.stages), m)
                stages.append(
                    StagePrediction(
                        pipeline=pi,
                        stage=si,
                        devices=st.devices,
                        cost=cost,
                        p2p_s=p2p[si] if si < len(p2p) else 0.0,
                        bubble_s=pipeline_times[-1] - m * (cost.fwd_s + cost.bwd_s),
                        sync_s=self.sync_s(cost, P, multi_node),
                        memory=cost.memory_bytes(held),
                    )
                )
        sync = max(s.sync_s for s in stages)
        optimizer = max(s.cost.optimizer_s for s in stages)
        return Estimate(
            step_time_s=max(pipeline_times) + sync + optimizer,
            global_batch_size=plan.global_batch_size,
            pipeline_times_s=tuple(pipeline_times),
            sync_s=sync,
            optimizer_s=optimizer,
            stages=tuple(stages),
            memory_capacity_bytes=self.cluster.device.memory_bytes,
            usable_memory_bytes=self.usable_memory_bytes,
        )


def _crosses_nodes(pipe: Pipeline, si: int) -> bool:
    here = parse_device(pipe.stages[si].devices[0])[0]
    there = parse_device(pipe.stages[si + 1].devices[0])[0]
    return here != there

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

Peak memory per device, as the runtime allocates it (runtime/precision.py, runtime/pipeline.py):
parameters in the plan's dtype and, for a 16-bit plan, their fp32 masters; fp32 main gradients and
AdamW moments of the shard it holds; per micro-batch in flight under 1F1B (stage s of p holds
min(p - s, m)) the activations its layers keep (in the stage's recompute mode and sequence split)
plus the boundary tensors the schedule holds for backward (the output it sent, the input it received
where no layer keeps it already); the gradient-sync buffers of segments that are not a whole local
gradient; the pieces of one exchange in flight; and the largest transient working memory of one of
its layers (the profiler measures it; a recomputed block's rerun forward adds its activations). A
plan fits when this peak is at most the device memory less MEMORY_HEADROOM.

Sequence parallelism and recomputation change a stage's cost from what the profile measured (TP
shards without either): activations follow `costmodel.analytic`'s formulas for the mode (the
profile's bytes times the formula's ratio of the mode to the plain shard, rounded up); a full
recomputation adds each block's forward (compute and its TP collectives) to the backward, a selective
one the attention core's share of the forward FLOPs (`analytic.attention_core_fraction`); sequence
parallelism replaces each all-reduce by an all-gather and a reduce-scatter of the same total volume.
Point-to-point is priced by the bytes one rank of the sender holds of the boundary activation.
"""

from dataclasses import dataclass

from costmodel import analytic
from costmodel.cluster import ClusterSpec, parse_device
from costmodel.comm import Link, all_gather_s, all_reduce_s, link, p2p_s
from costmodel.errors import ElastorError
from costmodel.hardware import DEVICE_KINDS
from costmodel.layout import device_pieces, shard_box, stage_params, sync_buckets
from costmodel.plan import Pipeline, Plan, Stage
from costmodel.profile import ModelProfile
from costmodel.table import format_table

FP32_BYTES = 4
# fp32 master parameters, gradients, AdamW exp_avg and exp_avg_sq (Loshchilov & Hutter 2019); a
# 16-bit plan adds its 16-bit copy of the parameters.
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
# Under sequence parallelism each of those becomes an all-gather and a reduce-scatter (a block's two
# regions: all-gather in, reduce-scatter out, and the reverse in backward); the embedding
# reduce-scatters forward and all-gathers backward, the head the other way round. Counted in
# halves: one all-gather or reduce-scatter of a whole activation.
SP_HALF_COLLECTIVES = {"embed": (1, 1), "block": (4, 4), "head": (1, 1)}
# The vocabulary-parallel cross-entropy (runtime.tensor_parallel) also all-reduces, in the forward
# pass, each token's largest logit, then its sum of exponentials with its target's logit: fp32, 4 and
# 8 bytes per token. Small, but on a CPU each collective costs milliseconds whatever its size.
CROSS_ENTROPY_ALL_REDUCE_BYTES_PER_TOKEN = (4, 8)


@dataclass(frozen=True)
class StageCost:
    """Per-device cost of one stage: layers [start, end) at TP degree tp and one micro-batch size,
    in one sequence split and recompute mode."""

    start: int
    end: int
    tp: int
    compute_fwd_s: float
    compute_bwd_s: float  # recomputed forwards included
    tp_comm_fwd_s: float
    tp_comm_bwd_s: float
    param_count: int  # parameters this device holds (TP rank 0: the largest shard)
    activation_bytes: int  # kept for backward per micro-batch by the stage's layers
    transient_bytes: int  # the largest layer's working memory above what it keeps (layers run one by one)
    boundary_bytes: int  # the output this rank holds per micro-batch (its slice under SP)
    optimizer_s: float
    input_bytes: int = 0  # the input this rank receives per micro-batch
    param_tensors: int = 0  # parameter tensors this device holds (each has an AdamW step count)
    # Per micro-batch in flight, what the schedule holds besides the layers' activations: the output
    # it sent (kept for its backward) and the received input where no layer keeps it already.
    input_kept_bytes: int = 0
    output_kept_bytes: int = 0
    dtype_bytes: int = FP32_BYTES
    sequence_parallel: bool = False
    recompute: str = "none"

    @property
    def fwd_s(self) -> float:
        return self.compute_fwd_s + self.tp_comm_fwd_s

    @property
    def bwd_s(self) -> float:
        return self.compute_bwd_s + self.tp_comm_bwd_s

    @property
    def grad_bytes(self) -> int:
        return self.param_count * FP32_BYTES

    def memory_bytes(self, in_flight: int, sync_buffer_bytes: int | None = None) -> dict[str, int]:
        """Peak memory by kind when `in_flight` micro-batches' activations are held. The gradient
        sync's extra buffers are `sync_buffer_bytes` where the plan is known, else at most a second
        copy of the gradients."""
        masters = 0 if self.dtype_bytes == FP32_BYTES else FP32_BYTES
        sync = self.grad_bytes if sync_buffer_bytes is None else sync_buffer_bytes
        return {
            "params": self.param_count * (self.dtype_bytes + masters),
            "grads": self.param_count * FP32_BYTES,
            "optimizer": 2 * self.param_count * FP32_BYTES + self.param_tensors * FP32_BYTES,
            "activations": (self.activation_bytes + self.input_kept_bytes + self.output_kept_bytes)
            * in_flight,
            "sync_buffers": sync,
            "exchange_buffers": 2 * (self.boundary_bytes + self.input_bytes),  # one exchange's pieces
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
                "sp",
                "recompute",
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
                    "yes" if c.sequence_parallel else "",
                    c.recompute if c.recompute != "none" else "",
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
                    f"{(mem['sync_buffers'] + mem['exchange_buffers']) / mib:.1f}",
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

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, *, recompute: str = "none"):
        """`recompute` is the mode of the stages a planner builds from this model (`planned_stage`);
        a plan's own stages are priced in their own modes."""
        self.profile = profile
        self.cluster = cluster
        self.model = profile.model
        self.recompute = recompute
        self.usable_memory_bytes = int(cluster.device.memory_bytes * (1 - MEMORY_HEADROOM))
        kind = DEVICE_KINDS.get(cluster.device.kind)
        self.memory_bandwidth_gbps = kind.memory_bandwidth_gbps if kind else DEFAULT_MEMORY_BANDWIDTH_GBPS
        self._stage_cache: dict[tuple[int, int, int, int], StageCost] = {}

    # ---- links ----------------------------------------------------------------------------------
    def link(self, collective: str, inter_node: bool) -> Link:
        return link(self.cluster.links, collective, inter_node)

    # ---- one stage ------------------------------------------------------------------------------
    def stage(
        self,
        start: int,
        end: int,
        tp: int,
        micro_batch_size: int,
        sequence_parallel: bool = False,
        recompute: str = "none",
    ) -> StageCost:
        key = (start, end, tp, micro_batch_size, sequence_parallel and tp > 1, recompute)
        if key not in self._stage_cache:
            self._stage_cache[key] = self._stage(*key)
        return self._stage_cache[key]

    def _stage(self, start: int, end: int, tp: int, mbs: int, sp: bool, recompute: str) -> StageCost:
        prof, model = self.profile, self.model
        seq, dtype, dt = prof.seq_len, prof.dtype, prof.bytes_per_param
        shards = tp if sp else 1
        costs = [prof.cost(i, mbs, tp) for i in range(start, end)]
        hidden = mbs * seq * model.hidden_size * dt  # one whole activation
        tp_fwd = tp_bwd = 0.0
        recompute_fwd_s = 0.0  # compute a recomputation reruns in backward
        activations = transient = 0
        for i, c in zip(range(start, end), costs, strict=True):
            kind = model.layer_kind(i)
            fwd_comm, bwd_comm = self._tp_comm_s(kind, tp, sp, hidden, mbs * seq)
            tp_fwd, tp_bwd = tp_fwd + fwd_comm, tp_bwd + bwd_comm
            mode = recompute if kind == "block" else "none"
            if mode == "full":
                recompute_fwd_s += c.fwd_s
                tp_bwd += fwd_comm
            elif mode == "selective":
                recompute_fwd_s += c.fwd_s * analytic.attention_core_fraction(model, mbs, seq, tp)
            args = (model, kind, mbs, seq, tp, dtype)
            # the profile measured the plain shard; the formula scales it to the mode
            plain = analytic.activation_bytes(*args)
            mine = analytic.activation_bytes(*args, sp, mode)
            activations += -(-c.activation_bytes * mine // plain) if plain else c.activation_bytes
            # autograd makes each parameter's gradient anew before adding it into the main gradient;
            # a measured or analytic transient has it already, a profile without one does not
            layer_grads = 0 if c.transient_bytes else analytic.shard_param_count(model, kind, tp) * dt
            transient = max(
                transient,
                c.transient_bytes + analytic.recompute_transient_bytes(*args, sp, mode) + layer_grads,
            )
        if any(model.layer_kind(i) == "block" for i in range(start, end)):
            transient += 2 * seq * model.head_dim * FP32_BYTES  # the stage's cached rotary tables
        params = sum(
            shard_box(spec, tp, 0).numel for spec in stage_params(model, start, end)
        )  # TP rank 0 holds the largest shard of every uneven split
        measured = [c.optimizer_s for c in costs]
        if all(t is not None for t in measured):
            optimizer_s = sum(measured)
        else:
            optimizer_s = params * OPTIMIZER_WORDS_PER_PARAM * FP32_BYTES / (self.memory_bandwidth_gbps * 1e9)
        local = hidden // shards  # what this rank holds of a boundary activation
        input_bytes = local if start > 0 else 0
        output_bytes = local if end < model.num_layers else 0
        # A received input is kept by the first layer already when it is fp32 (the norm keeps it as
        # its fp32 input) or when that layer is a fully recomputed block (its checkpointed input).
        first_keeps_input = dt == FP32_BYTES or (model.layer_kind(start) == "block" and recompute == "full")
        return StageCost(
            start=start,
            end=end,
            tp=tp,
            compute_fwd_s=sum(c.fwd_s for c in costs),
            compute_bwd_s=sum(c.bwd_s for c in costs) + recompute_fwd_s,
            tp_comm_fwd_s=tp_fwd,
            tp_comm_bwd_s=tp_bwd,
            param_count=params,
            activation_bytes=activations,
            transient_bytes=transient,
            boundary_bytes=output_bytes,
            optimizer_s=optimizer_s,
            input_bytes=input_bytes,
            param_tensors=len(stage_params(model, start, end)),
            input_kept_bytes=0 if first_keeps_input else input_bytes,
            output_kept_bytes=output_bytes,
            dtype_bytes=dt,
            sequence_parallel=sp,
            recompute=recompute,
        )

    def _tp_comm_s(self, kind: str, tp: int, sp: bool, hidden: float, tokens: int) -> tuple[float, float]:
        """Forward and backward TP collective seconds of one layer (module docstring)."""
        if tp == 1:
            return 0.0, 0.0
        if sp:
            halves = SP_HALF_COLLECTIVES[kind]
            one = all_gather_s(hidden, tp, self.link("all_gather", inter_node=False))
            fwd, bwd = halves[0] * one, halves[1] * one
        else:
            n_fwd, n_bwd = TP_ALL_REDUCES[kind]
            one = all_reduce_s(hidden, tp, self.link("all_reduce", inter_node=False))
            fwd, bwd = n_fwd * one, n_bwd * one
        if kind == "head":
            tp_link = self.link("all_reduce", inter_node=False)
            fwd += sum(
                all_reduce_s(tokens * b, tp, tp_link) for b in CROSS_ENTROPY_ALL_REDUCE_BYTES_PER_TOKEN
            )
        return fwd, bwd

    def sequence_parallel(self, tp: int) -> bool:
        """Whether a planned stage of TP degree `tp` splits the sequence: always where it can, since
        it moves the bytes of the all-reduces it replaces, keeps less and never computes more."""
        return tp > 1 and self.profile.seq_len % tp == 0

    def planned(self, start: int, end: int, tp: int, micro_batch_size: int) -> StageCost:
        """The cost of a stage a planner builds: sequence parallel where it can be, `recompute`."""
        return self.stage(start, end, tp, micro_batch_size, self.sequence_parallel(tp), self.recompute)

    def planned_stage(self, layers: tuple[int, int], devices: tuple[str, ...]) -> Stage:
        return Stage(
            layers=layers,
            devices=devices,
            sequence_parallel=self.sequence_parallel(len(devices)),
            recompute=self.recompute,
        )

    def stage_of(self, stage: Stage, micro_batch_size: int) -> StageCost:
        """The cost of a plan's stage, in its own sequence split and recompute mode."""
        return self.stage(
            *stage.layers, stage.tp_degree, micro_batch_size, stage.sequence_parallel, stage.recompute
        )

    def p2p_s(self, stage: StageCost, inter_node: bool) -> float:
        """Sending one micro-batch's boundary activation (or its gradient) to the next stage: the
        bytes one rank holds of it (its sequence slice under SP, in the plan's dtype). The planner's
        tables know the sender only; what the routes of `costmodel.boundary` add for fan-out to
        receivers of other TP degrees is not priced."""
        return p2p_s(stage.boundary_bytes, self.link("p2p", inter_node))

    def sync_s(self, stage: StageCost, num_pipelines: int, inter_node: bool) -> float:
        """Ring all-reduce of this device's gradients with the other pipelines' holders."""
        return all_reduce_s(stage.grad_bytes, num_pipelines, self.link("all_reduce", inter_node))

    # ---- a whole plan ---------------------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        if plan.dtype != self.profile.dtype:
            raise ElastorError(
                f"The plan trains in {plan.dtype} but the profile measured {self.profile.dtype}; use a "
                f"{plan.dtype} profile (elastor profile --dtype {plan.dtype}) or set the plan's dtype."
            )
        mbs = plan.micro_batch_size
        multi_node = len(plan.nodes()) > 1
        P = len(plan.pipelines)
        sync_buffers = sync_buffer_bytes(plan)
        stages: list[StagePrediction] = []
        pipeline_times = []
        for pi, pipe in enumerate(plan.pipelines):
            costs = [self.stage_of(st, mbs) for st in pipe.stages]
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
                        memory=cost.memory_bytes(held, max(sync_buffers[d] for d in st.devices)),
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


def sync_buffer_bytes(plan: Plan) -> dict[str, int]:
    """Per device, the gradient sync's buffer bytes beyond its gradients: segments that are part of a
    local gradient are packed into a bucket buffer; whole local gradients live in theirs
    (runtime/grad_sync.py)."""
    local = {d: {spec.name: box for spec, box in device_pieces(plan, d)} for d in plan.devices}
    extra = dict.fromkeys(plan.devices, 0)
    for holders, segments in sync_buckets(plan).items():
        for device in holders:
            extra[device] += sum(
                seg.numel * FP32_BYTES for name, seg in segments if seg != local[device][name]
            )
    return extra


def _crosses_nodes(pipe: Pipeline, si: int) -> bool:
    here = parse_device(pipe.stages[si].devices[0])[0]
    there = parse_device(pipe.stages[si + 1].devices[0])[0]
    return here != there

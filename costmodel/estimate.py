"""Predicted step time and per-device peak memory of a plan: the cost model the solver optimises.

Pure functions of a profile, a cluster and a plan's structure. Every term is named, and
`Estimate.explain()` prints them per stage.

Step time:
    step = max over pipelines of pipeline_time + exposed gradient sync + optimizer step

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

A pipeline whose stages hold v > 1 layer chunks runs interleaved 1F1B (costmodel/schedule.py):
its time is `schedule.interleaved_time_s` over the stage totals (the fill and drain at chunk
granularity, the inner links once each way and the wrap-around link from the last stage to the
first v - 1 times, the steady state at the slowest stage's F + B plus its share of link latency;
tested against the schedule's replay), and a stage's activations are the peak of its live chunks in
its own order (`schedule.peak_live`, exact for the plan's m), each chunk keeping its own input and
output.

A pipeline that splits its backwards (`Pipeline.split_backward`, ZB-H1: runtime/split_backward.py)
is priced by `schedule.interleaved_time_s` with each stage's weight-gradient time G_s
(`StageCost.wgrad_s`: the blocks' projection weight gradients and their main-gradient
accumulation, `analytic.weight_gradient_fraction` of the backward), at one chunk too: the fill and
drain cross each stage with W_s - 2 G_s. Its stages' memory walks the split program
(`schedule.peak_live` with `held`: B frees a chunk's activations and keeps what its W reads,
`StageCost.held_bytes`, until W), and its gradient buckets are ready when the last W ends, whose
deferral shrinks the sync windows (`hide_window_s`, `chunk_hide`).

Gradient sync: every segment of every parameter has one holder per pipeline (costmodel.layout), and
the holders reduce it together in gradient buckets (costmodel.sharding): ring all-reduce, or under
ZeRO-1 reduce-scatter and, after the step, all-gather of the updated parameters in the plan's dtype.
A device holding B bytes of gradients moves 2(P-1)/P * B (all-reduce) or (P-1)/P * B plus
(P-1)/P of its parameters (ZeRO-1) over its link (P pipelines); devices work in parallel and a
pipeline's device of most parameters sets its time. Links cross nodes whenever the plan does.
The runtime issues each bucket as soon as backward has produced it (runtime/dist_optim.py), so only
the remainder counts (`SyncCost.exposed_s`): the reduction less the window backward leaves it
(`hide_window_s`; the least over the plan's pipelines, since every bucket has a holder in each),
and never less than what backward produces last. Under interleaved 1F1B a stage's chunks finish
their backward one after another and no bucket spans two chunks (`costmodel.sharding`), so each
chunk's buckets reduce while the stage still runs the others' backwards (`chunk_hide`: a window per
chunk). tests/test_overlap_model.py holds this against a step-by-step simulation of the schedule
(the interleaved one replayed), the buckets and their holders sharing links. The ZeRO-1 gather
follows the step and is never hidden.

Optimizer step: what the runtime does to a stage's gradients besides the sync (zero them, sum their
squares for the global norm, clip, AdamW, publish the masters). Measured profiles carry its time per
layer shard (`LayerCost.optimizer_s`) and a stage's is the sum over its layers: on a CPU it is
several times the bandwidth bound below, as torch's AdamW runs a handful of kernels per tensor, each
with a fixed cost (gpt-tiny on one core: 2.3 ms measured against 1.0 ms from bandwidth). Without a
measurement, each of those passes is taken as memory-bound at the device kind's streaming-kernel
efficiency (`costmodel.analytic.KERNEL_EFFICIENCY`), with the traffic of `optimizer_bytes_per_param`.

Peak memory per device, as the runtime allocates it (runtime/dist_optim.py, runtime/pipeline.py):
parameters in the plan's dtype and the fp32 masters of the rows whose state it keeps (all it holds,
or under ZeRO-1 its slice of each bucket); fp32 main-gradient buckets of all it holds, and AdamW
moments of the rows it keeps (`costmodel.sharding.state_bytes`, exact for a plan; `state_bound`
for the planner's tables); under ZeRO-1 the all-gather buffers of two buckets; per micro-batch in
flight under 1F1B (stage s of p holds min(p - s, m)) the activations its layers keep (in the
stage's recompute mode and sequence split) plus the boundary tensors the schedule holds for backward
(the output it sent, the input it received where no layer keeps it already); the pieces of one
exchange in flight; the largest transient working memory of one of its layers (the profiler
measures it; a recomputed block's rerun forward adds its activations); and on GPUs the buffers of
the NCCL communicators it belongs to and of its point-to-point peers (`costmodel.communicators`:
exact for a plan, `planned_bytes` reserved in the planner's tables). A plan fits when this peak is
at most the device memory less MEMORY_HEADROOM.

Sequence parallelism and recomputation change a stage's cost from what the profile measured (TP
shards without either): activations follow `costmodel.analytic`'s formulas for the mode (the
profile's bytes times the formula's ratio of the mode to the plain shard, rounded up); a full
recomputation adds each block's forward (compute and its TP collectives) to the backward, a selective
one the attention core's share of the forward FLOPs (`analytic.attention_core_fraction`); sequence
parallelism replaces each all-reduce by an all-gather and a reduce-scatter of the same total volume.
Point-to-point is priced by the bytes of the boundary's busiest rank, the most any one rank sends or
receives under the routes the runtime posts (`costmodel.boundary`: sequence slices, fan-out to a
stage of another TP degree), forward and backward averaged (`CostModel.exchange_s`).
"""

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from costmodel import analytic, communicators, flops, schedule
from costmodel.boundary import busiest_shares
from costmodel.cluster import ClusterSpec, parse_device
from costmodel.comm import Link, all_gather_s, all_reduce_s, link, p2p_s, reduce_scatter_s
from costmodel.errors import ElastorError
from costmodel.hardware import DEVICE_KINDS
from costmodel.layout import shard_box, stage_params
from costmodel.plan import BUCKET_BYTES, OptimizerLayout, Pipeline, Plan, Stage
from costmodel.profile import ModelProfile
from costmodel.schedule import interleaved_time_s
from costmodel.sharding import StateBytes, state_bound, state_bytes
from costmodel.table import format_table

FP32_BYTES = 4
# fp32 master parameters, gradients, AdamW exp_avg and exp_avg_sq (Loshchilov & Hutter 2019); a
# 16-bit plan adds its 16-bit copy of the parameters.
STATE_WORDS_PER_PARAM = 4


def optimizer_bytes_per_param(dtype_bytes: int) -> int:
    """Memory traffic of one optimizer step per parameter, pass by pass as runtime/trainer.py and
    runtime/dist_optim.py run it (and profiler/measure.py times it): zero the fp32 main gradient
    (write 4), its squared norm (read 4), the clip's scaling (read 4, write 4), AdamW (read the
    master, gradient and two moments, write the master and moments: 28), and the publish (read the
    master, write the parameter in the plan's dtype)."""
    return 4 + 4 + 8 + 28 + 4 + dtype_bytes


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
    row_numel: int = 1  # the largest row a gradient bucket cuts this stage's tensors at (hidden size)
    # A planned stage's optimizer state is sharded over at least this many holders (1: unsharded;
    # ZeRO-1 plans with at least this many pipelines), in buckets of `bucket_bytes`.
    sharded_over: int = 1
    bucket_bytes: int = BUCKET_BYTES
    # NCCL buffers a planned stage reserves (`communicators.planned_bytes`); a plan's are exact.
    comm_bytes: int = 0
    # Split backward (ZB-H1): the part of compute_bwd_s its W runs (the blocks' weight gradients,
    # `analytic.weight_gradient_fraction`), and what a micro-batch holds from B to W in place of its
    # activations, which B frees (`analytic.deferred_gradient_bytes`).
    wgrad_s: float = 0.0
    held_bytes: int = 0

    @property
    def fwd_s(self) -> float:
        return self.compute_fwd_s + self.tp_comm_fwd_s

    @property
    def bwd_s(self) -> float:
        return self.compute_bwd_s + self.tp_comm_bwd_s

    @property
    def grad_bytes(self) -> int:
        return self.param_count * FP32_BYTES

    def state_bytes(self) -> StateBytes:
        """The optimizer side's bytes before the plan is known: `costmodel.sharding.state_bound`."""
        return state_bound(
            self.param_count,
            self.param_tensors,
            self.row_numel,
            self.sharded_over,
            self.dtype_bytes,
            self.bucket_bytes,
        )

    def memory_bytes(
        self, in_flight: float, state: StateBytes | None = None, comm: int | None = None
    ) -> dict[str, int]:
        """Peak memory by kind when `in_flight` micro-batches' activations are held (a fraction for
        an interleaved stage: its peak of live chunks over one micro-batch's). The optimizer
        side (masters, main gradients, moments, ZeRO-1 gather buffers) is `state` and the NCCL
        buffers `comm` where the plan is known (`costmodel.sharding.state_bytes`,
        `costmodel.communicators.device_bytes`), else this stage's bound and reserve."""
        state = self.state_bytes() if state is None else state
        return {
            "params": self.param_count * self.dtype_bytes + state.masters,
            "grads": state.grads,
            "optimizer": state.moments + state.steps,
            "activations": _whole(
                (self.activation_bytes + self.input_kept_bytes + self.output_kept_bytes) * in_flight
            ),
            "sync_buffers": state.gather,
            "exchange_buffers": 2 * (self.boundary_bytes + self.input_bytes),  # one exchange's pieces
            "transient": self.transient_bytes,
            "communicators": self.comm_bytes if comm is None else comm,
        }


@dataclass(frozen=True)
class SyncCost:
    """A pipeline's data-parallel gradient reduction and ZeRO-1 all-gather (`CostModel.sync`)."""

    reduce_s: float  # bucketed ring all-reduce of fp32 main gradients, or reduce-scatter under ZeRO-1
    floor_s: float  # never hidden: what backward produces last, or one bucket
    gather_s: float  # ZeRO-1: all-gather of the updated parameters after the step (else 0)

    def exposed_s(self, hide_s: float) -> float:
        """What the step waits for when backward can hide `hide_s` of the reduction."""
        return max(self.floor_s, self.reduce_s - hide_s) + self.gather_s

    def hidden_s(self, hide_s: float) -> float:
        return self.reduce_s + self.gather_s - self.exposed_s(hide_s)

    def with_partial(self, partial: "HideTerms") -> "SyncCost":
        """This sync with an interleaved pipeline's chunk terms (`chunk_hide`): each share of the
        reduction that must wait for its window raises the floor, never hidden."""
        if not partial:
            return self
        floor = max(self.floor_s, *(self.reduce_s * share - w for share, w in partial))
        return SyncCost(self.reduce_s, floor, self.gather_s)


def plan_sync_s(pipelines: Sequence[tuple[SyncCost, float]]) -> float:
    """The gradient sync a plan waits for, from each pipeline's (SyncCost, hide window): every
    bucket has a holder in every pipeline, so no reduction starts before the pipeline that hides
    least allows (the least window is everyone's), and the pipeline with the most to reduce sets it."""
    hide = min(h for _, h in pipelines)
    return max(sync.exposed_s(hide) for sync, _ in pipelines)


def buckets_of(params: int, bucket_bytes: int) -> int:
    """Gradient buckets of a device holding `params` parameters (fp32 main gradients)."""
    return max(1, -(-int(params) * FP32_BYTES // bucket_bytes))


def hide_window_s(
    bwd_s: Sequence[float],
    p2p_s: Sequence[float],
    buckets: Sequence[int],
    wgrad_s: Sequence[float] | None = None,
) -> float:
    """How long before a pipeline's backward ends its devices' gradient reductions can start, at the
    least over its stages: stage s's buckets become ready one by one over its last micro-batch's
    backward B_s (K_s buckets: the last one B_s / K_s before the backward ends), and after it the
    cool-down still runs on the stages in front of it for sum_{s' < s} (B_s' + c_s'). So
    min_s B_s (1 - 1/K_s) + sum_{s' < s} (B_s' + c_s'); the first stage (no cool-down in front)
    usually sets it.

    Split backward (`wgrad_s`, G_s of each B_s; `costmodel.schedule.split_backward`): the gradients
    come from the W ops, and stage s runs its last s of them after its last B, so its buckets are
    ready when its last W ends (runtime/split_backward.py accumulates a W's gradients after
    computing them all), s G_s after that B, while the cool-down in front runs the input gradients
    alone and then stage 0's last W: max(0, sum_{s' < s} (B_s' - G_s' + c_s') + G_0 [s > 0] - s G_s)."""
    if wgrad_s is None:  # the cool-down in front of each stage, summed front to back
        steps = map(operator.add, bwd_s, itertools.chain(p2p_s, itertools.repeat(0.0)))
        cooling = itertools.accumulate(steps, initial=0.0)
        return min(
            (b * (1 - 1 / max(1, k)) + c for b, k, c in zip(bwd_s, buckets, cooling, strict=False)),
            default=math.inf,
        )
    cooling, hide = 0.0, math.inf
    for s, (b, g) in enumerate(zip(bwd_s, wgrad_s, strict=True)):
        hide = min(hide, max(0.0, cooling + (wgrad_s[0] if s else 0.0) - s * g))
        cooling += b - g + (p2p_s[s] if s < len(p2p_s) else 0.0)
    return hide


HideTerms = tuple[tuple[float, float], ...]  # (share of the reduction, window) pairs: `chunk_hide`


def chunk_hide(
    bwd_s: Sequence[Sequence[float]],
    p2p_s: Sequence[float],
    params: Sequence[Sequence[int]],
    buckets: Sequence[Sequence[int]],
    wgrad_s: Sequence[Sequence[float]] | None = None,
) -> tuple[float, HideTerms]:
    """`hide_window_s` for a pipeline under interleaved 1F1B, where each stage's chunks finish their
    backward one after another: chunk k of stage s (backward b_sk per micro-batch, K_sk buckets,
    the share Q_sk of the stage's parameters in its chunks 0..k) is complete a window E_sk before the
    pipeline ends, and its buckets (the runtime issues chunk v-1's first: latest layer first, and no
    bucket spans two chunks, `costmodel.sharding`) reduce while the stage runs the rest.

    E_sk is a lower bound on what still runs after chunk k's last backward on stage s, the larger of
    (a) the stage's own remaining backwards, S of every earlier chunk (its last group of the
    schedule: S micro-batches whenever m >= 2S, more below) followed by the cool-down in front of
    it, sum_{s' < s} (b_s'0 + c_s'), and (b) the last micro-batch's chain through every earlier
    virtual stage: sum_{s' < s} (b_s'k + c_s') plus, per earlier chunk, all stages' backwards, the
    inner links and the wrap-around link (p2p_s[S - 1]).

    A stage whose reduction takes R (set by the pipeline's widest device, so conservative for the
    others) then finishes at the latest of its buckets' ready times plus what is queued from them:
    for chunk k, R Q_sk - (E_sk + b_sk (1 - 1/K_sk)) from its first bucket and
    R (Q_s,k-1 + q_sk / K_sk) - E_sk from its last (q_sk its own share), as `hide_window_s` for one
    range. The term of chunk v-1's first bucket has share 1: its window, the least over stages, is
    the pipeline's hide window (returned first); the other terms are returned as (share, window)
    pairs, those no other pair dominates, for `CostModel.sync` to add to the floor. At v = 1 the
    window is `hide_window_s`'s (the estimate calls `hide_window_s` there).
    tests/test_overlap_model.py holds it against a simulation of the replayed schedule.

    Split backward (`wgrad_s`, the W part g_sk of each b_sk): chunk k's gradients are complete at
    its last W, which stage s runs s backwards after its B: the window shrinks by s b_s,max (each
    deferred pair a B and a W of some chunk), for chunk 0, whose last backwards are the stage's
    last, by the s trailing W's, s g_s0; the chains through other stages (the cool-down in front,
    the earlier virtual stages) count input gradients alone, b - g, and a chunk's buckets are all
    ready when its last W ends (no b (1 - 1/K) to add). tests/test_overlap_model.py holds it
    against a simulation of the split replay."""
    return ChunkTerms.of(bwd_s, params, buckets, wgrad_s).hide(p2p_s)


@dataclass(frozen=True, eq=False)
class ChunkTerms:
    """What `chunk_hide` computes of a pipeline's chunks before its links come in: the solver
    prices the variants of many pipelines whose stages are alike and whose links differ
    (`solver.interleave`), and keeps these per stages and chunk count. `hide(p2p_s)` is
    `chunk_hide`, operation for operation."""

    chain: np.ndarray  # per stage and chunk, what its backward takes on the chain (b, or b - g split)
    own: np.ndarray  # S backwards of each earlier chunk of the stage (before its cool-down)
    chain_total: np.ndarray  # per chunk, every stage's chain
    delay: np.ndarray | None  # split backward: what the deferred W's take off each window
    ready: np.ndarray | float  # unsplit: when a chunk's first bucket is ready after its window
    shares: np.ndarray  # each term's share of the reduction, in `hide`'s order of terms

    @staticmethod
    def of(bwd_s, params, buckets, wgrad_s=None) -> "ChunkTerms":
        b = np.asarray(bwd_s, dtype=float)
        S, v = b.shape
        g = b if wgrad_s is None else np.asarray(wgrad_s, dtype=float)
        chain = b if wgrad_s is None else b - g  # what the other stages' backwards take on the chain
        delay = None
        if wgrad_s is not None:
            stage = np.arange(S, dtype=float)
            delay = np.empty((S, v))
            delay[:] = (stage * b.max(axis=1))[:, None]
            delay[:, 0] = stage * g[:, 0]
        n = np.asarray(params, dtype=float)
        share = n / np.maximum(1.0, n.sum(axis=1, keepdims=True))
        before = np.cumsum(share, axis=1) - share
        K = np.maximum(1, np.asarray(buckets, dtype=float))
        return ChunkTerms(
            chain=chain,
            own=S * (np.cumsum(b, axis=1) - b),
            chain_total=chain.sum(axis=0),
            delay=delay,
            ready=b * (1 - 1 / K) if wgrad_s is None else 0.0,
            shares=np.concatenate([(before + share)[:, :-1].ravel(), (before + share / K).ravel()]),
        )

    def hide(self, p2p_s: Sequence[float]) -> tuple[float, HideTerms]:
        """`chunk_hide` with these links (the inner ones, then the wrap-around)."""
        chain = self.chain
        S, v = chain.shape
        wrap = p2p_s[S - 1] if len(p2p_s) >= S else 0.0
        inner = np.zeros(S)
        inner[: S - 1] = p2p_s[: S - 1]
        front = np.zeros((S, v))  # s' < s
        np.cumsum(chain[:-1] + inner[:-1, None], axis=0, out=front[1:])
        per_chunk = self.chain_total + inner.sum() + wrap
        earlier = np.zeros(v)  # every stage's chunks before k
        np.cumsum(per_chunk[:-1], out=earlier[1:])
        own = self.own + front[:, :1]  # S of each earlier chunk, then cool-down
        window = np.maximum(own, front + earlier[None, :])
        if self.delay is not None:
            window = np.maximum(0.0, window - self.delay)
        first = window + self.ready
        hide = float(first[:, -1].min())
        windows = np.concatenate([first[:, :-1].ravel(), window.ravel()])
        order = np.lexsort((windows, -self.shares))  # largest share first, then the narrowest window
        shares, windows = self.shares[order], windows[order]
        # a term counts only where no term of a larger share has a window as narrow (nor the hide's)
        narrowest = np.minimum.accumulate(np.concatenate([[hide], windows]))[:-1]
        kept = windows < narrowest
        return hide, tuple(zip(shares[kept].tolist(), windows[kept].tolist(), strict=True))


def pipeline_time_s(fwd_s: list[float], bwd_s: list[float], p2p: list[float], m: int) -> float:
    """1F1B time of one pipeline (module docstring); p2p[s] is the stage s -> s+1 transfer time."""
    per_stage = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    return sum(per_stage) + 2 * sum(p2p) + (m - 1) * steady_period_s(per_stage, p2p)


def steady_period_s(per_stage: list[float], p2p: list[float]) -> float:
    """The steady state's time per micro-batch: the slowest stage's F + B and its two exchanges."""
    c = [0.0, *p2p, 0.0]
    return max(t + a + b for t, a, b in zip(per_stage, c, c[1:], strict=False))


def in_flight(stage: int, num_stages: int, m: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B."""
    return min(num_stages - stage, m)


@dataclass(frozen=True)
class StagePrediction:
    pipeline: int
    stage: int
    devices: tuple[str, ...]
    cost: StageCost
    p2p_s: float  # the exchange with the next stage per micro-batch (`CostModel.exchange_s`)
    bubble_s: float  # time this stage is idle within its pipeline's time
    sync_s: float  # the gradient reduction (and ZeRO-1 gather) the step waits for
    memory: dict[str, int]
    sync_hidden_s: float = 0.0  # the reduction that overlaps backward
    optimizer_s: float = 0.0  # AdamW over the state this stage's device keeps
    chunks: tuple[tuple[int, int], ...] = ()  # the stage's layer chunks (the cost's range if empty)

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
    # For MFU (costmodel.flops): the model's FLOPs per step, the GPUs the plan runs on, and the
    # device kind's peak (None for the cpu kind, whose peak is a placeholder).
    model_flops_per_step: float = 0.0
    gpus: int = 1
    peak_flops: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.step_time_s

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model FLOP/s per GPU the plan runs on, in TFLOP/s."""
        return self.model_flops_per_step / self.step_time_s / self.gpus / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation (costmodel.flops), None where the device kind has no real peak."""
        if self.peak_flops is None:
            return None
        return flops.mfu(self.model_flops_per_step, self.step_time_s, self.gpus, self.peak_flops)

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
            "sync_hidden_s": max(s.sync_hidden_s for s in self.stages),
            "optimizer_s": self.optimizer_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "usable_memory_bytes": self.usable_memory_bytes,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
        }

    @property
    def mfu_text(self) -> str:
        return "n/a (the cpu kind has no peak)" if self.mfu is None else f"{self.mfu:.1%}"

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
                "hidden ms",
                "opt ms",
                "params MiB",
                "grad+opt MiB",
                "activ MiB",
                "buffers MiB",
                "nccl MiB",
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
                    ",".join(f"[{a},{b})" for a, b in (s.chunks or ((c.start, c.end),))),
                    c.tp,
                    "yes" if c.sequence_parallel else "",
                    c.recompute if c.recompute != "none" else "",
                    f"{c.compute_fwd_s * 1e3:.2f}",
                    f"{c.compute_bwd_s * 1e3:.2f}",
                    f"{(c.tp_comm_fwd_s + c.tp_comm_bwd_s) * 1e3:.2f}",
                    f"{s.p2p_s * 1e3:.2f}",
                    f"{s.bubble_s * 1e3:.2f}",
                    f"{s.sync_s * 1e3:.2f}",
                    f"{s.sync_hidden_s * 1e3:.2f}",
                    f"{s.optimizer_s * 1e3:.2f}",
                    f"{mem['params'] / mib:.1f}",
                    f"{(mem['grads'] + mem['optimizer']) / mib:.1f}",
                    f"{mem['activations'] / mib:.1f}",
                    f"{(mem['sync_buffers'] + mem['exchange_buffers']) / mib:.1f}",
                    f"{mem['communicators'] / mib:.0f}",
                    f"{s.peak_memory_bytes / self.usable_memory_bytes:.0%}",
                )
            )
        pipes = ", ".join(f"{t * 1e3:.1f}" for t in self.pipeline_times_s)
        return "\n".join(
            [
                format_table(rows),
                f"pipeline times (ms): {pipes}",
                f"step {self.step_time_s * 1e3:.1f} ms = slowest pipeline "
                f"{max(self.pipeline_times_s) * 1e3:.1f} + exposed gradient sync {self.sync_s * 1e3:.1f} "
                f"+ optimizer {self.optimizer_s * 1e3:.1f}; {self.samples_per_s:.2f} samples/s, "
                f"{self.model_tflops_per_gpu:.3g} model TFLOP/s per GPU, MFU {self.mfu_text}",
            ]
        )


@dataclass(frozen=True)
class _LayerTerms:
    """What the cost model adds to one layer's profiled row in a stage (`CostModel._layer_terms`)."""

    tp_comm_s: tuple[float, float]  # forward and backward TP collectives
    core_fraction: float  # the share of its forward selective recomputation reruns
    deferred: float  # the share of its backward a split backward defers (weight gradients)
    held_bytes: int  # what a split backward holds from B to W
    plain_bytes: int  # activations of the plain shard (what a profile measured)
    mode_bytes: int  # activations in the stage's sequence parallelism and recompute mode
    grad_bytes: int  # its parameters' gradient shard, made anew in backward
    recompute_transient_bytes: int


class CostModel:
    """Predictions for one profile on one cluster; stage costs are cached by (range, tp, mbs)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        *,
        recompute: str = "none",
        optimizer: OptimizerLayout | None = None,
        replicas: int = 1,
    ):
        """`recompute` is the mode of the stages a planner builds from this model (`planned_stage`),
        `optimizer` their optimizer layout, and under ZeRO-1 `replicas` the fewest pipelines their
        plans have (each stage's state is sharded over at least that many holders); a plan's own
        stages are priced in their own modes and layout."""
        self.profile = profile
        self.cluster = cluster
        self.model = profile.model
        self.recompute = recompute
        self.optimizer = optimizer = optimizer or OptimizerLayout()
        self.replicas = replicas if optimizer.sharding == "zero1" else 1
        self._planned_cache: dict[tuple[int, int, int, int], StageCost] = {}
        self.usable_memory_bytes = int(cluster.device.memory_bytes * (1 - MEMORY_HEADROOM))
        kind = DEVICE_KINDS.get(cluster.device.kind)
        self.memory_bandwidth_gbps = kind.memory_bandwidth_gbps if kind else DEFAULT_MEMORY_BANDWIDTH_GBPS
        # what a streaming elementwise kernel reaches (the optimizer's passes)
        efficiency = analytic.kernel_efficiency(cluster.device.kind)["bandwidth"]
        self.streaming_bytes_per_s = self.memory_bandwidth_gbps * 1e9 * efficiency
        self._stage_cache: dict[tuple[int, int, int, int], StageCost] = {}
        self._terms_cache: dict[tuple, _LayerTerms] = {}  # `_layer_terms`

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
        seq, dt = prof.seq_len, prof.bytes_per_param
        shards = tp if sp else 1
        costs = [prof.cost(i, mbs, tp) for i in range(start, end)]
        hidden = mbs * seq * model.hidden_size * dt  # one whole activation
        tp_fwd = tp_bwd = 0.0
        recompute_fwd_s = 0.0  # compute a recomputation reruns in backward
        full_fwd_extra_s = 0.0  # what checkpointing adds to a measured block's forward
        activations = transient = held = 0
        wgrad_s = 0.0
        for i, c in zip(range(start, end), costs, strict=True):
            kind = model.layer_kind(i)
            mode = recompute if kind == "block" else "none"
            terms = self._layer_terms(kind, tp, mbs, sp, mode)
            fwd_comm, bwd_comm = terms.tp_comm_s
            tp_fwd, tp_bwd = tp_fwd + fwd_comm, tp_bwd + bwd_comm
            if mode == "full":
                if c.full_fwd_s is None:  # the rerun forward's time
                    recompute_fwd_s += c.fwd_s
                else:  # measured under torch.utils.checkpoint, its own work included
                    full_fwd_extra_s += c.full_fwd_s - c.fwd_s
                    recompute_fwd_s += c.full_bwd_s - c.bwd_s
                tp_bwd += fwd_comm
            elif mode == "selective":
                recompute_fwd_s += c.fwd_s * terms.core_fraction
            wgrad_s += terms.deferred * c.bwd_s
            held += terms.held_bytes
            # the profile measured the plain shard; the formula scales it to the mode
            plain, mine = terms.plain_bytes, terms.mode_bytes
            activations += -(-c.activation_bytes * mine // plain) if plain else c.activation_bytes
            # autograd makes each parameter's gradient anew before adding it into the main gradient;
            # a measured or analytic transient has it already, a profile without one does not
            layer_grads = 0 if c.transient_bytes else terms.grad_bytes
            transient = max(transient, c.transient_bytes + terms.recompute_transient_bytes + layer_grads)
        if any(model.layer_kind(i) == "block" for i in range(start, end)):
            transient += 2 * seq * model.head_dim * FP32_BYTES  # the stage's cached rotary tables
        specs = stage_params(model, start, end)
        params = sum(shard_box(spec, tp, 0).numel for spec in specs)  # rank 0: the largest shards
        measured = [c.optimizer_s for c in costs]
        if all(t is not None for t in measured):
            optimizer_s = sum(measured)
        else:
            optimizer_s = params * optimizer_bytes_per_param(dt) / self.streaming_bytes_per_s
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
            compute_fwd_s=sum(c.fwd_s for c in costs) + full_fwd_extra_s,
            compute_bwd_s=sum(c.bwd_s for c in costs) + recompute_fwd_s,
            tp_comm_fwd_s=tp_fwd,
            tp_comm_bwd_s=tp_bwd,
            param_count=params,
            activation_bytes=activations,
            transient_bytes=transient,
            boundary_bytes=output_bytes,
            optimizer_s=optimizer_s,
            input_bytes=input_bytes,
            param_tensors=len(specs),
            input_kept_bytes=0 if first_keeps_input else input_bytes,
            output_kept_bytes=output_bytes,
            dtype_bytes=dt,
            sequence_parallel=sp,
            recompute=recompute,
            row_numel=model.hidden_size,
            wgrad_s=wgrad_s,
            held_bytes=held,
        )

    def _layer_terms(self, kind: str, tp: int, mbs: int, sp: bool, mode: str) -> "_LayerTerms":
        """What a layer of this kind adds to a stage beside its profiled row (the same for every
        layer of the kind: computed once per model and shape, since a planner prices every range)."""
        key = (kind, tp, mbs, sp, mode)
        if key not in self._terms_cache:
            prof, model = self.profile, self.model
            seq, dtype = prof.seq_len, prof.dtype
            kind_of_device = DEVICE_KINDS.get(prof.device_kind)  # prices the math kernel's core share
            priced_on = (dtype, kind_of_device) if kind_of_device is not None else None
            args = (model, kind, mbs, seq, tp, dtype)
            hidden = mbs * seq * model.hidden_size * prof.bytes_per_param  # one whole activation
            self._terms_cache[key] = _LayerTerms(
                tp_comm_s=self._tp_comm_s(kind, tp, sp, hidden, mbs * seq),
                core_fraction=(
                    analytic.attention_core_fraction(model, mbs, seq, tp, prof.attention, priced_on)
                    if mode == "selective"
                    else 0.0
                ),
                deferred=analytic.weight_gradient_fraction(*args, prof.attention, kind_of_device),
                held_bytes=analytic.deferred_gradient_bytes(*args),
                plain_bytes=analytic.activation_bytes(*args, attention=prof.attention),
                mode_bytes=analytic.activation_bytes(*args, sp, mode, prof.attention),
                grad_bytes=analytic.shard_param_count(model, kind, tp) * prof.bytes_per_param,
                recompute_transient_bytes=analytic.recompute_transient_bytes(*args, sp, mode, prof.attention),
            )
        return self._terms_cache[key]

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
        """The cost of a stage a planner builds: sequence parallel where it can be, `recompute`, its
        optimizer state and AdamW sharded over `replicas` holders under ZeRO-1."""
        key = (start, end, tp, micro_batch_size)
        if key not in self._planned_cache:
            cost = self.stage(start, end, tp, micro_batch_size, self.sequence_parallel(tp), self.recompute)
            reserve = communicators.stage_reserve(
                self.cluster.device.kind, tp, start, end, self.model.num_layers, self.model.tie_embeddings
            )
            cost = replace(cost, comm_bytes=reserve)
            if self.replicas > 1:
                cost = replace(cost, sharded_over=self.replicas, bucket_bytes=self.optimizer.bucket_bytes)
                kept = cost.state_bytes().masters / max(1, cost.param_count * FP32_BYTES)
                cost = replace(cost, optimizer_s=cost.optimizer_s * min(1.0, kept))
            self._planned_cache[key] = cost
        return self._planned_cache[key]

    def planned_stage(self, layers, devices: tuple[str, ...], recompute: str | None = None) -> Stage:
        """A planner's stage of layers (start, end), or of chunks ((start, end), ...), in `recompute`
        (default: the model's planned mode)."""
        return Stage(
            chunks=tuple(layers) if isinstance(layers[0], tuple) else (tuple(layers),),
            devices=devices,
            sequence_parallel=self.sequence_parallel(len(devices)),
            recompute=recompute or self.recompute,
        )

    def stage_of(self, stage: Stage, micro_batch_size: int) -> StageCost:
        """The cost of a plan's stage, in its own sequence split and recompute mode(s)."""
        return combine_chunks(self.chunk_costs(stage, micro_batch_size))

    def chunk_costs(self, stage: Stage, micro_batch_size: int) -> list[StageCost]:
        """One cost per layer chunk of a plan's stage."""
        return [
            self.stage(
                a, b, stage.tp_degree, micro_batch_size, stage.sequence_parallel, stage.chunk_recompute(k)
            )
            for k, (a, b) in enumerate(stage.chunks)
        ]

    def exchange_s(self, front: StageCost, back_tp: int, back_sp: bool, inter_node: bool):
        """One micro-batch's exchange across the boundary from stage `front` to a stage of TP degree
        `back_tp` (sequence parallel or not), the mean of the forward send of the activation and the
        backward send of its gradient (1F1B does each once per micro-batch, so twice this is their
        sum): each the bytes of its busiest rank (`costmodel.boundary.busiest_shares`: the routes
        the runtime posts, with fan-out to receivers of other TP degrees and sequence slices), in
        the plan's dtype. Works on a table of stages too (the solver's, `boundary_bytes` an array)."""
        whole = front.boundary_bytes * (front.tp if front.sequence_parallel else 1)
        fwd, bwd = busiest_shares(
            self.profile.seq_len, (front.tp, front.sequence_parallel), (back_tp, back_sp)
        )
        via = self.link("p2p", inter_node)
        return (p2p_s(whole * fwd, via) + p2p_s(whole * bwd, via)) / 2

    def sync(
        self,
        params: int,
        num_pipelines: int,
        inter_node: bool,
        *,
        last_params: int = 0,
        sharding: str = "none",
        bucket_bytes: int = BUCKET_BYTES,
        partial: HideTerms = (),
    ) -> SyncCost:
        """A pipeline's gradient reduction with the other pipelines' holders (one per pipeline),
        set by its device of most parameters (`params`): ring all-reduce of the fp32 main gradients
        bucket by bucket, or under ZeRO-1 their reduce-scatter and, after the step, the all-gather
        of the updated parameters in the plan's dtype. The reduction overlaps backward (its
        buckets are issued as they become ready), all but the `last_params` that backward
        produces last (the first stage's first layer: an embedding's gradient is complete only
        when backward ends) and at least one bucket; the gather overlaps nothing. `partial`: an
        interleaved pipeline's chunk terms (`chunk_hide`), each a share of the reduction that must
        wait for a window, also never hidden."""
        P = num_pipelines
        if P <= 1:
            return SyncCost(0.0, 0.0, 0.0)
        k = buckets_of(params, bucket_bytes)  # one collective per bucket, each with its latency
        collective = reduce_scatter_s if sharding == "zero1" else all_reduce_s
        scope = self.link("reduce_scatter" if sharding == "zero1" else "all_reduce", inter_node)

        def reduced_s(count: int) -> float:
            """`count` parameters' gradients reduced bucket by bucket."""
            n = buckets_of(count, bucket_bytes)
            return n * collective(count * FP32_BYTES / n, P, scope) if count else 0.0

        reduce, gather = reduced_s(params), 0.0
        if sharding == "zero1":
            dtype_bytes = self.profile.bytes_per_param
            gather = k * all_gather_s(params * dtype_bytes / k, P, self.link("all_gather", inter_node))
        return SyncCost(reduce, max(reduce / k, reduced_s(last_params)), gather).with_partial(partial)

    # ---- a whole plan ---------------------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        if plan.dtype != self.profile.dtype:
            raise ElastorError(
                f"The plan trains in {plan.dtype} but the profile measured {self.profile.dtype}; use a "
                f"{plan.dtype} profile (elastor profile --dtype {plan.dtype}) or set the plan's dtype."
            )
        if plan.attention != self.profile.attention:
            raise ElastorError(
                f"The plan runs the {plan.attention} attention kernel but the profile measured the "
                f"{self.profile.attention} one; use a profile made with --attention {plan.attention} or set "
                "the plan's attention."
            )
        mbs = plan.micro_batch_size
        multi_node = len(plan.nodes()) > 1
        P = len(plan.pipelines)
        layout = plan.optimizer
        states = state_bytes(plan, self.profile.bytes_per_param)
        comms = communicators.device_bytes(plan, self.cluster.device.kind)
        priced = []  # per pipeline: stage costs, p2p, time, sync, hide window
        for pipe in plan.pipelines:
            costs = [self.stage_of(st, mbs) for st in pipe.stages]
            S, v = len(pipe.stages), pipe.num_chunks
            p2p = [
                self.exchange_s(
                    costs[si], costs[si + 1].tp, costs[si + 1].sequence_parallel, _crosses_nodes(pipe, si)
                )
                for si in range(S - 1)
            ]
            fwd, bwd = [c.fwd_s for c in costs], [c.bwd_s for c in costs]
            wgrad = [c.wgrad_s for c in costs] if pipe.split_backward else None
            # the wrap-around link carries chunk k's output of the last stage to the first
            wrap = (
                self.exchange_s(
                    costs[-1], costs[0].tp, costs[0].sequence_parallel, _crosses_nodes(pipe, S - 1, 0)
                )
                if v > 1
                else 0.0
            )
            if v == 1 and wgrad is None:
                time_s = pipeline_time_s(fwd, bwd, p2p, pipe.num_microbatches)
            else:
                time_s = interleaved_time_s(fwd, bwd, [*p2p, wrap], pipe.num_microbatches, v, wgrad)
            if v == 1:
                buckets = [buckets_of(c.param_count, layout.bucket_bytes) for c in costs]
                window, terms = hide_window_s(bwd, p2p, buckets, wgrad), ()
            else:  # each chunk's buckets reduce as soon as its backward is done
                chunks = [self.chunk_costs(st, mbs) for st in pipe.stages]
                window, terms = chunk_hide(
                    [[c.bwd_s for c in cs] for cs in chunks],
                    [*p2p, wrap],
                    [[c.param_count for c in cs] for cs in chunks],
                    [[buckets_of(c.param_count, layout.bucket_bytes) for c in cs] for cs in chunks],
                    [[c.wgrad_s for c in cs] for cs in chunks] if wgrad else None,
                )
            sync = self.sync(
                max(c.param_count for c in costs),
                P,
                multi_node,
                last_params=self.stage(0, 1, costs[0].tp, mbs).param_count,
                sharding=layout.sharding,
                bucket_bytes=layout.bucket_bytes,
                partial=terms,
            )
            priced.append((costs, p2p, time_s, sync, window))
        hide = min(h for *_, h in priced)  # every bucket waits for its holder in the least-hiding pipeline
        stages: list[StagePrediction] = []
        for pi, (pipe, (costs, p2p, time_s, sync, _)) in enumerate(zip(plan.pipelines, priced, strict=True)):
            m = pipe.num_microbatches
            for si, (st, cost) in enumerate(zip(pipe.stages, costs, strict=True)):
                fullest = max(st.devices, key=lambda d: _total(states[d]) + comms[d])
                state, comm = states[fullest], comms[fullest]
                kept = state.masters / max(1, cost.param_count * FP32_BYTES)
                stages.append(
                    StagePrediction(
                        pipeline=pi,
                        stage=si,
                        devices=st.devices,
                        cost=cost,
                        p2p_s=p2p[si] if si < len(p2p) else 0.0,
                        bubble_s=time_s - m * (cost.fwd_s + cost.bwd_s),
                        sync_s=sync.exposed_s(hide),
                        sync_hidden_s=sync.hidden_s(hide),
                        optimizer_s=cost.optimizer_s * min(1.0, kept),
                        memory=cost.memory_bytes(stage_in_flight(self, st, si, pipe, mbs), state, comm),
                        chunks=st.chunks,
                    )
                )
        pipeline_times = [t for _, _, t, _, _ in priced]
        sync = max(s.sync_s for s in stages)
        optimizer = max(s.optimizer_s for s in stages)
        return Estimate(
            step_time_s=max(pipeline_times) + sync + optimizer,
            global_batch_size=plan.global_batch_size,
            pipeline_times_s=tuple(pipeline_times),
            sync_s=sync,
            optimizer_s=optimizer,
            stages=tuple(stages),
            memory_capacity_bytes=self.cluster.device.memory_bytes,
            usable_memory_bytes=self.usable_memory_bytes,
            model_flops_per_step=flops.model_flops_per_step(self.model, plan.seq_len, plan.global_batch_size),
            gpus=plan.world_size,
            peak_flops=None if self.cluster.device.kind == "cpu" else self.cluster.device.peak_flops,
        )


def _whole(nbytes):
    """Bytes rounded up where a fractional in-flight count made them fractional (numpy grids pass)."""
    return math.ceil(nbytes) if isinstance(nbytes, float) else nbytes


def _total(state: StateBytes) -> int:
    return state.masters + state.grads + state.moments + state.steps + state.gather


def _crosses_nodes(pipe: Pipeline, si: int, to: int | None = None) -> bool:
    """Whether stage si's link to stage `to` (default si + 1) crosses nodes."""
    here = parse_device(pipe.stages[si].devices[0])[0]
    there = parse_device(pipe.stages[si + 1 if to is None else to].devices[0])[0]
    return here != there


def combine_chunks(chunks: list[StageCost]) -> StageCost:
    """One stage's cost from its chunks' (an interleaved stage): times, parameters, optimizer and
    per-micro-batch activations add up (a micro-batch passes every chunk); the working memory is the
    largest chunk's and the boundary tensors the largest. Start and end are the first chunk's start
    and the last chunk's end. The schedule's boundary tensors are counted in the activations."""
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    kept = sum(c.activation_bytes + c.input_kept_bytes + c.output_kept_bytes for c in chunks)
    return replace(
        first,
        end=chunks[-1].end,
        compute_fwd_s=sum(c.compute_fwd_s for c in chunks),
        compute_bwd_s=sum(c.compute_bwd_s for c in chunks),
        tp_comm_fwd_s=sum(c.tp_comm_fwd_s for c in chunks),
        tp_comm_bwd_s=sum(c.tp_comm_bwd_s for c in chunks),
        param_count=sum(c.param_count for c in chunks),
        activation_bytes=kept,
        input_kept_bytes=0,
        output_kept_bytes=0,
        transient_bytes=max(c.transient_bytes for c in chunks),
        boundary_bytes=max(c.boundary_bytes for c in chunks),
        input_bytes=max(c.input_bytes for c in chunks),
        optimizer_s=sum(c.optimizer_s for c in chunks),
        param_tensors=sum(c.param_tensors for c in chunks),
        wgrad_s=sum(c.wgrad_s for c in chunks),
        held_bytes=sum(c.held_bytes for c in chunks),
        recompute=",".join(dict.fromkeys(c.recompute for c in chunks)),  # shown per stage
    )


def stage_in_flight(cm: "CostModel", stage: Stage, si: int, pipe: Pipeline, mbs: int) -> float:
    """Micro-batches' worth of activations stage si holds at its peak: min(p - s, m) under 1F1B; an
    interleaved stage's peak of live chunk activations (`costmodel.schedule.peak_live`, each chunk
    weighted by what it keeps per micro-batch) over what one micro-batch keeps in all its chunks.
    Under split backward (at any chunk count) each chunk's B frees its activations but keeps
    `held_bytes` until its W."""
    S, v, m = len(pipe.stages), pipe.num_chunks, pipe.num_microbatches
    if v == 1 and not pipe.split_backward:
        return in_flight(si, S, m)
    chunks = cm.chunk_costs(stage, mbs)
    weights = [c.activation_bytes + c.input_kept_bytes + c.output_kept_bytes for c in chunks]
    held = [c.held_bytes for c in chunks] if pipe.split_backward else None
    total = sum(weights)
    return schedule.peak_live(si, S, v, m, weights, held) / total if total else 0.0

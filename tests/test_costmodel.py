"""The cost model against closed forms, hand-computed values and a schedule simulation."""

import dataclasses
import random

import pytest
from checkpoint_support import random_plan
from helpers import QWEN_TINY, TIED_TINY
from reference_1f1b import simulate_1f1b
from synthetic import synthetic_profile

import solver
from costmodel import PRESETS, ClusterSpec, ElastorError, Pipeline, Plan, Stage
from costmodel.analytic import kernel_efficiency
from costmodel.boundary import busiest_shares
from costmodel.comm import Link, all_gather_s, all_reduce_s
from costmodel.estimate import (
    FP32_BYTES,
    MEMORY_HEADROOM,
    CostModel,
    SyncCost,
    in_flight,
    pipeline_time_s,
)
from costmodel.layout import device_pieces, holder_sets, layer_params, segments, sync_buckets
from profiler.analytic import analytic_profile
from solver.baselines import Grid

TINY = PRESETS["gpt-tiny"]


def _plan(pipelines, mbs=2, config=TINY):
    pipes = tuple(
        Pipeline(num_microbatches=m, stages=tuple(Stage(chunks=(r,), devices=tuple(d)) for r, d in stages))
        for m, stages in pipelines
    )
    total = sum(m for m, _ in pipelines)
    return Plan(
        model=config, global_batch_size=total * mbs, micro_batch_size=mbs, seq_len=64, pipelines=pipes
    )


# ---- collectives ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_buffer(n):
    bandwidth_only = Link(latency_s=0.0, bandwidth_gbps=1.0)
    assert all_reduce_s(1e9, n, bandwidth_only) == pytest.approx(2 * (n - 1) / n)
    assert all_gather_s(1e9, n, bandwidth_only) == pytest.approx((n - 1) / n)
    latency_only = Link(latency_s=1e-3, bandwidth_gbps=1e30)
    assert all_reduce_s(1.0, n, latency_only) == pytest.approx(2 * (n - 1) * 1e-3)


def test_a_single_rank_communicates_nothing():
    assert all_reduce_s(1e9, 1, Link(latency_s=1.0, bandwidth_gbps=1.0)) == 0.0


# ---- one stage --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_one_stage_is_the_sum_of_its_layers(tp):
    profile = synthetic_profile()
    cm = CostModel(profile, ClusterSpec.parse("8", "cpu"))
    whole = cm.stage(0, TINY.num_layers, tp, 2)
    parts = [cm.stage(i, i + 1, tp, 2) for i in range(TINY.num_layers)]
    for field in ("compute_fwd_s", "compute_bwd_s", "tp_comm_fwd_s", "tp_comm_bwd_s", "optimizer_s"):
        assert getattr(whole, field) == pytest.approx(sum(getattr(p, field) for p in parts))
    for field in ("activation_bytes", "param_count"):
        assert getattr(whole, field) == sum(getattr(p, field) for p in parts)
    assert whole.boundary_bytes == parts[-1].boundary_bytes


def test_stage_params_match_the_layout_of_tp_rank_zero():
    plan = _plan([(2, [((0, 3), ["n0:0", "n0:1", "n0:2"]), ((3, 6), ["n0:3"])])])
    cm = CostModel(synthetic_profile(), ClusterSpec.parse("4", "cpu"))
    for device, (start, end, tp) in (("n0:0", (0, 3, 3)), ("n0:3", (3, 6, 1))):
        held = sum(box.numel for _, box in device_pieces(plan, device))
        assert cm.stage(start, end, tp, 2).param_count == held


def test_tensor_parallelism_adds_collectives_only_when_tp_exceeds_one():
    cm = CostModel(synthetic_profile(), ClusterSpec.parse("8", "cpu"))
    assert cm.stage(1, 3, 1, 2).tp_comm_fwd_s == 0.0
    two = cm.stage(1, 3, 2, 2)
    # 2 blocks x 2 all-reduces each way of a [2, 64, 96] fp32 activation on 2 ranks.
    link = cm.link("all_reduce", inter_node=False)
    one = all_reduce_s(2 * 64 * 96 * 4, 2, link)
    assert two.tp_comm_fwd_s == pytest.approx(4 * one)
    assert two.tp_comm_bwd_s == pytest.approx(4 * one)
    # The head: its input's gradient backward; the cross-entropy's max, then sum and target logit,
    # per token in fp32, forward.
    L, tokens = TINY.num_layers, 2 * 64
    head = cm.stage(L - 1, L, 2, 2)
    assert head.tp_comm_bwd_s == pytest.approx(one)
    assert head.tp_comm_fwd_s == pytest.approx(
        all_reduce_s(4 * tokens, 2, link) + all_reduce_s(8 * tokens, 2, link)
    )


# ---- 1F1B -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 9, 16])
def test_1f1b_formula_is_exact_for_equal_stages(p, m):
    f, b = 0.7, 1.9
    formula = pipeline_time_s([f] * p, [b] * p, [0.0] * (p - 1), m)
    assert formula == pytest.approx(simulate_1f1b([f] * p, [b] * p, [0.0] * (p - 1), m))
    assert formula == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 9, 16])
def test_1f1b_formula_with_transfers_is_at_most_one_transfer_above_the_schedule(p, m):
    """The runtime waits for every exchange, so each steady-state micro-batch costs a stage one
    exchange with each neighbour; a middle stage's two overlap the ends of the pipeline by one."""
    f, b, c = 0.7, 1.9, 0.05
    formula = pipeline_time_s([f] * p, [b] * p, [c] * (p - 1), m)
    simulated = simulate_1f1b([f] * p, [b] * p, [c] * (p - 1), m)
    assert simulated - 1e-9 <= formula <= simulated + c + 1e-9
    if p == 2:
        assert formula == pytest.approx(simulated)
    # Leaving the transfers out of the steady state (the formula before) misses (m - 1) of them.
    assert simulated >= (m + p - 1) * (f + b) + 2 * (p - 1) * c + (m - 1) * c - 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_1f1b_formula_is_exact_for_two_stages_when_the_back_one_is_slower(seed):
    """The usual case (the back stage holds the head); when the front one is slower, the first and
    last steady-state rounds are shorter than the formula's and it lies above the schedule."""
    rng = random.Random(seed)
    for _ in range(200):
        fwd, bwd = [rng.uniform(0.2, 2.0) for _ in range(2)], [rng.uniform(0.4, 4.0) for _ in range(2)]
        c, m = rng.uniform(0.0, 1.0), rng.randint(1, 12)
        formula, simulated = pipeline_time_s(fwd, bwd, [c], m), simulate_1f1b(fwd, bwd, [c], m)
        if fwd[1] + bwd[1] >= fwd[0] + bwd[0]:
            assert formula == pytest.approx(simulated)
        else:
            assert simulated - 1e-9 <= formula


def test_1f1b_textbook_bubble_without_transfers():
    for p, m in ((4, 8), (3, 3), (6, 24)):
        assert pipeline_time_s([1.0] * p, [2.0] * p, [0.0] * (p - 1), m) == pytest.approx((m + p - 1) * 3.0)


# Stated bound: for stages within +-25% of each other (what a balanced plan has), the formula is
# within 1.5% below and 10% above the simulated schedule.
@pytest.mark.parametrize("seed", range(5))
def test_1f1b_formula_tracks_the_simulation_for_balanced_stages(seed):
    rng = random.Random(seed)
    for _ in range(300):
        p = rng.randint(1, 8)
        m = rng.randint(p, 4 * p)
        fwd = [rng.uniform(1.0, 1.25) for _ in range(p)]
        bwd = [2 * f * rng.uniform(0.95, 1.05) for f in fwd]
        p2p = [rng.uniform(0.0, 0.05) for _ in range(p - 1)]
        simulated = simulate_1f1b(fwd, bwd, p2p, m)
        predicted = pipeline_time_s(fwd, bwd, p2p, m)
        assert -0.015 <= (predicted - simulated) / simulated <= 0.10


def test_in_flight_micro_batches_under_1f1b():
    assert [in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]


def test_the_optimizer_is_bandwidth_bound_unless_the_profile_measured_it():
    profile = synthetic_profile()
    cm = CostModel(profile, ClusterSpec.parse("1", "cpu"))
    stage = cm.stage(1, 4, 1, 2)
    # every pass of the step at the cpu kind's streaming efficiency: 48 bytes per parameter + a copy
    traffic = stage.param_count * (48 + profile.bytes_per_param)
    bound = traffic / (cm.memory_bandwidth_gbps * 1e9 * kernel_efficiency("cpu")["bandwidth"])
    assert stage.optimizer_s == pytest.approx(bound)
    # A measured profile carries the time per layer shard; a stage's is the sum over its layers.
    measured = dataclasses.replace(
        profile,
        layers=tuple(
            dataclasses.replace(
                layer, costs=tuple(dataclasses.replace(c, optimizer_s=(i + 1) * 1e-3) for c in layer.costs)
            )
            for i, layer in enumerate(profile.layers)
        ),
    )
    assert CostModel(measured, cm.cluster).stage(1, 4, 1, 2).optimizer_s == pytest.approx((2 + 3 + 4) * 1e-3)


# ---- memory -----------------------------------------------------------------------------------------
def test_memory_by_hand_for_a_gpt_tiny_stage():
    profile = synthetic_profile()
    cm = CostModel(profile, ClusterSpec.parse("4", "cpu"))
    plan = _plan([(4, [((0, 2), ["n0:0", "n0:1"]), ((2, 6), ["n0:2"])])])
    est = cm.estimate(plan)
    first = next(s for s in est.stages if s.stage == 0)
    # embed (960x96) split in two, blocks.0 with its attention/MLP split in two and norms whole.
    block = TINY.block_param_count()
    norms = 2 * TINY.hidden_size
    params = 960 * 96 // 2 + (block - norms) // 2 + norms
    assert first.cost.param_count == params
    activation = sum(profile.cost(i, 2, 2).activation_bytes for i in (0, 1))
    output = 2 * 64 * 96 * 4  # the [micro-batch, seq, hidden] fp32 output it sent, held for backward
    assert first.memory == {
        "params": 2 * params * FP32_BYTES,  # the fp32 module weights and their fp32 masters
        "grads": params * FP32_BYTES,
        "optimizer": 2 * params * FP32_BYTES + 10 * FP32_BYTES,  # and the step counts of its 10 tensors
        "activations": 2 * (activation + output),  # stage 0 of 2 holds 2 micro-batches
        "sync_buffers": 0,  # one pipeline: nothing to reduce across pipelines
        "exchange_buffers": 2 * output,  # the send and its gradient's receive
        # the profile measured none: the block's parameter gradients as autograd makes them (the
        # largest layer's), and the cached fp32 rotary tables
        "transient": ((block - norms) // 2 + norms) * FP32_BYTES + 2 * 64 * 16 * 4,
        "communicators": 0,  # gloo on a CPU keeps no per-channel device buffers
    }
    assert first.peak_memory_bytes == sum(first.memory.values())
    assert est.usable_memory_bytes == int(cm.cluster.device.memory_bytes * (1 - MEMORY_HEADROOM))
    assert est.peak_memory_bytes["n0:1"] == first.peak_memory_bytes


def test_a_plan_that_does_not_fit_is_flagged():
    big = PRESETS["llama2-7b"]
    profile = synthetic_profile(big, seq_len=128, tp_degrees=(1,))
    cluster = ClusterSpec.parse("1", "A100-40GB")  # 6.7e9 params x 16 bytes is far above 40 GiB
    plan = _plan([(1, [((0, big.num_layers), ["n0:0"])])], mbs=1, config=big)
    assert not CostModel(profile, cluster).estimate(plan).fits


# ---- stage boundaries -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("front", "back", "shares"),
    [
        ((4, True), (4, True), (1 / 4, 1 / 4)),  # equal slices: each rank moves its own quarter
        ((1, False), (4, True), (1, 1)),  # the TP1 rank sends four quarters; backward takes them back
        ((4, True), (1, False), (1, 1)),  # the TP1 rank receives the four quarters
        ((2, True), (4, True), (1 / 2, 1 / 2)),  # each TP2 rank sends its half as two quarters
        ((8, True), (2, True), (1 / 2, 1 / 2)),  # each TP2 rank receives a half from four ranks
        ((1, False), (4, False), (4, 1)),  # no sequence split: four whole copies from the one rank
    ],
)
def test_a_boundary_is_priced_by_its_busiest_rank(front, back, shares):
    """The busiest rank's share of the activation, forward and backward, counted from the routes
    the runtime posts (`costmodel.boundary`, held to the sockets by tests/test_runtime_bytes.py)."""
    assert busiest_shares(64, front, back) == pytest.approx(shares)


def test_an_exchange_into_fewer_ranks_costs_what_the_receiver_takes():
    """A TP4 stage feeding TP1: the receiver takes the whole activation (four quarters), not the
    quarter one sender holds; the reverse boundary is the same. Equal stages keep the sender's slice."""
    cm = CostModel(synthetic_profile(tp_degrees=(1, 4)), ClusterSpec.parse("5", "cpu"))
    wide = cm.stage(0, 3, 4, 2, sequence_parallel=True)
    narrow = cm.stage(0, 3, 1, 2)
    via = cm.link("p2p", inter_node=False)
    assert wide.boundary_bytes * 4 == narrow.boundary_bytes
    assert cm.exchange_s(wide, 1, False, False) == pytest.approx(via.transfer_s(narrow.boundary_bytes))
    assert cm.exchange_s(narrow, 4, True, False) == pytest.approx(via.transfer_s(narrow.boundary_bytes))
    assert cm.exchange_s(wide, 4, True, False) == pytest.approx(via.transfer_s(wide.boundary_bytes))
    stages = (
        Stage(chunks=((0, 3),), devices=("n0:0", "n0:1", "n0:2", "n0:3"), sequence_parallel=True),
        Stage(chunks=((3, 6),), devices=("n0:4",)),
    )
    plan = dataclasses.replace(_plan([(4, [])]), pipelines=(Pipeline(num_microbatches=4, stages=stages),))
    (front, _) = cm.estimate(plan).stages
    assert front.p2p_s == pytest.approx(via.transfer_s(4 * front.cost.boundary_bytes))


# ---- step time --------------------------------------------------------------------------------------
def test_step_is_slowest_pipeline_plus_sync_plus_optimizer():
    cm = CostModel(synthetic_profile(), ClusterSpec.parse("3,3", "cpu"))
    plan = _plan(
        [
            (5, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2"])]),
            (3, [((0, 2), ["n1:0", "n1:1"]), ((2, 6), ["n1:2"])]),
        ]
    )
    est = cm.estimate(plan)
    assert est.step_time_s == pytest.approx(max(est.pipeline_times_s) + est.sync_s + est.optimizer_s)
    assert est.samples_per_s == pytest.approx(16 / est.step_time_s)
    # the gradient sync crosses nodes, so it uses the inter-node link
    stage = next(s for s in est.stages if s.devices == ("n0:2",))
    assert stage.sync_s == pytest.approx(
        all_reduce_s(stage.cost.grad_bytes, 2, cm.link("all_reduce", inter_node=True))
    )
    text = est.explain()
    for term in (
        "fwd ms",
        "tp comm ms",
        "p2p ms",
        "bubble ms",
        "sync ms",
        "opt ms",
        "activ MiB",
        "peak / usable",
    ):
        assert term in text


def test_sync_volume_matches_the_buckets_the_runtime_reduces():
    """For pipelines of equal layout, 2(P-1)/P of a device's gradient bytes is exactly the ring volume
    of the buckets costmodel.layout gives that device."""
    plan = _plan(
        [
            (2, [((0, 3), ["n0:0"]), ((3, 6), ["n0:1"])]),
            (2, [((0, 3), ["n0:2"]), ((3, 6), ["n0:3"])]),
            (2, [((0, 3), ["n1:0"]), ((3, 6), ["n1:1"])]),
        ]
    )
    buckets = sync_buckets(plan)
    for device in ("n0:0", "n0:3", "n1:1"):
        ring_bytes = sum(
            2 * (len(group) - 1) / len(group) * sum(box.numel for _, box in segments) * FP32_BYTES
            for group, segments in buckets.items()
            if device in group
        )
        held = sum(box.numel for _, box in device_pieces(plan, device)) * FP32_BYTES
        assert ring_bytes == pytest.approx(2 * (3 - 1) / 3 * held)


def test_a_chunks_wait_raises_the_sync_floor_and_never_lowers_it():
    """An interleaved pipeline's chunk terms (share, window): the share of the reduction that must
    wait for its window is never hidden, so the floor is the larger of the plain floor and every
    share's reduction less its window; the reduction and gather stay (`SyncCost.with_partial`)."""
    settings = {"device_kind": "H100-80GB", "micro_batch_sizes": [1], "tp_degrees": [1], "seq_len": 4096}
    profile = analytic_profile(PRESETS["llama2-7b"], **settings)
    cm = CostModel(profile, ClusterSpec.parse("8,8", profile.device_kind))
    plain = cm.sync(400_000_000, 4, True, last_params=130_000_000)
    assert plain.floor_s > 0
    low = ((0.5, plain.reduce_s * 0.5 - plain.floor_s / 2),)  # waits less than the floor
    high = ((0.9, plain.reduce_s * 0.9 - 2 * plain.floor_s), (0.4, 0.0))  # waits more
    for terms, floor in ((low, plain.floor_s), (high, 2 * plain.floor_s)):
        chunked = cm.sync(400_000_000, 4, True, last_params=130_000_000, partial=terms)
        assert (chunked.reduce_s, chunked.gather_s) == (plain.reduce_s, plain.gather_s)
        assert chunked.floor_s == pytest.approx(floor, rel=1e-12)
    assert cm.sync(400_000_000, 1, True, partial=high) == SyncCost(0.0, 0.0, 0.0)  # one pipeline: no sync


def test_holder_sets_are_every_devices_pieces_cut_at_every_holders_boundary():
    """`holder_sets` cuts parameters alike once; against the definition, device by device (each
    parameter cut at every boundary any holder's box has, a segment's holders those whose box
    contains it, reduced across stages or under sequence parallelism), on random plans of plain,
    tied and biased models, some interleaved, some with sequence-parallel stages: the same sets,
    segments and order."""
    rng = random.Random(3)
    for case in range(60):
        config = (TINY, TIED_TINY, QWEN_TINY)[case % 3]
        plan = random_plan(rng, config)
        pipelines = tuple(
            dataclasses.replace(
                pipe,
                stages=tuple(
                    dataclasses.replace(st, sequence_parallel=st.tp_degree > 1 and rng.random() < 0.5)
                    for st in pipe.stages
                ),
            )
            for pipe in plan.pipelines
        )
        plan = dataclasses.replace(plan, pipelines=pipelines)
        rank = {d: i for i, d in enumerate(plan.devices)}
        holders = {}
        for device in plan.devices:
            for spec, box in device_pieces(plan, device):
                holders.setdefault(spec.name, (spec, []))[1].append((device, box))
        expected = {}
        order = [s.name for i in range(config.num_layers) for s in layer_params(config, i)]
        for name in (n for n in order if n in holders):
            spec, held = holders[name]
            for segment in segments(spec, [box for _, box in held]):
                owners = tuple(sorted((d for d, box in held if box.contains(segment)), key=rank.get))
                pi, si = plan.placement(owners[0])
                sequence_parallel = plan.pipelines[pi].stages[si].sequence_parallel
                across = len({plan.placement(d) for d in owners}) > 1
                reduced = across or (len(owners) > 1 and sequence_parallel)
                expected.setdefault(owners, (reduced, []))[1].append((spec, segment))
        found = holder_sets(plan)
        assert list(found) == sorted(expected, key=lambda owners: [rank[d] for d in owners])
        assert found == expected, case


def test_a_plan_in_another_dtype_than_its_profile_is_refused_in_one_sentence():
    profile = synthetic_profile()  # float32
    plan = dataclasses.replace(_plan([(4, [((0, 6), ["n0:0"])])]), dtype="bfloat16")
    with pytest.raises(ElastorError) as e:
        CostModel(profile, ClusterSpec.parse("1", "cpu")).estimate(plan)
    assert str(e.value).count(".") == 1 and "bfloat16" in str(e.value) and "float32" in str(e.value)


def test_a_plan_with_another_attention_kernel_than_its_profile_is_refused_in_one_sentence():
    profile = synthetic_profile()  # the fused kernel
    plan = dataclasses.replace(_plan([(4, [((0, 6), ["n0:0"])])]), attention="math")
    assert Plan.from_json(plan.to_json()).attention == "math"  # written, and read back
    assert "attention" not in dataclasses.replace(plan, attention="fused").to_json()  # older plans' form
    assert dataclasses.replace(plan, attention="sparse").violations() == [
        "attention 'sparse' is not one of fused, math."
    ]
    with pytest.raises(ElastorError) as e:
        CostModel(profile, ClusterSpec.parse("1", "cpu")).estimate(plan)
    assert str(e.value).count(".") == 1 and "math" in str(e.value) and "fused" in str(e.value)


def test_the_math_attention_kernel_costs_time_and_memory_in_the_analytic_profile():
    """On an analytic H100 profile of llama2-7b at 4,096 tokens the math kernel keeps the b x H x s x s
    scores and moves them through memory several times: more activation bytes and a slower block,
    forward and backward, and a plan priced from it runs slower and holds more."""
    kw = dict(device_kind="H100-80GB", micro_batch_sizes=[1], tp_degrees=[1, 2], seq_len=4096)
    fused, math = (analytic_profile(PRESETS["llama2-7b"], **kw, attention=a) for a in ("fused", "math"))
    for tp in (1, 2):
        a, b = fused.cost(1, 1, tp), math.cost(1, 1, tp)
        heads = PRESETS["llama2-7b"].num_heads // tp
        assert b.activation_bytes - a.activation_bytes >= 2 * heads * 4096 * 4096 * 0.99  # the bf16 scores
        assert b.fwd_s > a.fwd_s and b.bwd_s > a.bwd_s
    cluster = ClusterSpec.parse("2", "H100-80GB")
    plans = [solver.solve(p, cluster, 8, method="uniform", grid=Grid(tp=2, pp=1)) for p in (fused, math)]
    assert plans[1].attention == "math" and plans[0].attention == "fused"
    assert plans[1].predicted["step_time_s"] > plans[0].predicted["step_time_s"]
    assert max(plans[1].predicted["peak_memory_bytes"].values()) > max(
        plans[0].predicted["peak_memory_bytes"].values()
    )


def test_sequence_parallel_and_recompute_price_memory_and_time():
    """On a TP2 stage: SP keeps less and moves the same all-reduce volume in halves; full
    recomputation keeps least and adds each block's forward to the backward; selective in between."""
    cm = CostModel(synthetic_profile(), ClusterSpec.parse("2", "cpu"))
    plain, sp = cm.stage(1, 5, 2, 2), cm.stage(1, 5, 2, 2, sequence_parallel=True)
    full = cm.stage(1, 5, 2, 2, sequence_parallel=True, recompute="full")
    selective = cm.stage(1, 5, 2, 2, sequence_parallel=True, recompute="selective")
    assert full.activation_bytes < selective.activation_bytes < sp.activation_bytes < plain.activation_bytes
    assert sp.compute_bwd_s < selective.compute_bwd_s < full.compute_bwd_s
    assert full.compute_bwd_s == pytest.approx(sp.compute_bwd_s + sp.compute_fwd_s)
    assert full.tp_comm_bwd_s == pytest.approx(sp.tp_comm_bwd_s + sp.tp_comm_fwd_s)
    assert sp.boundary_bytes == plain.boundary_bytes // 2  # each rank sends its half of the sequence


def test_a_block_measured_under_full_recomputation_is_priced_as_measured():
    """A profile whose blocks carry their checkpointed times (`full_fwd_s`, `full_bwd_s`): a fully
    recomputed stage costs those instead of the plain times plus the rerun forward; other modes and
    the embedding and head are unchanged."""
    profile = synthetic_profile(tp_degrees=(1,))
    blocks = range(1, profile.model.num_layers - 1)
    layers = list(profile.layers)
    for i in blocks:  # checkpointing adds a tenth to the forward and the backward reruns it thrice
        costs = [dataclasses.replace(c, full_fwd_s=1.1 * c.fwd_s, full_bwd_s=c.bwd_s + 3 * c.fwd_s)
                 for c in layers[i].costs]  # fmt: skip
        layers[i] = dataclasses.replace(layers[i], costs=tuple(costs))
    measured = dataclasses.replace(profile, layers=tuple(layers))
    cluster = ClusterSpec.parse("1", "cpu")
    old, new = CostModel(profile, cluster), CostModel(measured, cluster)
    L = profile.model.num_layers
    fwd = sum(profile.cost(i, 2, 1).fwd_s for i in blocks)
    for start, end in ((0, L), (1, L - 1)):
        before, after = (
            old.stage(start, end, 1, 2, recompute="full"),
            new.stage(start, end, 1, 2, recompute="full"),
        )
        assert after.compute_fwd_s == pytest.approx(before.compute_fwd_s + 0.1 * fwd)
        assert after.compute_bwd_s == pytest.approx(before.compute_bwd_s + 2 * fwd)
        for mode in ("none", "selective"):
            assert new.stage(start, end, 1, 2, recompute=mode) == old.stage(start, end, 1, 2, recompute=mode)
    stage = Stage(chunks=((0, L),), devices=("n0:0",), recompute="full")
    plan = Plan(
        model=profile.model, global_batch_size=4, micro_batch_size=2, seq_len=profile.seq_len,
        pipelines=(Pipeline(num_microbatches=2, stages=(stage,)),),
    ).validate()  # fmt: skip
    assert new.estimate(plan).step_time_s > old.estimate(plan).step_time_s

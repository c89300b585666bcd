"""NCCL's communicator buffers (costmodel.communicators): the groups and point-to-point peers the cost
model counts are the ones the runtime makes, priced by hand, in every plan's estimate, and reserved
by the planner (or searched again for)."""

import dataclasses

import numpy as np
import pytest
from dist_helpers import plan_json
from test_runtime_interleaved import PLANS as INTERLEAVED
from test_runtime_parity import PLANS

import solver
from costmodel import PRESETS, ClusterSpec, Plan, communicators
from costmodel.communicators import CONNECTION_BYTES, device_bytes, p2p_peers, plan_groups, planned_bytes
from costmodel.estimate import MEMORY_HEADROOM, CostModel
from costmodel.sharding import state_bytes
from profiler.analytic import analytic_profile
from runtime import distributed
from runtime.pipeline import _links
from solver.stages import stage_grid

TINY = PRESETS["gpt-tiny"].to_json()
H100 = "H100-80GB"
# Two pipelines of two TP2 stages, one per node; and the same with the second pipeline cut
# elsewhere and at TP4 in its first stage, so that devices hold segments with several holder sets.
ALIKE = {
    **plan_json(
        TINY,
        [
            (4, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2", "n0:3"])]),
            (4, [((0, 3), ["n1:0", "n1:1"]), ((3, 6), ["n1:2", "n1:3"])]),
        ],
        seq_len=64,
    ),
    "dtype": "bfloat16",
}
UNALIKE = {
    **plan_json(
        TINY,
        [
            (4, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2", "n0:3"])]),
            (4, [((0, 2), ["n1:0", "n1:1", "n1:2", "n1:3"]), ((2, 6), ["n1:4", "n1:5"])]),
        ],
        seq_len=64,
    ),
    "dtype": "bfloat16",
}
CASES = {
    **PLANS,
    **{f"interleaved-{k}": v for k, v in INTERLEAVED.items()},
    "alike": ALIKE,
    "unalike": UNALIKE,
}


def _plan(name: str) -> Plan:
    return Plan.from_json(CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_runtime_makes_exactly_the_groups_the_cost_model_counts(name, monkeypatch):
    """runtime.distributed.ProcessGroups on NCCL creates one group per `plan_groups` entry, in its
    order, and no other (a single device gets none)."""
    plan = _plan(name)
    made = []
    monkeypatch.setattr(distributed.dist, "new_group", lambda ranks, timeout: made.append(ranks) or object())
    monkeypatch.setattr(distributed.dist, "barrier", lambda: None)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "nccl")
    groups = distributed.ProcessGroups(plan)
    rank = {d: i for i, d in enumerate(plan.devices)}
    assert made == [[rank[d] for d in g] for g in plan_groups(plan)]
    assert len(groups) == len(made) and all(len(r) > 1 for r in made)


@pytest.mark.parametrize("name", sorted(CASES))
def test_point_to_point_peers_are_the_runtime_routes(name):
    """Every rank the schedules send to or receive from (runtime.pipeline._links over the boundaries
    each schedule links, the wrap-around too when interleaved) is a peer the cost model counts."""
    plan = _plan(name)
    rank = {d: i for i, d in enumerate(plan.devices)}
    counted = p2p_peers(plan)
    for pipe in plan.pipelines:
        S = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            if pipe.num_chunks > 1:
                links = {((si - 1) % S, si), (si, (si + 1) % S)} if S > 1 else set()
            else:
                links = {(a, b) for a, b in ((si - 1, si), (si, si + 1)) if a >= 0 and b < S}
            for me, device in enumerate(stage.devices):
                runtime = set()
                for a, b in links:
                    forward, backward = _links(
                        pipe.stages[a], pipe.stages[b], me, plan.seq_len, rank, a == si
                    )
                    runtime |= {peer for side in (*forward, *backward) for peer, _, _ in side}
                assert runtime == {rank[p] for p in counted[device]}, (name, device)


def test_nccl_buffers_by_hand():
    """n0:0 (first stage, TP rank 0, sequence parallel) belongs to the whole job's group, its TP
    group, its shard's holders {n0:0, n1:0} and the replicated norm weights' holders (both pipelines'
    first-stage TP groups); it exchanges with n0:2 only. 32 channels of 10 MiB each on H100, the
    peer on its node over as many."""
    plan = _plan("alike")
    per_group = 32 * CONNECTION_BYTES
    assert {("n0:0", "n1:0"), ("n0:0", "n0:1", "n1:0", "n1:1"), ("n0:0", "n0:1")} <= set(plan_groups(plan))
    assert p2p_peers(plan)["n0:0"] == {"n0:2"}
    assert device_bytes(plan, H100)["n0:0"] == 4 * per_group + per_group
    assert set(device_bytes(plan, "cpu").values()) == {0}  # gloo: no per-channel device buffers
    # a plan cut alike stays within what the planner reserves for a TP2 stage
    assert max(device_bytes(plan, H100).values()) <= planned_bytes(H100, 2)


def test_cuts_and_shards_that_differ_put_devices_in_more_groups():
    alike, unalike = (device_bytes(_plan(n), H100) for n in ("alike", "unalike"))
    assert unalike["n0:0"] > alike["n0:0"]
    assert max(unalike.values()) > planned_bytes(H100, 2)  # beyond the reserve: the solver rechecks


def _estimate(plan: Plan, kind: str):
    tps = sorted({s.tp_degree for p in plan.pipelines for s in p.stages})
    profile = analytic_profile(
        plan.model,
        device_kind=kind,
        micro_batch_sizes=[plan.micro_batch_size],
        tp_degrees=tps,
        seq_len=plan.seq_len,
        dtype=plan.dtype,
        attention=plan.attention,
    )
    nodes = {}
    for d in plan.devices:
        nodes.setdefault(d.split(":")[0], []).append(int(d.split(":")[1]))
    cluster = ClusterSpec.parse(",".join(str(max(g) + 1) for g in nodes.values()), kind)
    return CostModel(profile, cluster).estimate(plan)


@pytest.mark.parametrize("name", ["alike", "unalike"])
def test_every_estimate_holds_each_devices_buffers(name):
    """A stage's predicted peak is its fullest device's: that device's optimizer state and NCCL
    buffers together (the devices of the unalike plan's stages hold different numbers of groups);
    on the cpu kind no buffers."""
    plan = _plan(name)
    exact = device_bytes(plan, H100)
    states = state_bytes(plan, 2)
    gpu, cpu = _estimate(plan, H100), _estimate(plan, "cpu")
    for on_gpu, on_cpu in zip(gpu.stages, cpu.stages, strict=True):
        fullest = max(on_gpu.devices, key=lambda d: sum(dataclasses.astuple(states[d])) + exact[d])
        assert on_gpu.memory["communicators"] == exact[fullest] > 0
        assert on_gpu.peak_memory_bytes - on_cpu.peak_memory_bytes == exact[fullest]
        assert on_cpu.memory["communicators"] == 0


def test_planned_stages_reserve_their_buffers():
    """The planner's stage of TP t reserves the job's group, the TP group, the sync groups of a plan
    cut alike (one, two under TP) and a peer on its node per neighbouring stage; its stage table
    the same per range; nothing on the cpu kind."""
    tiny = PRESETS["gpt-tiny"]
    profile = analytic_profile(tiny, device_kind=H100, micro_batch_sizes=[1], tp_degrees=[1, 2], seq_len=64)
    cm = CostModel(profile, ClusterSpec.parse("8", H100))
    g = communicators.group_bytes(H100)

    def reserved(start, end, tp):
        return cm.planned(start, end, tp, 1).memory_bytes(1)["communicators"]

    assert reserved(0, 6, 1) == 2 * g  # the whole model: no neighbour
    assert reserved(0, 3, 1) == 2 * g + g  # the first stage: one
    assert reserved(2, 4, 1) == 2 * g + 2 * g  # a middle stage: two
    assert reserved(3, 6, 2) == 4 * g + g
    tied = CostModel(
        analytic_profile(
            PRESETS["gpt-small"], device_kind=H100, micro_batch_sizes=[1], tp_degrees=[1], seq_len=64
        ),
        ClusterSpec.parse("8", H100),
    )
    L = PRESETS["gpt-small"].num_layers
    assert tied.planned(0, 3, 1, 1).comm_bytes == 3 * g + g  # the tied embedding's holders too
    assert tied.planned(3, L, 1, 1).comm_bytes == 3 * g + g
    assert tied.planned(3, 5, 1, 1).comm_bytes == 2 * g + 2 * g
    assert tied.planned(0, L, 1, 1).comm_bytes == 2 * g  # both copies on one device: no group
    grid = stage_grid(cm, 2, 1)
    comm = np.broadcast_to(grid.memory_bytes(1)["communicators"], (7, 7))
    assert all(comm[s, e] == reserved(s, e, 2) for s in range(6) for e in range(s + 1, 7))
    on_cpu = CostModel(
        analytic_profile(tiny, device_kind="cpu", micro_batch_sizes=[1], tp_degrees=[1], seq_len=64),
        ClusterSpec.parse("8", "cpu"),
    )
    assert on_cpu.planned(0, 3, 1, 1).memory_bytes(1)["communicators"] == 0


def test_a_device_kind_outside_the_table_counts_none():
    assert communicators.channels("MI300X") == 0 and communicators.peer_bytes("MI300X", True) == 0
    assert communicators.peer_bytes(H100, inter_node=True) == 2 * CONNECTION_BYTES


def test_a_plan_beyond_the_reserve_is_searched_again_and_fits(monkeypatch):
    """gpt-small on 6+5+6 H100s cut to 3.28 GiB each: the first answer puts devices in more groups
    than the planner reserved and does not fit; the solver searches again with the shortfall
    reserved (and says so as it goes), and its answer fits with every device's exact buffers
    counted."""
    profile = analytic_profile(
        PRESETS["gpt-small"], device_kind=H100, micro_batch_sizes=[1, 2], tp_degrees=[1, 2, 4], seq_len=1024
    )
    cluster = ClusterSpec.parse("6,5,6", H100)
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, memory_bytes=int(3.28 * 2**30))
    )
    monkeypatch.setattr(solver, "PROGRESS_AFTER_S", -1.0)  # every line, however short the solve
    lines = []
    plan = solver.solve(profile, cluster, 32, progress=lines.append)
    assert plan.solver["nccl_reserve_bytes"] > 0
    again = [line for line in lines if "searching again" in line]
    assert again and "once its NCCL buffers are counted" in again[0]
    assert f"{plan.solver['nccl_reserve_bytes'] / 2**20:,.0f} MiB less memory" in " ".join(again)
    assert plan.solver["status"] == "FEASIBLE"  # a search with less memory proves nothing
    (reason,) = plan.solver["not_proven"]  # and says why, not that a time limit stopped it
    assert "did not fit" in reason and f"{plan.solver['nccl_reserve_bytes'] / 2**20:,.0f} MiB less" in reason
    estimate = CostModel(profile, cluster).estimate(plan)
    assert estimate.fits
    exact = device_bytes(plan, H100)
    for stage in estimate.stages:
        assert stage.memory["communicators"] == max(exact[d] for d in stage.devices)


def test_a_plan_the_reserve_shuts_out_is_found_where_it_fits():
    """One H100 with 300 MiB more than gpt-small's single-device plan needs: the planner reserves a
    stage's buffers and finds nothing; a single GPU has no NCCL communicator, so the search with the
    reserve given back finds that plan, which fits exactly."""
    profile = analytic_profile(
        PRESETS["gpt-small"], device_kind=H100, micro_batch_sizes=[1], tp_degrees=[1], seq_len=1024
    )
    cluster = ClusterSpec.parse("1", H100)
    model = profile.model
    alone = Plan.from_json(
        {
            **plan_json(model.to_json(), [(8, [((0, model.num_layers), ["n0:0"])])], seq_len=1024),
            "dtype": "bfloat16",
        }
    )
    need = CostModel(profile, cluster).estimate(alone).stages[0].peak_memory_bytes
    memory = int((need + 300 * 2**20) / (1 - MEMORY_HEADROOM)) + 1
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory))
    plan = solver.solve(profile, cluster, 8, recompute="none")
    assert plan.solver["nccl_reserve_bytes"] < 0 and plan.solver["status"] == "FEASIBLE"
    (reason,) = plan.solver["not_proven"]
    assert "given back" in reason and "time limit" not in reason
    assert CostModel(profile, cluster).estimate(plan).fits

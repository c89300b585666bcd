"""More resources never plan slower.

On random small instances (the generator of tests/test_solver_optimality.py, kept within the sizes
the solver searches exhaustively) each of three growths must give a plan at least as fast as the
original's: one GPU more on a node, one node more, and devices with a quarter more memory. A plan of
the smaller cluster is a plan of the larger one (GPUs may stay idle; memory only admits more), so
an exact search can only gain; the test holds the whole solver (passes, recompute relaxation,
ZeRO-1) to it end to end. A growth that makes an instance feasible is fine; one that makes a
feasible instance infeasible fails.

The same growths hold where NCCL's buffers count (a GPU device kind, memory for 3 to 9
communicators beside the instance's): the planner reserves a plan cut alike's buffers and searches
again where an answer needs more, so this checks that those searches keep the order.

On the preset models, where the skeleton family is searched instead, the same is checked where
it matters most: the H200's larger memory must not plan slower than the plan chosen for H100 priced
on H200 (a family that depends on memory can search shallower pipelines and miss it).
"""

import dataclasses
import random

import pytest
from test_solver_optimality import random_instance

import solver
from costmodel import PRESETS, ClusterSpec, ElastorError
from costmodel.cluster import NodeSpec
from costmodel.communicators import group_bytes
from costmodel.estimate import MEMORY_HEADROOM, CostModel
from costmodel.plan import SHARDING
from profiler.analytic import analytic_profile
from solver.core import EXACT_GPUS

NUM_CASES = 200
GPU = "H100-80GB"
RELATIVE = 1e-9


def _step(profile, cluster, gbs) -> float | None:
    try:
        plan = solver.solve(profile, cluster, gbs, sharding=SHARDING)
    except ElastorError:
        return None
    return CostModel(profile, cluster).estimate(plan.validate(cluster)).step_time_s


def grown(cluster: ClusterSpec, rng: random.Random) -> dict[str, ClusterSpec]:
    """The instance's cluster with one GPU more, one node more, and a quarter more memory (the
    first two only while the whole cluster stays within the exhaustive search's size)."""
    device = dataclasses.replace(cluster.device, memory_bytes=int(cluster.device.memory_bytes * 1.25))
    out = {"memory": dataclasses.replace(cluster, device=device)}
    gpus = cluster.world_size
    widest = max(len(n.gpus) for n in cluster.nodes)
    if gpus < EXACT_GPUS:
        i = rng.randrange(len(cluster.nodes))
        node = cluster.nodes[i]
        more = NodeSpec(name=node.name, gpus=(*node.gpus, max(node.gpus) + 1))
        out["gpu"] = dataclasses.replace(
            cluster,
            nodes=(*cluster.nodes[:i], more, *cluster.nodes[i + 1 :]),
            gpus_per_node=max(cluster.gpus_per_node, max(more.gpus) + 1),  # a GPU id past a whole node's
        )
        size = rng.randint(1, min(widest, EXACT_GPUS - gpus))
        node = NodeSpec(name=f"n{len(cluster.nodes)}", gpus=tuple(range(size)))
        out["node"] = dataclasses.replace(cluster, nodes=(*cluster.nodes, node))
    return out


def _check_growths(profile, cluster, gbs, seed) -> None:
    """Every growth of the instance plans at least as fast (a growth may make it feasible)."""
    base = _step(profile, cluster, gbs)
    if base is None:
        return
    for growth, bigger in grown(cluster, random.Random(seed)).items():
        step = _step(profile, bigger, gbs)
        assert step is not None, (
            f"{growth}: {bigger.short_form()} has no plan where {cluster.short_form()} has"
        )
        assert step <= base * (1 + RELATIVE), (growth, bigger.short_form(), step, base)


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_more_gpus_nodes_or_memory_never_plan_slower(seed):
    profile, cluster, gbs = random_instance(seed)
    _check_growths(profile, cluster, gbs, seed)


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_more_resources_never_plan_slower_where_nccl_buffers_count(seed):
    """The same growths on H100s, each device given 3 to 9 communicators' worth of NCCL buffers
    beside the instance's memory: plans now differ in the groups their devices belong to
    (costmodel.communicators), and answers that do not fit are searched again
    (`solver._within_nccl_buffers`)."""
    profile, cluster, gbs = random_instance(seed)
    buffers = random.Random(seed).randint(3, 9) * group_bytes(GPU)
    memory = cluster.device.memory_bytes + int(buffers / (1 - MEMORY_HEADROOM))
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, kind=GPU, memory_bytes=memory)
    )
    _check_growths(profile, cluster, gbs, seed)


@pytest.mark.parametrize(
    ("model", "counts", "gbs"),
    [pytest.param("llama2-7b", "8,8,7", 128, marks=pytest.mark.slow), ("llama2-13b", "8,8", 64)],
)  # the 7b case -m slow: make test's time budget
def test_h200_never_plans_slower_than_the_h100_plan_priced_on_h200(model, counts, gbs):
    def prof(kind):
        return analytic_profile(
            PRESETS[model], device_kind=kind, micro_batch_sizes=[1, 2], tp_degrees=[1, 2, 4, 8], seq_len=4096
        )

    h100, h200 = prof("H100-80GB"), prof("H200-141GB")
    c100, c200 = ClusterSpec.parse(counts, "H100-80GB"), ClusterSpec.parse(counts, "H200-141GB")
    on_h100 = solver.solve(h100, c100, gbs)
    priced = CostModel(h200, c200).estimate(dataclasses.replace(on_h100, predicted=None).validate(c200))
    assert priced.fits
    on_h200 = solver.solve(h200, c200, gbs)
    assert on_h200.predicted["step_time_s"] <= priced.step_time_s * (1 + RELATIVE)

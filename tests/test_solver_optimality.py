"""The solver is exact: on random small instances its plan is as fast as the best plan a brute-force
enumeration of the whole search space finds (tests/brute_force.py), with ZeRO-1 allowed on both sides,
and every plan it returns is valid and fits in memory.

Equality is to a relative 1e-9: the master problem works in integer units of 1e-13 of the incumbent's
step time and recomputes the chosen plan's time in floating point, the brute force sums in floating
point. Instances: up to 8 layers (6 blocks), 3 nodes and 6 GPUs, random per-layer times, activation
and boundary bytes, random device memory (so memory binds in some, and some are infeasible), random
links and global batch; the largest ones are kept few so the test stays quick on two cores.
"""

import dataclasses
import random

import pytest
from brute_force import best_plan
from synthetic import synthetic_profile

import solver
from costmodel import ClusterSpec, ElastorError, ModelConfig
from costmodel.cluster import DeviceSpec, LinkSpec
from costmodel.estimate import MEMORY_HEADROOM, CostModel
from costmodel.plan import SHARDING

NUM_INSTANCES = 200
RELATIVE = 1e-9


def random_instance(seed: int):
    """(profile, cluster, global batch size) of a random small instance."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4, 6])
    config = ModelConfig(
        name=f"random-{seed}",
        vocab_size=rng.choice([64, 96]),
        hidden_size=8 * heads,
        intermediate_size=rng.choice([32, 48, 64]),
        num_blocks=rng.randint(1, 6),
        num_heads=heads,
        num_kv_heads=rng.choice([d for d in (1, 2, 3, 6) if heads % d == 0]),
        max_seq_len=64,
        tie_embeddings=rng.random() < 0.3,
    )
    # Keep the brute force quick: many layers only with few GPUs.
    most_gpus = 6 if config.num_layers <= 5 else (5 if config.num_layers <= 6 else 4)
    counts = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    while sum(counts) > most_gpus:
        i = rng.randrange(len(counts))
        counts[i] -= 1
        counts = [c for c in counts if c]
    tps = sorted({1} | {t for t in (2, 3) if rng.random() < 0.7})
    profile = synthetic_profile(config, seq_len=16, micro_batch_sizes=(1, 2), tp_degrees=tuple(tps), rng=rng)
    layers = tuple(
        dataclasses.replace(layer, output_bytes_per_sample=1024 * rng.randint(1, 64))
        for layer in profile.layers
    )
    profile = dataclasses.replace(profile, layers=layers)
    shape = ClusterSpec.parse(",".join(map(str, counts)), "cpu")
    whole_model = sum(CostModel(profile, shape).stage(0, config.num_layers, 1, 1).memory_bytes(1).values())
    memory = int(whole_model * rng.uniform(0.35, 1.5) / (1 - MEMORY_HEADROOM))
    cluster = ClusterSpec(
        device=DeviceSpec(kind="cpu", memory_bytes=memory, peak_flops=1e11),
        nodes=shape.nodes,
        links=LinkSpec(intra_node_gbps=rng.choice([2.0, 10.0]), inter_node_gbps=rng.choice([0.5, 1.0])),
    )
    return profile, cluster, rng.choice([1, 2, 3, 4, 6, 8])


@pytest.mark.parametrize("seed", range(NUM_INSTANCES))
def test_solver_matches_brute_force(seed):
    profile, cluster, gbs = random_instance(seed)
    expected, reference = best_plan(profile, cluster, gbs, [1, 2])
    if reference is None:
        with pytest.raises(ElastorError) as e:
            solver.solve(profile, cluster, gbs, sharding=SHARDING)
        assert len(str(e.value).splitlines()) == 1 and str(e.value).endswith(".")
        return
    cm = CostModel(profile, cluster)
    assert cm.estimate(reference).step_time_s == pytest.approx(expected, rel=1e-12)  # the reference's score
    plan = solver.solve(profile, cluster, gbs, sharding=SHARDING)
    plan.validate(cluster)
    estimate = cm.estimate(plan)
    assert estimate.fits
    assert estimate.step_time_s == pytest.approx(expected, rel=RELATIVE)
    assert plan.predicted["step_time_s"] == estimate.step_time_s
    assert plan.solver["status"] == "OPTIMAL" and plan.solver["gap"] == 0.0


def test_pipelines_of_one_plan_may_differ_in_recompute_mode():
    """Where memory binds so that some pipelines fit only with recomputation, the fastest plan can
    mix pipelines with and without it: the solver finds that plan (equal to the brute force), and
    it beats every plan whose pipelines all share one mode. The instance is a random one (seed
    110) with its device memory at half the whole model's footprint."""
    profile, cluster, _ = random_instance(110)
    whole = sum(CostModel(profile, cluster).stage(0, profile.model.num_layers, 1, 1).memory_bytes(1).values())
    device = dataclasses.replace(cluster.device, memory_bytes=int(whole * 0.5 / (1 - MEMORY_HEADROOM)))
    cluster = dataclasses.replace(cluster, device=device)
    expected, _ = best_plan(profile, cluster, 8, [1])
    one_mode, _ = best_plan(profile, cluster, 8, [1], mix_modes=False)
    plan = solver.solve(profile, cluster, 8, micro_batch_sizes=[1], sharding=SHARDING)
    step = CostModel(profile, cluster).estimate(plan).step_time_s
    assert step == pytest.approx(expected, rel=RELATIVE)
    assert step < one_mode * 0.99
    modes = [{st.recompute for st in pipe.stages} for pipe in plan.pipelines]
    assert {"none"} in modes and any(m != {"none"} for m in modes)

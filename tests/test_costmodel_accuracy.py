"""The cost-model accuracy benchmark's pieces: its statistics, its plans, the measured optimizer term,
and the notebook that plots its results."""

import pytest
from helpers import load_benchmark

from costmodel import PRESETS, ClusterSpec, ModelProfile, Plan
from costmodel.estimate import CostModel

TINY = PRESETS["gpt-tiny"]


def _benchmark():
    return load_benchmark("costmodel_accuracy")


def test_spearman_and_mape_by_hand():
    bench = _benchmark()
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ranks (1, 2, 3, 4) and (1, 3, 2, 4): rho = 1 - 6 * sum(d^2) / (n (n^2 - 1)) = 1 - 12 / 60.
    assert bench.spearman([1, 2, 3, 4], [5, 7, 6, 9]) == pytest.approx(0.8)
    # Ties share their average rank: (1, 2.5, 2.5, 4) against (1, 2, 3, 4).
    assert bench.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert bench.mape([110, 90], [100, 100]) == pytest.approx(0.10)


def test_the_plans_are_valid_and_need_at_most_two_processes():
    plans = _benchmark().plans(TINY)
    assert len(plans) >= 8
    for data in plans.values():
        plan = Plan.from_json(data).validate(ClusterSpec.parse("2", "cpu"))
        assert plan.world_size <= 2


def test_the_profiler_measures_the_optimizer_step_per_layer_shard():
    from profiler.measure import measure_profile

    profile = measure_profile(
        TINY, micro_batch_sizes=[1, 2], tp_degrees=[1, 2], seq_len=16, repeats=3, warmup=1, progress=False
    )
    for layer in profile.layers:
        by_tp = {c.tp_degree: c.optimizer_s for c in layer.costs}
        assert all(c.optimizer_s == by_tp[c.tp_degree] > 0 for c in layer.costs)  # one per shard
    assert ModelProfile.from_json(profile.to_json()) == profile
    whole = CostModel(profile, ClusterSpec.parse("1", "cpu")).stage(0, TINY.num_layers, 1, 1)
    assert whole.optimizer_s == pytest.approx(sum(layer.costs[0].optimizer_s for layer in profile.layers))


def test_the_worker_times_every_phase_of_a_training_step(tmp_path):
    """The benchmark's torchrun worker wraps the trainer's own phases (the main state's zeroing and
    reduction, the schedule, AdamW) and reports each one per step: renaming any of them fails here."""
    bench = _benchmark()
    plan = Plan.from_json(bench.plans(TINY)["1 dev, mbs 2 x 2"]).validate()
    ranks = bench.run_plan(plan, steps=3, warmup=1, tmp=tmp_path)
    assert len(ranks) == 1 and len(ranks[0]["step_s"]) == 3
    terms = bench.measured_terms(ranks, warmup=1)
    assert all(terms[name] > 0 for name in ("step", "pipeline", "sync", "optimizer"))
    assert terms["pipeline"] < terms["step"]

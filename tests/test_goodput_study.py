"""Failure traces, paired comparisons, reproducibility, and the checkpoint interval against Young/Daly."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from costmodel import ElastorError
from goodput import (
    FailureModel,
    PlanPoint,
    RecoveryCosts,
    Study,
    best_intervals,
    draw_trace,
    mean_ci,
    signature,
    summarize,
    young_daly,
)
from goodput.failures import HOUR_S
from goodput.plans import expand, place, signature_order
from goodput.sim import PHASES

POLICIES = ("elastor", "node-drop", "wait-for-repair", "spare-nodes:2")


def linear_oracle(sig):
    gpus = sum(expand(sig))
    return PlanPoint(samples_per_s=10.0 * gpus, num_pipelines=1) if gpus else None


def busy_study(**kwargs) -> Study:
    """16 nodes of 8 GPUs failing 200x as often as in the Llama 3 report: a few failures a day."""
    fields = dict(
        oracle=linear_oracle,
        gpus_per_node=[8] * 16,
        global_batch_size=64,
        failures=FailureModel.llama3().scaled(200),
        costs=RecoveryCosts(load_s=5, reshard_load_s=6, ckpt_stall_s=2, ckpt_background_s=4),
        horizon_s=7 * 86400.0,
    )
    fields.update(kwargs)
    return Study(**fields)


def test_llama3_rates_reproduce_the_reported_interruption_rate():
    # 419 unexpected interruptions in 54 days on 2,048 nodes of 8 H100s: one per 3.09 hours.
    model = FailureModel.llama3()
    assert 1 / model.interruptions_per_hour(16_384, 2_048) == pytest.approx(54 * 24 / 419)


def test_drawn_failures_match_the_rates():
    model = FailureModel.llama3().scaled(50)
    horizon_s = 2000 * HOUR_S
    trace = draw_trace(model, [8] * 64, horizon_s, seed=3)
    counts = trace.counts()
    # Expected counts: rate x exposure, less the little time devices spend under repair.
    for scope, rate, units in (
        ("gpu", model.gpu_per_gpu_hour, 512),
        ("node", model.node_per_node_hour, 64),
        ("job", model.job_per_gpu_hour, 512),
    ):
        expected = rate * units * 2000
        assert abs(counts[scope] - expected) < 4 * math.sqrt(expected) + 0.02 * expected, scope
    assert np.all(np.diff(trace.time_s) >= 0)
    assert np.all(trace.repair_s[trace.scope == 2] == 0)


def test_weibull_lifetimes_keep_the_mean():
    exp = FailureModel(gpu_per_gpu_hour=1e-3, node_per_node_hour=0, job_per_gpu_hour=0, repair_sigma=0,
                       gpu_repair_mean_h=1e-6)  # fmt: skip
    weib = FailureModel(**{**exp.to_json(), "distribution": "weibull", "weibull_shape": 0.7})
    n = [len(draw_trace(m, [8] * 100, 20_000 * HOUR_S, seed=1)) for m in (exp, weib)]
    # A renewal process's long-run rate is 1 / mean lifetime, whatever the shape: 800 x 20 = 16,000.
    assert n[0] == pytest.approx(16_000, rel=0.03) and n[1] == pytest.approx(16_000, rel=0.05)


def test_same_seed_same_result_and_another_seed_another():
    a = busy_study().runs(POLICIES, seeds=[7], intervals_s=[600.0])
    b = busy_study().runs(POLICIES, seeds=[7], intervals_s=[600.0])
    pd.testing.assert_frame_equal(a, b)
    c = busy_study().runs(POLICIES, seeds=[8], intervals_s=[600.0])
    assert not np.allclose(a["goodput_fraction"], c["goodput_fraction"])


def test_policies_see_identical_failure_sequences():
    s = busy_study()
    trace = draw_trace(s.failures, s.gpus_per_node, s.horizon_s, seed=5)
    before = [a.copy() for a in (trace.time_s, trace.node, trace.gpu, trace.repair_s)]
    seen = []
    for policy in POLICIES:
        r = s.run_one(policy, seed=5, ckpt_interval_s=600.0)  # draws the trace from the seed itself
        seen.append(r.counts["failures"])
        s.run_one(policy, seed=5, ckpt_interval_s=600.0, trace=trace)
    assert seen == [len(trace)] * len(POLICIES) and len(trace) > 10
    for a, b in zip(before, (trace.time_s, trace.node, trace.gpu, trace.repair_s), strict=True):
        np.testing.assert_array_equal(a, b)  # no policy alters the shared trace
    runs = s.runs(POLICIES, seeds=[5, 6], intervals_s=[600.0])
    assert runs.groupby("seed")["failures"].nunique().eq(1).all()


def test_lost_work_adds_up_for_every_policy():
    s = busy_study()
    for policy in POLICIES:
        r = s.run_one(policy, seed=2, ckpt_interval_s=900.0)
        total = r.reference_samples_per_s * r.horizon_s
        assert r.useful_samples + sum(r.lost_samples().values()) == pytest.approx(total, rel=1e-9)
        assert sum(r.phase_s[p] for p in PHASES) == pytest.approx(r.horizon_s, rel=1e-12)


def test_elastor_is_never_worse_than_node_drop_on_paired_runs():
    runs = busy_study().runs(["elastor", "node-drop"], seeds=range(3), intervals_s=[900.0])
    wide = runs.pivot(index="seed", columns="policy", values="goodput_fraction")
    assert (wide["elastor"] >= wide["node-drop"] - 1e-12).all()


def test_daly_formula_reproduces_the_papers_examples():
    # Daly (2006), figures 3-5: delta = 5 min and M = 24 h, 6 h, 15 min give 117, 57 and 9.1 min.
    for mtbf_min, expected in ((24 * 60, 117), (6 * 60, 57), (15, 9.1)):
        young, daly = young_daly(5 * 60, mtbf_min * 60)
        assert daly / 60 == pytest.approx(expected, abs=0.5)
        assert young == pytest.approx(math.sqrt(2 * 5 * mtbf_min) * 60)


def test_best_simulated_interval_is_within_20_percent_of_young_daly():
    # Young's model: Poisson crashes (MTBF 2 h) on fixed hardware, checkpoint cost C = 120 s
    # (blocking, no background write), restart 60 s.
    s = Study(
        oracle=linear_oracle,
        gpus_per_node=[8],
        global_batch_size=8,
        failures=FailureModel(gpu_per_gpu_hour=0, node_per_node_hour=0, job_per_gpu_hour=1 / 16),
        costs=RecoveryCosts(detect_s=30, plan_s=0, restart_s=30, ckpt_stall_s=120),
        horizon_s=2000 * HOUR_S,
    )
    young, daly = s.young_daly()
    assert (round(young), round(daly)) == (1315, 1236)
    sweep = s.runs(["elastor"], seeds=[0], intervals_s=list(np.geomspace(500, 3200, 9)))
    best = best_intervals(sweep)["best_interval_s"].iloc[0]
    assert abs(best / daly - 1) < 0.2 and abs(best / young - 1) < 0.2


def test_summary_has_confidence_intervals():
    runs = busy_study().runs(["elastor", "wait-for-repair"], seeds=range(3), intervals_s=[600.0])
    table = summarize(runs)
    assert list(table["policy"]) == ["elastor", "wait-for-repair"]
    assert (table["runs"] == 3).all() and (table["goodput_fraction_ci"] > 0).all()
    assert mean_ci([1.0, 2.0, 3.0]) == pytest.approx((2.0, 4.303 / math.sqrt(3)))
    for few in ([1.0], [1.0, 2.0]):  # no interval below 3 runs: two give t = 12.7, a meaningless span
        mean, half = mean_ci(few)
        assert mean == pytest.approx(sum(few) / len(few)) and math.isnan(half)


def test_signature_groups_interchangeable_nodes():
    counts = np.array([8, 7, 8, 0, 7, 8])
    assert signature(counts) == ((8, 3), (7, 2))
    order = signature_order(counts)
    assert order.tolist() == [0, 2, 5, 1, 4]
    healthy = np.arange(8)[None, :] < counts[:, None]
    in_use = place(PlanPoint(1.0, 1, (8, 8, 4, 7, 0)), order, healthy)
    assert in_use.sum(axis=1).tolist() == [8, 7, 8, 0, 0, 4]


def test_costs_from_a_file_and_defaults_for_a_model():
    from costmodel import PRESETS

    costs = RecoveryCosts.defaults_for(PRESETS["llama3-70b"], num_gpus=16_384, num_pipelines=512)
    # 70.6e9 parameters x 12 bytes = 847 GB of state; a GPU's share 26.5 GB over 25 GB/s.
    assert costs.ckpt_stall_s == pytest.approx(1.06, abs=0.01)
    assert costs.ckpt_background_s == pytest.approx(4.23, abs=0.01)
    measured = costs.updated(json.loads('{"schema_version": 1, "restart_s": 45, "load_s": 8}'), "m.json")
    assert (measured.restart_s, measured.load_s, measured.reshard_load_s) == (45, 8, pytest.approx(9.6))
    with pytest.raises(ElastorError, match="unknown field"):
        costs.updated({"restart": 45}, "m.json")


def test_slices_add_up_and_share_the_damage_worst_first():
    from goodput.slices import SlicedOracle

    asked = []

    def slice_oracle(sig):  # 10 samples/s per GPU, every GPU used but the last node's first one
        asked.append(sig)
        counts = expand(sig)
        return PlanPoint(10.0 * sum(counts), 1, (*counts[:-1], counts[-1] - 1))

    sliced = SlicedOracle(slice_oracle, num_nodes=8, gpus_per_node=8, slices=2)
    healthy = sliced(((8, 8),))
    assert healthy.samples_per_s == 640 and healthy.num_pipelines == 2 and healthy.status == "SLICED"
    # One node dead and one at 7 GPUs: the dead one to the first slice, the partial one to the second.
    damaged = sliced(((8, 6), (7, 1)))
    assert sliced.slice_signatures(((8, 6), (7, 1))) == [((8, 3),), ((8, 3), (7, 1))]
    assert damaged.samples_per_s == 10 * (24 + 31)
    # Usage in the whole signature's order, per healthy count: the first slice's three 8-GPU nodes
    # (its last one a GPU short), the second's, then the 7-GPU node (the second slice's last).
    assert damaged.used_per_node == (8, 8, 7, 8, 8, 8, 6)
    assert set(asked) == {((8, 4),), ((8, 3),), ((8, 3), (7, 1))}
    # Dealt in turn, worst first: dead, 5, 7, 7 -> (dead, 7) and (5, 7).
    assert sliced.slice_signatures(((8, 4), (7, 2), (5, 1))) == [
        ((8, 2), (7, 1)),
        ((8, 2), (7, 1), (5, 1)),
    ]
    with pytest.raises(ElastorError, match="more nodes"):
        sliced.slice_signatures(((8, 9),))
    with pytest.raises(ElastorError, match="does not divide"):
        SlicedOracle(slice_oracle, num_nodes=8, gpus_per_node=8, slices=3)

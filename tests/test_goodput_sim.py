"""The goodput simulation against hand-computed runs, with a throughput oracle standing in for the solver.

The oracle double gives 10 samples/s per healthy GPU, so every figure below can be worked out by hand.
"""

import math

import pytest

from goodput import FailureModel, FailureTrace, PlanPoint, RecoveryCosts, Study
from goodput.plans import expand

PER_GPU = 10.0  # samples/s per GPU in the oracle double


def linear_oracle(sig):
    gpus = sum(expand(sig))
    return PlanPoint(samples_per_s=PER_GPU * gpus, num_pipelines=1) if gpus else None


COSTS = RecoveryCosts(
    detect_s=10,
    detect_node_s=15,
    plan_s=1,
    restart_s=20,
    load_s=5,
    reshard_load_s=6,
    ckpt_stall_s=2,
    ckpt_background_s=3,
)


def study(horizon_s=400.0, costs=COSTS, gpus_per_node=(4, 4), oracle=linear_oracle, failures=None):
    # 8 GPUs, global batch 8: X0 = 80 samples/s = 10 steps/s.
    return Study(
        oracle=oracle,
        gpus_per_node=list(gpus_per_node),
        global_batch_size=8,
        failures=failures or FailureModel.none(),
        costs=costs,
        horizon_s=horizon_s,
    )


def run(s, policy, events, interval_s=100.0):
    return s.run_one(policy, seed=0, ckpt_interval_s=interval_s, trace=FailureTrace.of(s.horizon_s, events))


def test_without_failures_or_checkpoints_goodput_is_the_failure_free_throughput():
    s = study(horizon_s=30 * 86400.0)
    for policy in ("elastor", "node-drop", "wait-for-repair"):
        r = run(s, policy, [], interval_s=None)
        assert r.goodput_samples_per_s == 80.0
        assert r.goodput_fraction == 1.0


def test_without_failures_only_the_stalls_are_lost():
    # K = 100 s * 10 steps/s = 1000 steps; checkpoints due at 100, 202, 304, ... (each stalls 2 s).
    s = study(horizon_s=10_000.0)
    r = run(s, "elastor", [])
    stalls = math.floor((10_000.0 + 2) / 102)  # 98 stalls end by the horizon
    assert r.counts["checkpoints"] == stalls
    assert r.phase_s["stall"] == pytest.approx(2.0 * stalls, rel=1e-12)
    assert r.useful_samples == pytest.approx(80.0 * (10_000.0 - 2.0 * stalls), rel=1e-12)
    assert r.lost_samples()["recompute"] == 0 and r.lost_samples()["restart"] == 0


def test_one_gpu_failure_costs_recomputation_stall_restart_and_load():
    # 0-100 train (1000 steps), 100-102 stall, durable at 105; 102-202 train (2000), 202-204 stall,
    # durable at 207; 204-250 train to 2460 steps. At 250 n1:2 fails: back to 2000 steps (460 steps
    # = 3,680 samples recomputed); detect 10, plan 1 (new layout), restart 20, reshard load 6, then
    # from 287 train on 7 GPUs at 70 samples/s to the horizon at 400.
    r = run(study(), "elastor", [(250.0, "gpu", 1, 2, 1e6)])
    lost = r.lost_samples()
    assert lost["recompute"] == pytest.approx(460 * 8, rel=1e-12)
    assert lost["stall"] == pytest.approx(2 * 2.0 * 80, rel=1e-12)
    assert lost["restart"] == pytest.approx((10 + 1 + 20 + 6) * 80, rel=1e-12)
    assert lost["degraded"] == pytest.approx((80 - 70) * (400 - 287), rel=1e-12)
    assert lost["wait"] == 0
    assert r.useful_samples == pytest.approx((2000 + 8.75 * (400 - 287)) * 8, rel=1e-12)
    assert r.useful_samples + sum(lost.values()) == pytest.approx(80 * 400, rel=1e-12)
    assert r.counts == {
        "failures": 1,
        "interruptions": 1,
        "restarts": 1,
        "in_process": 0,
        "scale_ups": 0,
        "checkpoints": 2,
    }


def replicated_oracle(sig):
    """As linear_oracle, in two pipelines (replicas to recover from) from two GPUs on."""
    gpus = sum(expand(sig))
    return PlanPoint(samples_per_s=PER_GPU * gpus, num_pipelines=min(gpus, 2)) if gpus else None


IN_PROCESS_COSTS = RecoveryCosts(**{**COSTS.to_json(), "reform_s": 4.0, "transfer_s": 0.5, "source": "test"})


def test_a_gpu_lost_in_process_redoes_only_the_step_in_flight():
    # As above up to 250.05 (2460.5 steps): n1:2 fails and the survivors go on in-process: half a
    # step (4 samples) is redone; detect 10, plan 1, re-form 4, transfer 0.5, so from 265.55 on 7
    # GPUs (8.75 steps/s) from step 2460; the checkpoint of step 3000 falls due 540 / 8.75 s later
    # and stalls 2 s; training runs to the horizon at 400.
    s = study(costs=IN_PROCESS_COSTS, oracle=replicated_oracle)
    r = run(s, "elastor-in-process", [(250.05, "gpu", 1, 2, 1e6)])
    lost = r.lost_samples()
    trained_after = 400 - 265.55 - 2
    assert lost["recompute"] == pytest.approx(0.5 * 8, rel=1e-9)
    assert lost["restart"] == pytest.approx((10 + 1 + 4 + 0.5) * 80, rel=1e-9)
    assert lost["stall"] == pytest.approx(3 * 2.0 * 80, rel=1e-9)
    assert lost["degraded"] == pytest.approx((80 - 70) * trained_after, rel=1e-9)
    assert r.useful_samples == pytest.approx((2460 + 8.75 * trained_after) * 8, rel=1e-9)
    assert r.useful_samples + sum(lost.values()) == pytest.approx(80 * 400, rel=1e-12)
    assert r.counts["in_process"] == 1 and r.counts["restarts"] == 0
    # The same failure under `elastor` restarts from the checkpoint of step 2000.
    assert run(s, "elastor", [(250.05, "gpu", 1, 2, 1e6)]).lost_samples()["recompute"] > 400 * 8


def test_a_lost_node_or_a_plan_without_replicas_takes_the_restart_path():
    s = study(costs=IN_PROCESS_COSTS, oracle=replicated_oracle)
    node = run(s, "elastor-in-process", [(250.05, "node", 1, 0, 1e6)])
    assert node.counts["restarts"] == 1 and node.counts["in_process"] == 0
    single = run(study(costs=IN_PROCESS_COSTS), "elastor-in-process", [(250.05, "gpu", 1, 2, 1e6)])
    assert single.counts["restarts"] == 1 and single.counts["in_process"] == 0


def test_a_job_crash_restarts_on_the_same_layout_without_planning():
    # Back at 250 + 10 + 20 + 5 = 285 on all 8 GPUs; 3000 steps fall due at 385 and stall 2 s.
    r = run(study(), "elastor", [(250.0, "job", 1, 2, 0.0)])
    assert r.lost_samples()["restart"] == pytest.approx((10 + 20 + 5) * 80, rel=1e-12)
    assert r.lost_samples()["degraded"] == 0
    assert r.lost_samples()["stall"] == pytest.approx(3 * 2.0 * 80, rel=1e-12)
    assert r.useful_samples == pytest.approx((2000 + 10 * (400 - 285 - 2)) * 8, rel=1e-12)


@pytest.mark.parametrize(
    ("when", "progress_steps"),
    [(203.0, 2000.0), (206.0, 2000.0 + 2 * 10)],  # during the stall; after it, before durable at 207
)
def test_a_failure_before_the_checkpoint_is_durable_loses_it(when, progress_steps):
    r = run(study(), "elastor", [(when, "gpu", 0, 0, 1e6)])
    assert r.recomputed_samples == pytest.approx((progress_steps - 1000) * 8, rel=1e-12)


def test_a_failure_of_an_idle_gpu_does_not_interrupt():
    def seven_of_eight(sig):  # the plan leaves the last GPU of the last node idle
        point = linear_oracle(sig)
        counts = expand(sig)
        return PlanPoint(point.samples_per_s - PER_GPU, 1, (*counts[:-1], counts[-1] - 1))

    s = study(oracle=seven_of_eight)
    r = run(s, "elastor", [(250.0, "gpu", 1, 3, 1e6)])
    assert r.counts["interruptions"] == 0
    # 70 samples/s, K = 875 steps = 100 s: stalls at 100, 202 and 304.
    assert r.useful_samples == pytest.approx(70 * (400 - 3 * 2), rel=1e-12)


def test_node_drop_loses_the_whole_node():
    r = run(study(), "node-drop", [(250.0, "gpu", 1, 2, 1e6)])
    assert r.lost_samples()["degraded"] == pytest.approx((80 - 40) * (400 - 287), rel=1e-12)


def test_wait_for_repair_waits_then_restarts_on_the_original_layout():
    # Detected at 260, repaired at 250 + 100 = 350, restart 20 and same-layout load 5: trains from 375.
    r = run(study(), "wait-for-repair", [(250.0, "gpu", 1, 2, 100.0)])
    assert r.phase_s["wait"] == pytest.approx(90.0)
    assert r.useful_samples == pytest.approx((2000 + 10 * (400 - 375)) * 8, rel=1e-12)


def test_spare_nodes_swap_in_a_spare_and_keep_the_layout():
    # Three nodes, one a spare: train on 8 GPUs (X = 80 of the reference 120 samples/s).
    s = study(gpus_per_node=(4, 4, 4))
    r = run(s, "spare-nodes:1", [(250.0, "gpu", 0, 1, 1e6)], interval_s=100.0)
    assert r.lost_samples()["restart"] == pytest.approx((10 + 20 + 5) * 120, rel=1e-12)
    # A second failure on the training nodes finds no healthy spare: wait (here until the horizon)
    # once the lost host is detected (15 s).
    r2 = run(s, "spare-nodes:1", [(250.0, "gpu", 0, 1, 1e6), (300.0, "node", 1, -1, 1e6)], interval_s=100.0)
    assert r2.phase_s["wait"] == pytest.approx(400 - 300 - 15)


def test_a_lost_host_is_detected_in_its_own_time():
    # As test_one_gpu_failure_costs_recomputation_stall_restart_and_load, but the whole of n1 is lost
    # at 250: detected after detect_node_s 15, then plan 1, restart 20, reshard load 6: 4 GPUs from 292.
    r = run(study(), "elastor", [(250.0, "node", 1, -1, 1e6)])
    assert r.phase_s["detect"] == pytest.approx(15.0)
    assert r.lost_samples()["restart"] == pytest.approx((15 + 1 + 20 + 6) * 80, rel=1e-12)
    assert r.lost_samples()["degraded"] == pytest.approx((80 - 40) * (400 - 292), rel=1e-12)


def test_elastor_scales_back_up_at_the_next_checkpoint():
    # n1:2 fails at 250 and is back at 300. Restarted at 287 on 7 GPUs (8.75 steps/s, 2000 steps);
    # the next checkpoint (3000 steps) falls due at 287 + 1000 / 8.75, where the save blocks for
    # stall 2 + background 3, then plan 1, restart 20 and reshard load 6 bring back all 8 GPUs.
    horizon = 1000.0
    s = study(horizon_s=horizon)
    r = run(s, "elastor", [(250.0, "gpu", 1, 2, 50.0)])
    due = 287 + 1000 / 8.75
    back = due + 2 + 3 + 1 + 20 + 6
    assert r.counts["scale_ups"] == 1 and r.counts["restarts"] == 2
    # From `back`, 8 GPUs at 10 steps/s, with checkpoints every 1000 steps after 3000 (2 s stalls).
    steps, t = 3000.0, back
    while t + 100 + 2 <= horizon:
        steps, t = steps + 1000, t + 102
    steps += 10 * min(horizon - t, 100)
    assert r.useful_samples == pytest.approx(steps * 8, rel=1e-12)

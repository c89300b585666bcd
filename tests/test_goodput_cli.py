"""`elastor simulate`: the whole path from files to tables and plots, and its user errors."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO

import solver
from costmodel import PRESETS, ElastorError, flops
from costmodel.jsonio import write_json
from elastor.cli import main
from profiler.analytic import analytic_profile


def fake_solve(profile, cluster, global_batch_size, method="elastor", interleave=False):
    """A solver double: every healthy GPU in one plan, 10 samples/s each (interleaved or not)."""
    return SimpleNamespace(
        devices=cluster.devices,
        pipelines=[None],
        predicted={"samples_per_s": 10.0 * cluster.world_size},
        solver={"status": "OPTIMAL", "gap": 0.0},
    )


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    profile = analytic_profile(
        PRESETS["gpt-tiny"], device_kind="H100-80GB", micro_batch_sizes=[1, 2], tp_degrees=[1, 2], seq_len=64
    )
    write_json(path, profile.to_json())
    return str(path)


def test_simulate_prints_the_table_and_writes_csv_and_plots(monkeypatch, tmp_path, profile_path, capsys):
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    out = tmp_path / "sim"
    costs = tmp_path / "costs.json"  # measured costs; gpt-tiny's own would checkpoint every step
    costs.write_text('{"ckpt_stall_s": 20, "restart_s": 60, "load_s": 10}')
    args = ["simulate", "--profile", profile_path, "--cluster", "4x8", "--global-batch-size", "8"]
    args += ["--days", "3", "--runs", "2", "--costs", str(costs), "--quiet", "--out-dir", str(out)]
    # Llama 3's rates on 32 GPUs give a failure a month: scale them up so that something happens.
    args += ["--sweep-intervals", "auto", "--rate-factors", "100,300"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for policy in ("elastor", "node-drop", "wait-for-repair", "spare-nodes:1"):
        assert f"\n{policy} " in printed
    # MFU beside the throughput, on the 32 GPUs the plan runs on (costmodel.flops' one definition)
    config, peak = PRESETS["gpt-tiny"], 989e12  # H100's dense bf16 peak
    mfu = 320.0 * 64 * flops.model_flops_per_token(config, 64) / (32 * peak)
    assert f"failure-free: 320.0 samples/s (MFU {mfu:.1%}, 1 pipelines)" in printed
    assert "best interval s" in printed
    detected = "detect 20.5 s (a lost host 11 s)"
    assert f"costs ({costs}): {detected}, plan 1 s, restart 60 s, load 10.0 s (reshard 12.0 s)" in printed
    for name in ("runs.csv", "summary.csv", "intervals.csv", "best_intervals.csv", "rates.csv"):
        assert (out / name).stat().st_size > 0, name
    for name in ("goodput_vs_interval.png", "goodput_vs_failure_rate.png", "timeline.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name


def test_the_plan_cache_spares_a_second_run_every_solve(monkeypatch, tmp_path, profile_path, capsys):
    calls = []
    monkeypatch.setattr(
        solver, "solve", lambda *a, **k: calls.append(a) or fake_solve(*a, **k), raising=False
    )
    cache = tmp_path / "plans.json"
    args = ["simulate", "--profile", profile_path, "--cluster", "4x8", "--global-batch-size", "8", "--quiet"]
    args += ["--days", "2", "--runs", "2", "--rate-factors", "300", "--plan-cache", str(cache)]
    assert main(args) == 0
    first = capsys.readouterr().out
    solved = len(calls)
    assert solved > 1 and f"{solved} solved now" in first
    assert main(args) == 0
    assert len(calls) == solved and "0 solved now" in capsys.readouterr().out
    assert main([*args, "--global-batch-size", "16"]) == 0  # other inputs: other plans
    assert len(calls) > solved


@pytest.mark.parametrize(
    ("flags", "sentence"),
    [
        (["--cluster", "2x"], "is neither healthy GPUs per node"),
        (["--policies", "elastor,magic"], "Unknown policy 'magic'"),
        (["--policies", "spare-nodes:9"], "spare-nodes needs between 1 and 1 spares"),
        (["--costs", "absent.json"], "The costs file absent.json does not exist."),
        (["--sweep-intervals", "60,x"], "--sweep-intervals takes positive numbers"),
        (["--failures", "weird.json"], "The failure model file weird.json does not exist."),
    ],
)
def test_user_errors_are_one_sentence(monkeypatch, profile_path, capsys, flags, sentence):
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "2x8", "--global-batch-size", "8", "--quiet"]
    assert main(args + flags) == 2
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err


def test_goodput_never_imports_torch():
    code = "import goodput, goodput.experiment, goodput.plots, sys; assert 'torch' not in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_simulate_on_the_real_solver(profile_path, capsys):
    args = ["simulate", "--profile", profile_path, "--cluster", "2x4", "--global-batch-size", "8"]
    assert main([*args, "--days", "2", "--runs", "2", "--rate-factors", "1000", "--quiet"]) == 0
    assert "solved now" in capsys.readouterr().out


def test_slices_plan_each_slice_for_its_share_of_the_batch(monkeypatch, profile_path, capsys):
    batches = []

    def solve(profile, cluster, global_batch_size, **kwargs):
        batches.append(global_batch_size)
        return fake_solve(profile, cluster, global_batch_size, **kwargs)

    monkeypatch.setattr(solver, "solve", solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "4x8", "--global-batch-size", "8", "--quiet"]
    assert main([*args, "--days", "1", "--runs", "1", "--slices", "2"]) == 0
    printed = capsys.readouterr().out
    assert "samples/s (MFU " in printed and "%, 2 pipelines, planned as 2 slices)" in printed
    assert set(batches) == {4}
    assert main([*args, "--slices", "3"]) == 2
    assert "needs nodes with equal GPU counts and a global batch it divides" in capsys.readouterr().err


def test_auto_slices_are_the_fewest_of_at_most_2048_gpus_that_split_evenly():
    from goodput.slices import auto_slices

    assert auto_slices([8] * 256, 512) == 1  # small enough to plan whole
    assert auto_slices([8] * 2048, 4096) == 8
    assert auto_slices([8] * 2000, 4100) == 10  # 8 slices of 250 nodes fit, but 8 does not divide the batch
    assert auto_slices([8] * 257, 512) == 1  # 257 nodes are prime: no even split
    assert auto_slices([8] * 300 + [4], 600) == 1  # unequal nodes


def test_slices_default_to_auto(monkeypatch, profile_path, capsys):
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--global-batch-size", "8", "--quiet"]
    args += ["--failures", "none", "--ckpt-interval", "3600", "--days", "0.5", "--runs", "1"]
    assert main([*args, "--cluster", "512x8"]) == 0
    assert "%, 2 pipelines, planned as 2 slices)" in capsys.readouterr().out
    assert main([*args, "--cluster", "257x8"]) == 0
    assert "planning all 2,056 GPUs as one cluster" in capsys.readouterr().err
    assert main([*args, "--cluster", "4x8", "--slices", "two"]) == 2
    assert '--slices takes "auto" or a positive whole number' in capsys.readouterr().err


def test_without_failures_there_are_no_periodic_checkpoints(monkeypatch, profile_path, capsys):
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "4x8", "--global-batch-size", "8"]
    args += ["--failures", "none", "--days", "1", "--runs", "1", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "checkpoint interval none (no failures)" in printed
    assert "\nelastor             320.0              100.00 " in printed and "±" not in printed
    assert "confidence intervals need --runs 3 or more" in printed
    assert main([*args, "--sweep-intervals", "auto"]) == 2
    assert "--sweep-intervals auto needs failures" in capsys.readouterr().err


def test_unequal_nodes_run_every_policy_that_applies_and_say_which_they_skip(
    monkeypatch, profile_path, capsys
):
    """`--cluster 8,8,7` failed outright: the default spare-nodes policy swaps nodes of one size."""
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "8,8,7", "--global-batch-size", "8"]
    assert main([*args, "--days", "3", "--runs", "1", "--rate-factors", "100", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert all(f"\n{policy} " in printed for policy in ("elastor", "node-drop", "wait-for-repair"))
    assert "spare-nodes skipped: it swaps nodes of one size, and these have 8, 7 GPUs." in printed
    assert "\nspare-nodes:" not in printed


def test_the_interval_answer_is_printed_without_a_sweep(monkeypatch, profile_path, capsys):
    monkeypatch.setattr(solver, "solve", fake_solve, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "4x8", "--global-batch-size", "8"]
    args += ["--days", "3", "--runs", "1", "--rate-factors", "100", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    daly = printed.split("Daly ")[1].split(" s)")[0]
    assert f"interval answer: checkpoint every {daly} s of training, Daly's optimum" in printed
    assert main([*args, "--ckpt-interval", "600"]) == 0
    assert "interval answer: not searched; every policy checkpointed every 600 s as asked" in (
        capsys.readouterr().out
    )


def test_slices_too_small_for_any_pipeline_say_so(monkeypatch, profile_path, capsys):
    def no_plan(*args, **kwargs):
        raise ElastorError("No plan fits.")

    monkeypatch.setattr(solver, "solve", no_plan, raising=False)
    args = ["simulate", "--profile", profile_path, "--cluster", "512x8", "--global-batch-size", "8"]
    assert main([*args, "--failures", "none", "--quiet"]) == 2
    assert "No plan fits a slice of 256 nodes with its share of the batch (4)" in capsys.readouterr().err

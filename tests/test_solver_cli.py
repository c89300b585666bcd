"""`elastor plan` and `elastor whatif` end to end on small synthetic and analytic profiles."""

import json

import pandas as pd
from helpers import run_elastor
from synthetic import synthetic_profile

from costmodel import PRESETS, ClusterSpec, Plan
from costmodel.estimate import CostModel
from costmodel.jsonio import write_json
from elastor.cli import main
from profiler.analytic import analytic_profile


def tiny_profile(tmp_path) -> str:
    path = tmp_path / "tiny.json"
    write_json(path, synthetic_profile().to_json())
    return str(path)


def test_plan_writes_a_valid_plan_and_prints_its_stages(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", tiny_profile(tmp_path), "--cluster", "3,2", "--global-batch-size", "8"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(json.loads(out.read_text()))
    cluster = ClusterSpec.parse("3,2", "cpu")
    estimate = CostModel(synthetic_profile(), cluster).estimate(plan.validate(cluster))
    assert plan.predicted["step_time_s"] == estimate.step_time_s
    assert plan.solver["method"] == "elastor" and plan.solver["status"] == "OPTIMAL"
    assert plan.summary() in printed and estimate.explain() in printed
    assert "elastor: OPTIMAL" in printed


def test_plan_compare_lists_every_method(tmp_path, capsys):
    args = ["plan", "--profile", tiny_profile(tmp_path), "--cluster", "2,2,1", "--global-batch-size", "8"]
    assert main([*args, "--compare", "--out", str(tmp_path / "p.json")]) == 0
    table = capsys.readouterr().out.split("method ")[-1]
    for method in ("elastor", "uniform", "node-drop", "pow2-greedy"):
        assert f"\n{method} " in "\n" + table, method


def test_node_drop_keeps_only_nodes_with_every_gpu_of_a_whole_node(tmp_path, capsys):
    """`--cluster 7,7` planned all 14 GPUs as node-drop when a node counted as whole if it had as many
    GPUs as the largest node now; with a nominal 8 GPUs per node neither node is whole."""
    args = ["plan", "--profile", tiny_profile(tmp_path), "--cluster", "3,3", "--global-batch-size", "8"]
    out = tmp_path / "p.json"
    assert main([*args, "--method", "node-drop", "--out", str(out)]) == 0
    assert len(Plan.from_json(json.loads(out.read_text())).devices) == 6
    assert main([*args, "--gpus-per-node", "4", "--method", "node-drop", "--out", str(out)]) == 2
    assert "no node of cluster 3,3 has all 4 GPUs" in capsys.readouterr().err
    assert main([*args[:4], "4,3", *args[5:], "--method", "node-drop", "--out", str(out)]) == 0
    assert {d.split(":")[0] for d in Plan.from_json(json.loads(out.read_text())).devices} == {"n0"}


def test_plan_of_a_model_too_large_is_one_sentence_and_exit_2(tmp_path):
    path = tmp_path / "p70.json"
    profile = analytic_profile(
        PRESETS["llama2-70b"],
        device_kind="H100-80GB",
        micro_batch_sizes=[1],
        tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )
    write_json(path, profile.to_json())
    result = run_elastor(
        "plan", "--profile", str(path), "--cluster", "7", "--global-batch-size", "64", "--out", "x.json"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert (
        "llama2-70b needs at least" in line
        and "H100-80GB GPUs for weights, gradients and optimizer state; 7 are healthy." in line
    )


def test_whatif_writes_the_csv_and_the_plot(tmp_path, capsys):
    csv, png = tmp_path / "w.csv", tmp_path / "w.png"
    args = ["whatif", "--profile", tiny_profile(tmp_path), "--cluster", "2,2", "--global-batch-size", "8"]
    assert main([*args, "--fail", "0..2", "--csv", str(csv), "--plot", str(png), "--quiet"]) == 0
    frame = pd.read_csv(csv)
    assert len(frame) == 3 * 4 and set(frame.method) == {"elastor", "uniform", "node-drop", "pow2-greedy"}
    assert list(frame[frame.method == "elastor"].healthy_gpus) == [4, 3, 2]
    elastor = frame[frame.method == "elastor"].set_index("failures").samples_per_s
    for method in ("uniform", "node-drop", "pow2-greedy"):
        other = frame[frame.method == method].set_index("failures").samples_per_s
        assert (other.isna() | (elastor >= other * (1 - 1e-12))).all(), method
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "failures  healthy" in printed and "proportional" in printed


def test_a_pinned_grid_can_split_its_backwards(tmp_path, capsys):
    """`--method uniform --split-backward` writes plans whose pipelines split their backwards (and
    price them so: faster than the same grid unsplit); without --method uniform it is a pin error."""
    path = tmp_path / "p7.json"
    write_json(
        path,
        analytic_profile(
            PRESETS["llama2-7b"],
            device_kind="H100-80GB",
            micro_batch_sizes=[1],
            tp_degrees=[1, 2],
            seq_len=4096,
        ).to_json(),
    )
    base = ["plan", "--profile", str(path), "--cluster", "8", "--global-batch-size", "32"]
    grid = ["--method", "uniform", "--tp", "2", "--pp", "4"]
    steps = {}
    for split in (False, True):
        out = tmp_path / f"plan-{split}.json"
        assert main([*base, *grid, *(["--split-backward"] if split else []), "--out", str(out)]) == 0
        plan = Plan.from_json(json.loads(out.read_text()))
        assert all(p.split_backward == split for p in plan.pipelines)
        steps[split] = plan.predicted["step_time_s"]
        assert f"split backward in {len(plan.pipelines) if split else 0} of" in capsys.readouterr().out
    assert steps[True] < steps[False]
    assert main([*base, "--split-backward", "--out", str(tmp_path / "x.json")]) == 2
    assert "--split-backward pin a uniform grid" in capsys.readouterr().err


def test_a_plan_searched_again_for_nccl_buffers_says_why_it_is_not_proven(tmp_path, capsys):
    """gpt-small on 6+5+6 H100s cut to 3.28 GiB: the first answer does not fit once its NCCL buffers
    are counted (tests/test_communicators.py), so the answer is FEASIBLE, and the last line gives
    that reason; it used to blame a time limit that never stopped anything."""
    profile = analytic_profile(
        PRESETS["gpt-small"],
        device_kind="H100-80GB",
        micro_batch_sizes=[1, 2],
        tp_degrees=[1, 2, 4],
        seq_len=1024,
    )
    cluster = ClusterSpec.parse("6,5,6", "H100-80GB").to_json()
    cluster["device"]["memory_bytes"] = int(3.28 * 2**30)
    write_json(tmp_path / "p.json", profile.to_json())
    write_json(tmp_path / "c.json", cluster)
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json")]
    assert main([*args, "--global-batch-size", "32", "--out", str(tmp_path / "plan.json")]) == 0
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("elastor: ")][-1]
    assert "elastor: FEASIBLE" in last and "time limit" not in last
    assert "did not fit once its NCCL buffers were counted exactly" in last and "MiB less memory" in last

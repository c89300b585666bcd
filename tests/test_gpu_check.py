"""`benchmarks/gpu_check.py --device cpu`: the GPU check's every step, scaled down, as a dry run."""

import json

import pytest
from helpers import load_benchmark

from costmodel import ModelProfile


def test_gpu_check_dry_run_writes_profiles_and_measured_against_predicted(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert load_benchmark("gpu_check").main(["--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["recompute"] for r in results["runs"]] == ["none", "full"]
    for run in results["runs"]:
        assert run["measured_step_s"] > 0 and run["predicted_step_s"] > 0
        assert run["predicted_mfu"] is None  # the cpu kind has no peak to divide by
        # the memory event of a real bf16 training step, beside the cost model's prediction
        assert 0.5 < run["peak_ratio"] <= 1.05
    for name, entry in results["profiles"].items():
        profile = ModelProfile.from_json(json.loads((tmp_path / entry["path"]).read_text()))
        assert profile.model.name == name and profile.dtype == "bfloat16" and profile.source == "cpu"
    full, none = (r["memory"] for r in reversed(results["runs"]))
    assert full["activations_peak_bytes"] < none["activations_peak_bytes"]  # recompute keeps less


@pytest.mark.gpu
def test_gpu_check_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = tmp_path / "gpu_check.json"
    assert load_benchmark("gpu_check").main(["--out", str(out)]) == 0
    assert all(r["predicted_mfu"] is not None for r in json.loads(out.read_text())["runs"])

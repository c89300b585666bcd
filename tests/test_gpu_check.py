"""`benchmarks/gpu_check.py --device cpu`: the GPU check's every step, scaled down, as a dry run."""

import json

import pytest
from helpers import load_benchmark

from costmodel import ModelProfile


def test_gpu_check_dry_run_writes_profiles_and_measured_against_predicted(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert load_benchmark("gpu_check").main(["--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    runs = [(r["model"], r["recompute"]) for r in results["runs"]]
    assert runs == [(m, r) for m in ("gpt-tiny", "llama-narrow-block") for r in ("none", "full")]
    for run in results["runs"]:
        assert run["measured_step_s"] > 0 and run["predicted_step_s"] > 0
        assert run["predicted_mfu"] is None  # the cpu kind has no peak to divide by
        # the memory event of a real bf16 training step, beside the cost model's prediction
        assert 0.5 < run["peak_ratio"] <= 1.05
        # three profiled steps ran; on the cpu no kernel time to divide by
        assert run["gpu"]["profiled_step_s"] > 0 and run["gpu"]["busy"] is None
    for name, entry in results["profiles"].items():
        profile = ModelProfile.from_json(json.loads((tmp_path / entry["path"]).read_text()))
        assert profile.model.name == name and profile.dtype == "bfloat16" and profile.source == "cpu"
    for none, full in zip(results["runs"][::2], results["runs"][1::2], strict=True):
        # recompute keeps less
        assert full["memory"]["activations_peak_bytes"] < none["memory"]["activations_peak_bytes"]


@pytest.mark.gpu
def test_gpu_check_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = tmp_path / "gpu_check.json"
    assert load_benchmark("gpu_check").main(["--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert all(r["predicted_mfu"] is not None and r["gpu"]["busy"] > 0 for r in runs)

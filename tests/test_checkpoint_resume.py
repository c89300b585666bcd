"""Training resumed from a checkpoint saved under another plan continues exactly as an uninterrupted run.

`elastor train` under plan A (two pipelines, one of two stages) saves at step 4; `elastor train`
under plan B (one pipeline, TP=2) resumes from it, resharding, and trains to step 8. A single process
trains 8 steps straight. Losses of every step within 1e-5 relative, final weights and AdamW moments
within 1e-5 (the runtime's parity tolerance).
"""

import sys

from dist_helpers import launch, plan_json, torchrun

from costmodel import PRESETS
from costmodel.jsonio import write_json
from runtime.compare import compare_runs
from runtime.elastic.report import read_metrics

MODEL = PRESETS["gpt-tiny"].to_json()
PLAN_A = plan_json(
    MODEL, [(2, [((0, 3), ["n0:0"]), ((3, 6), ["n0:1"])]), (2, [((0, 6), ["n1:0"])])], micro_batch_size=2
)
PLAN_B = plan_json(MODEL, [(4, [((0, 6), ["n0:0", "n0:1"])])], micro_batch_size=2)
SINGLE = plan_json(MODEL, [(4, [((0, 6), ["n0:0"])])], micro_batch_size=2)


def _train(tmp, plan, name: str, nproc: int, *flags: str):
    write_json(tmp / f"{name}.json", plan)
    args = ["-m", "elastor", "train", f"--plan={tmp / f'{name}.json'}", "--steps=8", *flags]
    done = launch(torchrun(nproc, *args) if nproc > 1 else [sys.executable, *args], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_resume_under_another_plan_matches_an_uninterrupted_run(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    _train(
        tmp_path,
        PLAN_A,
        "a",
        3,
        f"--ckpt-dir={ckpt}",
        "--ckpt-every=4",
        "--stop-at=4",
        f"--metrics={metrics}",
    )
    _train(tmp_path, PLAN_B, "b", 2, f"--ckpt-dir={ckpt}", "--ckpt-every=4", f"--metrics={metrics}")
    reference = tmp_path / "reference"
    _train(tmp_path, SINGLE, "single", 1, f"--ckpt-dir={reference}", f"--metrics={tmp_path / 'single.jsonl'}")

    records = read_metrics(metrics)
    restored = next(r for r in records if r.get("event") == "restored")
    assert (restored["step"], restored["saved_devices"], restored["devices"]) == (4, 3, 2)
    check = compare_runs(records, read_metrics(tmp_path / "single.jsonl"), ckpt, reference)
    assert check["steps_match"] and [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert check["loss_max_rel_diff"] <= 1e-5, check
    assert check["param_max_abs_diff"] <= 1e-5, check

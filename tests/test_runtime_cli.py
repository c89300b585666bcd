"""`elastor train` as users run it: under torchrun, with a data file, writing docs/DESIGN.md's metrics."""

import json
import subprocess
import sys

import pytest
import torch
from dist_helpers import REPO, free_port, launch, plan_json, run_env, torchrun

from costmodel import PRESETS, ModelConfig, Plan
from runtime.optim import OptimConfig
from runtime.reference import train_reference

TINY = PRESETS["gpt-tiny"].to_json()
# A TP-2 replica beside a single-device one, 3 and 1 micro-batches of 2.
PLAN = plan_json(
    TINY, [(3, [((0, 6), ["n0:0", "n0:1"])]), (1, [((0, 6), ["n1:0"])])], micro_batch_size=2, seq_len=32
)
STEPS = 6
STEP_FIELDS = {"step", "loss", "step_time_s", "samples_per_s", "ckpt_stall_s"}


def elastor(*args: str) -> subprocess.CompletedProcess:
    """`python -m elastor ARGS` in one process, without torchrun."""
    return subprocess.run(
        [sys.executable, "-m", "elastor", *args],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_plan(tmp_path, plan) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_train_under_torchrun_writes_metrics_and_matches_the_reference(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("Élastor trains through failures. " * 200 + "A node with 7 of 8 GPUs counts.\n" * 50)
    metrics = tmp_path / "m.jsonl"
    args = ["-m", "elastor", "train", "--plan", write_plan(tmp_path, PLAN), "--steps", str(STEPS)]
    args += ["--metrics", str(metrics), "--data", str(text), "--warmup-steps", "2", "--lr", "3e-4"]
    result = launch(torchrun(3, *args), timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1]["event"] == "done"
    assert all(isinstance(r["time_s"], float) for r in (records[0], records[-1]))
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # after the first step, one memory event: every device measured by kind, the prediction beside it
    (memory,) = [r for r in records if r.get("event") == "memory"]
    assert memory["step"] == 1 and set(memory["devices"]) == set(Plan.from_json(PLAN).devices)
    for entry in memory["devices"].values():
        kinds = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_peak_bytes")
        assert all(entry[k] > 0 and entry["predicted"][k] > 0 for k in kinds)
    assert 0 < memory["worst_measured_over_predicted"] <= 1.0
    assert "memory: worst measured/predicted peak" in result.stdout + result.stderr
    for r in steps:
        assert set(r) >= STEP_FIELDS and "mfu" not in r  # a CPU has no peak to measure MFU against
        assert r["step_time_s"] > 0 and r["samples_per_s"] > 0 and r["ckpt_stall_s"] == 0.0

    torch.set_num_threads(1)
    optim = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2, decay_steps=STEPS)
    want, _ = train_reference(
        ModelConfig.from_json(TINY),
        global_batch_size=PLAN["global_batch_size"],
        seq_len=PLAN["seq_len"],
        steps=STEPS,
        optim=optim,
        data=str(text),
    )
    for r, w in zip(steps, want, strict=True):
        assert abs(r["loss"] - w) <= 1e-5 * w


def test_world_size_mismatch_is_one_sentence_on_every_rank(tmp_path):
    """Each rank refuses on its own, before any rendezvous: started alone with the environment
    torchrun gives it, rank 0 or rank 1 of 2 prints the sentence and exits 2 without waiting for the
    other. Under torchrun the first refusal ends the job (torchrun stops the other rank, which may
    not have reached its own check yet)."""
    args = ["-m", "elastor", "train", "--plan", write_plan(tmp_path, PLAN), "--steps", "1"]
    args += ["--metrics", str(tmp_path / "m.jsonl")]
    sentence = "elastor: error: The plan needs 3 processes, one per device, but this job has 2;"
    for rank in (0, 1):
        env = dict(run_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # nobody listens there
        alone = subprocess.run(
            [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert alone.returncode == 2 and alone.stderr.count(sentence) == 1, (rank, alone.stderr[-3000:])
        assert "Traceback" not in alone.stderr
    result = launch(torchrun(2, *args), timeout=120)
    assert result.returncode != 0 and 1 <= result.stderr.count(sentence) <= 2, result.stderr[-3000:]
    assert result.wall_s < 60


@pytest.mark.parametrize(
    ("extra", "sentence"),
    [
        (("--data", "missing.bin"), "The data file missing.bin does not exist."),
        (("--steps", "-1"), "--steps, --warmup-steps and --ckpt-every must be non-negative"),
    ],
)
def test_user_errors_exit_2_with_one_sentence(tmp_path, extra, sentence):
    one_device = plan_json(TINY, [(2, [((0, 6), ["n0:0"])])])
    args = ["train", "--plan", write_plan(tmp_path, one_device), "--metrics", str(tmp_path / "m.jsonl")]
    result = elastor(*args, "--steps", "1", *extra)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [next(line for line in result.stderr.splitlines())]
    assert sentence in result.stderr


def test_a_plan_for_more_devices_without_torchrun_is_refused(tmp_path):
    result = elastor("train", "--plan", write_plan(tmp_path, PLAN), "--steps", "1", "--metrics", "m.jsonl")
    assert result.returncode == 2
    assert "The plan needs 3 processes, one per device, but this job has 1;" in result.stderr


def test_a_gpu_step_reports_its_mfu_where_the_hardware_table_knows_the_kind(monkeypatch):
    """On CUDA every step's record and the progress bar carry the measured MFU: the plan's model
    FLOPs per step (costmodel.flops) over the step time, the plan's GPUs and the kind's peak."""
    from types import SimpleNamespace

    import profiler.measure
    from costmodel import flops
    from costmodel.hardware import DEVICE_KINDS
    from runtime import loop

    plan = Plan.from_json(PLAN)
    trainer = SimpleNamespace(ctx=SimpleNamespace(is_cuda=False), plan=plan)
    assert loop._mfu_of(trainer) is None
    trainer.ctx.is_cuda = True
    monkeypatch.setattr(profiler.measure, "cuda_device_kind", lambda: "H100-80GB")
    per_step = flops.model_flops_per_token(plan.model, 32) * 32 * plan.global_batch_size
    peak = DEVICE_KINDS["H100-80GB"].peak_flops
    assert loop._mfu_of(trainer)(0.5) == pytest.approx(per_step / 0.5 / (3 * peak))
    monkeypatch.setattr(profiler.measure, "cuda_device_kind", lambda: "NVIDIA GB300")  # not in the table
    assert loop._mfu_of(trainer) is None

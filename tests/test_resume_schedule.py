"""A resumed run whose command line asks for another schedule: one rule, never silent.

A run of `--steps 4` stops at step 2 with a checkpoint (warm-up 1 step, cosine to step 4). Resumed
with `--steps 8`, the checkpoint's schedule continues (step 3 has the learning rate of the 4-step
cosine) and one warning names the flag that differs, old and new; with `--reset-schedule` the
8-step cosine takes over from step 3 and the warning says so; resumed with the same flags, nothing
is said. Each resume starts from its own copy of the checkpoint.
"""

import shutil
import sys

import pytest
from dist_helpers import launch, plan_json

from costmodel import PRESETS
from costmodel.jsonio import write_json
from runtime.elastic.report import read_metrics
from runtime.optim import OptimConfig

PLAN = plan_json(PRESETS["gpt-tiny"].to_json(), [(2, [((0, 6), ["n0:0"])])], micro_batch_size=2)
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 1


def _train(tmp, ckpt, metrics, *flags: str):
    command = [sys.executable, "-m", "elastor", "train", f"--plan={tmp / 'plan.json'}"]
    schedule = [f"--lr={LR}", f"--min-lr={MIN_LR}", f"--warmup-steps={WARMUP}"]
    done = launch([*command, *schedule, f"--ckpt-dir={ckpt}", f"--metrics={metrics}", *flags], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedule")
    write_json(tmp / "plan.json", PLAN)
    _train(tmp, tmp / "ckpt", tmp / "first.jsonl", "--steps=4", "--stop-at=2", "--ckpt-every=2")
    return tmp


def _resume(stopped, name: str, *flags: str) -> tuple[str, dict[int, float], list[dict]]:
    ckpt = stopped / f"ckpt-{name}"
    shutil.copytree(stopped / "ckpt", ckpt)
    metrics = stopped / f"{name}.jsonl"
    err = _train(stopped, ckpt, metrics, "--ckpt-every=0", *flags)
    records = read_metrics(metrics)
    return (
        err,
        {r["step"]: r["lr"] for r in records if "lr" in r},
        [r for r in records if r.get("event") == "schedule"],
    )


def _cosine(decay_steps: int) -> OptimConfig:
    return OptimConfig(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, decay_steps=decay_steps)


def test_the_checkpoints_schedule_continues_and_the_difference_is_named(stopped):
    err, lr, events = _resume(stopped, "kept", "--steps=8")
    assert lr[3] == pytest.approx(_cosine(4).lr_at(2)) and lr[3] != pytest.approx(_cosine(8).lr_at(2))
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "--steps 4 -> 8" in warnings[0] and "--reset-schedule" in warnings[0], err
    assert [(e["reset"], e["changed"]) for e in events] == [(False, {"decay_steps": [4, 8]})]


def test_reset_schedule_takes_the_command_lines_from_the_resumed_step(stopped):
    err, lr, events = _resume(stopped, "reset", "--steps=8", "--reset-schedule")
    assert [lr[s] for s in range(3, 9)] == pytest.approx([_cosine(8).lr_at(s - 1) for s in range(3, 9)])
    assert "this command line's schedule (--reset-schedule): --steps 4 -> 8" in err, err
    assert [e["reset"] for e in events] == [True]


def test_a_resume_with_the_same_flags_says_nothing(stopped):
    err, lr, events = _resume(stopped, "same", "--steps=4")
    assert "warning:" not in err and events == []
    assert lr[3] == pytest.approx(_cosine(4).lr_at(2))

"""Recovery without restarting the survivors, under `elastor run` (runtime/elastic/inprocess.py,
runtime/elastic/workers.py): a worker dies, the others re-plan and reshard from each other's memory in
their own processes, and training goes on exactly as an uninterrupted run would have."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dist_helpers import launch, run_env, torchrun
from test_elastic import (
    CKPT_EVERY,
    RUN_TIMEOUT_S,
    _assert_matches_reference,
    _events,
    _profile,
    _reference,
    _run,
    profile_path,  # noqa: F401 - the module-scoped fixture
    run_command,
)

from costmodel import Plan
from costmodel.jsonio import write_json
from runtime.compare import compare_runs
from runtime.elastic.report import format_recoveries, read_metrics, recoveries

IN_PROCESS_STORY = [
    "replanned",
    "start",
    "failure_detected",
    "replanned",
    "restored",
    "start",
    "resumed",
    "done",
]


def test_a_lost_worker_is_recovered_in_process_and_matches_an_uninterrupted_run(tmp_path, profile_path):  # noqa: F811
    steps = 12
    done = _run(tmp_path, profile_path, "2,2", steps, "--inject-failure=n1:1@5")
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    # peer snapshots start wherever the survivors' plan keeps rows on one rank alone
    events = [e for e in _events(records) if e not in ("failure_injected", "peer_snapshots")]
    assert events == IN_PROCESS_STORY, (events, done.stdout[-3000:])
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["path"] == "in-process" and detected["dead"] == ["n1:1"]
    restored = next(r for r in records if r.get("event") == "restored")
    assert restored["path"] == "in-process" and restored["source"] == "peers"
    assert restored["checkpoint_files_read"] == 0  # the state came from the survivors' memory
    assert restored["step"] == 5  # the step the failure came after: nothing is redone
    losses = [r["step"] for r in records if "loss" in r]
    assert losses == list(range(1, steps + 1))
    found = recoveries(records)
    assert [(r.kind, r.path) for r in found] == [("failure", "in-process")]
    assert set(found[0].phases_s) >= {"detect", "plan", "re-form", "transfer", "first step"}
    assert "in-process" in done.stdout  # the breakdown table names the path
    _assert_matches_reference(tmp_path, records, steps)


def test_a_failure_inside_the_commit_all_reduce_is_finished_with_a_peers_totals(tmp_path, profile_path):  # noqa: F811
    """n1:0 dies inside step 5's commit all-reduce: the next device (n1:1) misses the totals while
    the others complete step 5. The commit check finishes step 5 on n1:1 with a peer's totals, so
    every survivor goes on from step 5, and the run equals an uninterrupted one."""
    steps = 12  # as the test above: the two share their uninterrupted reference run
    done = _run(tmp_path, profile_path, "2,2", steps, "--inject-failure=commit:n1:0@5")
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    first = Plan.from_json(next(r["plan"] for r in records if r.get("event") == "replanned"))
    assert first.devices.index("n1:1") == first.devices.index("n1:0") + 1
    restored = next(r for r in records if r.get("event") == "restored")
    assert restored["path"] == "in-process" and restored["step"] == 5, restored
    logs = "".join(p.read_text() for p in (tmp_path / "metrics-logs").glob("*.log"))
    assert "n1:1: finishing step 5 with a peer's totals" in logs, logs[-3000:]
    assert [r.path for r in recoveries(records)] == ["in-process"]
    _assert_matches_reference(tmp_path, records, steps)


@pytest.fixture(scope="module")
def bf16_profile(tmp_path_factory) -> Path:
    """A bf16 profile: ZeRO-1 pays in 16-bit, so the solver takes it."""
    return _profile(tmp_path_factory.mktemp("bf16") / "profile.json", "bfloat16")


def test_a_lost_zero1_slice_rolls_back_to_its_peer_snapshot_exactly(tmp_path, bf16_profile):
    """Under ZeRO-1 the lost rank's optimizer slice lives on in its buddy's snapshot: every survivor
    rolls back to that snapshot's step, in-process, reading no checkpoint, and redoes the steps since.
    The run is bit for bit the one that trains the first plan to that step, saves, and resumes under
    the second plan from the checkpoint."""
    steps = 10
    done = _run(
        tmp_path, bf16_profile, "2,2", steps, "--sharding=zero1", "--peer-snapshot-every=3",
        "--inject-failure=n1:1@5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    first = Plan.from_json(next(r["plan"] for r in records if r.get("event") == "replanned"))
    assert first.optimizer.sharding == "zero1"
    announced = [r for r in records if r.get("event") == "peer_snapshots"]
    assert announced and announced[0]["every"] == 3 and announced[0]["max_sent_bytes"] > 0
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["path"] == "in-process" and detected["source"] == "peer snapshot"
    restored = next(r for r in records if r.get("event") == "restored")
    assert restored["path"] == "in-process" and restored["source"] == "peer snapshot"
    assert restored["checkpoint_files_read"] == 0
    assert restored["step"] == 3 and restored["rolled_back_steps"] == 2  # the snapshot of step 3
    assert [r.path for r in recoveries(records)] == ["in-process"]
    plans = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"]
    reference = _switched_reference(tmp_path / "reference", plans, 3, steps)
    check = compare_runs(records, read_metrics(reference / "metrics.jsonl"), tmp_path / "ckpt", reference)
    assert check["steps_match"], check
    assert check["loss_max_rel_diff"] == 0.0 and check["param_max_abs_diff"] == 0.0, check


SNAPSHOT_TRIALS = 6


@pytest.mark.slow  # -m slow: about 50 s a trial
def test_sigkill_of_a_zero1_worker_at_random_moments_rolls_back_exactly(tmp_path, bf16_profile):
    """SIGKILL one worker of a ZeRO-1 run with peer snapshots every 4 steps at random moments: every
    run recovers in-process from the snapshots, reading no checkpoint, and equals bit for bit the run
    switched from the first plan to the second at the step it rolled back to."""
    rng = random.Random(23)
    steps = 24
    for trial in range(SNAPSHOT_TRIALS):
        tmp = tmp_path / f"trial-{trial}"
        tmp.mkdir()
        command = run_command(tmp, bf16_profile, "2,2", steps, "--sharding=zero1", "--peer-snapshot-every=4")
        # after the snapshot of step 4: the reference switches plans at a saved step
        victim, phase, records = _run_killing_one(tmp, command, rng, after_step=rng.randint(5, steps - 8))
        restored = next(r for r in records if r.get("event") == "restored")
        assert restored["checkpoint_files_read"] == 0 and restored["source"] == "peer snapshot", restored
        # the newest snapshot, or the one before while the newest was still being exchanged
        assert restored["step"] % 4 == 0 and 0 <= restored["rolled_back_steps"] <= 2 * 4 + 1, restored
        plans = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"]
        reference = _switched_reference(tmp / "reference", plans, restored["step"], steps)
        check = compare_runs(records, read_metrics(reference / "metrics.jsonl"), tmp / "ckpt", reference)
        assert check["steps_match"], (victim, phase, check)
        assert check["loss_max_rel_diff"] == 0.0 and check["param_max_abs_diff"] == 0.0, (
            victim,
            phase,
            check,
        )
        print(f"trial {trial}: {victim} in {phase}, rolled back {restored['rolled_back_steps']} step(s)")


def _switched_reference(out: Path, plans: list[Plan], switch_step: int, steps: int) -> Path:
    """Train plans[0] to `switch_step` under torchrun, save, and resume under plans[1] to `steps`:
    the uninterrupted run of an exact rollback to `switch_step`. Returns its checkpoint directory."""
    out.mkdir()
    common = [f"--steps={steps}", f"--ckpt-dir={out}", f"--metrics={out / 'metrics.jsonl'}", "--device=cpu"]
    for k, (plan, extra) in enumerate([(plans[0], [f"--stop-at={switch_step}"]), (plans[1], [])]):
        write_json(out / f"plan-{k}.json", plan.to_json())
        command = torchrun(plan.world_size, "-m", "elastor", "train", f"--plan={out / f'plan-{k}.json'}")
        done = launch([*command, *common, *extra], timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow  # -m slow: make test's time budget (test_peer_reshard.py checks the missing rows)
def test_a_lost_zero1_slice_falls_back_to_the_checkpoint_and_says_why(tmp_path, bf16_profile):
    """Under ZeRO-1 without peer snapshots the lost rank's optimizer slice is held by nobody else:
    the restart path runs."""
    done = _run(
        tmp_path,
        bf16_profile,
        "2,2",
        8,
        "--sharding=zero1",
        "--peer-snapshot-every=0",
        "--inject-failure=n1:1@5",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    declined = [r for r in records if r.get("event") == "in_process_declined"]
    assert len(declined) == 1 and "held by no survivor" in declined[0]["why"], declined
    assert "zero1 optimizer state" in declined[0]["why"]
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["path"] == "restart"
    restored = next(r for r in records if r.get("event") == "restored")
    assert restored["checkpoint"] == f"step-{CKPT_EVERY:08d}"  # from storage: the newest checkpoint
    assert [r.path for r in recoveries(records)] == ["restart"]
    assert "no in-process recovery" in done.stdout


TRIALS = 20


@pytest.mark.slow  # -m slow: about 20 s a trial
def test_sigkill_at_random_moments_recovers_in_process_every_time(tmp_path, profile_path):  # noqa: F811
    """SIGKILL one worker of the 2+2 cluster at a random moment of a random step (forward, backward,
    the gradient reduction, the optimizer step, a checkpoint save): every run recovers in-process
    and its losses and final weights equal the uninterrupted run's."""
    rng = random.Random(17)
    steps, phases, times = 40, [], []  # a step takes tens of milliseconds here
    reference = None
    for trial in range(TRIALS):
        tmp = tmp_path / f"trial-{trial}"
        tmp.mkdir()
        command = run_command(tmp, profile_path, "2,2", steps)
        victim, phase, records = _run_killing_one(tmp, command, rng, after_step=rng.randint(1, steps - 10))
        phases.append(phase)
        found = recoveries(records)
        assert all(r.get("checkpoint_files_read", 0) == 0 for r in records if r.get("event") == "restored")
        times.append(found[0].total_s)
        if reference is None:
            reference_dir = _reference(tmp, records, steps)
            reference = read_metrics(reference_dir.with_suffix(".jsonl"))
        check = compare_runs(records, reference, tmp / "ckpt", reference_dir)
        assert check["steps_match"] and check["equal"], (victim, phase, check)
        assert check["loss_max_rel_diff"] <= 1e-5 and check["param_max_abs_diff"] <= 1e-5, check
    times.sort()
    median = times[len(times) // 2]
    print(f"phases killed in: {sorted(phases)}; recovery s: median {median:.2f}, max {times[-1]:.2f}")
    assert len(set(phases)) >= 3, phases  # the kills landed in several parts of a step


def _run_killing_one(tmp: Path, command: list[str], rng: random.Random, after_step: int):
    """Run `command` (an `elastor run` writing tmp/metrics.jsonl), SIGKILL one of its workers at a
    random moment after `after_step` (`_kill_a_worker`), check that the run still finishes and that
    its one recovery took the in-process path; returns the victim, its phase and the metrics."""
    with open(tmp / "out.txt", "w") as out:
        run = subprocess.Popen(command, env=run_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        victim, phase = _kill_a_worker(tmp, rng, after_step=after_step)
        code = run.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert code == 0, (tmp / "out.txt").read_text()[-3000:]
    records = read_metrics(tmp / "metrics.jsonl")
    found = recoveries(records)
    assert [r.path for r in found] == ["in-process"], (victim, phase, format_recoveries(found))
    return victim, phase, records


def _kill_a_worker(tmp: Path, rng: random.Random, after_step: int) -> tuple[str, str]:
    """SIGKILL a random worker of the run writing tmp/metrics.jsonl once it has done `after_step`
    steps, after a further random delay; returns its device and the phase its progress record last
    showed (published every runtime.elastic.progress.PUBLISH_S, so at most that old)."""
    metrics = tmp / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        done = [r for r in read_metrics(metrics) if "loss" in r] if metrics.exists() else []
        if done and done[-1]["step"] >= after_step:
            break
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.05))
    workers = _workers_of(metrics)
    assert workers, "no worker of the run was found"
    device, (pid, progress_dir) = rng.choice(sorted(workers.items()))
    record = Path(progress_dir) / f"{device.replace(':', '_')}.json"
    phase = json.loads(record.read_text()).get("phase", "?") if record.exists() else "?"
    os.kill(pid, signal.SIGKILL)
    return device, phase


def _workers_of(metrics: Path) -> dict[str, tuple[int, str]]:
    """The `elastor train` processes of the run writing `metrics`: device -> (pid, progress dir)."""
    first = next(r for r in read_metrics(metrics) if r.get("event") == "replanned")
    order = Plan.from_json(first["plan"]).devices
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                line.split("=", 1) for line in (entry / "environ").read_text().split("\0") if "=" in line
            )
        except OSError:
            continue
        if b"train" in cmdline and f"--metrics={metrics}".encode() in cmdline and "RANK" in environ:
            found[order[int(environ["RANK"])]] = (int(entry.name), environ["ELASTOR_PROGRESS_DIR"])
    return found

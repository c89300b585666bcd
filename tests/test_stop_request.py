"""SIGTERM or SIGINT ends training after a step with a checkpoint (runtime/stopping.py), and the run
resumed from it matches an uninterrupted one.

Alone under torchrun the signal goes to torchrun, which forwards it to its workers, as a scheduler's
preemption does; under `elastor run` it goes to the launcher, which tells every supervisor
(tests/test_elastic_faults.py has the multi-node story, `slow`).
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
from dist_helpers import REPO, _group_alive, _kill_group, launch, plan_json, run_env, torchrun

from costmodel import PRESETS
from costmodel.jsonio import write_json
from runtime import stopping
from runtime.compare import compare_runs
from runtime.elastic.report import read_metrics
from runtime.elastic.supervisor import checkpointed_step

STEPS = 12
MODEL = PRESETS["gpt-tiny"].to_json()
TWO_STAGES = plan_json(MODEL, [(2, [((0, 3), ["n0:0"]), ((3, 6), ["n0:1"])])], micro_batch_size=2)
ONE_PROCESS = plan_json(MODEL, [(2, [((0, 6), ["n0:0"])])], micro_batch_size=2)


def _train_args(tmp, name: str, nproc: int) -> list[str]:
    """Two stages on two processes under torchrun, or the whole model in one (the reference)."""
    plan = tmp / f"plan-{nproc}.json"
    write_json(plan, TWO_STAGES if nproc == 2 else ONE_PROCESS)
    data = tmp / "data"  # real data, shuffled: the resumed run must read on where the stopped one left off
    if not data.exists():
        data.mkdir()
        for i, size in enumerate((900, 700)):
            tokens = np.random.default_rng(i).integers(0, MODEL["vocab_size"], size)
            np.save(data / f"shard-{i}.npy", tokens.astype(np.uint32))
    args = ["-m", "elastor", "train", f"--plan={plan}", f"--steps={STEPS}", f"--data={data}"]
    args += [f"--ckpt-dir={tmp / name}", "--ckpt-every=100", f"--metrics={tmp / f'{name}.jsonl'}"]
    return torchrun(nproc, *args) if nproc > 1 else [sys.executable, *args]


def _steps_logged(path) -> int:
    if not path.exists():
        return 0
    return max((r["step"] for r in read_metrics(path) if "loss" in r), default=0)


def test_a_request_is_taken_from_a_signal_or_from_the_supervisors_file(tmp_path):
    alone = stopping.StopRequest()
    alone.listen(None)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert alone.requested and alone.exit_code() == 143 and alone.name() == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # the same request by another path: not a second one
        assert alone.signum == signal.SIGTERM
    finally:
        alone.restore()
    supervised = stopping.StopRequest()
    supervised.listen(str(tmp_path))
    assert not supervised.requested
    stopping.request_stop(tmp_path, signal.SIGINT)
    deadline = time.monotonic() + 5
    while not supervised.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervised.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # under a supervisor SIGTERM still kills


def test_sigterm_at_a_random_step_checkpoints_that_step_and_the_resumed_losses_equal_an_unstopped_run(
    tmp_path,
):
    at = random.Random().randint(1, 5)
    print(f"SIGTERM once step {at} is logged")
    proc = subprocess.Popen(
        _train_args(tmp_path, "ckpt", 2), cwd=REPO, env=run_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while (seen := _steps_logged(tmp_path / "ckpt.jsonl")) < at and proc.poll() is None:
            assert time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to the workers
        proc.wait(timeout=60)
        reader.join(timeout=10)
        assert not _group_alive(proc.pid), "a process of the stopped run is still alive"
    finally:
        if _group_alive(proc.pid):
            _kill_group(proc.pid)
        proc.wait()
    printed = "".join(output)
    stopped = [r for r in read_metrics(tmp_path / "ckpt.jsonl") if r.get("event") == "stopped"]
    assert len(stopped) == 1, printed[-3000:]
    step = stopped[0]["step"]
    assert seen <= step <= seen + 2 < STEPS, (seen, step)  # the step in flight, or the next
    assert checkpointed_step(tmp_path / "ckpt") == step and stopped[0]["signal"] == "SIGTERM"
    assert f"stopped on request after step {step}" in printed and proc.returncode != 0

    resumed = launch(_train_args(tmp_path, "ckpt", 2), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    unstopped = launch(_train_args(tmp_path, "reference", 1), timeout=300)
    assert unstopped.returncode == 0, unstopped.stderr[-3000:]
    records = read_metrics(tmp_path / "ckpt.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    check = compare_runs(
        records, read_metrics(tmp_path / "reference.jsonl"), tmp_path / "ckpt", tmp_path / "reference"
    )
    assert check["steps_match"] and check["loss_max_rel_diff"] <= 1e-5, check  # the parity tolerance
    assert check["param_max_abs_diff"] <= 1e-5, check

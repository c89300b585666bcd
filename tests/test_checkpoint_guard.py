"""A --ckpt-dir's guards: one job at a time, only Elastor's own debris removed, an older checkpoint
tried when the newest fails its checks (on any rank), and a full disk that loses nothing."""

import errno
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from checkpoint_support import TINY, random_plan, rank_pieces, save_in_process
from dist_helpers import elastor_run, launch, plan_json, torchrun

from costmodel import PRESETS
from costmodel.jsonio import write_json
from runtime.checkpoint import Checkpointer, CheckpointError, latest_checkpoint
from runtime.checkpoint import commit as commit_module
from runtime.checkpoint.format import Manifest
from runtime.checkpoint.lock import ENV_JOB, lock_directory
from runtime.checkpoint.store import committed, remove_stale
from runtime.checkpoint.verify import verify_checkpoint
from runtime.elastic.report import read_metrics

MODEL = PRESETS["gpt-tiny"].to_json()
TWO_STAGES = plan_json(MODEL, [(2, [((0, 3), ["n0:0"]), ((3, 6), ["n0:1"])])], micro_batch_size=2)


# ---- the lock -------------------------------------------------------------------------------------
def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with lock_directory(tmp_path, job="aaaa") as held:
        assert held.job == "aaaa"
        with pytest.raises(
            CheckpointError, match=rf"in use by another job \(pid {os.getpid()} on .*job aaaa"
        ):
            lock_directory(tmp_path, job="bbbb")
    lock_directory(tmp_path, job="bbbb").release()  # released: free again


def test_a_worker_of_the_holding_job_goes_on_and_a_stranger_does_not(tmp_path, monkeypatch):
    with lock_directory(tmp_path, job="cafe01"):
        monkeypatch.setenv(ENV_JOB, "cafe01")
        lock_directory(tmp_path).release()  # the supervisor's own worker
        monkeypatch.setenv(ENV_JOB, "beef02")
        with pytest.raises(CheckpointError, match="in use by another job"):
            lock_directory(tmp_path)


def test_a_killed_holder_leaves_the_directory_free(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from runtime.checkpoint.lock import lock_directory\n"
            "lock = lock_directory(sys.argv[1], job='dead01'); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="dead01"):
            lock_directory(tmp_path)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock_directory(tmp_path).release()  # SIGKILL released it: no stale lock to clean up by hand


def test_elastor_train_refuses_a_directory_another_job_holds(tmp_path):
    write_json(tmp_path / "plan.json", TWO_STAGES)
    ckpt = tmp_path / "ckpt"
    with lock_directory(ckpt, job="other9"):
        done = launch(
            [
                *torchrun(2, "-m", "elastor", "train", f"--plan={tmp_path / 'plan.json'}", "--steps=2"),
                f"--metrics={tmp_path / 'm.jsonl'}",
                f"--ckpt-dir={ckpt}",
            ],
            timeout=120,
        )
    assert done.returncode != 0
    assert "is in use by another job" in done.stderr and "job other9" in done.stderr, done.stderr[-2000:]
    assert not committed(ckpt)


# ---- debris --------------------------------------------------------------------------------------
def test_only_elastors_own_temporaries_are_removed(tmp_path):
    own_tmp, own_trash = tmp_path / ".tmp-0123456789ab-000003", tmp_path / ".trash-step-00000004-0123456789ab"
    current = tmp_path / ".tmp-ffffffffffff-000000"
    users = [tmp_path / ".tmp-my-notes", tmp_path / ".trash-old-stuff", tmp_path / ".tmp-0123456789ab-x"]
    for d in (own_tmp, own_trash, current, *users):
        d.mkdir()
    as_file = tmp_path / ".tmp-abcdefabcdef-000001"
    as_file.write_text("a user's file with an Elastor-like name")
    remove_stale(tmp_path, "ffffffffffff")
    assert not own_tmp.exists() and not own_trash.exists()
    assert current.exists() and as_file.exists() and all(d.exists() for d in users)


# ---- falling back to an older checkpoint ----------------------------------------------------------
def _flip_a_byte_of(step, tensor: str) -> None:
    """Damage one byte of `tensor`'s first piece in its data file (the manifest stays intact)."""
    piece = Manifest.read(step).tensors[tensor].pieces[0]
    with open(step / piece.file, "r+b") as f:
        f.seek(piece.offset + piece.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_every_rank_resumes_from_the_older_checkpoint_when_one_rank_finds_the_newest_damaged(tmp_path):
    """Only the second stage reads the head's weight: its damage is seen by one rank, and both
    ranks must still resume from the same (older) step; the damaged checkpoint is set aside, so the
    saves that follow do not count it against --keep."""
    write_json(tmp_path / "plan.json", TWO_STAGES)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    train = [
        *torchrun(2, "-m", "elastor", "train", f"--plan={tmp_path / 'plan.json'}"),
        f"--metrics={metrics}",
    ]
    first = launch([*train, "--steps=4", f"--ckpt-dir={ckpt}", "--ckpt-every=2"], timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    older, newest = committed(ckpt)[-2:]
    _flip_a_byte_of(newest, "head.output.weight")
    again = launch([*train, "--steps=5", f"--ckpt-dir={ckpt}", "--ckpt-every=0"], timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    events = [r for r in read_metrics(metrics) if r.get("event") in ("restored", "checkpoint_skipped")]
    assert [(e["event"], e["checkpoint"]) for e in events] == [
        ("checkpoint_skipped", newest.name),
        ("restored", older.name),
    ], events
    assert events[0]["reason"].startswith("rank 1 could not read its part"), events[0]  # rank 0 read its part
    assert f"rank 1: skipping the checkpoint {newest}" in again.stderr and "CRC32C" in again.stderr
    steps = [r["step"] for r in read_metrics(metrics) if "loss" in r]
    assert steps[-3:] == [3, 4, 5], steps  # steps 3 and 4 are redone from the older checkpoint
    # The damaged one was set aside: retention (--keep 2) kept the good older one and the new one.
    assert [p.name for p in committed(ckpt)] == [older.name, "step-00000005"]
    assert (ckpt / f"{newest.name}.damaged").is_dir()


# ---- a full disk ----------------------------------------------------------------------------------
def test_a_full_disk_fails_the_save_in_one_sentence_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    plan = random_plan(random.Random(3), TINY, world_size=1)
    save_in_process(tmp_path, plan, step=1, salt=1)
    before = latest_checkpoint(tmp_path)

    def full(path, data):
        with open(path, "wb") as f:
            f.write(bytes(data[: len(data) // 2]))  # half written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(commit_module, "write_file", full)
    saver = Checkpointer(tmp_path, plan, 0, session="0123456789ab")
    saver.save(2, rank_pieces(plan, 0, salt=2), {"step": 2})
    with pytest.raises(CheckpointError) as failed:
        saver.wait()
    message = str(failed.value)
    assert (
        "\n" not in message
        and "No space left on device" in message
        and "previous checkpoint is intact" in message
    )
    assert latest_checkpoint(tmp_path) == before and not verify_checkpoint(before).problems
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_elastor_run_refuses_a_directory_another_job_holds(tmp_path):
    """The leading supervisor takes the lock before its first round: no worker starts."""
    ckpt = tmp_path / "ckpt"
    command = elastor_run(tmp_path)
    with lock_directory(ckpt, job="other7"):
        done = launch(command, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastor: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "is in use by another job" in errors[0] and "job other7" in errors[0]
    assert not (tmp_path / "metrics-logs").exists()  # no round ran


def test_a_directory_that_cannot_be_created_is_one_sentence(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"cannot be created \(Not a directory\)\.$"):
        lock_directory(tmp_path / "a-file" / "ckpt")
    plan = random_plan(random.Random(5), TINY, world_size=1)
    with pytest.raises(CheckpointError, match=r"cannot be created \(Not a directory\)\.$"):
        Checkpointer(tmp_path / "a-file" / "ckpt", plan, 0, session="0123456789ab")


def test_state_of_a_dtype_no_load_accepts_is_refused_at_save(tmp_path):
    """The save and the manifest checks share one list of dtypes: nothing is written unreadable."""
    plan = random_plan(random.Random(6), TINY, world_size=1)
    pieces = rank_pieces(plan, 0, salt=1)
    pieces[0] = pieces[0]._replace(tensor=pieces[0].tensor.to(torch.int32))
    with pytest.raises(CheckpointError, match=r"dtype torch\.int32 cannot be checkpointed"):
        Checkpointer(tmp_path, plan, 0, session="0123456789ab").save(1, pieces, {"step": 1})
    assert not committed(tmp_path)

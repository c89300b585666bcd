"""Crash safety: SIGKILL every saving process at a random moment, many times over, in one --ckpt-dir.

Each trial starts fresh processes under a new random plan (as an elastic restart would), which save
steps back to back from where the newest checkpoint left off, and kills them all after a random
delay: while snapshotting, writing, fsyncing, committing, updating `latest` or pruning. Every other
trial waits instead until a save is in flight and kills it there, so the suite exercises torn saves
however fast the machine's disk is. After every
kill the newest complete checkpoint must exist if any commit was reported, be at least as new as the
last reported one, verify, and load bit-identically under yet another plan; `.tmp-*` leftovers of
killed saves are never picked, and the next trial's processes clean them up.

Processes come from a fork server that has imported torch once, so a trial costs milliseconds
rather than an interpreter start.
"""

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from checkpoint_support import crash_worker, expected, random_plan

from runtime.checkpoint import latest_checkpoint, load_checkpoint, wanted_for
from runtime.checkpoint.format import LATEST
from runtime.checkpoint.store import committed
from runtime.checkpoint.verify import verify_checkpoint

TRIALS = 36  # -m slow; the default suite kills 4 (make test's time budget)


@pytest.mark.parametrize("trials", [4, pytest.param(TRIALS, marks=pytest.mark.slow)])
def test_sigkill_at_random_moments_never_loses_the_newest_complete_checkpoint(tmp_path, trials):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "runtime.checkpoint", "checkpoint_support"])
    rng = random.Random(2024)
    directory = tmp_path / "ckpt"
    log = tmp_path / "commits.log"
    log.touch()
    mid_save = 0
    for trial in range(trials):
        newest = latest_checkpoint(directory)
        first_step = 1 + (int(newest.name.split("-")[1]) if newest else 0)
        plan = random_plan(rng, world_size=rng.randint(1, 4))
        session = f"{rng.getrandbits(48):012x}"
        procs = [
            ctx.Process(
                target=crash_worker, args=(r, plan.to_json(), str(directory), session, first_step, str(log))
            )
            for r in range(plan.world_size)
        ]
        try:
            for p in procs:
                p.start()
            ready = [Path(f"{log}-ready-{r}") for r in range(plan.world_size)]
            deadline = time.monotonic() + 30
            while not all(r.exists() for r in ready) and time.monotonic() < deadline:
                time.sleep(0.005)
            for r in ready:
                r.unlink(missing_ok=True)
            if trial % 2:
                time.sleep(rng.uniform(0.0, 0.4))
            else:  # kill the moment a save of this session is on disk but not yet committed
                wait_for_a_save_in_flight(directory, session, after=rng.randint(0, 3))
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
        mid_save += directory.exists() and any(
            c.name.startswith(f".tmp-{session}") for c in directory.iterdir()
        )
        check_newest(directory, log, rng)
    assert len(log.read_text().split()) >= trials // 4, "many trials should commit a save before the kill"
    assert mid_save >= trials // 4, f"only {mid_save} kills landed in the middle of a save"


def wait_for_a_save_in_flight(directory: Path, session: str, after: int, timeout_s: float = 30.0) -> None:
    """Return once `session` has begun its (after + 1)-th save that is still uncommitted when seen: a
    `.tmp-<session>` entry under `directory` (each save writes its own). Seeing it takes a directory
    listing, so the kill lands inside that save unless it commits in the microseconds between."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            names = [e.name for e in os.scandir(directory) if e.name.startswith(f".tmp-{session}")]
        except FileNotFoundError:
            names = []
        seen.update(names)
        if names and len(seen) > after:
            return
        time.sleep(0.001)  # the savers need the cores more than this loop does
    raise AssertionError(f"no save of session {session} was seen in flight within {timeout_s:.0f} s")


def check_newest(directory, log, rng) -> None:
    reported = [int(s) for s in log.read_text().split()]
    newest = latest_checkpoint(directory)
    if not reported:
        return
    assert newest is not None, "a commit was reported but no complete checkpoint is found"
    tensors_step = int(newest.name.split("-")[1])
    assert tensors_step >= max(reported), f"{newest.name} is older than the reported step {max(reported)}"
    for path in committed(directory):
        report = verify_checkpoint(path)
        assert not report.problems, report.problems
    if (directory / LATEST).exists():
        assert (directory / (directory / LATEST).read_text().strip() / "manifest.json").is_file()
    b = random_plan(rng, world_size=rng.randint(1, 6))
    for rank in range(b.world_size):
        wanted = wanted_for(b, rank)
        tensors, meta = load_checkpoint(directory, wanted, model=b.model)
        assert meta == {"step": tensors_step}
        for got, want in zip(tensors, expected(wanted, salt=tensors_step), strict=True):
            assert torch.equal(got, want)

"""`elastor run`'s processes form one tree that dies together: launcher, supervisors, torchrun, workers.

Each test starts a two-node simulated run (one worker per node, on the CPU), waits until its workers
train, collects every descendant of the launcher from /proc, then kills one process of the tree: the
rest must be gone within the documented bound (lifeline.ORPHAN_BOUND_S), never left training.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from dist_helpers import REPO, elastor_run, run_env
from proc_helpers import MARK, children, cmdline, descendants, end_launch, gone_within

from runtime.elastic.lifeline import ORPHAN_BOUND_S, SUPERVISOR_STOP_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

START_TIMEOUT_S = 120  # from the launch to the workers' first step, on a loaded machine


def test_sigkill_of_the_launcher_takes_the_whole_tree_down(tmp_path):
    with _run(tmp_path) as (launcher, tree):
        launcher.kill()
        launcher.wait()
        assert gone_within(tree, ORPHAN_BOUND_S) == set()


@pytest.mark.slow  # about 12 s; the launcher's SIGKILL case runs in make test
def test_sigterm_of_the_launcher_stops_every_process_before_it_exits(tmp_path):
    with _run(tmp_path) as (launcher, tree):
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=SUPERVISOR_STOP_S) == 128 + signal.SIGTERM
        assert gone_within(tree, 1.0) == set()


@pytest.mark.slow  # about 12 s; the launcher's SIGKILL case runs in make test
def test_sigkill_of_a_supervisor_takes_its_workers_down_and_the_others_go_on(tmp_path):
    with _run(tmp_path) as (launcher, _tree):
        supervisor = next(p for p in children(launcher.pid) if "--node=n1" in cmdline(p))
        below = descendants(supervisor)
        assert below, "the supervisor of n1 has no workers"
        os.kill(supervisor, signal.SIGKILL)
        assert gone_within(below, ORPHAN_BOUND_S) == set()
        time.sleep(1.0)
        assert launcher.poll() is None  # a lost non-leader node does not end the run


@pytest.mark.slow  # about 12 s; the launcher's SIGKILL case runs in make test
def test_sigkill_of_the_leaders_supervisor_ends_the_run_and_every_process(tmp_path):
    with _run(tmp_path) as (launcher, tree):
        supervisor = next(p for p in children(launcher.pid) if "--node=n0" in cmdline(p))
        os.kill(supervisor, signal.SIGKILL)  # it hosts the rendezvous: nobody can go on
        assert launcher.wait(timeout=SUPERVISOR_STOP_S) == 128 + signal.SIGKILL
        assert gone_within(tree, ORPHAN_BOUND_S) == set()


class _run:
    """Start `elastor run --cluster 1,1` and wait until its workers train; yields (launcher, the pids
    of all its descendants then); on the way out, SIGKILL whatever the test started that is left."""

    def __init__(self, tmp: Path):
        self.tmp, self.mark = tmp, uuid.uuid4().hex

    def __enter__(self) -> tuple[subprocess.Popen, set[int]]:
        metrics = self.tmp / "metrics.jsonl"
        # --steps and --ckpt-every are never reached: the test ends the run.
        command = elastor_run(self.tmp, "--ckpt-every=100000", cluster="1,1", steps=100_000)
        # a launcher killed outright cannot remove its token's directory: it stays in the test's own
        scratch = self.tmp / "tmp"
        scratch.mkdir()
        env = {**run_env(), MARK: self.mark, "TMPDIR": str(scratch)}
        with open(self.tmp / "launcher.log", "w") as out:
            self.launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _trained_a_step(metrics):
            assert self.launcher.poll() is None, (self.tmp / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the workers did not start training"
            time.sleep(0.2)
        tree = descendants(self.launcher.pid)
        assert len(tree) >= 4, tree  # two supervisors and one worker each (started by the supervisor)
        return self.launcher, tree

    def __exit__(self, *exc) -> None:
        end_launch(self.launcher, self.mark)


def _trained_a_step(metrics: Path) -> bool:
    if not metrics.is_file():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if "loss" in json.loads(line):
                return True
        except json.JSONDecodeError:
            pass
    return False

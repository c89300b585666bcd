"""`elastor run` against what clusters lose: a whole host, a frozen GPU, and strangers on the network.

Each test runs a simulated cluster of single-GPU nodes (each node's supervisor in its own process
group, its torchrun and workers below it), does something to it from outside while it trains, and
checks that the run finishes and matches an uninterrupted single-process run within 1e-5
(tests/test_elastic.py's reference), or that nothing changed at all.
"""

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import REPO, run_env
from etcd_helpers import etcd_server, needs_etcd
from proc_helpers import MARK, children, cmdline, descendants, end_launch, gone_within, marked
from test_elastic import RUN_TIMEOUT_S, _assert_matches_reference, _profile, run_command

from costmodel import Plan
from runtime.elastic.lifeline import ORPHAN_BOUND_S, STOP_REQUEST_S
from runtime.elastic.report import read_metrics, recoveries
from runtime.elastic.store import SignedStore
from runtime.elastic.supervisor import checkpointed_step

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

FLOOD_S = 2.0  # how long the stranger posts
START_TIMEOUT_S = 180  # from the launch to the step a test acts at, on a loaded machine
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("profile") / "profile.json")


class _Run:
    """`elastor run` started in the background; on the way out, SIGKILL whatever is left of it."""

    def __init__(self, tmp: Path, profile: Path, cluster: str, steps: int, *flags: str):
        self.tmp, self.mark, self.metrics = tmp, os.urandom(8).hex(), tmp / "metrics.jsonl"
        command = run_command(tmp, profile, cluster, steps, *flags)
        self.log = open(tmp / "launcher.log", "w")  # noqa: SIM115 - closed in __exit__
        self.launcher = subprocess.Popen(
            command, cwd=REPO, env={**run_env(), MARK: self.mark}, stdout=self.log, stderr=subprocess.STDOUT
        )

    def __enter__(self) -> "_Run":
        return self

    def __exit__(self, *exc) -> None:
        end_launch(self.launcher, self.mark)
        self.log.close()

    def output(self) -> str:
        return (self.tmp / "launcher.log").read_text()[-4000:]

    def wait_for_step(self, step: int) -> list[dict]:
        """Wait until training has logged `step` steps; returns the records so far."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            records = read_metrics(self.metrics) if self.metrics.is_file() else []
            if sum(1 for r in records if "loss" in r) >= step:
                return records
            assert self.launcher.poll() is None, self.output()
            assert time.monotonic() < deadline, f"training did not reach step {step}"
            time.sleep(0.1)

    def supervisor(self, node: str) -> int:
        return next(p for p in children(self.launcher.pid) if f"--node={node} " in cmdline(p) + " ")

    def finish(self) -> list[dict]:
        """Wait for the run to end well; no process of it, of any round, may be left behind."""
        code = self.launcher.wait(timeout=RUN_TIMEOUT_S)
        assert code == 0, self.output()
        assert gone_within(set(marked(self.mark)), ORPHAN_BOUND_S) == set()
        return read_metrics(self.metrics)


def _first_plan(records) -> Plan:
    return Plan.from_json(next(r["plan"] for r in records if r.get("event") == "replanned"))


def _victim(plan: Plan) -> str:
    """A node of the plan other than the leader (n0)."""
    return next(n for n in plan.nodes() if n != "n0")


@pytest.mark.slow  # about 60 s
def test_a_lost_host_is_left_out_and_the_run_matches_an_uninterrupted_one(tmp_path, profile_path):
    steps = 12
    with _Run(tmp_path, profile_path, "1,1,1", steps, "--lease-s=4") as run:
        records = run.wait_for_step(6)
        victim = _victim(_first_plan(records))
        supervisor = run.supervisor(victim)
        host = {supervisor, *descendants(supervisor)}  # the supervisor, its torchrun and its worker
        for pid in host:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        records = run.finish()
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["cause"] == "lost" and detected["lost"] == [victim]
    plans = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"]
    assert len(plans) == 2 and victim not in plans[1].nodes()
    (found,) = recoveries(records)
    assert found.phases_s["detect"] <= 4 + 2  # the lease, and a heartbeat's period
    assert "failure" in run.output()  # the breakdown is printed
    _assert_matches_reference(tmp_path, records, steps)


@needs_etcd
@pytest.mark.slow  # about 60 s
def test_on_etcd_the_leaders_host_is_lost_and_another_node_leads_to_the_end(tmp_path, profile_path):
    steps = 12
    with etcd_server(tmp_path / "etcd") as endpoint:
        flags = ("--lease-s=4", "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}")
        with _Run(tmp_path, profile_path, "1,1,1", steps, *flags) as run:
            records = run.wait_for_step(6)
            first = next(r for r in records if r.get("event") == "replanned")
            leader = first["leader"]
            if leader not in Plan.from_json(first["plan"]).nodes():
                pytest.fail(f"the leader {leader} has no GPU in the plan; the test needs one that does")
            supervisor = run.supervisor(leader)
            for pid in {supervisor, *descendants(supervisor)}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            records = run.finish()
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["cause"] == "lost" and detected["lost"] == [leader]
    replanned = [r for r in records if r.get("event") == "replanned"]
    assert len(replanned) == 2 and replanned[1]["leader"] != leader
    assert leader not in Plan.from_json(replanned[1]["plan"]).nodes()
    (found,) = recoveries(records)
    assert found.phases_s["detect"] <= 4 + 2
    _assert_matches_reference(tmp_path, records, steps)


@pytest.mark.slow  # about 70 s
def test_a_frozen_worker_is_found_within_the_hang_timeout_and_left_out(tmp_path, profile_path):
    steps, hang_timeout_s = 12, 8
    with _Run(tmp_path, profile_path, "1,1,1", steps, f"--hang-timeout-s={hang_timeout_s}") as run:
        records = run.wait_for_step(6)
        plan = _first_plan(records)
        victim = _victim(plan)
        (device,) = [d for d in plan.devices if d.startswith(f"{victim}:")]
        worker = max(
            p for p in descendants(run.supervisor(victim)) if "torch.distributed.run" not in cmdline(p)
        )
        os.kill(worker, signal.SIGSTOP)
        frozen_at = time.time()
        records = run.finish()
    detected = next(r for r in records if r.get("event") == "failure_detected")
    assert detected["cause"] == "hung" and detected["dead"] == [device]
    assert detected["time_s"] - frozen_at <= hang_timeout_s + 5
    later = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"][1:]
    assert later and all(device not in p.devices for p in later)
    _assert_matches_reference(tmp_path, records, steps)


@pytest.mark.slow  # about 30 s; make test's budget (the forgeries are also tested in one process by
# tests/test_control_plane.py, and the stores' binding)
def test_strangers_messages_change_nothing_and_nothing_listens_beyond_loopback(tmp_path, profile_path):
    """A process without the token posts, again and again while the round trains, a failure of n1, a
    plan for the next round and heartbeats, unsigned and signed with a guessed token: the run goes on
    as if nothing had been posted, and the supervisors log what they ignored."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    steps = 120  # about 10 s of training: the stranger posts while the round runs
    with _Run(tmp_path, profile_path, "1,1", steps) as run:
        run.wait_for_step(2)
        tree = descendants(run.launcher.pid)
        supervisor = cmdline(run.supervisor("n1")).split()
        endpoint = next(a for a in supervisor if a.startswith("--rdzv-endpoint="))  # the supervisors' store
        host, _, port = endpoint.partition("=")[2].rpartition(":")
        raw = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        forged = {"plan": _first_plan(read_metrics(run.metrics)).to_json(), "stop_at": 1, "members": ["n0"]}
        guessed = SignedStore(raw, b"a-guessed-token-0000", "n0")
        flood_until = time.monotonic() + FLOOD_S  # posted again and again, so the round reads them
        while time.monotonic() < flood_until:
            for key, value in [
                ("0/exit/n1", {"code": 1, "time_s": 0.0}),
                ("1/decision", forged),
                ("1/health/n0", {"gpus": [], "host": "10.0.0.66"}),
                ("hb/n1", {"seq": 10**9, "progress": {}}),
            ]:
                guessed.put(key, value)
                raw.set(key, str(value))  # unsigned
            time.sleep(0.05)
        # Its posts must have met a running round (a key overwritten after its writer wrote it is a
        # denial of service, which signing cannot prevent: README, "Strangers").
        trained = sum(1 for r in read_metrics(run.metrics) if "loss" in r)
        assert trained < steps, "the round ended before the stranger was done"
        listening = {a for p in tree for a in _listening(p)}
        records = run.finish()
    assert listening and listening <= LOOPBACK, listening
    assert not [r for r in records if r.get("event") == "failure_detected"]
    assert [r["event"] for r in records if r.get("event") == "replanned"] == ["replanned"]
    assert "ignored the value of rendezvous key" in run.output()
    _assert_matches_reference(tmp_path, records, steps)


def _listening(pid: int) -> set[str]:
    """The local addresses of the listening TCP sockets process `pid` holds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.add(fields[1].partition(":")[0])
    return found


@pytest.mark.slow  # about 60 s: two runs of a simulated cluster
@pytest.mark.parametrize("to", ["launcher", "a supervisor"])
def test_sigterm_stops_every_worker_after_a_step_with_a_checkpoint_and_the_rerun_resumes(
    tmp_path, profile_path, to
):
    # Enough steps after the signal for the stop to land first: a quiet machine trains gpt-tiny at
    # 20 steps a second, and the request reaches the workers through a 0.2 s poll.
    steps, at = 60, random.Random().randint(2, 7)
    with _Run(tmp_path, profile_path, "1,1", steps) as run:
        run.wait_for_step(at)
        target = run.launcher.pid if to == "launcher" else run.supervisor("n1")
        os.kill(target, signal.SIGTERM)
        asked_at = time.monotonic()
        code = run.launcher.wait(timeout=RUN_TIMEOUT_S)
        assert time.monotonic() - asked_at <= STOP_REQUEST_S, run.output()
        assert gone_within(set(marked(run.mark)), ORPHAN_BOUND_S) == set()
        assert code == 128 + signal.SIGTERM, run.output()
        stopped = [r for r in read_metrics(run.metrics) if r.get("event") == "stopped"]
        assert len(stopped) == 1 and checkpointed_step(tmp_path / "ckpt") == stopped[0]["step"] < steps
        assert "stopped by SIGTERM" in run.output()
    with _Run(tmp_path, profile_path, "1,1", steps) as rerun:
        records = rerun.finish()
    assert not any(r.get("event") == "failure_detected" for r in records)
    _assert_matches_reference(tmp_path, records, steps)

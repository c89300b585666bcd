"""The supervisors' control plane in one process: signed messages, binding, leases, deadlines, hangs.

The multi-process stories (a node lost, a worker frozen, a stranger's messages) are in
tests/test_elastic_faults.py.
"""

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import free_port
from etcd_helpers import OPENSSL, etcd_cluster, etcd_server, make_certs, needs_etcd

from costmodel.errors import ElastorError
from elastor.commands import run as run_command
from goodput import costs as goodput_costs
from runtime.elastic import faults, progress
from runtime.elastic.faults import Fault
from runtime.elastic.launch import failure_excerpt
from runtime.elastic.progress import HangWatch
from runtime.elastic.rendezvous import HEARTBEAT_S, NotLeader, Rendezvous, etcd_rendezvous, tcp_rendezvous
from runtime.elastic.report import measured_costs, recoveries
from runtime.elastic.store import SignedStore, host_store, read_token, write_token

TOKEN = b"a-shared-secret-of-the-job"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


# ---- the store ----------------------------------------------------------------------------------
@linux_only
def test_the_store_listens_on_the_address_it_was_given_only():
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=5)
    store.set("k", "v")
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    del store
    assert listening_addresses(port) == set()  # the store owned its socket


def test_signed_values_round_trip_and_a_strangers_are_ignored_and_logged(capsys):
    raw = host_store("127.0.0.1", 0, timeout_s=5)
    mine, theirs = SignedStore(raw, TOKEN, "n0"), SignedStore(raw, b"not-the-job-secret!!", "n1")
    mine.put("0/decision", {"plan": "real"})
    assert mine.get("0/decision") == {"plan": "real"}
    theirs.put("0/decision", {"plan": "forged"})  # a stranger overwrites with its own signature
    assert mine.get("0/decision") is None
    raw.set("0/exit/n1", '{"code": 1}')  # unsigned
    assert mine.get("0/exit/n1") is None
    mine.put("0/exit/n1", {"code": 0})
    raw.set("1/exit/n1", raw.get("0/exit/n1"))  # a signed value replayed under another key
    assert mine.get("1/exit/n1") is None
    assert mine.get("never/set") is None
    mine.get("0/decision")  # the same rejected value is logged once
    err = capsys.readouterr().err
    assert err.count("ignored the value of rendezvous key '0/decision'") == 1
    assert "signature is wrong" in err and "is not a signed message" in err


def test_a_token_must_be_private_and_long_enough(tmp_path):
    token = write_token(tmp_path / "token")
    assert len(read_token(token)) == 64
    os.chmod(token, 0o644)
    with pytest.raises(ElastorError, match="can be read by other users"):
        read_token(token)
    short = tmp_path / "short"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    with pytest.raises(ElastorError, match="at least 16"):
        read_token(short)
    with pytest.raises(ElastorError, match="Cannot read"):
        read_token(tmp_path / "missing")


# ---- leases and deadlines -----------------------------------------------------------------------
def _pair(**kw) -> tuple[Rendezvous, Rendezvous]:
    port = free_port()
    leader = tcp_rendezvous("127.0.0.1", port, ["n0", "n1", "n2"], "n0", token=TOKEN, **kw)
    follower = tcp_rendezvous("127.0.0.1", port, ["n0", "n1", "n2"], "n1", token=TOKEN, **kw)
    return leader, follower


def test_a_round_goes_on_without_a_node_that_misses_its_deadline():
    leader, follower = _pair(lease_s=3.0, deadline_s=0.5)
    try:
        leader.report_health(0, [0, 1])
        follower.report_health(0, [0])
        started = time.monotonic()
        members = leader.health(0)  # n2 never started
        assert sorted(members) == ["n0", "n1"] and members["n1"]["gpus"] == [0]
        assert 0.5 <= time.monotonic() - started < 2.0
    finally:
        leader.close()
        follower.close()


def test_a_node_whose_heartbeat_stops_is_lost_and_its_round_counts_as_failed():
    leader, follower = _pair(lease_s=3.0, deadline_s=1.0)
    try:
        deadline = time.monotonic() + 5
        while leader.last_seen("n1") is None and time.monotonic() < deadline:
            leader.observe()
            time.sleep(0.05)
        assert leader.last_seen("n1") is not None and leader.lost() == set()
        assert leader.peer_failed(0, ["n0", "n1"]) is None
        follower.close()  # its heart stops, as if its host were gone
        started = time.monotonic()
        exits = leader.exits(0, ["n1"])  # waits for its report until the lease runs out
        # The lease runs from the last beat seen, up to a heartbeat before the close.
        assert 3.0 - HEARTBEAT_S <= time.monotonic() - started < 6.0
        assert exits["n1"]["lost"] and exits["n1"]["code"] != 0
        assert exits["n1"]["since_s"] <= exits["n1"]["time_s"] - 3.0
        assert leader.peer_failed(0, ["n0", "n1"]) == "node n1 was lost"
        leader.report_health(1, [0, 1])
        assert sorted(leader.health(1)) == ["n0"]  # n1 is lost, and n2 (never started) missed the deadline
    finally:
        leader.close()


def test_a_lease_shorter_than_three_heartbeats_is_refused():
    with pytest.raises(ElastorError, match="--lease-s 1"):
        tcp_rendezvous("127.0.0.1", free_port(), ["n0"], "n0", token=TOKEN, lease_s=1.0)


def test_a_forged_failure_report_does_not_stop_the_peers():
    leader, follower = _pair(lease_s=3.0)
    try:
        leader.store.raw.set("0/exit/n1", '{"code": 1, "time_s": 0}')
        SignedStore(leader.store.raw, b"guessed-token-guessed", "n1").put("0/exit/n1", {"code": 1})
        assert leader.peer_failed(0, ["n0", "n1"]) is None
        follower.report_exit(0, 1)
        assert leader.peer_failed(0, ["n0", "n1"]) == "the workers of node n1 failed"
    finally:
        leader.close()
        follower.close()


# ---- hang detection -----------------------------------------------------------------------------
def _record(device: str, *, seq: int, age_s: float = 0.0, waiting: bool = False, done: int = 1) -> dict:
    return {
        "device": device,
        "step": 3,
        "seq": seq,
        "phase": "forward",
        "waiting": waiting,
        "done": done,
        "time_s": time.time() - age_s,
    }


def test_a_rank_whose_reports_stop_is_frozen():
    watch = HangWatch(["n0:0", "n1:0"], ["n1:0"], timeout_s=5.0)
    fresh = {"n0:0": _record("n0:0", seq=1), "n1:0": _record("n1:0", seq=1)}
    assert watch.hung(fresh) is None
    verdict = watch.hung({**fresh, "n1:0": _record("n1:0", seq=1, age_s=6.0)})
    assert verdict.devices == ("n1:0",) and "no progress report" in verdict.why
    assert watch.hung({**fresh, "n0:0": _record("n0:0", seq=1, age_s=6.0)}) is None  # not ours to judge


def test_a_stall_blames_the_ranks_that_are_not_waiting_on_a_peer():
    timeout = 0.2
    mine = HangWatch(["n0:0", "n1:0"], ["n1:0"], timeout_s=timeout)
    theirs = HangWatch(["n0:0", "n1:0"], ["n0:0"], timeout_s=timeout)
    stalled = {"n0:0": _record("n0:0", seq=7, waiting=True), "n1:0": _record("n1:0", seq=5)}
    assert mine.hung(stalled) is None and theirs.hung(stalled) is None  # the state just changed
    time.sleep(timeout + 0.05)
    stalled = {d: {**r, "time_s": time.time()} for d, r in stalled.items()}  # their threads still write
    verdict = mine.hung(stalled)
    assert verdict.devices == ("n1:0",) and "stuck in its own work" in verdict.why
    assert theirs.hung(stalled) is None  # n1's supervisor acts


def test_a_stall_nobody_can_be_blamed_for_waits_longer_and_blames_the_round(monkeypatch):
    monkeypatch.setattr(progress, "BLAME_GRACE_S", 0.2)
    watch = HangWatch(["n0:0", "n1:0"], ["n0:0"], timeout_s=0.2)
    waiting = {d: _record(d, seq=4, waiting=True) for d in ("n0:0", "n1:0")}
    assert watch.hung(waiting) is None
    time.sleep(0.25)
    assert watch.hung({d: {**r, "time_s": time.time()} for d, r in waiting.items()}) is None  # the grace
    time.sleep(0.25)
    verdict = watch.hung({d: {**r, "time_s": time.time()} for d, r in waiting.items()})
    assert verdict.devices == () and "every rank stalled" in verdict.why


def test_no_stall_is_judged_before_every_rank_finished_a_step():
    watch = HangWatch(["n0:0", "n1:0"], ["n0:0"], timeout_s=0.1)
    loading = {"n0:0": _record("n0:0", seq=0, done=0), "n1:0": _record("n1:0", seq=3)}
    watch.hung(loading)
    time.sleep(0.15)
    assert watch.hung({d: {**r, "time_s": time.time()} for d, r in loading.items()}) is None
    starting = {"n0:0": _record("n0:0", seq=0, done=0)}  # n1:0 has not published yet
    assert HangWatch(["n0:0", "n1:0"], ["n0:0"], timeout_s=0.1).hung(starting) is None


def test_a_worker_publishes_its_progress_at_a_bounded_rate(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.ENV_DIR, str(tmp_path))
    mine = progress.Progress()
    mine.start("n0:1")
    try:
        for _ in range(1000):
            mine.mark("forward")
        with mine.waiting():
            mine.step_done(5)
            time.sleep(progress.PUBLISH_S * 2.5)
            record = progress.read(tmp_path)["n0:1"]
            assert record["waiting"] and record["step"] == 5 and record["seq"] == 1001 and record["done"] == 1
        assert len(list(tmp_path.iterdir())) == 1  # one file per worker, rewritten in place
    finally:
        mine.stop()


# ---- the recovery breakdown ---------------------------------------------------------------------
def test_a_failure_the_supervisors_found_is_timed_from_when_it_happened():
    records = [
        {"event": "replanned", "time_s": 0.0, "devices": 3, "solve_s": 0.1, "step": 0},
        {"step": 1, "loss": 1.0, "samples_per_s": 10.0, "time_s": 1.0},
        {"event": "resumed", "time_s": 0.5, "step": 0},
        {"event": "failure_detected", "time_s": 14.0, "cause": "lost", "failed_since_s": 10.0, "step": 0},
        {"event": "replanned", "time_s": 15.0, "devices": 2, "solve_s": 0.2, "step": 0},
        {"event": "restored", "time_s": 20.0, "load_s": 1.0, "step": 0},
        {"event": "resumed", "time_s": 21.0, "step": 0},
    ]
    (found,) = recoveries(records)
    costs = measured_costs([*records, {"step": 2, "loss": 1.0, "ckpt_stall_s": 0.3, "time_s": 22.0}])
    # A lost host's detection is its own cost (the goodput simulator applies it to host failures).
    assert costs == pytest.approx(
        {"detect_node_s": 4.0, "plan_s": 0.2, "restart_s": 5.8, "reshard_load_s": 1.0, "ckpt_stall_s": 0.3}
    )
    assert found.cause == "lost"
    assert found.phases_s["detect"] == pytest.approx(4.0)
    assert found.phases_s["rendezvous"] == pytest.approx(0.8)
    assert found.total_s == pytest.approx(11.0)
    assert (found.devices_before, found.devices_after) == (3, 2)


def test_the_goodput_simulators_detection_follows_elastor_runs_defaults():
    assert goodput_costs.HANG_TIMEOUT_S == run_command.HANG_TIMEOUT_S
    assert goodput_costs.LEASE_S == run_command.LEASE_S
    assert goodput_costs.HEARTBEAT_S == HEARTBEAT_S
    assert goodput_costs.PROGRESS_PERIOD_S == progress.PUBLISH_S


# ---- etcd: an elected leader ---------------------------------------------------------------------
@needs_etcd
def test_etcd_elects_one_leader_and_a_successor_without_a_split_brain(tmp_path):
    with etcd_server(tmp_path / "etcd") as endpoint:
        nodes = ["n0", "n1"]
        run_id = os.urandom(4).hex()
        first, second = (
            etcd_rendezvous(endpoint, run_id, nodes, n, token=TOKEN, lease_s=3.0, deadline_s=1.0)
            for n in nodes
        )
        try:
            assert first.campaign() and not second.campaign()
            assert first.leader() == second.leader() == "n0"
            with pytest.raises(NotLeader):
                second.decide(0, {"plan": "forged by a follower"})
            first.decide(0, {"plan": "first"})
            first.save_state({"closed": 0})
            assert second.decision(0) == {"plan": "first"}
            first._stopped.set()  # n0's host freezes: no more heartbeats or lease refreshes
            started = time.monotonic()
            assert second.decision(1) is None  # the office fell vacant and n1 took it: it must decide
            assert 3.0 <= time.monotonic() - started < 8.0
            assert second.is_leader and second.load_state() == {"closed": 0}
            with pytest.raises(NotLeader):  # n0 wakes up: its writes as leader are refused
                first.decide(1, {"plan": "stale"})
            second.decide(1, {"plan": "second"})
            assert first.past_decision(1) == {"plan": "second"}
        finally:
            first.close()
            second.close()


def test_an_unreachable_etcd_is_one_sentence():
    with pytest.raises(ElastorError, match=r"Cannot reach etcd at 127\.0\.0\.1:1 "):
        etcd_rendezvous("127.0.0.1:1", "x", ["n0"], "n0", token=TOKEN)


# ---- injected faults of each kind ---------------------------------------------------------------
def test_injected_faults_name_their_kind_and_round_trip():
    assert Fault.parse("n1:3@20", "--inject-failure") == Fault(step=20, device="n1:3")
    hang, host = Fault.parse("hang:n1:3@20", "f"), Fault.parse("host:n0:0@5", "f")
    assert (hang.kind, hang.device, host.kind, host.step) == ("hang", "n1:3", "host", 5)
    assert faults.decode(faults.encode([hang, host])) == [hang, host]
    with pytest.raises(ElastorError, match="'freeze' is not a kind of failure"):
        Fault.parse("freeze:n1:3@20", "--inject-failure")
    assert Fault.parse("commit:n1:0@5", "f") == Fault(step=5, device="n1:0", kind="commit")


def test_a_commit_fault_fires_inside_the_step_only_and_needs_the_in_process_recovery(tmp_path, capsys):
    """`commit:` faults are not fired by the step-boundary check (the trainer's hook fires them), and
    `elastor run` refuses them where no in-process recovery would ever call that hook."""
    fault = Fault.parse("commit:n1:0@5", "f")
    faults.maybe_fail("n1:0", 5, [fault], tmp_path / "metrics.jsonl")  # would SIGKILL this process
    assert not (tmp_path / "metrics.jsonl").exists()
    assert faults.at_commit(["n0:0", "n0:1"], "n0:0", [fault], tmp_path / "m", None) is None  # not in plan
    from elastor.cli import main

    code = main(
        ["run", "--cluster=2", "--profile=profiles/gpt-tiny-cpu.json", "--global-batch-size=8",
         "--steps=4", f"--ckpt-dir={tmp_path}", "--recovery=restart", "--inject-failure=commit:n0:1@2"]
    )  # fmt: skip
    assert code == 2 and "needs --recovery in-process" in capsys.readouterr().err


@linux_only
def test_an_injected_hang_stops_the_worker_and_a_host_failure_kills_its_supervisor(tmp_path):
    """The worker's side of `hang:` and `host:`, in child processes standing in for the worker and
    its supervisor."""
    import subprocess

    metrics = tmp_path / "metrics.jsonl"
    code = (
        "import sys; from pathlib import Path; from runtime.elastic import faults; "
        "faults.maybe_fail('n1:0', 4, faults.decode(sys.argv[1]), Path(sys.argv[2]))"
    )
    worker = subprocess.Popen([sys.executable, "-c", code, "hang:n1:0@4", str(metrics)])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{worker.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait()
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = {**os.environ, faults.ENV_SUPERVISOR: str(supervisor.pid)}
    worker = subprocess.run([sys.executable, "-c", code, "host:n1:0@4", str(metrics)], env=env, timeout=60)
    assert worker.returncode == -signal.SIGKILL and supervisor.wait(timeout=10) == -signal.SIGKILL
    kinds = [(f.kind, f.device) for f, _ in faults.fired(metrics)]
    assert kinds == [("hang", "n1:0"), ("host", "n1:0")]


# ---- GPUs: probes and what the workers see -------------------------------------------------------
def test_gpus_are_probed_at_once_each_alone_and_a_stuck_probe_is_left_out(monkeypatch):
    from runtime.elastic import supervisor

    # Stand-ins for the CUDA probe: GPU 1 is broken, GPU 3 hangs; each sees only its own GPU.
    probe = (
        "import os, sys, time; g = os.environ['CUDA_VISIBLE_DEVICES']; time.sleep(0.5); "
        "time.sleep(600 if g == '3' else 0); sys.exit(g == '1')"
    )
    monkeypatch.setattr(supervisor, "_PROBE", probe)
    started = time.monotonic()
    assert supervisor.probe_cuda([0, 1, 2, 3], timeout_s=1.5) == [0, 2]
    assert time.monotonic() - started < 1.5 + 1.0  # in parallel: the bound, not four probes' time


def test_a_worker_sees_only_its_nodes_gpus_of_the_plan(tmp_path, monkeypatch):
    from costmodel import ClusterSpec, ModelProfile
    from costmodel.cluster import NodeSpec
    from costmodel.jsonio import read_json
    from runtime.distributed import ENV_VISIBLE_GPUS, cuda_index
    from runtime.elastic.supervisor import NodeSupervisor, RunConfig
    from solver import solve

    profile = ModelProfile.from_json(
        read_json(Path(__file__).parent.parent / "profiles" / "gpt-tiny-cpu.json", "profile")
    )
    counts = ClusterSpec.from_counts([2, 3], profile.device_kind)
    cluster = dataclasses.replace(
        counts, nodes=(NodeSpec(name="n0", gpus=(0, 1)), NodeSpec(name="n1", gpus=(2, 5, 7))), gpus_per_node=8
    )
    plan = solve(profile, cluster, 8)
    config = RunConfig(
        profile=profile,
        cluster=cluster,
        global_batch_size=8,
        steps=1,
        ckpt_dir=tmp_path,
        ckpt_every=1,
        metrics=tmp_path / "m.jsonl",
        max_restarts=0,
        device="cuda",
    )

    class _Rdzv:
        node = "n1"

    on_node = [d for d in plan.devices if d.startswith("n1:")]
    env = NodeSupervisor(config, _Rdzv(), [2, 5, 7])._worker_env(
        0, plan, on_node, {}, tmp_path, "10.0.0.1:1234"
    )
    mine = [int(d.split(":")[1]) for d in on_node]
    assert mine and env["CUDA_VISIBLE_DEVICES"] == env[ENV_VISIBLE_GPUS] == ",".join(map(str, mine))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(config.log_dir))
    monkeypatch.setenv(ENV_VISIBLE_GPUS, env[ENV_VISIBLE_GPUS])
    assert [cuda_index(g) for g in mine] == list(range(len(mine)))


@needs_etcd
def test_a_three_member_etcd_keeps_the_rendezvous_going_when_a_member_is_lost(tmp_path):
    with etcd_cluster(tmp_path / "etcd", members=3) as members:
        endpoints = ",".join(endpoint for endpoint, _ in members)
        rdzv = etcd_rendezvous(endpoints, os.urandom(4).hex(), ["n0"], "n0", token=TOKEN, lease_s=3.0)
        try:
            assert rdzv.campaign()
            rdzv.decide(0, {"plan": "before"})
            first = members[0][1]
            first.send_signal(signal.SIGKILL)  # the member the client talks to first
            first.wait()
            rdzv.decide(1, {"plan": "after"})  # the client goes on with the others
            assert rdzv.past_decision(0) == {"plan": "before"} and rdzv.decision(1) == {"plan": "after"}
            time.sleep(rdzv.lease_s + 1)  # heartbeats kept the lease, so the office, alive
            assert rdzv.is_leader
        finally:
            rdzv.close()


@needs_etcd
@pytest.mark.skipif(OPENSSL is None, reason="needs openssl to make certificates")
def test_etcd_over_tls_admits_only_a_client_certificate_of_its_ca(tmp_path):
    from runtime.elastic.etcd import EtcdTLS

    certs = make_certs(tmp_path / "certs")
    with etcd_server(tmp_path / "etcd", tls=certs) as endpoint:
        tls = EtcdTLS(str(certs["ca"]), str(certs["client"]), str(certs["client-key"]))
        rdzv = etcd_rendezvous(endpoint, "tls", ["n0"], "n0", token=TOKEN, tls=tls)
        try:
            assert rdzv.campaign()
            rdzv.decide(0, {"plan": "over TLS"})
            assert rdzv.decision(0) == {"plan": "over TLS"}
        finally:
            rdzv.close()
        with pytest.raises(ElastorError, match="Cannot reach etcd"):  # no client certificate
            etcd_rendezvous(endpoint, "tls", ["n0", "n1"], "n1", token=TOKEN, tls=EtcdTLS(str(certs["ca"])))


@needs_etcd
def test_on_etcd_the_nodes_run_for_the_office_in_their_order(tmp_path):
    import threading

    with etcd_server(tmp_path / "etcd") as endpoint:
        nodes, run_id = ["n0", "n1", "n2"], os.urandom(4).hex()
        first, second = (
            etcd_rendezvous(endpoint, run_id, nodes, n, token=TOKEN, lease_s=3.0) for n in nodes[:2]
        )
        try:
            got = {}
            waiter = threading.Thread(target=lambda: got.update(d=second.decision(0)))
            waiter.start()
            time.sleep(1.0)  # the office is vacant, but n0 is alive and goes first
            assert second.leader() is None and not second.is_leader
            assert first.campaign()
            first.decide(0, {"plan": "n0's"})
            waiter.join(timeout=10)
            assert got["d"] == {"plan": "n0's"}
        finally:
            first.close()
            second.close()
        started = time.monotonic()  # the lease counts from the rendezvous's start
        alone = etcd_rendezvous(endpoint, os.urandom(4).hex(), nodes, "n1", token=TOKEN, lease_s=3.0)
        try:
            assert alone.decision(0) is None and alone.is_leader  # n0 never came: after a lease, n1 runs
            assert 3.0 <= time.monotonic() - started < 6.0
        finally:
            alone.close()


def test_a_failed_torchrun_is_reported_by_the_workers_last_words_and_torchruns_summary():
    workers = "".join(f"rank 2 line {i}\n" for i in range(200)) + "terminate called: enforce failed\n"
    stopping = "W1202 api.py:1028] Sending process 7 closing signal SIGTERM\n"
    summary = "".join(f"summary {i}\n" for i in range(200)) + "Root Cause: rank 2 SIGABRT\n"
    excerpt = failure_excerpt(workers + stopping + summary, limit=600)
    assert "terminate called: enforce failed" in excerpt and excerpt.endswith("rank 2 SIGABRT\n")
    assert "closing signal" not in excerpt and len(excerpt) <= 620
    assert failure_excerpt("no summary at all", limit=5) == "t all"  # not torchrun's: its tail

"""Launching on one machine: `elastor run --cluster 4,4 ...` (one supervisor process per simulated
node), and plain local torchrun jobs for benchmarks.

Each supervisor is exactly what a node of a real cluster runs (`elastor run --node NAME --nodes ...
--rdzv-endpoint HOST:PORT --token-file F`), given its node's GPUs; here they all rendezvous on
loopback, with a token the launcher makes for the run, and their workers run on the CPU, one process
per simulated GPU. The launcher starts them, forwards SIGTERM and Ctrl-C to them and waits for them,
and returns the run's exit code (the leader's; on etcd, where any node may lead last, the
survivors'); the supervisors die with it (runtime.elastic.lifeline).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from costmodel.cluster import ClusterSpec
from runtime.elastic import lifeline
from runtime.elastic.lifeline import SUPERVISOR_GRACE_S, SUPERVISOR_STOP_S
from runtime.elastic.store import write_token

POLL_S = 0.1
# torchrun's --log-dir. Without one its elastic agent makes a torchelastic_* directory in the temp
# directory for each run and never removes it; torch takes os.devnull as "no log files". The
# workers' output goes to torchrun's own streams (a round's log, `run_local_torchrun`'s pipe) and
# no entry point records torchelastic error files, so nothing is lost.
NO_TORCHRUN_LOGS = os.devnull


def free_port() -> int:
    """A TCP port free on loopback now; the rounds use the ports just above it too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_torchrun(
    nproc: int, target: list[str], *, timeout_s: float, threads: int = 1, cwd: str | None = None
) -> tuple[int, str]:
    """Run `target` (a script and its arguments) under torchrun on `nproc` local processes, rendezvous
    on loopback and gloo's sockets on the loopback interface, `threads` torch threads each; the
    whole process group is killed if it outlives `timeout_s`. Returns (exit code, stdout + stderr)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--log-dir={NO_TORCHRUN_LOGS}",
        *target,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = f"timed out after {timeout_s:.0f} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out


def failure_excerpt(out: str, limit: int = 3000) -> str:
    """What a failed `run_local_torchrun` printed that says why: the workers' last lines before torchrun
    began stopping the others (its "closing signal" lines), then torchrun's own summary."""
    cut = out.find("closing signal")
    if cut < 0:
        return out[-limit:]
    workers = out[: out.rfind("\n", 0, cut) + 1]
    return f"{workers[-(limit * 2 // 3) :]}[...]\n{out[-(limit // 3) :]}"


def launch_simulated(cluster: ClusterSpec, supervisor_args: list[str], *, etcd: str | None = None) -> int:
    """Start one `elastor run --node ...` per node of `cluster` and wait for all of them.

    SIGTERM and Ctrl-C are forwarded to the supervisors, who stop their workers; the launcher waits
    for them (SUPERVISOR_STOP_S at most, then SIGKILL). Each supervisor runs under a lifeline to the
    launcher, so killing the launcher outright takes the whole tree down too, within
    lifeline.ORPHAN_BOUND_S. A node's supervisor killed by a signal is a lost host: the others go on
    without it. With the embedded store the leader's ends the run (exit 128 + the signal), since it
    hosts the rendezvous; with `etcd` (the cluster's endpoints) the others elect a new leader.
    """
    names = [n.name for n in cluster.nodes]
    endpoint = etcd or f"127.0.0.1:{free_port()}"
    rdzv = [f"--rdzv-endpoint={endpoint}"] + ([f"--rdzv-id=simulated-{os.urandom(6).hex()}"] if etcd else [])
    env = {**os.environ, lifeline.ENV_PARENT: str(os.getpid())}
    children: list[subprocess.Popen] = []
    secret = Path(tempfile.mkdtemp(prefix="elastor-token-"))
    token = write_token(secret / "token")
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for node in cluster.nodes:
            command = [
                sys.executable,
                "-m",
                "runtime.elastic.lifeline",
                f"--grace-s={SUPERVISOR_GRACE_S}",
                "elastor",
                "run",
                *supervisor_args,
                f"--node={node.name}",
                f"--nodes={','.join(names)}",
                f"--gpus={','.join(str(g) for g in node.gpus)}",
                *rdzv,
                f"--token-file={token}",
            ]
            children.append(subprocess.Popen(command, env=env, start_new_session=True))
        told: set[str] = set()
        while None in (codes := [c.poll() for c in children]):
            for name, code in zip(names, codes, strict=True):
                if code is None or code >= 0 or name in told:
                    continue
                told.add(name)
                signum = -code
                if name == names[0] and not etcd:  # it hosts the rendezvous: the others cannot go on
                    print(
                        f"elastor run: the leader {name}'s supervisor was killed by "
                        f"{signal.Signals(signum).name}; stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 128 + signum
                print(
                    f"elastor run: the supervisor of {name} was killed by {signal.Signals(signum).name}; "
                    "the others go on without that node",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(POLL_S)
    finally:
        _stop_all(children)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(secret, ignore_errors=True)
    if etcd:  # any node may lead at the end: the run's code is the survivors'
        return max((c for c in codes if c >= 0), default=codes[0], key=abs)
    return codes[0]


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _stop_all(children: list[subprocess.Popen]) -> None:
    """SIGTERM every supervisor still running, wait SUPERVISOR_STOP_S for all, SIGKILL the rest."""
    running = [c for c in children if c.poll() is None]
    for child in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + SUPERVISOR_STOP_S
    for child in running:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()

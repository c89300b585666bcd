"""Launching on one machine: `elastor run --cluster 4,4 ...` (one supervisor process per simulated
node), and plain local torchrun jobs for benchmarks.

Each supervisor is exactly what a node of a real cluster runs (`elastor run --node NAME --nodes ...
--rdzv-endpoint HOST:PORT`), given its node's GPUs; here they all rendezvous on loopback and their
workers run on the CPU, one process per simulated GPU. The launcher only starts them, forwards a
Ctrl-C, and returns the leader's exit code.
"""

import os
import signal
import socket
import subprocess
import sys

from costmodel.cluster import ClusterSpec


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


def launch_simulated(cluster: ClusterSpec, supervisor_args: list[str]) -> int:
    """Start one `elastor run --node ...` per node of `cluster` and wait for all of them."""
    names = [n.name for n in cluster.nodes]
    endpoint = f"127.0.0.1:{free_port()}"
    children = []
    try:
        for node in cluster.nodes:
            command = [
                sys.executable,
                "-m",
                "elastor",
                "run",
                *supervisor_args,
                f"--node={node.name}",
                f"--nodes={','.join(names)}",
                f"--gpus={','.join(str(g) for g in node.gpus)}",
                f"--rdzv-endpoint={endpoint}",
            ]
            children.append(subprocess.Popen(command, start_new_session=True))
        codes = [child.wait() for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
    return codes[0] or max(codes, key=abs)

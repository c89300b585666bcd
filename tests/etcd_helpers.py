"""A one-member etcd on loopback for the tests (Debian's `etcd-server`; .ci/run installs it)."""

import contextlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dist_helpers import free_port

ETCD = shutil.which("etcd")
START_TIMEOUT_S = 30
needs_etcd = pytest.mark.skipif(ETCD is None, reason="needs the etcd server (apt-get install etcd-server)")


@contextlib.contextmanager
def etcd_server(data_dir: Path):
    """Start etcd with its data in `data_dir`, listening on loopback only; yields HOST:PORT."""
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            ETCD,
            "--name=test",
            f"--data-dir={data_dir}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir.with_suffix(".log"), "w"),  # noqa: SIM115 - the server's lifetime
        start_new_session=True,
    )
    try:
        _wait_ready(client, proc)
        yield f"127.0.0.1:{client}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _wait_ready(port: int, proc: subprocess.Popen) -> None:
    from etcd3gw.client import Etcd3Client

    client = Etcd3Client(host="127.0.0.1", port=port, timeout=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client.status()
            return
        except Exception:  # not listening yet: any error of the client means "try again"
            assert proc.poll() is None, "etcd exited at start-up"
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.1)

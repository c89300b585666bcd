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


OPENSSL = shutil.which("openssl")


@contextlib.contextmanager
def etcd_server(data_dir: Path, tls: dict[str, Path] | None = None):
    """Start a one-member etcd with its data in `data_dir`, on loopback only; yields HOST:PORT. With
    `tls` (from `make_certs`) it serves HTTPS and admits only clients with a certificate of the CA."""
    with etcd_cluster(data_dir, members=1, tls=tls) as members:
        yield members[0][0]


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {k: folder / f"{k}.pem" for k in ("ca", "ca-key", "server", "server-key", "client", "client-key")}

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(names["ca-key"]), "-out", str(names["ca"]))  # fmt: skip
    for who, extra in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        csr = folder / f"{who}.csr"
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", str(names[f"{who}-key"]), "-out", str(csr))  # fmt: skip
        ext = folder / f"{who}.ext"
        ext.write_text(extra + "\n")
        run("x509", "-req", "-in", str(csr), "-CA", str(names["ca"]), "-CAkey", str(names["ca-key"]),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(names[who]))  # fmt: skip
    return names


@contextlib.contextmanager
def etcd_cluster(data_dir: Path, members: int = 3, tls: dict[str, Path] | None = None):
    """Start an etcd cluster of `members` on loopback, data under `data_dir`; yields a list of
    (HOST:PORT, process), one per member."""
    ports = [(free_port(), free_port()) for _ in range(members)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    scheme = "https" if tls else "http"
    secure = (
        [
            f"--cert-file={tls['server']}",
            f"--key-file={tls['server-key']}",
            f"--trusted-ca-file={tls['ca']}",
            "--client-cert-auth",
        ]
        if tls
        else []
    )
    procs = []
    try:
        for i, (client, peer) in enumerate(ports):
            log = open(data_dir.with_name(f"{data_dir.name}-m{i}.log"), "w")  # noqa: SIM115 - the server's
            procs.append(
                subprocess.Popen(
                    [
                        ETCD,
                        f"--name=m{i}",
                        f"--data-dir={data_dir}/m{i}",
                        f"--listen-client-urls={scheme}://127.0.0.1:{client}",
                        f"--advertise-client-urls={scheme}://127.0.0.1:{client}",
                        *secure,
                        f"--listen-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-cluster={initial}",
                        "--initial-cluster-state=new",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
            )
        for (client, _), proc in zip(ports, procs, strict=True):
            _wait_ready(client, proc, tls)
        yield [(f"127.0.0.1:{client}", proc) for (client, _), proc in zip(ports, procs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def _wait_ready(port: int, proc: subprocess.Popen, tls: dict[str, Path] | None) -> None:
    from etcd3gw.client import Etcd3Client

    options = {}
    if tls:
        options = {"protocol": "https", "ca_cert": str(tls["ca"]), "cert_cert": str(tls["client"])}
        options["cert_key"] = str(tls["client-key"])
    client = Etcd3Client(host="127.0.0.1", port=port, timeout=1, **options)
    client.session.trust_env = False  # the CA above, not the environment's bundle
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client.status()
            return
        except Exception:  # not listening yet: any error of the client means "try again"
            assert proc.poll() is None, "etcd exited at start-up"
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.1)

"""The supervisors' key-value store: a TCPStore bound to one address, and messages signed with the job's
shared secret.

Binding. torch's TCPStore server listens on every interface of the machine whatever host it is given;
it does accept a listening socket made by its caller (`master_listen_fd`), so `host_store` binds the
socket itself to the address asked for (`--host`, loopback by default) and hands it over. The workers'
own store is bound the same way (`runtime.distributed`), and torchrun joins the round as a client of a
store its supervisor hosts, so nothing of a run listens beyond `--host`.

Admission. A TCPStore has no authentication: any process that reaches the port can read and write any
key. So every value a supervisor writes is a signed envelope, `{"v": value, "from": node, "mac": hex}`
with the mac an HMAC-SHA256, under the job's token (`--token-file`), of the key, the writer and the
value; a reader that finds a value whose mac does not verify (a stranger's, a replayed one copied to
another key, or garbage) logs it once and treats the key as unset, so the job never acts on it. What a
stranger who reaches the port can still do is deny service (overwrite a key with garbage, so that its
readers wait); a store reachable only on loopback or a private network, or etcd with TLS client
certificates, is the defence against that.
"""

import contextlib
import hashlib
import hmac
import json
import os
import socket
import stat
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from costmodel.errors import ElastorError

MIN_TOKEN_BYTES = 16  # a shared secret shorter than this is refused: it could be guessed
LISTEN_BACKLOG = 1024  # pending connections the store's socket queues (one per worker at start-up)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly `host:port` (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, *, timeout_s: float) -> TCPStore:
    """A TCPStore server listening on `host:port` only (port 0: any free one, `store.port` says
    which). The store owns the socket from then on and closes it when it is destroyed."""
    sock = bind(host, port)
    port = sock.getsockname()[1]
    return TCPStore(
        host,
        port,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def read_token(path: str | os.PathLike) -> bytes:
    """The job's shared secret from `path`: at least MIN_TOKEN_BYTES after stripping white space, and
    readable by its owner only (a token others can read admits them)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().strip()
    except OSError as e:
        raise ElastorError(f"Cannot read --token-file {path} ({e.strerror}).") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ElastorError(
            f"--token-file {path} can be read by other users; make it private with `chmod 600 {path}`."
        )
    if len(token) < MIN_TOKEN_BYTES:
        raise ElastorError(
            f"--token-file {path} holds {len(token)} bytes; a shared secret needs at least "
            f"{MIN_TOKEN_BYTES} (make one with `python -c 'import secrets; print(secrets.token_hex(32))'`)."
        )
    return token


def write_token(path: Path) -> Path:
    """A fresh random token in a new file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path


class SignedStore:
    """A store whose values are signed by their writer and checked by their reader (module docstring).

    `put` and `get` carry JSON values; `get` returns None for a key that is unset or whose value does
    not verify. `raw` is a TCPStore or a runtime.elastic.etcd.EtcdStore; `create` and `put_if` (etcd
    only) are its transactions, and return the envelope they wrote (None: not written)."""

    def __init__(self, raw, token: bytes, node: str):
        self.raw, self._token, self.node = raw, token, node
        self._rejected: set[tuple[str, bytes]] = set()  # logged once each

    def put(self, key: str, value: Any, lease=None) -> None:
        envelope = self._envelope(key, value)
        if lease is None:
            self.raw.set(key, envelope)
        else:
            self.raw.set(key, envelope, lease=lease)

    def create(self, key: str, value: Any, lease=None) -> str | None:
        envelope = self._envelope(key, value)
        return envelope if self.raw.create(key, envelope, lease=lease) else None

    def put_if(self, key: str, value: Any, guard_key: str, guard_envelope: str) -> bool:
        return self.raw.put_if(key, self._envelope(key, value), guard_key, guard_envelope)

    def get(self, key: str) -> Any:
        return self._verified(key, self._fetch(key))

    def get_many(self, keys: list[str]) -> dict[str, Any]:
        """`get` of each of `keys` (etcd: in one request, `fetch_many`)."""
        if hasattr(self.raw, "fetch_many"):
            found = self.raw.fetch_many(keys)
            return {k: self._verified(k, found.get(k)) for k in keys}
        return {k: self.get(k) for k in keys}

    def _verified(self, key: str, data: bytes | None) -> Any:
        """The value `data` of `key` carries, or None if there is none or it does not verify."""
        if data is None:
            return None
        try:
            envelope = json.loads(data)
            payload, writer, mac = envelope["v"], envelope["from"], envelope["mac"]
            if not (isinstance(payload, str) and isinstance(writer, str) and isinstance(mac, str)):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            return self._reject(key, data, "is not a signed message")
        if not hmac.compare_digest(mac, self._mac(key, writer, payload)):
            return self._reject(key, data, f"claims to come from {writer!r} but its signature is wrong")
        return json.loads(payload)

    def _fetch(self, key: str) -> bytes | None:
        if hasattr(self.raw, "fetch"):  # etcd: one request
            return self.raw.fetch(key)
        return self.raw.get(key) if self.raw.check([key]) else None

    def _envelope(self, key: str, value: Any) -> str:
        payload = json.dumps(value, sort_keys=True)
        return json.dumps({"v": payload, "from": self.node, "mac": self._mac(key, self.node, payload)})

    def _mac(self, key: str, writer: str, payload: str) -> str:
        message = b"\0".join(s.encode() for s in (key, writer, payload))
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    def _reject(self, key: str, data: bytes, why: str) -> None:
        if (key, data) not in self._rejected:
            self._rejected.add((key, data))
            with contextlib.suppress(OSError):
                print(
                    f"elastor run: ignored the value of rendezvous key {key!r} ({len(data)} bytes): it {why}",
                    file=sys.stderr,
                    flush=True,
                )
        return None

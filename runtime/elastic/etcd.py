"""The rendezvous on etcd (`--rdzv-backend etcd`): a store that outlives any one host.

With the embedded TCPStore the leader's process is the store, so losing the leader's host ends the
run. etcd (https://etcd.io, Debian's `etcd-server`) keeps its keys in a Raft group: a 3-member
cluster survives the loss of any one member, and the supervisors can lose any host, the leader's
included. What the rendezvous takes from etcd:
- keys under one prefix per run (`/elastor/<--rdzv-id>/`);
- leases: each supervisor holds one with a TTL of `--lease-s`, refreshed with every heartbeat; its
  heartbeat key is attached to it, so a dead node's keys vanish when the lease lapses;
- an election: the leader is whoever created the `leader` key (a transaction that succeeds only if
  the key does not exist), attached to its lease, so a lost leader's key lapses and another node
  can take the office; every decision is written in a transaction guarded on the writer still
  holding that key, so a deposed leader (one that was cut off until its lease lapsed) can never
  overwrite its successor's decisions: no split brain.

The client is etcd3gw (maintained by OpenStack, the etcd v3 API through etcd's gRPC gateway, which
every etcd since 3.4 serves on its client port): plain HTTP/JSON, so no gRPC or protobuf version to
pin against torch's, and TLS client certificates through `requests`. python-etcd3, the gRPC client,
has had no release since 2020 and no longer installs cleanly beside current protobuf. Several
endpoints may be given: a request that cannot reach one tries the next.
"""

import base64
import contextlib
import os
import threading
import time
from dataclasses import dataclass

from costmodel.errors import ElastorError

PREFIX = "/elastor"
REQUEST_TIMEOUT_S = 2.0  # one request to one endpoint
# How long a request keeps trying every endpoint before the store counts as lost: a few of etcd's
# Raft elections (1 s each by default), short beside a lease.
RETRY_S = 10.0
RETRY_PAUSE_S = 0.2


@dataclass(frozen=True)
class EtcdTLS:
    """TLS towards etcd: the CA that signed its certificate, and this node's client certificate."""

    ca_cert: str
    cert: str | None = None
    key: str | None = None


def _encode(text: str) -> str:
    """What the gateway's JSON carries for keys and values: base64."""
    return base64.b64encode(text.encode()).decode()


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' -> [(h1, 2379), (h2, 2379)]."""
    found = []
    for part in text.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ElastorError(f"--rdzv-endpoint {text!r} is not HOST:PORT[,HOST:PORT...].")
        found.append((host.strip("[]"), int(port)))
    return found


class EtcdStore:
    """The few store operations the rendezvous needs, on etcd, under `prefix` (module docstring).

    `set`/`fetch` carry bytes; `create` and `put_if` are etcd's transactions; `lease_*` its leases.
    Connection failures on every endpoint raise ConnectionError."""

    def __init__(self, endpoints: list[tuple[str, int]], run_id: str, *, tls: EtcdTLS | None = None):
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise ElastorError(
                "--rdzv-backend etcd needs the etcd3gw package (pip install etcd3gw)."
            ) from None
        protocol = "https" if tls else "http"
        options = {"ca_cert": tls.ca_cert, "cert_cert": tls.cert, "cert_key": tls.key} if tls else {}
        self._clients = [
            Etcd3Client(host=h, port=p, protocol=protocol, timeout=REQUEST_TIMEOUT_S, **options)
            for h, p in endpoints
        ]
        for client in self._clients:
            # Not the environment's proxies or CA bundle: requests lets REQUESTS_CA_BUNDLE override
            # the session's own CA (so --etcd-cacert), and etcd is never reached through a proxy.
            client.session.trust_env = False
        self.endpoints = endpoints
        self.prefix = f"{PREFIX}/{run_id}/"
        self._lock = threading.Lock()  # requests' sessions are not safe across threads
        self.retry_s = RETRY_S

    def _call(self, name: str, *args, **kwargs):
        """Client method `name` on the first endpoint that answers."""
        return self._each(lambda client: getattr(client, name)(*args, **kwargs))

    def _each(self, op):
        """`op(client)` on the first endpoint that answers; that one goes first from then on. While
        none does, for up to RETRY_S (a member lost, the others electing a new Raft leader), try
        them all again."""
        from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, InternalServerError

        retry = (ConnectionFailedError, ConnectionTimeoutError, InternalServerError)
        deadline = time.monotonic() + self.retry_s
        while True:
            errors = []
            with self._lock:
                for i, client in enumerate(self._clients):
                    try:
                        result = op(client)
                    except retry as e:  # refused, timed out, or a 5xx such as "leader changed"
                        errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {type(e).__name__}")
                        continue
                    if i:
                        self._clients.insert(0, self._clients.pop(i))
                        self.endpoints.insert(0, self.endpoints.pop(i))
                    return result
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"no etcd endpoint answered in {self.retry_s:g} s ({'; '.join(errors)})"
                )
            time.sleep(RETRY_PAUSE_S)

    # ---- keys -----------------------------------------------------------------------------------
    def set(self, key: str, value: str, lease=None) -> None:
        self._call("put", self.prefix + key, value, lease=lease)

    def fetch(self, key: str) -> bytes | None:
        values = self._call("get", self.prefix + key)
        return values[0] if values else None

    def fetch_many(self, keys: list[str]) -> dict[str, bytes]:
        """The values of those of `keys` that exist, in one range request over their common prefix."""
        prefix = self.prefix + os.path.commonprefix(keys)  # noqa: RUF071 - etcd ranges over characters
        found = self._call("get_prefix", prefix)
        values = {meta["key"].decode()[len(self.prefix) :]: value for value, meta in found}
        return {k: values[k] for k in keys if k in values}

    def create(self, key: str, value: str, lease=None) -> bool:
        """Write `key` if it does not exist; whether it was written."""
        return bool(self._call("create", self.prefix + key, value, lease=lease))

    def put_if(self, key: str, value: str, guard_key: str, guard_value: str) -> bool:
        """Write `key` only while `guard_key` holds exactly `guard_value`; whether it was written."""
        txn = {
            "compare": [
                {
                    "key": _encode(self.prefix + guard_key),
                    "result": "EQUAL",
                    "target": "VALUE",
                    "value": _encode(guard_value),
                }
            ],
            "success": [{"request_put": {"key": _encode(self.prefix + key), "value": _encode(value)}}],
            "failure": [],
        }
        return bool(self._call("transaction", txn).get("succeeded"))

    def delete_all(self) -> None:
        self._call("delete_prefix", self.prefix)

    # ---- leases ---------------------------------------------------------------------------------
    def lease_grant(self, ttl_s: float):
        return self._call("lease", max(1, round(ttl_s)))

    def lease_refresh(self, lease) -> bool:
        """Refresh `lease` through whichever endpoint answers; False if it had already lapsed (etcd
        then answers without a TTL)."""
        from etcd3gw.lease import Lease

        return self._each(lambda client: Lease(lease.id, client).refresh()) > 0

    def lease_revoke(self, lease) -> None:
        """Give `lease` back: its keys go at once instead of when it lapses."""
        from etcd3gw.exceptions import Etcd3Exception
        from etcd3gw.lease import Lease

        with contextlib.suppress(Etcd3Exception):  # etcd no longer knows it: it lapsed already
            self._each(lambda client: Lease(lease.id, client).revoke())

"""`elastor run`: elastic training; on failure re-plan for the surviving GPUs, resume, and grow back."""

import argparse
import signal
from pathlib import Path

from costmodel import ClusterSpec, ElastorError, ModelProfile
from costmodel.cluster import of_kind
from costmodel.jsonio import read_json
from costmodel.plan import SHARDING
from elastor.commands import subcommand
from elastor.commands.argtypes import (
    GLOBAL_BATCH_SIZE,
    MAX_STEPS,
    SEED,
    STEPS,
    add_gpus_per_node,
    integer,
    real,
)
from elastor.commands.train import EVAL_BATCHES, EVAL_FRACTION, LR, SNAPSHOT_EVERY, TIMEOUT_S

EXAMPLE = (
    "elastor run --cluster 2,2 --profile profiles/gpt-tiny-cpu.json --global-batch-size 16 --steps 40 \\\n"
    "      --ckpt-dir ckpt/ --ckpt-every 5 --inject-failure n1:1@15 --inject-recovery n1:1@30"
)

# Flags passed unchanged to `elastor train` by every supervisor.
TRAIN_FLAGS = (
    "peer_snapshot_every",
    "data",
    "seed",
    "lr",
    "warmup_steps",
    "timeout_s",
    "eval_fraction",
    "eval_every",
    "eval_batches",
    "tokenizer",
)
# Rounds that may follow a failed round: enough for a handful of GPU failures in one run, few enough
# that a cause no restart can fix stops the run in minutes.
MAX_RESTARTS = 10
# Steps between peer snapshots (runtime/elastic/snapshots.py): a lost ZeRO-1 slice redoes at most
# this many steps, and each worker sends the state it alone keeps once per this many.
PEER_SNAPSHOT_EVERY = 10
RESTARTS = integer(0, 10_000)
POSITIVE_STEPS = integer(1, MAX_STEPS)
SECONDS = real(1.0, 86_400.0)
# A rank without progress for this long is hung: well under the workers' collective timeout (60 s by
# default), so that a hang costs seconds rather than a timeout; long enough for a step's slowest phase.
HANG_TIMEOUT_S = 20.0
LEASE_S = 10.0  # a node whose heartbeat stops for this long is lost
ROUND_DEADLINE_S = 60.0  # how long the leader waits for a round's health reports


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "run",
        "Train elastically: plan for the healthy GPUs, run under torchrun, and after a failure re-plan "
        "for the survivors and resume from the newest checkpoint; grow back when a GPU returns.",
        EXAMPLE,
    )
    p.add_argument(
        "--cluster",
        required=True,
        help='healthy GPUs per node ("4,4") or a cluster JSON; with --node only its device and links count',
    )
    add_gpus_per_node(p)
    p.add_argument("--profile", required=True, help="profile JSON from `elastor profile`")
    p.add_argument(
        "--global-batch-size", type=GLOBAL_BATCH_SIZE, required=True, help=f"an integer {GLOBAL_BATCH_SIZE}"
    )
    p.add_argument(
        "--steps", type=POSITIVE_STEPS, required=True, help=f"the global step to reach, {POSITIVE_STEPS}"
    )
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory, shared by every node")
    p.add_argument(
        "--ckpt-every",
        type=POSITIVE_STEPS,
        default=5,
        help=f"steps between checkpoints, {POSITIVE_STEPS} (default: %(default)s)",
    )
    p.add_argument("--metrics", help="metrics JSON-lines file (default: CKPT_DIR/metrics.jsonl)")
    p.add_argument("--method", default="elastor", help="planning method (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: %(default)s")
    p.add_argument("--data", help="passed to `elastor train`")
    p.add_argument("--tokenizer", help="passed to `elastor train`")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="passed to `elastor train`")
    p.add_argument("--eval-fraction", type=EVAL_FRACTION, help="passed to `elastor train`")
    p.add_argument("--eval-every", type=STEPS, help="passed to `elastor train`")
    p.add_argument("--eval-batches", type=EVAL_BATCHES, help="passed to `elastor train`")
    p.add_argument("--seed", type=SEED, default=0, help=f"passed to `elastor train`, {SEED} (default: 0)")
    p.add_argument(
        "--lr", type=LR, default=3e-4, help=f"passed to `elastor train`, {LR} (default: %(default)s)"
    )
    p.add_argument(
        "--warmup-steps", type=STEPS, default=10, help=f"passed to `elastor train`, {STEPS} (default: 10)"
    )
    p.add_argument(
        "--timeout-s",
        type=TIMEOUT_S,
        default=60.0,
        help=f"collective timeout of the workers, {TIMEOUT_S} (default: %(default)s)",
    )
    p.add_argument(
        "--max-restarts",
        type=RESTARTS,
        default=MAX_RESTARTS,
        help=f"rounds that may follow a failed round, {RESTARTS}; one more failure ends the run with "
        "exit 2 (default: %(default)s); a round that fails with the same error as the one before, on the "
        "same GPUs and without a newer checkpoint, ends it at once",
    )
    p.add_argument(
        "--hang-timeout-s",
        type=SECONDS,
        default=HANG_TIMEOUT_S,
        help=f"a worker without progress for this long is hung: its node's workers are killed and the "
        f"round re-planned without its GPU, {SECONDS} (default: %(default)s)",
    )
    p.add_argument(
        "--lease-s",
        type=SECONDS,
        default=LEASE_S,
        help=f"a node whose supervisor's heartbeat stops for this long is lost and left out, {SECONDS} "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--round-deadline-s",
        type=SECONDS,
        default=ROUND_DEADLINE_S,
        help=f"how long the leader waits for the nodes' health reports before a round goes on without "
        f"the missing ones, {SECONDS} (default: %(default)s)",
    )
    p.add_argument(
        "--sharding",
        choices=("auto", *SHARDING),
        default="none",
        help="optimizer state of every round's plan: sharded over each bucket's holders (zero1: a lost "
        "GPU's slice then exists only in its peer snapshot, see --peer-snapshot-every), not (none; "
        "default), or whichever is faster (auto)",
    )
    p.add_argument(
        "--recovery",
        choices=("in-process", "restart"),
        default="in-process",
        help="after a worker dies: its surviving peers re-plan and reshard from each other's memory in "
        "their processes, falling back to a restart where they cannot (in-process, the default); or "
        "every failure restarts the round's workers under torchrun from the newest checkpoint (restart)",
    )
    p.add_argument(
        "--peer-snapshot-every",
        type=SNAPSHOT_EVERY,
        default=PEER_SNAPSHOT_EVERY,
        help=f"in-process recovery: every this many steps each worker copies the state it alone keeps "
        f"(ZeRO-1 slices, any row without a replica) to a peer on another node, and the loss of such "
        f"state rolls the survivors back to that copy instead of restarting, {SNAPSHOT_EVERY}; 0 for "
        "never (default: %(default)s)",
    )
    p.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="[hang:|host:|commit:]DEVICE@STEP",
        help="SIGKILL the worker playing DEVICE when training reaches STEP; hang:DEVICE@STEP freezes it "
        "(SIGSTOP), host:DEVICE@STEP takes its whole node down, commit:DEVICE@STEP kills it inside step "
        "STEP's commit all-reduce, which the next device then misses (repeatable; a script: each failure "
        "is armed once the ones before it have fired or are due no later)",
    )
    p.add_argument(
        "--inject-recovery",
        action="append",
        default=[],
        metavar="DEVICE@STEP",
        help="bring DEVICE back at the first checkpoint boundary from STEP on (repeatable)",
    )
    node = p.add_argument_group("one node of a real cluster (without these, --cluster is simulated here)")
    node.add_argument("--node", help="this node's name")
    node.add_argument("--nodes", help="every node's name, comma-separated; the first one leads")
    node.add_argument(
        "--rdzv-endpoint",
        help="tcp: HOST:PORT of the store the first node hosts; etcd: HOST:PORT[,HOST:PORT...] of the "
        "etcd cluster's members (then also for a simulated --cluster)",
    )
    p.add_argument(
        "--rdzv-backend",
        choices=("tcp", "etcd"),
        default="tcp",
        help="where the supervisors agree on rounds: tcp, a store the first node hosts (no set-up; it "
        "is a single point of failure), or etcd, which survives the loss of any host, the leader's "
        "included (default: %(default)s)",
    )
    p.add_argument(
        "--rdzv-id",
        help="etcd: this run's key prefix, the same on every node and new for every launch (the "
        "scheduler's job id, say); a simulated cluster makes one up",
    )
    p.add_argument("--etcd-cacert", help="etcd over TLS: the CA certificate that signed etcd's")
    p.add_argument("--etcd-cert", help="etcd over TLS: this node's client certificate")
    p.add_argument("--etcd-key", help="etcd over TLS: the client certificate's key")
    node.add_argument("--gpus", help="this node's GPU ids (default: every GPU torch sees)")
    node.add_argument(
        "--host",
        default="127.0.0.1",
        help="this node's address: its stores (the leader's rendezvous, the workers' own) listen on it "
        "only (default: %(default)s)",
    )
    node.add_argument(
        "--token-file",
        help="the job's shared secret (the same file on every node, private to its owner): every "
        "rendezvous message is signed with it, and unsigned ones are ignored; needed with --node",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from runtime.elastic.faults import Fault

    profile = ModelProfile.from_json(read_json(args.profile, "profile"))
    cluster = of_kind(
        ClusterSpec.parse(args.cluster, profile.device_kind, args.gpus_per_node),
        profile.device_kind,
        args.cluster,
    )
    failures = [Fault.parse(f, "--inject-failure") for f in args.inject_failure]
    recoveries = [Fault.parse(f, "--inject-recovery") for f in args.inject_recovery]
    if args.recovery != "in-process" and any(f.kind == "commit" for f in failures):
        raise ElastorError(
            "--inject-failure commit:DEVICE@STEP tests the in-process recovery's commit check; it needs "
            "--recovery in-process."
        )
    if args.rdzv_backend == "etcd" and not args.rdzv_endpoint:
        raise ElastorError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT of the etcd cluster.")
    if args.node is None:
        from runtime.elastic.launch import launch_simulated

        return launch_simulated(
            cluster, _supervisor_args(args), etcd=args.rdzv_endpoint if _etcd(args) else None
        )
    return _run_node(args, profile, cluster, tuple(failures), tuple(recoveries))


def _run_node(args, profile, cluster, failures, recoveries) -> int:
    from runtime.elastic.store import read_token
    from runtime.elastic.supervisor import NodeSupervisor, RunConfig

    if not (args.nodes and args.rdzv_endpoint):
        raise ElastorError("--node needs --nodes and --rdzv-endpoint HOST:PORT.")
    if _etcd(args) and not args.rdzv_id:
        raise ElastorError(
            "--rdzv-backend etcd needs --rdzv-id, the same on every node and new for every launch."
        )
    if not args.token_file:
        raise ElastorError(
            "--node needs --token-file, a shared secret readable by its owner only and the same on every "
            "node (`python -c 'import secrets; print(secrets.token_hex(32))' > token && chmod 600 token`)."
        )
    token = read_token(args.token_file)
    config = RunConfig(
        profile=profile,
        cluster=cluster,
        global_batch_size=args.global_batch_size,
        steps=args.steps,
        ckpt_dir=Path(args.ckpt_dir),
        ckpt_every=args.ckpt_every,
        metrics=_metrics_path(args),
        max_restarts=args.max_restarts,
        method=args.method,
        device=args.device,
        train_args=tuple(_train_args(args)),
        failures=failures,
        recoveries=recoveries,
        hang_timeout_s=args.hang_timeout_s,
        recovery=args.recovery,
        sharding=SHARDING if args.sharding == "auto" else (args.sharding,),
        peer_snapshot_every=args.peer_snapshot_every if args.recovery == "in-process" else 0,
    )
    gpus = _gpus(args.gpus, args.device)
    rendezvous = _rendezvous(args, token)
    supervisor = NodeSupervisor(config, rendezvous, gpus, host=args.host)
    # SIGTERM (the launcher, a scheduler) or Ctrl-C: the workers finish their step and save, and the
    # run ends; a second signal unwinds through the supervisor, which stops its workers at once.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.request_stop)
    try:
        code = supervisor.run()
        leads = rendezvous.is_leader
    finally:
        rendezvous.close()
    if leads and code == 0:
        _print_report(config.metrics)
    return code


def _etcd(args) -> bool:
    return args.rdzv_backend == "etcd"


def _rendezvous(args, token: bytes):
    from runtime.elastic.etcd import EtcdTLS
    from runtime.elastic.rendezvous import etcd_rendezvous, tcp_rendezvous

    nodes = args.nodes.split(",")
    timing = {"lease_s": args.lease_s, "deadline_s": args.round_deadline_s}
    if _etcd(args):
        tls = EtcdTLS(args.etcd_cacert, args.etcd_cert, args.etcd_key) if args.etcd_cacert else None
        return etcd_rendezvous(
            args.rdzv_endpoint, args.rdzv_id, nodes, args.node, token=token, tls=tls, **timing
        )
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ElastorError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT.")
    return tcp_rendezvous(host, int(port), nodes, args.node, token=token, bind_host=args.host, **timing)


def _gpus(text: str | None, device: str) -> list[int]:
    if text:
        try:
            return [int(g) for g in text.split(",")]
        except ValueError:
            raise ElastorError(f"--gpus {text!r} is not a comma-separated list of GPU ids.") from None
    if device != "cuda":
        raise ElastorError("--gpus is needed when the node's GPUs are simulated (--device cpu).")
    import torch

    return list(range(torch.cuda.device_count()))


def _metrics_path(args) -> Path:
    return Path(args.metrics) if args.metrics else Path(args.ckpt_dir) / "metrics.jsonl"


def _supervisor_args(args) -> list[str]:
    """The flags every simulated node's supervisor gets (the launcher adds --node and friends)."""
    return [
        f"--cluster={args.cluster}",
        *([f"--gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []),
        f"--profile={args.profile}",
        f"--global-batch-size={args.global_batch_size}",
        f"--steps={args.steps}",
        f"--ckpt-dir={args.ckpt_dir}",
        f"--ckpt-every={args.ckpt_every}",
        f"--metrics={_metrics_path(args)}",
        f"--max-restarts={args.max_restarts}",
        f"--method={args.method}",
        f"--device={args.device}",
        f"--hang-timeout-s={args.hang_timeout_s}",
        f"--recovery={args.recovery}",
        f"--sharding={args.sharding}",
        f"--lease-s={args.lease_s}",
        f"--round-deadline-s={args.round_deadline_s}",
        f"--rdzv-backend={args.rdzv_backend}",
        *(
            f"--{flag.replace('_', '-')}={getattr(args, flag)}"
            for flag in ("etcd_cacert", "etcd_cert", "etcd_key")
            if getattr(args, flag)
        ),
        *_train_args(args),
        *(f"--inject-failure={f}" for f in args.inject_failure),
        *(f"--inject-recovery={f}" for f in args.inject_recovery),
    ]


def _train_args(args) -> list[str]:
    given = [
        f"--{f.replace('_', '-')}={getattr(args, f)}" for f in TRAIN_FLAGS if getattr(args, f) is not None
    ]
    return given if args.shuffle else [*given, "--no-shuffle"]


def _print_report(metrics: Path) -> None:
    """The recovery breakdown, and the measured costs beside the metrics as `<stem>-costs.json`,
    the file `elastor simulate --costs` reads."""
    from costmodel.jsonio import write_json
    from runtime.elastic.report import format_recoveries, measured_costs, read_metrics, recoveries

    if metrics.is_file():
        records = read_metrics(metrics)
        print(format_recoveries(recoveries(records)))
        if costs := measured_costs(records):
            out = metrics.with_name(f"{metrics.stem}-costs.json")
            write_json(out, costs)
            print(f"measured costs for `elastor simulate --costs`: {out}")

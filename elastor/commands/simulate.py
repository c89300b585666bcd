"""`elastor simulate`: goodput of a training run under failures, per recovery policy (goodput/).

goodput (with pandas and matplotlib) is imported when the command runs, not when the parser is
built, so `elastor --help` and the other subcommands start fast.
"""

import argparse
import math
import re
import sys
import time

from costmodel import ClusterSpec, ElastorError, ModelProfile
from costmodel.jsonio import read_json
from costmodel.table import format_table
from elastor.commands import subcommand

_NODES_BY_GPUS = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "simulate",
        "Simulate weeks of training under GPU and node failures: goodput per recovery policy, lost "
        "work by cause with confidence intervals, and the best checkpoint interval.",
        "elastor simulate --profile p70.json --cluster 2048x8 --global-batch-size 4096 --days 30 "
        "--runs 5 --out-dir sim/",
    )
    p.add_argument("--profile", required=True, help="profile JSON (elastor profile ... --analytic)")
    p.add_argument(
        "--cluster",
        required=True,
        help='nodes x GPUs ("2048x8"), healthy GPUs per node ("8,8,7") or a cluster JSON file',
    )
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per step")
    p.add_argument("--days", type=float, default=30.0, help="simulated days per run (default: %(default)s)")
    p.add_argument(
        "--runs", type=int, default=5, help="repeated runs (seeds) per policy (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument(
        "--policies",
        help="comma-separated among elastor, node-drop, wait-for-repair, spare-nodes:K "
        "(default: all four, with K = 1%% of the nodes)",
    )
    p.add_argument(
        "--ckpt-interval",
        type=float,
        help="seconds of training between checkpoints (default: Daly's optimum for these costs and rates)",
    )
    p.add_argument(
        "--sweep-intervals",
        help='"auto" (a quarter to four times Daly\'s optimum) or seconds, comma-separated: find the best '
        "interval per policy",
    )
    p.add_argument(
        "--rate-factors", help="also simulate these multiples of the failure rates, e.g. 0.5,1,2,4"
    )
    p.add_argument(
        "--failures",
        default="llama3",
        help='"llama3" (the Llama 3 report\'s rates), "none", or a failure-model JSON file '
        "(default: %(default)s)",
    )
    p.add_argument("--distribution", choices=("exponential", "weibull"), help="lifetime distribution")
    p.add_argument("--weibull-shape", type=float, help="Weibull shape (default 0.7)")
    p.add_argument("--gpu-repair-h", type=float, help="mean GPU repair time, hours (default 24)")
    p.add_argument("--node-repair-h", type=float, help="mean node repair time, hours (default 12)")
    p.add_argument("--repair-sigma", type=float, help="lognormal shape of repair times (default 1; 0: fixed)")
    p.add_argument("--costs", help="measured recovery and checkpoint costs, JSON (fields of RecoveryCosts)")
    p.add_argument(
        "--plan-cache",
        help="JSON file keeping the solver's plans between runs (created if absent; delete it when the "
        "solver changes)",
    )
    p.add_argument("--solver-time-limit", type=float, help="seconds per solver call (default: the solver's)")
    p.add_argument(
        "--chunks",
        choices=("1", "auto"),
        default="1",
        help="layer chunks per stage in the plans: 1 (1F1B; default) or auto (as elastor plan --chunks)",
    )
    p.add_argument(
        "--slices",
        default="auto",
        help="plan the cluster as this many equal slices, each with its share of the batch, and add "
        "their throughputs: an approximation for clusters too large to solve whole; 1 plans it whole; "
        '"auto": slices of at most 2,048 GPUs when the nodes and the batch split evenly '
        "(default: %(default)s)",
    )
    p.add_argument("--out-dir", help="write CSV files and plots here")
    p.add_argument(
        "--timeline-days",
        type=float,
        default=7.0,
        help="days shown on the timeline plot (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def parse_cluster(text: str, kind: str) -> ClusterSpec:
    match = _NODES_BY_GPUS.match(text)
    if match:
        nodes, gpus = int(match[1]), int(match[2])
        if nodes < 1 or gpus < 1:
            raise ElastorError(f"Cluster {text!r} needs at least one node of at least one GPU.")
        return ClusterSpec.from_counts([gpus] * nodes, kind)
    return ClusterSpec.parse(text, kind)


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ElastorError(f"{flag} takes positive numbers separated by commas, not {text!r}.") from None
    if not values or min(values) <= 0:
        raise ElastorError(f"{flag} takes positive numbers separated by commas, not {text!r}.")
    return values


def failure_model(args: argparse.Namespace):
    from goodput import FailureModel

    overrides = {
        name: getattr(args, flag)
        for flag, name in (
            ("distribution", "distribution"),
            ("weibull_shape", "weibull_shape"),
            ("gpu_repair_h", "gpu_repair_mean_h"),
            ("node_repair_h", "node_repair_mean_h"),
            ("repair_sigma", "repair_sigma"),
        )
        if getattr(args, flag) is not None
    }
    if args.failures == "llama3":
        return FailureModel.llama3(**overrides)
    if args.failures == "none":
        return FailureModel(**{**FailureModel.none().to_json(), **overrides})
    data = read_json(args.failures, "failure model")
    return FailureModel.from_json({**data, **overrides, "source": args.failures})


def parse_slices(text: str, cluster: ClusterSpec, global_batch_size: int) -> int:
    from goodput.slices import SLICE_GPUS, auto_slices

    if text != "auto":
        try:
            slices = int(text)
        except ValueError:
            slices = 0
        if slices < 1:
            raise ElastorError(f'--slices takes "auto" or a positive whole number, not {text!r}.')
        return slices
    counts = [len(n.gpus) for n in cluster.nodes]
    slices = auto_slices(counts, global_batch_size)
    if slices == 1 and sum(counts) > SLICE_GPUS:
        print(
            f"note: planning all {sum(counts):,} GPUs as one cluster (no even split into slices of at "
            f"most {SLICE_GPUS:,} GPUs); each plan may take the solver minutes.",
            file=sys.stderr,
        )
    return slices


def check_flags(args: argparse.Namespace) -> None:
    if args.global_batch_size < 1 or args.runs < 1:
        raise ElastorError("--global-batch-size and --runs must be at least 1.")
    if args.days <= 0 or args.timeline_days <= 0:
        raise ElastorError("--days and --timeline-days must be positive.")
    if args.ckpt_interval is not None and args.ckpt_interval <= 0:
        raise ElastorError(f"--ckpt-interval must be a positive number of seconds, not {args.ckpt_interval}.")


def run(args: argparse.Namespace) -> int:
    from goodput.experiment import auto_intervals, build_study, run_experiment, write_outputs
    from goodput.plots import loss_table
    from goodput.policies import default_policies

    started = time.perf_counter()
    check_flags(args)
    profile = ModelProfile.from_json(read_json(args.profile, "profile"))
    cluster = parse_cluster(args.cluster, profile.device_kind)
    nodes = len(cluster.nodes)
    slices = parse_slices(args.slices, cluster, args.global_batch_size)
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else default_policies(nodes)
    failures = failure_model(args)
    study = build_study(
        profile,
        cluster,
        args.global_batch_size,
        failures,
        args.days,
        args.costs,
        progress=not args.quiet,
        plan_cache=args.plan_cache,
        solver_time_limit_s=args.solver_time_limit,
        interleave=args.chunks == "auto",
        slices=slices,
    )
    young, daly = study.young_daly()
    sweep = None
    if args.sweep_intervals == "auto" and not math.isfinite(daly):
        raise ElastorError(
            "--sweep-intervals auto needs failures: without them Daly's interval is unbounded."
        )
    if args.sweep_intervals:
        sweep = (
            auto_intervals(daly)
            if args.sweep_intervals == "auto"
            else parse_floats(args.sweep_intervals, "--sweep-intervals")
        )
    rates = parse_floats(args.rate_factors, "--rate-factors") if args.rate_factors else None
    outcome = run_experiment(
        study,
        policies,
        args.runs,
        seed=args.seed,
        interval_s=args.ckpt_interval,
        sweep_intervals=sweep,
        rate_factors=rates,
        timeline=bool(args.out_dir),
    )

    c = study.costs
    interval = "none (no failures)" if outcome.interval_s is None else f"{outcome.interval_s:g} s"
    sliced = f", planned as {slices} slices" if slices > 1 else ""
    print(
        f"{profile.model.name} on {study.num_gpus:,} {cluster.device.kind} GPUs ({nodes:,} nodes), "
        f"global batch {args.global_batch_size}, {args.days:g} days x {args.runs} runs\n"
        f"failure-free: {study.reference.samples_per_s:,.1f} samples/s "
        f"({study.reference.num_pipelines} pipelines{sliced}); failures: {failures.source} "
        f"({failures.distribution}), MTBF {study.mtbf_s() / 3600:.2f} h\n"
        f"costs ({c.source}): detect {c.detect_s:g} s, plan {c.plan_s:g} s, restart {c.restart_s:g} s, "
        f"load {c.load_s:.1f} s (reshard {c.reshard_load_s:.1f} s), checkpoint stall {c.ckpt_stall_s:.2f} s "
        f"+ background {c.ckpt_background_s:.2f} s\n"
        f"checkpoint interval {interval} (Young {young:.0f} s, Daly {daly:.0f} s)\n"
    )
    table = loss_table(outcome.summary)
    print(format_table([list(table.columns), *table.astype(str).values.tolist()]))
    if outcome.best is not None:
        rows = [("policy", "best interval s", "grid best s", "vs Young", "vs Daly", "goodput %")]
        for _, b in outcome.best.iterrows():
            rows.append(
                (
                    b["policy"],
                    f"{b['best_interval_s']:.0f}",
                    f"{b['grid_best_s']:.0f}",
                    f"{b['best_interval_s'] / young:.2f}",
                    f"{b['best_interval_s'] / daly:.2f}",
                    f"{100 * b['goodput']:.2f}",
                )
            )
        print("\n" + format_table(rows))
    if args.out_dir:
        for path in write_outputs(outcome, study, args.out_dir, args.timeline_days):
            print(f"wrote {path}")
    oracle = study.solver_cache
    points = [p for p in oracle.points().values() if p is not None]
    feasible = [p.gap for p in points if p.status == "FEASIBLE"]
    proven = f"{len(points) - len(feasible)} proven optimal" + (
        f", {len(feasible)} FEASIBLE (gap up to {100 * max(feasible):.1f}%)" if feasible else ""
    )
    phases = ", ".join(f"{name} {s:.1f} s" for name, s in outcome.wall_s.items())
    print(
        f"\n{oracle.solves} plans ({proven}): {oracle.solved} solved now in {oracle.solve_wall_s:.1f} s, "
        f"{oracle.solves - oracle.solved} from the plan cache; {study.oracle.calls} look-ups; {phases}; "
        f"total {time.perf_counter() - started:.1f} s"
    )
    return 0

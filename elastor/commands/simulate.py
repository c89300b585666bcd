"""`elastor simulate`: goodput of a training run under failures, per recovery policy (goodput/).

goodput (with pandas and matplotlib) is imported when the command runs, not when the parser is
built, so `elastor --help` and the other subcommands start fast.
"""

import argparse
import math
import re
import sys
import time

from costmodel import ClusterSpec, ElastorError, ModelProfile, flops
from costmodel.cluster import check_size, of_kind
from costmodel.jsonio import output_dir, output_path, read_json, shown
from costmodel.table import format_table
from elastor.commands import subcommand
from elastor.commands.argtypes import (
    CLUSTER_BOUNDS,
    GLOBAL_BATCH_SIZE,
    SEED,
    SOLVER_TIME_LIMIT_S,
    add_gpus_per_node,
    integer,
    real,
)

_NODES_BY_GPUS = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")
# A year of simulated training: longer than any run reported (Llama 3 405B: 54 days), and a bound on
# the simulation's time, which grows with the days (--days inf would never return).
MAX_DAYS = 365.0
# Repeated runs per policy: a hundred already give confidence intervals of a few tenths of a percent.
MAX_RUNS = 1000
# Multiples of the failure rates: a thousand times Llama 3's fails a GPU of a 16,384-GPU cluster
# every few seconds, past any rate worth studying.
MAX_RATE_FACTOR = 1000.0
# The most expected failures in one run, over every rate factor: the simulation handles them one by
# one, so this bounds its time (Llama 3's 54 days on 16,384 GPUs saw 419).
MAX_EXPECTED_FAILURES = 1_000_000
# The most intervals one sweep simulates (each is every policy times every run).
MAX_SWEEP_INTERVALS = 100

DAYS = real(above=0.0, high=MAX_DAYS)
HOURS = real(above=0.0, high=MAX_DAYS * 24)
SECONDS = real(above=0.0, high=MAX_DAYS * 86_400)


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
        help=f'nodes x GPUs ("2048x8"), healthy GPUs per node ("8,8,7") or a cluster JSON file '
        f"({CLUSTER_BOUNDS})",
    )
    add_gpus_per_node(p)
    p.add_argument(
        "--global-batch-size",
        type=GLOBAL_BATCH_SIZE,
        required=True,
        help=f"samples per step, an integer {GLOBAL_BATCH_SIZE}",
    )
    p.add_argument(
        "--days", type=DAYS, default=30.0, help=f"simulated days per run, {DAYS} (default: %(default)s)"
    )
    p.add_argument(
        "--runs",
        type=integer(1, MAX_RUNS),
        default=5,
        help=f"repeated runs (seeds) per policy, in 1..{MAX_RUNS:,} (default: %(default)s)",
    )
    p.add_argument("--seed", type=SEED, default=0, help=f"first seed, {SEED} (default: %(default)s)")
    p.add_argument(
        "--policies",
        help="comma-separated among elastor, node-drop, wait-for-repair, spare-nodes:K "
        "(default: all four, with K = 1%% of the nodes)",
    )
    p.add_argument(
        "--ckpt-interval",
        type=SECONDS,
        help=f"seconds of training between checkpoints, {SECONDS} (default: Daly's optimum for these "
        "costs and rates)",
    )
    p.add_argument(
        "--sweep-intervals",
        help='"auto" (a quarter to four times Daly\'s optimum) or seconds, comma-separated (at most '
        f"{MAX_SWEEP_INTERVALS}, each {SECONDS}): find the best interval per policy",
    )
    p.add_argument(
        "--rate-factors",
        help="also simulate these multiples of the failure rates, e.g. 0.5,1,2,4 (at most "
        f"{MAX_SWEEP_INTERVALS}, each above 0 and at most {MAX_RATE_FACTOR:g})",
    )
    p.add_argument(
        "--failures",
        default="llama3",
        help='"llama3" (the Llama 3 report\'s rates), "none", or a failure-model JSON file '
        "(default: %(default)s)",
    )
    p.add_argument("--distribution", choices=("exponential", "weibull"), help="lifetime distribution")
    # the failure model checks the shapes' ranges (goodput.failures), so a failure file obeys them too
    p.add_argument("--weibull-shape", type=real(), help="Weibull shape, in 0.1..10 (default 0.7)")
    p.add_argument("--gpu-repair-h", type=HOURS, help=f"mean GPU repair time, hours, {HOURS} (default 24)")
    p.add_argument("--node-repair-h", type=HOURS, help=f"mean node repair time, hours, {HOURS} (default 12)")
    p.add_argument(
        "--repair-sigma",
        type=real(),
        help="lognormal shape of repair times, in 0..5 (default 1; 0: fixed)",
    )
    p.add_argument("--costs", help="measured recovery and checkpoint costs, JSON (fields of RecoveryCosts)")
    p.add_argument(
        "--plan-cache",
        help="JSON file keeping the solver's plans between runs (created if absent; delete it when the "
        "solver changes)",
    )
    p.add_argument(
        "--solver-time-limit",
        type=SOLVER_TIME_LIMIT_S,
        help=f"seconds per solver call, {SOLVER_TIME_LIMIT_S} (default: the solver's)",
    )
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
        type=DAYS,
        default=7.0,
        help=f"days shown on the timeline plot, {DAYS} (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def parse_cluster(text: str, kind: str, gpus_per_node: int | None = None) -> ClusterSpec:
    match = _NODES_BY_GPUS.match(text)
    if match:
        if len(match[1]) > 9 or len(match[2]) > 9:  # past every bound: no need to read them exactly
            raise ElastorError(f"Cluster {shown(text)} is larger than any cluster Elastor plans.")
        nodes, gpus = int(match[1]), int(match[2])
        if nodes < 1 or gpus < 1:
            raise ElastorError(f"Cluster {text!r} needs at least one node of at least one GPU.")
        check_size(nodes, gpus, nodes * gpus)
        return ClusterSpec.from_counts([gpus] * nodes, kind, gpus_per_node)
    return ClusterSpec.parse(text, kind, gpus_per_node)


def interval_answer(used_s: float | None, asked_s: float | None, daly_s: float) -> str:
    """The checkpoint interval to use, when no sweep searched one: Daly's, unless one was asked for."""
    if used_s is None:
        return "interval answer: no periodic checkpoint (no failures to recover from)."
    search = "--sweep-intervals auto finds each policy's best by simulation"
    if asked_s is not None:
        return (
            f"interval answer: not searched; every policy checkpointed every {used_s:g} s as asked "
            f"(Daly's optimum for these costs and rates: {daly_s:.0f} s; {search})."
        )
    return (
        f"interval answer: checkpoint every {used_s:g} s of training, Daly's optimum for these costs "
        f"and rates ({search})."
    )


def parse_floats(text: str, flag: str, high: float) -> list[float]:
    """Positive finite numbers up to `high`, comma-separated, at most MAX_SWEEP_INTERVALS of them."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or len(values) > MAX_SWEEP_INTERVALS or not all(0 < v <= high for v in values):
        raise ElastorError(
            f"{flag} takes positive numbers up to {high:,.0f} separated by commas (at most "
            f"{MAX_SWEEP_INTERVALS}), not {shown(text)}."
        )
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


def check_outputs(args: argparse.Namespace) -> None:
    """Bad output paths fail before the simulation, not after it."""
    if args.out_dir:
        output_dir(args.out_dir)
    if args.plan_cache:
        output_path(args.plan_cache)


def check_failures(failures, cluster: ClusterSpec, days: float, rates: list[float] | None) -> None:
    """Refuse a run expected to see more than MAX_EXPECTED_FAILURES failures."""
    per_hour = failures.interruptions_per_hour(cluster.world_size, len(cluster.nodes))
    expected = per_hour * days * 24 * max(rates or [1.0])
    if expected > MAX_EXPECTED_FAILURES:
        raise ElastorError(
            f"A run would see about {expected:,.0f} failures, more than the {MAX_EXPECTED_FAILURES:,} "
            "one simulation handles; simulate fewer days or lower rates."
        )


def reference_mfu(profile: ModelProfile, cluster: ClusterSpec, gbs: int, reference) -> str:
    """The failure-free plan's MFU on the GPUs it runs on (costmodel.flops), as the text that goes
    before its pipeline count; none where the device kind has no peak."""
    if cluster.device.kind == "cpu":
        return ""
    per_step = flops.model_flops_per_step(profile.model, profile.seq_len, gbs)
    step_s, used = gbs / reference.samples_per_s, int(reference.in_use.sum())
    return f"MFU {flops.mfu(per_step, step_s, used, cluster.device.peak_flops):.1%}, "


def run(args: argparse.Namespace) -> int:
    from goodput.experiment import auto_intervals, build_study, run_experiment, write_outputs
    from goodput.plots import loss_table
    from goodput.policies import default_policies
    from goodput.study import MIN_RUNS_FOR_CI

    started = time.perf_counter()
    check_outputs(args)
    intervals = args.sweep_intervals
    if intervals and intervals != "auto":
        intervals = parse_floats(intervals, "--sweep-intervals", SECONDS.high)
    rates = parse_floats(args.rate_factors, "--rate-factors", MAX_RATE_FACTOR) if args.rate_factors else None
    profile = ModelProfile.from_json(read_json(args.profile, "profile"))
    cluster = of_kind(
        parse_cluster(args.cluster, profile.device_kind, args.gpus_per_node),
        profile.device_kind,
        args.cluster,
    )
    nodes = len(cluster.nodes)
    slices = parse_slices(args.slices, cluster, args.global_batch_size)
    policies, skipped = default_policies([len(n.gpus) for n in cluster.nodes])
    if args.policies:
        policies, skipped = [p.strip() for p in args.policies.split(",")], []
    failures = failure_model(args)
    check_failures(failures, cluster, args.days, rates)
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
    if intervals == "auto" and not math.isfinite(daly):
        raise ElastorError(
            "--sweep-intervals auto needs failures: without them Daly's interval is unbounded."
        )
    sweep = auto_intervals(daly) if intervals == "auto" else intervals
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
        f"({reference_mfu(profile, cluster, args.global_batch_size, study.reference)}"
        f"{study.reference.num_pipelines} pipelines{sliced}); failures: {failures.source} "
        f"({failures.distribution}), MTBF {study.mtbf_s() / 3600:.2f} h\n"
        f"costs ({c.source}): detect {c.detect_s:g} s (a lost host {c.detect_node_s:g} s), "
        f"plan {c.plan_s:g} s, restart {c.restart_s:g} s, "
        f"load {c.load_s:.1f} s (reshard {c.reshard_load_s:.1f} s), checkpoint stall {c.ckpt_stall_s:.2f} s "
        f"+ background {c.ckpt_background_s:.2f} s; in-process: re-form {c.reform_s:g} s, transfer "
        f"{c.transfer_s:.2f} s\n"
        f"checkpoint interval {interval} (Young {young:.0f} s, Daly {daly:.0f} s)\n"
    )
    table = loss_table(outcome.summary)
    print(format_table([list(table.columns), *table.astype(str).values.tolist()]))
    for note in skipped:
        print(note)
    if args.runs < MIN_RUNS_FOR_CI:
        print(f"(means of {args.runs} run(s): confidence intervals need --runs {MIN_RUNS_FOR_CI} or more)")
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
    else:
        print("\n" + interval_answer(outcome.interval_s, args.ckpt_interval, daly))
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

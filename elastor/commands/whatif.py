"""`elastor whatif`: every method's predicted throughput as GPUs fail, as a table, a CSV and a plot."""

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

import solver
from costmodel import ElastorError
from costmodel.jsonio import output_path, write_atomic
from elastor.commands import subcommand
from elastor.commands.argtypes import (
    CLUSTER_BOUNDS,
    GLOBAL_BATCH_SIZE,
    SEED,
    SOLVER_TIME_LIMIT_S,
    add_gpus_per_node,
)
from elastor.commands.plan import load_inputs
from solver import whatif

PLOT_FORMATS = (".png", ".pdf", ".svg")  # what --plot writes, by the file's suffix


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "whatif",
        "Solve a cluster with 0, 1, 2, ... failed GPUs with every method and compare predicted throughput "
        "(no GPUs needed: profile analytically for hardware you do not have).",
        "elastor whatif --profile p7.json --cluster 8,8,8,8 --global-batch-size 128 --fail 0..8 "
        "--csv whatif.csv --plot whatif.png",
    )
    p.add_argument("--profile", required=True, help="profile JSON (elastor profile)")
    p.add_argument(
        "--cluster",
        required=True,
        help=f'GPUs per node when all are healthy ("8,8,8,8") or JSON ({CLUSTER_BOUNDS})',
    )
    add_gpus_per_node(p)
    p.add_argument(
        "--global-batch-size",
        type=GLOBAL_BATCH_SIZE,
        required=True,
        help=f"samples per training step, an integer {GLOBAL_BATCH_SIZE}",
    )
    p.add_argument(
        "--fail",
        default="0..8",
        help="failed GPU counts, each below the cluster's GPUs: a range 0..8 or a list 0,2,4, at most "
        f"{whatif.MAX_FAILURE_COUNTS:,} counts (default: %(default)s)",
    )
    p.add_argument(
        "--placement",
        choices=whatif.PLACEMENTS,
        default="worst",
        help="which GPUs fail: one per node in turn (worst), whole nodes first (best), or random "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=SEED, default=0, help=f"seed of --placement random, {SEED} (default: %(default)s)"
    )
    p.add_argument(
        "--methods",
        default=",".join(solver.METHODS),
        help="methods to compare, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--time-limit",
        type=SOLVER_TIME_LIMIT_S,
        default=solver.DEFAULT_TIME_LIMIT_S,
        help=f"seconds per solve, {SOLVER_TIME_LIMIT_S} (default: %(default)s)",
    )
    p.add_argument("--csv", help="write every case as CSV here")
    p.add_argument("--plot", help=f"write the throughput plot here ({', '.join(PLOT_FORMATS)} by its suffix)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for out in (args.csv, args.plot):
        if out:
            output_path(out)  # a bad output fails now, not after the sweep
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise ElastorError(f"--plot {args.plot} must end in {', '.join(PLOT_FORMATS)}.")
    fail = whatif.parse_range(args.fail)
    profile, cluster = load_inputs(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in solver.METHODS]
    if unknown:
        raise ElastorError(f"Unknown method(s) {', '.join(unknown)}; use {', '.join(solver.METHODS)}.")
    frame = whatif.sweep(
        profile,
        cluster,
        args.global_batch_size,
        fail,
        methods=methods,
        placement=args.placement,
        seed=args.seed,
        time_limit_s=args.time_limit,
        progress=None
        if args.quiet
        else lambda cases: tqdm(cases, desc="solving", unit="case", file=sys.stderr),
    )
    print(whatif.throughput_table(frame))
    if args.csv:
        write_atomic(args.csv, frame.to_csv(index=False).encode())
        print(f"wrote {args.csv}")
    if args.plot:
        model, kind = profile.model.name, profile.device_kind
        title = f"{model} on {cluster.short_form()} ({kind}), {args.placement} failures"
        whatif.plot(frame, args.plot, title=title)
        print(f"wrote {args.plot}")
    return 0

"""`elastor whatif`: every method's predicted throughput as GPUs fail, as a table, a CSV and a plot."""

import argparse
import sys

from tqdm import tqdm

import solver
from costmodel import ElastorError
from elastor.commands import subcommand
from elastor.commands.plan import load_inputs
from solver import whatif


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
    p.add_argument("--cluster", required=True, help='GPUs per node when all are healthy ("8,8,8,8") or JSON')
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per training step")
    p.add_argument(
        "--fail",
        default="0..8",
        help="failed GPU counts: a range 0..8 or a list 0,2,4 (default: %(default)s)",
    )
    p.add_argument(
        "--placement",
        choices=whatif.PLACEMENTS,
        default="worst",
        help="which GPUs fail: one per node in turn (worst), whole nodes first (best), or random "
        "(default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --placement random (default: %(default)s)")
    p.add_argument(
        "--methods",
        default=",".join(solver.METHODS),
        help="methods to compare, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=solver.DEFAULT_TIME_LIMIT_S,
        help="seconds per solve (default: %(default)s)",
    )
    p.add_argument("--csv", help="write every case as CSV here")
    p.add_argument("--plot", help="write the throughput plot (PNG) here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    profile, cluster = load_inputs(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in solver.METHODS]
    if unknown:
        raise ElastorError(f"Unknown method(s) {', '.join(unknown)}; use {', '.join(solver.METHODS)}.")
    frame = whatif.sweep(
        profile,
        cluster,
        args.global_batch_size,
        whatif.parse_range(args.fail),
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
        frame.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.plot:
        model, kind = profile.model.name, profile.device_kind
        title = f"{model} on {cluster.short_form()} ({kind}), {args.placement} failures"
        whatif.plot(frame, args.plot, title=title)
        print(f"wrote {args.plot}")
    return 0

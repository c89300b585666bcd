"""`elastor demo`: the whole story on this machine's CPU, no arguments needed."""

import argparse
from pathlib import Path

from costmodel.jsonio import output_dir
from elastor.commands import subcommand


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "demo",
        "Profile, plan, train on a simulated 2-node cluster, kill a GPU, re-plan, resume, bring it back, "
        "and check the result against an uninterrupted run; writes a report directory.",
        "elastor demo --out demo-report",
    )
    p.add_argument("--out", default="demo-report", help="report directory (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from runtime.elastic.demo import run_demo

    output_dir(args.out)  # an existing file or device is refused before anything runs
    return run_demo(Path(args.out))

"""`elastor <subcommand>`: parse arguments, dispatch to the subcommand's module.

User errors (`ElastorError`) print one sentence per problem and exit 2; anything else is a bug and
keeps its traceback.
"""

import argparse
import sys

from costmodel import ElastorError
from elastor.commands import ckpt, demo, estimate, plan, profile, run, simulate, train, validate, whatif

# Subcommands in the order `elastor --help` lists them; each module has `register(subparsers)`.
COMMANDS = (profile, validate, plan, estimate, whatif, train, run, ckpt, simulate, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastor",
        description="Elastor: heterogeneous, failure-resilient training plans for any set of GPUs.",
        epilog="example:\n  elastor validate examples/plan-hetero.json --cluster 4,3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ElastorError as e:
        for line in str(e).splitlines():
            print(f"elastor: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastor: interrupted", file=sys.stderr)
        return 130

"""`elastor <subcommand>`: one function per subcommand, each a thin call into its package.

User errors (`ElastorError`) print one sentence per problem and exit 2; anything else is a bug and
keeps its traceback.
"""

import argparse
import sys
from collections.abc import Callable

from costmodel import ClusterSpec, ElastorError, Plan
from costmodel.jsonio import read_json

Command = Callable[[argparse.Namespace], int]


def _subcommand(
    subparsers: argparse._SubParsersAction, name: str, summary: str, example: str
) -> argparse.ArgumentParser:
    """A subparser whose --help ends with a real example."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


# ---- validate -----------------------------------------------------------------------------------
def _add_validate(subparsers: argparse._SubParsersAction) -> None:
    p = _subcommand(
        subparsers,
        "validate",
        "Check a (possibly hand-written) plan against a cluster: print its stages or every violation.",
        "elastor validate examples/plan-hetero.json --cluster 4,3",
    )
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--cluster", required=True, help='healthy GPUs per node ("8,8,7") or a cluster JSON file')
    p.add_argument(
        "--device-kind",
        default="H100-80GB",
        help="device kind for a short --cluster string (default: %(default)s)",
    )
    p.set_defaults(run=_validate)


def _validate(args: argparse.Namespace) -> int:
    plan = Plan.from_json(read_json(args.plan, "plan"))
    cluster = ClusterSpec.parse(args.cluster, args.device_kind)
    problems = plan.violations(cluster)
    if problems:
        for problem in problems:
            print(f"elastor: invalid plan: {problem}", file=sys.stderr)
        return 2
    print(plan.summary())
    idle = sorted(set(cluster.devices) - set(plan.devices))
    print(f"valid on cluster {cluster.short_form()}" + (f"; idle: {', '.join(idle)}" if idle else ""))
    return 0


# ---- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastor",
        description="Elastor: heterogeneous, failure-resilient training plans for any set of GPUs.",
        epilog="example:\n  elastor validate examples/plan-hetero.json --cluster 4,3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND", required=True)
    for add in (_add_validate,):
        add(subparsers)
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

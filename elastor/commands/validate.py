"""`elastor validate PLAN --cluster C`: check a (possibly hand-written) plan."""

import argparse
import sys

from costmodel import ClusterSpec, Plan
from costmodel.jsonio import read_json
from elastor.commands import subcommand
from elastor.commands.argtypes import CLUSTER_BOUNDS, add_gpus_per_node


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "validate",
        "Check a (possibly hand-written) plan against a cluster: print its stages or every violation.",
        "elastor validate examples/plan-hetero.json --cluster 4,3",
    )
    p.add_argument("plan", help="plan JSON file")
    p.add_argument(
        "--cluster",
        required=True,
        help=f'healthy GPUs per node ("8,8,7") or a cluster JSON file ({CLUSTER_BOUNDS})',
    )
    add_gpus_per_node(p)
    p.add_argument(
        "--device-kind",
        default="H100-80GB",
        help="device kind for a short --cluster string (default: %(default)s)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.from_json(read_json(args.plan, "plan"))
    cluster = ClusterSpec.parse(args.cluster, args.device_kind, args.gpus_per_node)
    problems = plan.violations(cluster)
    if problems:
        for problem in problems:
            print(f"elastor: invalid plan: {problem}", file=sys.stderr)
        return 2
    print(plan.summary())
    idle = sorted(set(cluster.devices) - set(plan.devices))
    print(f"valid on cluster {cluster.short_form()}" + (f"; idle: {', '.join(idle)}" if idle else ""))
    return 0

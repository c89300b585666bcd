"""`elastor estimate PLAN --profile P --cluster C`: price any plan with the planner's own cost model."""

import argparse
import math

from costmodel import ElastorError, Plan
from costmodel.estimate import CostModel, Estimate
from costmodel.jsonio import read_json
from elastor.commands import subcommand
from elastor.commands.argtypes import CLUSTER_BOUNDS, add_gpus_per_node
from elastor.commands.plan import load_inputs

GIB = 1 << 30


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "estimate",
        "Price any plan (hand-written, another method's, an older one) on a profile and a cluster: the "
        "per-stage table `elastor plan` prints, its step time, throughput and MFU.",
        "elastor estimate examples/plan-hetero.json --profile profiles/gpt-tiny-cpu.json --cluster 4,3",
    )
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--profile", required=True, help="profile JSON (elastor profile)")
    p.add_argument(
        "--cluster",
        required=True,
        help=f'healthy GPUs per node ("8,8,7") or a cluster JSON file ({CLUSTER_BOUNDS})',
    )
    add_gpus_per_node(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    profile, cluster = load_inputs(args)
    plan = Plan.from_json(read_json(args.plan, "plan")).validate(cluster)
    estimate = CostModel(profile, cluster).estimate(plan)
    print(plan.summary())
    print(estimate.explain())
    print(against_recorded(plan, estimate))
    if not estimate.fits:
        raise ElastorError(overflow(estimate, cluster.device.kind))
    return 0


def against_recorded(plan: Plan, estimate: Estimate) -> str:
    """How this prediction compares with the one the plan file carries, if any."""
    recorded = (plan.predicted or {}).get("step_time_s")
    if recorded is None:
        return "the plan file records no prediction"
    if math.isclose(recorded, estimate.step_time_s, rel_tol=1e-9):
        return f"equal to the prediction the plan file records ({recorded * 1e3:.1f} ms)"
    return (
        f"the plan file records {recorded * 1e3:.1f} ms per step; this profile and cluster predict "
        f"{estimate.step_time_s * 1e3:.1f} ms ({estimate.step_time_s / recorded - 1:+.1%})"
    )


def overflow(estimate: Estimate, kind: str) -> str:
    """One sentence naming the device whose predicted peak most exceeds the usable memory."""
    worst = max(estimate.stages, key=lambda s: s.peak_memory_bytes)
    return (
        f"The plan does not fit: {worst.devices[0]} (pipeline {worst.pipeline}, stage {worst.stage}) needs "
        f"{worst.peak_memory_bytes / GIB:.1f} GiB of the {estimate.usable_memory_bytes / GIB:.1f} GiB usable "
        f"per {kind}."
    )

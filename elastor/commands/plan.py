"""`elastor plan`: the fastest plan for a profile on a set of healthy GPUs, and how the baselines compare."""

import argparse
import sys

import solver
from costmodel import ClusterSpec, ElastorError, ModelProfile, Plan
from costmodel.cluster import MAX_CLUSTER_GPUS, MAX_GPUS_PER_NODE, of_kind
from costmodel.config import MAX_FIELD
from costmodel.estimate import CostModel
from costmodel.jsonio import output_path, read_json, shown, write_json
from costmodel.plan import MAX_GLOBAL_BATCH_SIZE, SHARDING
from costmodel.table import format_table
from elastor.commands import subcommand
from elastor.commands.argtypes import (
    CLUSTER_BOUNDS,
    GLOBAL_BATCH_SIZE,
    SOLVER_TIME_LIMIT_S,
    add_gpus_per_node,
    integer,
)
from solver.baselines import Grid

TP = integer(1, MAX_GPUS_PER_NODE)  # a stage's devices sit on one node
PP = integer(1, MAX_CLUSTER_GPUS)
# Layer chunks per stage: each chunk holds at least one block, so no model has more.
MAX_CHUNKS = MAX_FIELD["num_blocks"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "plan",
        "Solve for the fastest plan of a profile on a cluster's healthy GPUs; print its stages and cost "
        "terms, and with --compare the baselines' predicted throughput.",
        "elastor plan --profile p7.json --cluster 8,7 --global-batch-size 128 --compare --out plan.json",
    )
    p.add_argument("--profile", required=True, help="profile JSON (elastor profile)")
    p.add_argument(
        "--cluster",
        required=True,
        help=f'healthy GPUs per node ("8,8,7") or a cluster JSON file ({CLUSTER_BOUNDS})',
    )
    add_gpus_per_node(p)
    p.add_argument(
        "--global-batch-size",
        type=GLOBAL_BATCH_SIZE,
        required=True,
        help=f"samples per training step, an integer {GLOBAL_BATCH_SIZE}",
    )
    p.add_argument(
        "--method", choices=solver.METHODS, default="elastor", help="planner (default: %(default)s)"
    )
    p.add_argument(
        "--sharding",
        choices=("auto", *SHARDING),
        default="none",
        help="optimizer state: sharded over each bucket's holders (zero1), not (none; default), or "
        "whichever is faster (auto: searches the ZeRO-1 passes too, several times the solve time)",
    )
    p.add_argument(
        "--chunks",
        type=chunks_arg,
        default="1",
        help="layer chunks per stage: 1 (1F1B; default); auto: also search interleaved 1F1B with "
        "2-8 chunks per stage and split backwards (ZB-H1) at any chunk count, chosen per pipeline "
        "(about three times the solve time); or a number V "
        f"(with --method uniform: every stage holds V chunks, Megatron's interleaved schedule; V in "
        f"1..{MAX_CHUNKS:,})",
    )
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="with --method uniform: every pipeline splits each backward into its input and weight "
        "gradients and defers the latter (ZB-H1; --chunks auto offers it to the solver per pipeline)",
    )
    p.add_argument("--tp", type=TP, help=f"with --method uniform: pin the TP degree of every stage ({TP})")
    p.add_argument("--pp", type=PP, help=f"with --method uniform: pin the pipeline depth ({PP})")
    p.add_argument(
        "--recompute",
        choices=solver.RECOMPUTE_PASSES,
        help="pin every stage's activation recomputation (default: each stage the lightest mode that fits)",
    )
    p.add_argument("--compare", action="store_true", help="also solve with every other method and compare")
    p.add_argument(
        "--micro-batch-sizes",
        help=f"micro-batch sizes to consider, comma-separated, each in 1..{MAX_GLOBAL_BATCH_SIZE:,} "
        "(default: all profiled)",
    )
    p.add_argument(
        "--time-limit",
        type=SOLVER_TIME_LIMIT_S,
        default=solver.DEFAULT_TIME_LIMIT_S,
        help=f"seconds for the solver, {SOLVER_TIME_LIMIT_S} (default: %(default)s)",
    )
    p.add_argument("--out", required=True, help="the plan JSON to write")
    p.set_defaults(run=run)


def load_inputs(args: argparse.Namespace) -> tuple[ModelProfile, ClusterSpec]:
    """The profile, and the cluster (a short form takes the profile's device kind)."""
    profile = ModelProfile.from_json(read_json(args.profile, "profile"))
    cluster = ClusterSpec.parse(args.cluster, profile.device_kind, args.gpus_per_node)
    return profile, of_kind(cluster, profile.device_kind, args.cluster)


def micro_batch_sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and 1 <= int(part) <= MAX_GLOBAL_BATCH_SIZE for part in parts):
        raise ElastorError(
            f"--micro-batch-sizes {shown(text)} is not a comma-separated list of integers in "
            f"1..{MAX_GLOBAL_BATCH_SIZE:,}."
        )
    return [int(part) for part in parts]


def chunks_arg(text: str) -> str:
    if text == "auto" or (text.isdigit() and len(text) < 10 and 1 <= int(text) <= MAX_CHUNKS):
        return text
    raise argparse.ArgumentTypeError(
        f"{shown(text)} is neither auto nor a number of chunks in 1..{MAX_CHUNKS:,}"
    )


def run(args: argparse.Namespace) -> int:
    output_path(args.out)  # a bad --out fails now, not after the solve
    profile, cluster = load_inputs(args)
    sizes = micro_batch_sizes(args.micro_batch_sizes)
    sharding = SHARDING if args.sharding == "auto" else (args.sharding,)
    grid = Grid(
        tp=args.tp,
        pp=args.pp,
        chunks=1 if args.chunks == "auto" else int(args.chunks),
        split_backward=args.split_backward,
    )
    plan = solver.solve(
        profile,
        cluster,
        args.global_batch_size,
        args.method,
        sizes,
        args.time_limit,
        sharding=sharding,
        interleave=args.chunks == "auto",
        recompute=args.recompute,
        grid=grid,
        progress=lambda line: print(f"elastor plan: {line}", file=sys.stderr, flush=True),
    )
    write_json(args.out, plan.to_json())
    print(plan.summary())
    print(CostModel(profile, cluster).estimate(plan).explain())
    info = plan.solver
    print(
        f"{info['method']}: {info['status']} (gap {info['gap']:.2%}) in {info['wall_s']:.2f} s"
        + (f" ({info['cpu_s']:.2f} s of CPU)" if "cpu_s" in info else "")
        + ("" if info["status"] == "OPTIMAL" else f" (not proven optimal: {not_proven(info)})")
        + ("" if info.get("complete", True) else f"; searched family {info.get('family')}")
        + f"; wrote {args.out}"
    )
    chunks = sorted({p.num_chunks for p in plan.pipelines})
    split = sum(p.split_backward for p in plan.pipelines)
    print(
        f"{plan.dtype}, optimizer {plan.optimizer.sharding}, layer chunks per stage {chunks}, "
        f"split backward in {split} of {len(plan.pipelines)} pipelines; "
        f"passes (predicted step s): {info['passes']}"
    )
    if args.compare:
        print(compare(profile, cluster, args.global_batch_size, plan, sizes, args.time_limit))
    return 0


def not_proven(info: dict) -> str:
    """Why a FEASIBLE answer is not proven optimal (a plan written before the solver said why: the
    time limit, then the only reason)."""
    return "; ".join(info.get("not_proven") or [solver.NOT_PROVEN_TIME_LIMIT])


def compare(profile, cluster, gbs: int, plan: Plan, sizes, time_limit_s: float) -> str:
    """Every method's predicted throughput side by side, relative to `plan`'s."""
    own = plan.predicted["samples_per_s"]
    rows = [
        (
            "method", "samples/s", "MFU", "vs " + plan.solver["method"], "pipelines", "stages",
            "sp stages", "recompute", "optimizer", "GPUs used", "status", "solve s (CPU s)",
        )
    ]  # fmt: skip
    for method in solver.METHODS:
        try:
            other = (
                plan
                if method == plan.solver["method"]
                else solver.solve(profile, cluster, gbs, method, sizes, time_limit_s)
            )
        except ElastorError as e:
            rows.append((method, "-", "-", "-", "-", "-", "-", "-", "-", "-", f"no plan: {e}", "-"))
            continue
        rate = other.predicted["samples_per_s"]
        rows.append(
            (
                method,
                f"{rate:.3f}",
                "n/a" if other.predicted.get("mfu") is None else f"{other.predicted['mfu']:.1%}",
                f"{rate / own:.3f}",
                len(other.pipelines),
                ",".join(sorted({str(len(p.stages)) for p in other.pipelines})),
                sum(st.sequence_parallel for p in other.pipelines for st in p.stages),
                ",".join(sorted({st.recompute for p in other.pipelines for st in p.stages})),
                other.optimizer.sharding,
                other.world_size,
                other.solver["status"],
                f"{other.solver['wall_s']:.2f} ({other.solver.get('cpu_s', float('nan')):.2f})",
            )
        )
    return format_table(rows)

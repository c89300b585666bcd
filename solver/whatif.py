"""What-if analysis: throughput of every method as GPUs fail, without the GPUs.

Failed GPUs are placed three ways, each nested (the failures of f+1 include those of f), so a curve
shows the cost of one more failure rather than of a different pattern:
    worst   one per node in turn (last GPU of n0, of n1, ...): the most nodes lose a GPU, the case
            node- and power-of-two-granular planners handle worst;
    best    whole nodes first (all GPUs of the last node, then the next): failures cost whole nodes;
    random  a seeded random order of all GPUs.
"""

import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

import solver
from costmodel import ClusterSpec, ElastorError
from costmodel.jsonio import atomic_output, shown
from costmodel.profile import ModelProfile
from costmodel.table import format_table

PLACEMENTS = ("worst", "best", "random")
# The most failure counts one sweep solves (times the methods): each is a solve of seconds, so 1,024
# is already hours, and a range such as 0..1000000000 is refused before its list is built.
MAX_FAILURE_COUNTS = 1024


def failure_order(cluster: ClusterSpec, placement: str, seed: int = 0) -> list[str]:
    """Devices in the order they fail under `placement` (module docstring)."""
    if placement == "worst":
        order, rounds = [], max(len(n.gpus) for n in cluster.nodes)
        for r in range(rounds):
            order += [f"{n.name}:{n.gpus[-1 - r]}" for n in cluster.nodes if r < len(n.gpus)]
        return order
    if placement == "best":
        return [d for n in reversed(cluster.nodes) for d in reversed(n.devices)]
    if placement == "random":
        order = list(cluster.devices)
        random.Random(seed).shuffle(order)
        return order
    raise ElastorError(f"Unknown failure placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")


def parse_range(text: str) -> list[int]:
    """`"0..8"` -> [0, ..., 8]; `"3"` -> [3]; `"0,2,5"` -> [0, 2, 5]; at most MAX_FAILURE_COUNTS."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            count = hi - lo + 1
            values = list(range(lo, hi + 1)) if count <= MAX_FAILURE_COUNTS else []
        else:
            values = [int(x) for x in text.split(",")]
            count = len(values)
    except ValueError:
        raise ElastorError(f"--fail {shown(text)} is not a range like 0..8 or a list like 0,2,4.") from None
    if count > MAX_FAILURE_COUNTS:
        raise ElastorError(
            f"--fail {shown(text)} names more failure counts than the {MAX_FAILURE_COUNTS:,} one sweep "
            "solves."
        )
    if not values or min(values) < 0:
        raise ElastorError(f"--fail {shown(text)} must name failure counts of zero or more.")
    return values


def sweep(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    failures: Sequence[int],
    *,
    methods: Sequence[str] = solver.METHODS,
    placement: str = "worst",
    seed: int = 0,
    time_limit_s: float = solver.DEFAULT_TIME_LIMIT_S,
    progress: Callable | None = None,
    interleave: bool = False,
) -> pd.DataFrame:
    """One row per (failures, method): healthy GPUs, predicted throughput (NaN: no plan), the plan's
    shape and the solver's status and time. `progress` wraps the iterable of cases (e.g. tqdm);
    `interleave` lets Elastor's search choose interleaved 1F1B (`solver.solve`)."""
    order = failure_order(cluster, placement, seed)
    if max(failures) >= len(order):
        raise ElastorError(
            f"Cluster {cluster.short_form()} has {len(order)} healthy GPUs; --fail must stay below that."
        )
    cases = [(f, m) for f in failures for m in methods]
    rows = []
    for f, method in progress(cases) if progress else cases:
        healthy = cluster.without(set(order[:f]))
        started = time.perf_counter()
        try:
            plan = solver.solve(
                profile,
                healthy,
                global_batch_size,
                method=method,
                time_limit_s=time_limit_s,
                interleave=interleave,
            )
            info, predicted = plan.solver or {}, plan.predicted or {}
            row = {
                "samples_per_s": predicted["samples_per_s"],
                "step_time_s": predicted["step_time_s"],
                "mfu": predicted.get("mfu"),
                "pipelines": len(plan.pipelines),
                "gpus_used": plan.world_size,
                "status": info.get("status", ""),
                "gap": info.get("gap", 0.0),
                "reason": "",
            }
        except ElastorError as e:
            row = {
                "samples_per_s": math.nan,
                "step_time_s": math.nan,
                "mfu": math.nan,
                "pipelines": 0,
                "gpus_used": 0,
            }
            row.update(status="INFEASIBLE", gap=math.nan, reason=str(e))
        rows.append(
            {
                "failures": f,
                "healthy_gpus": healthy.world_size,
                "cluster": healthy.short_form(),
                "method": method,
                **row,
                "wall_s": time.perf_counter() - started,
            }
        )
    return pd.DataFrame(rows)


def throughput_table(frame: pd.DataFrame) -> str:
    """Samples/s per failure count (rows) and method (columns), each with its MFU in parentheses
    where the profile's device kind has a peak (`costmodel.flops`), beside the proportional line."""
    index = ["failures", "healthy_gpus"]
    wide = frame.pivot(index=index, columns="method", values="samples_per_s")
    mfu = frame.pivot(index=index, columns="method", values="mfu") if "mfu" in frame else None
    methods = [m for m in solver.METHODS if m in wide.columns]
    share = proportional_line(frame)

    def cell(key, method: str) -> str:
        rate = wide.at[key, method]
        if math.isnan(rate):
            return "-"
        used = None if mfu is None else mfu.at[key, method]
        return f"{rate:.2f}" + ("" if used is None or math.isnan(used) else f" ({used:.1%})")

    rows = [("failures", "healthy", *methods, "proportional")]
    for key in wide.index:
        rows.append((str(key[0]), str(key[1]), *(cell(key, m) for m in methods), f"{share(key[1]):.2f}"))
    return format_table(rows)


def proportional_line(frame: pd.DataFrame) -> Callable[[float], float]:
    """The best plan's throughput at the fewest failures, scaled by the share of GPUs still healthy.

    A reference, not a bound: a smaller cluster can admit a split that uses each GPU better (a
    pipeline count that divides the batch, stages that balance), so a plan can sit above it."""
    first = frame[frame.failures == frame.failures.min()]
    best = first.samples_per_s.max()
    gpus = first.healthy_gpus.iloc[0]
    return lambda healthy: best * healthy / gpus


def plot(frame: pd.DataFrame, path: str | None = None, ax=None, title: str | None = None):
    """Predicted throughput vs healthy GPUs, one line per method, and the proportional line."""
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in [m for m in solver.METHODS if m in set(frame.method)]:
        part = frame[frame.method == method].sort_values("healthy_gpus")
        ax.plot(part.healthy_gpus, part.samples_per_s, marker="o", markersize=3, label=method)
    gpus = sorted(set(frame.healthy_gpus))
    share = proportional_line(frame)
    label = "proportional to healthy GPUs (a reference, not a bound)"
    ax.plot(gpus, [share(g) for g in gpus], linestyle="--", color="grey", label=label)
    ax.set_xlabel("healthy GPUs")
    ax.set_ylabel("predicted samples/s")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if path is not None:
        kind = Path(path).suffix[1:].lower() or "png"
        with atomic_output(path) as f:
            (fig or ax.figure).savefig(f, format=kind, dpi=120, bbox_inches="tight")
        if fig is not None:
            plt.close(fig)
    return ax

"""One goodput study from files to tables: what `elastor simulate` and the notebook both run.

`build_study` turns a profile, a cluster and a failure model into a `Study` on the real solver, with
recovery costs from a measured-costs file or the documented defaults; `run_experiment` runs the
policies over repeated seeds, and optionally the checkpoint-interval and failure-rate sweeps and one
recorded run per policy for the timeline; `write_outputs` saves the CSVs and the plots.
"""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from costmodel import ClusterSpec, ElastorError, ModelProfile
from costmodel.jsonio import atomic_output, output_dir, read_json, write_atomic
from goodput.costs import RecoveryCosts
from goodput.failures import FailureModel
from goodput.plans import CachedOracle, SolverOracle, signature
from goodput.plots import intervals_figure, rates_figure, timeline_figure
from goodput.sim import RunResult
from goodput.slices import SlicedOracle
from goodput.study import Study, best_intervals, summarize

DAY_S = 86400.0


def build_study(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    failures: FailureModel,
    days: float,
    costs_file: str | None = None,
    progress: bool = False,
    plan_cache: str | None = None,
    solver_time_limit_s: float | None = None,
    slices: int = 1,
    interleave: bool = False,
) -> Study:
    """A study on the real solver; costs: the defaults for the model and its healthy plan, then the file.

    `plan_cache` names a JSON file that keeps solved plans between runs (see `CachedOracle`);
    `slices` > 1 plans the cluster as that many slices (an approximation, see `goodput.slices`);
    `interleave` lets the solver choose interleaved 1F1B.
    """
    gpus_per_node = [len(n.gpus) for n in cluster.nodes]
    if slices > 1 and (len(set(gpus_per_node)) != 1 or global_batch_size % slices):
        raise ElastorError(
            f"--slices {slices} needs nodes with equal GPU counts and a global batch it divides."
        )
    planner = SolverOracle(
        profile, cluster, global_batch_size // slices, time_limit_s=solver_time_limit_s, interleave=interleave
    )
    solver_cache = CachedOracle(planner, path=plan_cache, context=planner.fingerprint())
    oracle = solver_cache
    if slices > 1:
        sliced = SlicedOracle(solver_cache, len(gpus_per_node), gpus_per_node[0], slices)
        oracle = CachedOracle(sliced)
    healthy = oracle(signature(gpus_per_node))
    if healthy is None and slices > 1:
        raise ElastorError(
            f"No plan fits a slice of {len(gpus_per_node) // slices} nodes with its share of the batch "
            f"({global_batch_size // slices}); plan fewer slices (--slices) or a larger batch."
        )
    num_pipelines = healthy.num_pipelines if healthy else 1
    costs = RecoveryCosts.defaults_for(profile.model, sum(gpus_per_node), num_pipelines)
    if costs_file:
        costs = costs.updated(read_json(costs_file, "costs"), source=costs_file)
    return Study(
        oracle=oracle,
        gpus_per_node=gpus_per_node,
        global_batch_size=global_batch_size,
        failures=failures,
        costs=costs,
        horizon_s=days * DAY_S,
        progress=progress,
        solver_cache=solver_cache,
    )


def auto_intervals(daly_s: float, points: int = 9) -> list[float]:
    """A geometric grid from a quarter to four times Daly's interval, whole seconds."""
    return sorted({float(round(x)) for x in np.geomspace(daly_s / 4, daly_s * 4, points)})


def default_interval(study: Study) -> float | None:
    """Daly's optimum in whole seconds, but no shorter than one save: the next save waits for it.
    None without failures: there is nothing to recover, so no periodic checkpoints."""
    c, daly = study.costs, study.young_daly()[1]
    if not math.isfinite(daly):
        return None
    return float(max(round(daly), c.ckpt_stall_s + c.ckpt_background_s))


@dataclass
class Outcome:
    interval_s: float | None  # None: no periodic checkpoints
    runs: pd.DataFrame
    summary: pd.DataFrame
    sweep: pd.DataFrame | None = None
    best: pd.DataFrame | None = None
    rates: pd.DataFrame | None = None
    timelines: dict[str, RunResult] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


def run_experiment(
    study: Study,
    policies: list[str],
    runs: int,
    seed: int = 0,
    interval_s: float | None = None,
    sweep_intervals: list[float] | None = None,
    rate_factors: list[float] | None = None,
    timeline: bool = False,
) -> Outcome:
    seeds = range(seed, seed + runs)
    interval = interval_s if interval_s is not None else default_interval(study)
    wall: dict[str, float] = {}
    start = time.perf_counter()
    main = study.runs(policies, seeds, [interval])
    wall["policies"] = time.perf_counter() - start
    outcome = Outcome(interval_s=interval, runs=main, summary=summarize(main), wall_s=wall)
    if sweep_intervals:
        start = time.perf_counter()
        outcome.sweep = study.runs(policies, seeds, sweep_intervals)
        outcome.best = best_intervals(outcome.sweep)
        wall["interval sweep"] = time.perf_counter() - start
    if rate_factors:
        start = time.perf_counter()
        outcome.rates = study.runs(policies, seeds, [interval], rate_factors=rate_factors)
        wall["rate sweep"] = time.perf_counter() - start
    if timeline:
        outcome.timelines = {p: study.run_one(p, seed, interval, record_timeline=True) for p in policies}
    return outcome


def write_outputs(outcome: Outcome, study: Study, out_dir: str, timeline_days: float = 7.0) -> list[Path]:
    """CSV files and PNG plots of everything the outcome holds; returns the paths written."""
    out = output_dir(out_dir)
    written = []

    def save_csv(frame: pd.DataFrame, name: str) -> None:
        write_atomic(out / name, frame.to_csv(index=False).encode())
        written.append(out / name)

    def save_png(fig, name: str) -> None:
        with atomic_output(out / name) as f:
            fig.savefig(f, format="png", dpi=120)
        written.append(out / name)

    save_csv(outcome.runs, "runs.csv")
    save_csv(outcome.summary, "summary.csv")
    young, daly = study.young_daly()
    if outcome.sweep is not None:
        save_csv(outcome.sweep, "intervals.csv")
        save_csv(outcome.best, "best_intervals.csv")
        save_png(intervals_figure(outcome.sweep, young, daly), "goodput_vs_interval.png")
    if outcome.rates is not None:
        save_csv(outcome.rates, "rates.csv")
        save_png(rates_figure(outcome.rates), "goodput_vs_failure_rate.png")
    if outcome.timelines:
        save_png(timeline_figure(outcome.timelines, days=timeline_days), "timeline.png")
    return written

"""Repeated runs, confidence intervals, and the sweeps: checkpoint interval and failure rate.

Every run of one seed draws its failure trace once and simulates every policy (and every checkpoint
interval, and every rate factor) on it: common random numbers, so differences between policies are
paired and the sweeps are smooth. Across seeds the runs are independent, which is what the 95%
confidence intervals (Student t over the per-seed means) assume.

The first-order optimum checkpoint interval with checkpoint cost C and mean time between failures M
is sqrt(2 C M) (Young 1974, "A first order approximation to the optimum checkpoint interval", CACM
17(9):530-531). Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3):303-312) refines it to sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C for
C < 2M, and M otherwise; with M = 24 h, C = 5 min this gives the paper's 117 min. C here is the time
training is blocked per checkpoint (the stall; the background write overlaps training).
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from costmodel import ElastorError
from goodput.costs import RecoveryCosts
from goodput.failures import HOUR_S, FailureModel, draw_trace
from goodput.plans import CachedOracle, Oracle
from goodput.policies import Elastor, Hardware, make_policy
from goodput.sim import RunResult, simulate

# Two-sided 95% Student t quantiles for 1..30 degrees of freedom; beyond, the normal 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)  # fmt: skip


def t95(dof: int) -> float:
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


# The fewest runs a confidence interval is given for: with two, Student's t (12.7) times a
# two-sample standard deviation spans tens of points and says nothing.
MIN_RUNS_FOR_CI = 3


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (NaN below MIN_RUNS_FOR_CI values)."""
    x = np.asarray(values, dtype=float)
    if len(x) < MIN_RUNS_FOR_CI:
        return float(x.mean()), math.nan
    return float(x.mean()), t95(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))


def young_daly(ckpt_cost_s: float, mtbf_s: float) -> tuple[float, float]:
    """(Young's, Daly's) optimum interval between checkpoints, in seconds of training."""
    young = math.sqrt(2 * ckpt_cost_s * mtbf_s)
    if ckpt_cost_s >= 2 * mtbf_s:
        return young, mtbf_s
    r = ckpt_cost_s / (2 * mtbf_s)
    return young, young * (1 + math.sqrt(r) / 3 + r / 9) - ckpt_cost_s


@dataclass
class Study:
    """One cluster, model plan oracle, failure model and costs; runs policies on shared traces."""

    oracle: Oracle
    gpus_per_node: list[int]
    global_batch_size: int
    failures: FailureModel
    costs: RecoveryCosts
    horizon_s: float
    progress: bool = False
    solver_cache: CachedOracle | None = None  # the cache in front of the solver itself, for reports

    def __post_init__(self) -> None:
        if not isinstance(self.oracle, CachedOracle):
            self.oracle = CachedOracle(self.oracle)
        if self.solver_cache is None:
            self.solver_cache = self.oracle
        reference = Elastor(Hardware(self.gpus_per_node), self.oracle).choose()
        if reference is None:
            raise ElastorError("No plan fits the whole healthy cluster, so there is nothing to simulate.")
        self.reference = reference

    @property
    def num_gpus(self) -> int:
        return sum(self.gpus_per_node)

    def mtbf_s(self, failures: FailureModel | None = None) -> float:
        rate = (failures or self.failures).interruptions_per_hour(self.num_gpus, len(self.gpus_per_node))
        return math.inf if rate == 0 else HOUR_S / rate

    def young_daly(self) -> tuple[float, float]:
        return young_daly(self.costs.ckpt_stall_s, self.mtbf_s())

    # ---- runs -----------------------------------------------------------------------------------
    def run_one(
        self,
        policy: str,
        seed: int,
        ckpt_interval_s: float | None,
        failures: FailureModel | None = None,
        record_timeline: bool = False,
        trace=None,
    ) -> RunResult:
        failures = failures or self.failures
        if trace is None:
            trace = draw_trace(failures, self.gpus_per_node, self.horizon_s, seed)
        hardware = Hardware(self.gpus_per_node)
        return simulate(
            trace,
            make_policy(policy, hardware, self.oracle),
            hardware,
            self.costs,
            global_batch_size=self.global_batch_size,
            reference_samples_per_s=self.reference.samples_per_s,
            ckpt_interval_s=ckpt_interval_s,
            mtbf_s=self.mtbf_s(failures),
            record_timeline=record_timeline,
        )

    def runs(
        self,
        policies: Sequence[str],
        seeds: Iterable[int],
        intervals_s: Sequence[float | None],
        rate_factors: Sequence[float] = (1.0,),
    ) -> pd.DataFrame:
        """One row per (seed, rate factor, policy, interval); each seed's trace shared by all its rows."""
        seeds = list(seeds)
        rows = []
        total = len(seeds) * len(rate_factors) * len(policies) * len(intervals_s)
        with tqdm(total=total, disable=not self.progress, desc="simulating", unit="run") as bar:
            for seed in seeds:
                for factor in rate_factors:
                    failures = self.failures.scaled(factor)
                    trace = draw_trace(failures, self.gpus_per_node, self.horizon_s, seed)
                    for policy in policies:
                        for interval in intervals_s:
                            result = self.run_one(policy, seed, interval, failures, trace=trace)
                            rows.append(
                                {
                                    "seed": seed,
                                    "rate_factor": factor,
                                    "interval_s": interval,
                                    **result.to_row(),
                                    "failures": len(trace),
                                }
                            )
                            bar.update()
        return pd.DataFrame(rows)


def summarize(runs: pd.DataFrame, by: Sequence[str] = ("policy",)) -> pd.DataFrame:
    """Mean and 95% CI half-width of goodput and of each cause of loss, per group of `by`."""
    losses = [c for c in runs.columns if c.startswith("lost_")]
    metrics = ["goodput_samples_per_s", "goodput_fraction", *losses]
    out = []
    for keys, group in runs.groupby(list(by), sort=False, dropna=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        row = dict(zip(by, keys, strict=True))
        row["runs"] = len(group)
        for m in metrics:
            row[m], row[f"{m}_ci"] = mean_ci(group[m].to_numpy())
        for c in ("interruptions", "restarts", "in_process", "scale_ups"):
            row[c] = float(group[c].mean())
        out.append(row)
    return pd.DataFrame(out)


def best_intervals(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per policy, the interval with the highest mean goodput, refined by a parabola in log(interval)."""
    rows = []
    for policy, group in sweep.groupby("policy", sort=False):
        curve = group.groupby("interval_s")["goodput_fraction"].mean().sort_index()
        x, y = np.log(curve.index.to_numpy(dtype=float)), curve.to_numpy()
        i = int(np.argmax(y))
        refined = float(np.exp(x[i]))
        if 0 < i < len(x) - 1:
            a, b, _ = np.polyfit(x[i - 1 : i + 2], y[i - 1 : i + 2], 2)
            if a < 0:
                refined = float(np.exp(np.clip(-b / (2 * a), x[i - 1], x[i + 1])))
        rows.append(
            {
                "policy": policy,
                "best_interval_s": refined,
                "grid_best_s": float(np.exp(x[i])),
                "goodput": y[i],
            }
        )
    return pd.DataFrame(rows)

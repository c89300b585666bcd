"""Plots of a goodput study: goodput vs checkpoint interval, vs failure rate, and a week's timeline.

Each function returns a matplotlib `Figure` built without pyplot, so it works the same in a script
(save it) and in a notebook (display it).
"""

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from goodput.sim import RunResult
from goodput.study import mean_ci, summarize

DAY_S = 86400.0


def _log_x(ax) -> None:
    """A log x axis labelled 1, 2, 5, 10, ... in plain numbers."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _with_ci(ax, x, table: pd.DataFrame, label: str) -> None:
    mean, ci = 100 * table["goodput_fraction"], 100 * table["goodput_fraction_ci"]
    (line,) = ax.plot(x, mean, marker="o", ms=3, label=label)
    ax.fill_between(x, mean - ci, mean + ci, color=line.get_color(), alpha=0.2, lw=0)


def intervals_figure(sweep: pd.DataFrame, young_s: float, daly_s: float, title: str = "") -> Figure:
    """Goodput vs checkpoint interval per policy, relative to the policy's best interval.

    Policies differ by tens of points while the interval moves goodput by tenths, so each curve is
    the paired difference (same seed, same failures) from the policy's best grid interval, in
    percentage points, with its 95% CI; the legend gives each policy's goodput at its best.
    """
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for policy, rows in sweep.groupby("policy", sort=False):
        wide = rows.pivot(index="seed", columns="interval_s", values="goodput_fraction").sort_index(axis=1)
        best = wide.mean().idxmax()
        diffs = wide.sub(wide[best], axis=0)
        stats = [mean_ci(diffs[c].to_numpy()) for c in diffs.columns]
        mean = 100 * np.array([m for m, _ in stats])
        ci = 100 * np.array([h for _, h in stats])
        minutes = diffs.columns.to_numpy(dtype=float) / 60
        label = f"{policy} (best {best / 60:.1f} min: {100 * wide[best].mean():.2f}%)"
        (line,) = ax.plot(minutes, mean, marker="o", ms=3, label=label)
        ax.fill_between(minutes, mean - ci, mean + ci, color=line.get_color(), alpha=0.2, lw=0)
    ax.axvline(young_s / 60, color="k", ls=":", lw=1, label=f"Young {young_s / 60:.1f} min")
    ax.axvline(daly_s / 60, color="k", ls="--", lw=1, label=f"Daly {daly_s / 60:.1f} min")
    _log_x(ax)
    ax.set_xlabel("checkpoint interval (minutes of training)")
    ax.set_ylabel("goodput vs the best interval (points)")
    ax.set_title(title or "Goodput vs checkpoint interval (paired, 95% CI)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def rates_figure(runs: pd.DataFrame, title: str = "") -> Figure:
    """Goodput (% of failure-free) vs failure rate (multiples of the base rates), one line per policy."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    table = summarize(runs, by=("policy", "rate_factor"))
    for policy, rows in table.groupby("policy", sort=False):
        rows = rows.sort_values("rate_factor")
        _with_ci(ax, rows["rate_factor"], rows, policy)
    _log_x(ax)
    ax.set_xticks(sorted(runs["rate_factor"].unique()))
    ax.set_ylim(0, 101)
    ax.set_xlabel("failure rate (x the base rates)")
    ax.set_ylabel("goodput (% of failure-free)")
    ax.set_title(title or "Goodput vs failure rate (95% CI)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def timeline_figure(results: Mapping[str, RunResult], days: float = 7.0, title: str = "") -> Figure:
    """Throughput over the first `days` of one simulated run per policy.

    Checkpoint stalls (seconds every few minutes) are drawn at the running plan's throughput; each
    interruption is a red line, each scale-up a green one, and waiting for a repair is shaded grey.
    """
    fig = Figure(figsize=(10, 1.3 + 1.2 * len(results)), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    end = days * DAY_S
    for ax, (policy, result) in zip(axes, results.items(), strict=True):
        x0 = result.reference_samples_per_s
        starts = [t for t, _, _ in result.timeline] + [result.horizon_s]
        xs, ys, running = [], [], 0.0
        for (t, phase, rate), t_next in zip(result.timeline, starts[1:], strict=True):
            if t >= end:
                break
            if phase == "train":
                running = rate
            level = running if phase in ("train", "stall", "save") else 0.0
            xs += [t / DAY_S, min(t_next, end) / DAY_S]
            ys += [100 * level / x0] * 2
            if phase == "detect":
                ax.axvline(t / DAY_S, color="C3", lw=0.6, alpha=0.7)
            elif phase == "save":
                ax.axvline(t / DAY_S, color="C2", lw=0.6, alpha=0.7)
            elif phase == "wait":
                ax.axvspan(t / DAY_S, min(t_next, end) / DAY_S, color="0.8", lw=0)
        ax.plot(xs, ys, color="C0", lw=1)
        ax.set_ylim(-5, 105)
        ax.set_ylabel("% of X0", fontsize="small")
        ax.set_title(f"{policy}: goodput {100 * result.goodput_fraction:.1f}% over the run", fontsize="small")
    handles = [
        Line2D([], [], color="C0", label="throughput of the running plan"),
        Line2D([], [], color="C3", lw=0.8, label="interruption"),
        Line2D([], [], color="C2", lw=0.8, label="scale-up"),
        Patch(color="0.8", label="waiting for a repair"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small")
    axes[-1].set_xlabel("day")
    axes[-1].set_xlim(0, days)
    fig.suptitle(title or f"Training throughput over {days:g} simulated days", fontsize="medium")
    return fig


def loss_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as percentages: goodput and each cause of loss, mean +- 95% CI half-width (the
    mean alone below MIN_RUNS_FOR_CI runs)."""
    out = pd.DataFrame({"policy": summary["policy"]})
    out["goodput samples/s"] = summary["goodput_samples_per_s"].round(1)
    columns = ["goodput_fraction"] + [c for c in summary.columns if c.startswith("lost_") and c[-3:] != "_ci"]
    for c in columns:
        name = "goodput %" if c == "goodput_fraction" else c.removeprefix("lost_") + " %"
        out[name] = [
            f"{100 * m:.2f}" + ("" if math.isnan(h) else f" ± {100 * h:.2f}")
            for m, h in zip(summary[c], summary[f"{c}_ci"], strict=True)
        ]
    for c in ("interruptions", "restarts", "in_process", "scale_ups"):
        out[c] = np.round(summary[c], 1)
    return out

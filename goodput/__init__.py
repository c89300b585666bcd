"""Goodput under failures: simulate weeks of training on thousands of GPUs, per recovery policy.

A discrete-event simulation of one training run on a cluster whose GPUs and nodes fail and get
repaired (`failures`), under a recovery policy (`policies`), paying the costs of checkpoints,
detection, planning, restart and load (`costs`), with the throughput of every healthy set taken from
the real solver and cost model (`plans`). `study` repeats runs on shared failure traces and sweeps the
checkpoint interval and the failure rate; `plots` draws the results; `elastor simulate` drives it.

Why a package of its own rather than a module of `solver/`: the simulation is a *client* of the
solver, not part of planning. It calls `solver.solve` hundreds of times and adds what planning has no
use for: random failure processes, recovery costs, policies that are not plans (waiting, spares),
statistics, tables and plots (pandas, matplotlib, tqdm). Keeping it out of `solver/` keeps the solver
small and its dependency direction one-way (goodput -> solver -> costmodel, never back). Like them it
never imports torch, so what-if studies of 16,384 GPUs run on a laptop.
"""

from goodput.costs import RecoveryCosts
from goodput.failures import FailureModel, FailureTrace, draw_trace
from goodput.plans import CachedOracle, PlanPoint, SolverOracle, signature
from goodput.policies import POLICIES, Hardware, make_policy
from goodput.sim import RunResult, simulate
from goodput.study import Study, best_intervals, mean_ci, summarize, young_daly

__all__ = [
    "POLICIES",
    "CachedOracle",
    "FailureModel",
    "FailureTrace",
    "Hardware",
    "PlanPoint",
    "RecoveryCosts",
    "RunResult",
    "SolverOracle",
    "Study",
    "best_intervals",
    "draw_trace",
    "make_policy",
    "mean_ci",
    "signature",
    "simulate",
    "summarize",
    "young_daly",
]

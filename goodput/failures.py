"""What breaks, how often, and for how long: failure rates, their distributions, and the trace.

Three scopes of failure, because they cost a training job different things:
- `gpu`: one GPU is lost until it is repaired (a faulty GPU, its HBM or SRAM, ...);
- `node`: a whole host is lost until it is repaired (NIC, cable or switch port, PSU, host maintenance);
- `job`: the job crashes but no hardware is lost (a software bug, a NCCL watchdog timeout); it restarts
  on the same GPUs.

Default rates: the Llama 3 report (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783,
section 3.3.4 and its table of root causes). In a 54-day snapshot of pre-training on 16,384 H100 GPUs
(2,048 hosts of 8) the job saw 466 interruptions, 47 planned and 419 unexpected. The table's counts,
grouped by scope here:
    gpu  268 = faulty GPU 148 + GPU HBM3 memory 72 + GPU SRAM memory 19 + GPU system processor 17
               + silent data corruption 6 + GPU thermal interface and sensor 6
    node  88 = network switch/cable 35 + host maintenance 32 + NIC 7 + SSD 3 + power supply 3
               + server chassis 2 + IO expansion board 2 + CPU 2 + system memory 2
    job   63 = software bug 54 + NCCL watchdog timeouts 7 + dependency 2
The counts sum to 419. (The table's percentages do not all match its counts: "faulty GPU" is printed
as 148 and 30.1%, but 148 is 35.3% of 419; every other row matches count/419. We use the counts.)
Exposure is 54 days x 24 h x 16,384 GPUs = 21,233,664 GPU-hours (2,654,208 node-hours), so one GPU
fails about once per 79,000 hours and the whole 16,384-GPU job is interrupted about every 3.1 hours.
The 47 planned interruptions are left out: maintenance can be scheduled at a checkpoint.

Lifetimes are exponential (a Poisson process per device, memoryless) or Weibull with the same mean.
Schroeder and Gibson (DSN 2006, "A large-scale study of failures in high-performance computing
systems", 23,000 failures at LANL) found times between failures well modelled by a Weibull with a
decreasing hazard rate (shape < 1) and repair times by a lognormal whose mean varies from under an
hour to over a day between systems. The shape 0.7 used for the Weibull option is an assumption in
that decreasing-hazard range; the repair means (24 h for a GPU, 12 h for a host) are assumptions too:
the Llama 3 report gives no repair times. Both are parameters, and the README says so.

Each device is a renewal process: it fails after a lifetime, is repaired, and draws a new lifetime
from the end of the repair (a Weibull clock therefore starts with new hardware at t = 0). The trace
is drawn once per seed, before any policy runs, so every policy sees the same failures at the same
times and the same repairs (common random numbers): comparisons between policies are paired.
"""

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from costmodel import ElastorError
from costmodel.jsonio import is_number, shown

SCOPES = ("gpu", "node", "job")
GPU, NODE, JOB = 0, 1, 2
HOUR_S = 3600.0

# The Llama 3 snapshot (see the module docstring).
LLAMA3_GPUS = 16_384
LLAMA3_GPUS_PER_NODE = 8
LLAMA3_HOURS = 54 * 24
LLAMA3_COUNTS = {"gpu": 268, "node": 88, "job": 63}
# Weibull shapes outside this range make the mean-preserving scale 1 / Gamma(1 + 1/k) overflow or
# vanish; fits of hardware lifetimes lie between 0.5 and 1. (`elastor simulate --help` states it.)
WEIBULL_SHAPES = (0.1, 10.0)
# A lognormal repair shape past 5 puts the median e^12.5 times below the mean: no repair process.
MAX_REPAIR_SIGMA = 5.0


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Failure rates per device-hour, the lifetime distribution and the repair-time distribution."""

    gpu_per_gpu_hour: float
    node_per_node_hour: float
    job_per_gpu_hour: float
    distribution: str = "exponential"  # or "weibull" (same mean lifetime)
    weibull_shape: float = 0.7
    gpu_repair_mean_h: float = 24.0
    node_repair_mean_h: float = 12.0
    repair_sigma: float = 1.0  # lognormal shape of repair times; 0 makes every repair exactly the mean
    source: str = "custom"

    def __post_init__(self) -> None:
        rates = (self.gpu_per_gpu_hour, self.node_per_node_hour, self.job_per_gpu_hour)
        if not all(is_number(rate, low=0) for rate in rates):
            raise ElastorError(f"Failure rates must be non-negative finite numbers, not {shown(rates)}.")
        if self.distribution not in ("exponential", "weibull"):
            raise ElastorError(
                f"Failure distribution {shown(self.distribution)} is not exponential or weibull."
            )
        repairs = (self.gpu_repair_mean_h, self.node_repair_mean_h)
        if not is_number(self.weibull_shape, *WEIBULL_SHAPES) or not all(
            is_number(h, above=0) for h in repairs
        ):
            raise ElastorError(
                f"The Weibull shape must lie in {WEIBULL_SHAPES[0]:g}..{WEIBULL_SHAPES[1]:g} and the mean "
                f"repair times must be positive, not {shown(self.weibull_shape)} and {shown(repairs)}."
            )
        if not is_number(self.repair_sigma, 0, MAX_REPAIR_SIGMA):
            raise ElastorError(
                f"The lognormal repair_sigma must lie in 0..{MAX_REPAIR_SIGMA:g}, "
                f"not {shown(self.repair_sigma)}."
            )

    @classmethod
    def llama3(cls, **overrides: Any) -> "FailureModel":
        """Rates fitted to the Llama 3 report's 419 unexpected interruptions (module docstring)."""
        gpu_hours = LLAMA3_GPUS * LLAMA3_HOURS
        node_hours = gpu_hours / LLAMA3_GPUS_PER_NODE
        fields: dict[str, Any] = {
            "gpu_per_gpu_hour": LLAMA3_COUNTS["gpu"] / gpu_hours,
            "node_per_node_hour": LLAMA3_COUNTS["node"] / node_hours,
            "job_per_gpu_hour": LLAMA3_COUNTS["job"] / gpu_hours,
            "source": "llama3",
        }
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def none(cls) -> "FailureModel":
        return cls(gpu_per_gpu_hour=0.0, node_per_node_hour=0.0, job_per_gpu_hour=0.0, source="none")

    def scaled(self, factor: float) -> "FailureModel":
        """Every rate multiplied by `factor` (repair times unchanged)."""
        return replace(
            self,
            gpu_per_gpu_hour=self.gpu_per_gpu_hour * factor,
            node_per_node_hour=self.node_per_node_hour * factor,
            job_per_gpu_hour=self.job_per_gpu_hour * factor,
        )

    def interruptions_per_hour(self, num_gpus: int, num_nodes: int) -> float:
        """Expected failures per hour on the whole cluster: 1 / (the cluster's MTBF in hours)."""
        return (
            num_gpus * (self.gpu_per_gpu_hour + self.job_per_gpu_hour) + num_nodes * self.node_per_node_hour
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "FailureModel":
        """A failure file: the three rates, optionally the distribution and repair parameters."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known - {"schema_version"})
        if unknown:
            raise ElastorError(f"The failure file has unknown field(s) {', '.join(unknown)}.")
        missing = [k for k in ("gpu_per_gpu_hour", "node_per_node_hour", "job_per_gpu_hour") if k not in data]
        if missing:
            raise ElastorError(f"The failure file lacks the required field(s) {', '.join(missing)}.")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class FailureTrace:
    """Failures in time order; `gpu` is the GPU's position on its node (-1 for a node failure)."""

    horizon_s: float
    time_s: np.ndarray
    scope: np.ndarray
    node: np.ndarray
    gpu: np.ndarray
    repair_s: np.ndarray  # 0 for job-scope failures: nothing to repair

    def __len__(self) -> int:
        return len(self.time_s)

    @classmethod
    def of(cls, horizon_s: float, events: Sequence[tuple[float, str, int, int, float]]) -> "FailureTrace":
        """A hand-written trace: (time_s, scope, node, gpu position or -1, repair_s) per failure."""
        rows = sorted(events)
        return cls(
            horizon_s=float(horizon_s),
            time_s=np.array([r[0] for r in rows], dtype=float),
            scope=np.array([SCOPES.index(r[1]) for r in rows], dtype=np.int8),
            node=np.array([r[2] for r in rows], dtype=np.int32),
            gpu=np.array([r[3] for r in rows], dtype=np.int32),
            repair_s=np.array([r[4] for r in rows], dtype=float),
        )

    def counts(self) -> dict[str, int]:
        return {name: int(np.sum(self.scope == i)) for i, name in enumerate(SCOPES)}


def draw_trace(
    model: FailureModel, gpus_per_node: Sequence[int], horizon_s: float, seed: int
) -> FailureTrace:
    """Every failure and repair on the cluster over `horizon_s`, deterministic in `seed`."""
    # One random stream per (scope, lifetimes | repairs): changing one scope's rate leaves the
    # other scopes' failures where they were.
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2 * len(SCOPES))]
    gpu_node = np.repeat(np.arange(len(gpus_per_node)), gpus_per_node)
    gpu_pos = np.concatenate([np.arange(g) for g in gpus_per_node]) if len(gpus_per_node) else np.zeros(0)
    units = {
        GPU: (model.gpu_per_gpu_hour, gpu_node, gpu_pos, model.gpu_repair_mean_h),
        NODE: (model.node_per_node_hour, np.arange(len(gpus_per_node)), None, model.node_repair_mean_h),
        JOB: (model.job_per_gpu_hour, gpu_node, gpu_pos, 0.0),
    }
    rows: list[tuple[float, int, int, int, float]] = []
    for scope, (rate, nodes, positions, repair_mean_h) in units.items():
        if rate <= 0 or len(nodes) == 0:
            continue
        life_rng, repair_rng = streams[2 * scope], streams[2 * scope + 1]
        lifetime = _lifetime_sampler(model, rate, life_rng)
        first = lifetime(len(nodes))
        heap = [(float(first[u]), int(u)) for u in np.flatnonzero(first < horizon_s)]
        heapq.heapify(heap)
        while heap:
            t, u = heapq.heappop(heap)
            repair = _repair_s(model, repair_mean_h, repair_rng) if repair_mean_h > 0 else 0.0
            gpu = -1 if positions is None else int(positions[u])
            rows.append((t, scope, int(nodes[u]), gpu, repair))
            nxt = t + repair + float(lifetime(1)[0])
            if nxt < horizon_s:
                heapq.heappush(heap, (nxt, u))
    rows.sort()
    return FailureTrace(
        horizon_s=float(horizon_s),
        time_s=np.array([r[0] for r in rows], dtype=float),
        scope=np.array([r[1] for r in rows], dtype=np.int8),
        node=np.array([r[2] for r in rows], dtype=np.int32),
        gpu=np.array([r[3] for r in rows], dtype=np.int32),
        repair_s=np.array([r[4] for r in rows], dtype=float),
    )


def _lifetime_sampler(model: FailureModel, rate_per_hour: float, rng: np.random.Generator):
    """Lifetimes in seconds with mean 1 / rate: exponential, or Weibull scaled to the same mean."""
    mean_s = HOUR_S / rate_per_hour
    if model.distribution == "exponential":
        return lambda n: rng.standard_exponential(n) * mean_s
    # A Weibull of shape k and scale lam has mean lam * Gamma(1 + 1/k).
    scale_s = mean_s / math.gamma(1.0 + 1.0 / model.weibull_shape)
    return lambda n: rng.weibull(model.weibull_shape, n) * scale_s


def _repair_s(model: FailureModel, mean_h: float, rng: np.random.Generator) -> float:
    """A lognormal repair time with the given mean (exactly the mean when repair_sigma is 0)."""
    if model.repair_sigma == 0:
        return mean_h * HOUR_S
    sigma = model.repair_sigma
    # A lognormal's mean is exp(mu + sigma^2 / 2).
    mu = math.log(mean_h * HOUR_S) - sigma * sigma / 2
    return float(rng.lognormal(mu, sigma))

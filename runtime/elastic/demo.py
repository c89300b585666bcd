"""`elastor demo`: the whole story on this machine's CPU, in a few minutes, with a report to look at.

1. profile gpt-tiny on the CPU;
2. plan for a simulated cluster of two nodes with two GPUs each (each GPU is a CPU process);
3. train elastically; GPU n1:1 is killed (SIGKILL) at step 12; the supervisors re-plan for the three
   survivors and resume from the newest checkpoint, resharded; at step 22 the GPU comes back and the
   run scales up again at the next checkpoint boundary;
4. train the same steps without any failure in a single process, and check that both runs' losses
   and final weights agree (the plan changes the speed, never the mathematics);
5. write a report directory: the plans used, the metrics, plots of loss and throughput with the
   failure and the recovery marked, and summary.json with every figure.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from costmodel.cluster import ClusterSpec
from costmodel.estimate import CostModel
from costmodel.jsonio import read_json, write_json
from costmodel.plan import Plan
from costmodel.profile import ModelProfile
from runtime.compare import TOLERANCE, compare_runs
from runtime.elastic.report import read_metrics, recoveries
from solver import solve

CLUSTER = "2,2"
GLOBAL_BATCH = 12
STEPS = 30
CKPT_EVERY = 5
FAILURE, RECOVERY = "n1:1@12", "n1:1@22"


def run_demo(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for old in ("elastic-ckpt", "reference-ckpt", "metrics.jsonl", "reference-metrics.jsonl", "metrics-logs"):
        path = out / old  # a previous demo's run would otherwise be resumed, not repeated
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    started = time.perf_counter()
    profile_path = out / "profile.json"
    _say(f"1/5 profiling gpt-tiny on this CPU -> {profile_path}")
    _elastor(
        "profile",
        "--model=gpt-tiny",
        "--device=cpu",
        "--micro-batch-size=1,2",
        "--seq-len=32",
        "--tp-degrees=1,2",
        f"--out={profile_path}",
        "--quiet",
    )
    profile = ModelProfile.from_json(read_json(profile_path, "profile"))

    cluster = ClusterSpec.parse(CLUSTER, profile.device_kind)
    plan = solve(profile, cluster, GLOBAL_BATCH)
    _say(f"2/5 plan for nodes with {CLUSTER} GPUs ({plan.solver['status']}, {plan.solver['wall_s']:.2f} s):")
    print(plan.summary(), CostModel(profile, cluster).estimate(plan).explain(), sep="\n", flush=True)

    _say(
        f"3/5 elastic run: {STEPS} steps; GPU {FAILURE.replace('@', ' dies at step ')}, returns at {RECOVERY}"
    )
    elastic_dir, metrics = out / "elastic-ckpt", out / "metrics.jsonl"
    code = _elastor(
        "run",
        f"--cluster={CLUSTER}",
        f"--profile={profile_path}",
        f"--global-batch-size={GLOBAL_BATCH}",
        f"--steps={STEPS}",
        f"--ckpt-dir={elastic_dir}",
        f"--ckpt-every={CKPT_EVERY}",
        f"--metrics={metrics}",
        f"--inject-failure={FAILURE}",
        f"--inject-recovery={RECOVERY}",
        check=False,
    )
    if code != 0:
        _say(f"the elastic run failed (exit {code}); see {metrics.with_name('metrics-logs')}")
        return code

    _say("4/5 the same training without failures, in one process")
    reference_dir, reference_metrics = out / "reference-ckpt", out / "reference-metrics.jsonl"
    whole_model = {"layers": [0, plan.model.num_layers], "devices": ["n0:0"]}
    one_pipeline = {"num_microbatches": GLOBAL_BATCH // plan.micro_batch_size, "stages": [whole_model]}
    single = Plan.from_json({**plan.to_json(), "pipelines": [one_pipeline]})
    write_json(out / "reference-plan.json", single.to_json())
    _elastor(
        "train",
        f"--plan={out / 'reference-plan.json'}",
        f"--steps={STEPS}",
        f"--ckpt-dir={reference_dir}",
        f"--metrics={reference_metrics}",
        "--device=cpu",
    )

    _say("5/5 report")
    records = read_metrics(metrics)
    found = recoveries(records)  # the run printed their table already
    check = compare_runs(records, read_metrics(reference_metrics), elastic_dir, reference_dir)
    plans = _write_plans(records, out / "plans")
    _plot(records, out)
    summary = {
        "cluster": CLUSTER,
        "global_batch_size": GLOBAL_BATCH,
        "steps": STEPS,
        "failure": FAILURE,
        "recovery": RECOVERY,
        "plans": [str(p.relative_to(out)) for p in plans],
        "recoveries": [r.__dict__ for r in found],
        "check": check,
        "wall_s": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    verdict = "equal" if check["equal"] else "DIFFERENT"
    _say(
        f"final model vs uninterrupted run: {verdict} (losses max relative difference "
        f"{check['loss_max_rel_diff']:.1e}, weights max abs difference {check['param_max_abs_diff']:.1e}, "
        f"tolerance {TOLERANCE:g}); report in {out} ({summary['wall_s']:.0f} s)"
    )
    return 0 if check["equal"] else 1


def _write_plans(records, directory: Path) -> list[Path]:
    directory.mkdir(exist_ok=True)
    paths = []
    for r in records:
        if r.get("event") == "replanned":
            path = directory / f"round-{r['round']}.json"
            write_json(path, r["plan"])
            paths.append(path)
    return paths


def _plot(records, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "loss" in r and "event" not in r]
    failures = [r for r in records if r.get("event") == "failure_injected"]
    scale_ups = [r for r in records if r.get("event") == "replanned" and r["round"] > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["step"] for r in steps],
        [r["loss"] for r in steps],
        ".-",
        lw=1,
        label="loss (steps redone shown twice)",
    )
    for f in failures:
        ax.axvline(f["step"], color="red", ls="--", label=f"{f['device']} killed")
    for r in scale_ups:
        ax.axvline(r["step"], color="green", ls=":", label=f"resumed on {r['devices']} GPUs")
    ax.set(xlabel="step", ylabel="loss", title="gpt-tiny, elastic run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    t0 = records[0]["time_s"]
    times, rates, now = [], [], None
    for r in records:
        if "time_s" in r:
            now = r["time_s"]
        elif "samples_per_s" in r and now is not None:
            now += r["step_time_s"]
            times.append(now - t0)
            rates.append(r["samples_per_s"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(times, rates, ".", label="samples/s per step")
    for f in failures:
        ax.axvline(f["time_s"] - t0, color="red", ls="--", label=f"{f['device']} killed")
    for r in scale_ups:
        ax.axvline(r["time_s"] - t0, color="green", ls=":", label=f"re-planned for {r['healthy']} GPUs")
    ax.set(xlabel="wall time (s)", ylabel="samples/s", title="throughput over time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)


def _elastor(*args: str, check: bool = True) -> int:
    code = subprocess.run([sys.executable, "-m", "elastor", *args]).returncode
    if check and code != 0:
        raise SystemExit(code)
    return code


def _say(line: str) -> None:
    print(f"\nelastor demo: {line}", flush=True)

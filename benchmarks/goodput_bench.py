"""Goodput per recovery policy for llama3-70b on 2,048 and 16,384 H100 GPUs, and what it costs to find out.

    python benchmarks/goodput_bench.py                  # the README table: 30 days x 5 runs per size
    python benchmarks/goodput_bench.py --days 7 --runs 2 --sizes 2048   # a smoke run

For each size it runs, as a user would, in a fresh interpreter:
    elastor profile --model llama3-70b --analytic --device-kind H100-80GB --seq-len 4096 \
        --micro-batch-size 1 --out P
    elastor simulate --profile P --cluster {nodes}x8 --global-batch-size B --days D --runs R \
        --plan-cache C
with 2M tokens per step per 2,048 GPUs (B = 512 and 4,096 sequences of 4,096 tokens; Llama 3 405B
trained with 16M-token batches on 16,384 GPUs) in micro-batches of one sequence (more micro-batch
sizes multiply the solver's work). 16,384 GPUs are planned as 8 slices of 2,048 (`--slices auto`,
`goodput/slices.py`): one whole-cluster plan takes the solver tens of minutes at that size.

Each size starts from an empty plan cache C of its own: the first run's wall time includes every
solver call; a second run finds every plan in C and times the simulation alone. Records the goodput
of every policy with its 95% CI and the lost work by cause. Prints a table and writes
benchmarks/results/goodput.json.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from costmodel.jsonio import write_json  # noqa: E402
from costmodel.table import format_table  # noqa: E402

PROFILE_ARGS = [
    "--model", "llama3-70b", "--analytic", "--device-kind", "H100-80GB", "--seq-len", "4096",
    "--micro-batch-size", "1",
]  # fmt: skip
SEQUENCES_PER_2048_GPUS = 512  # of 4,096 tokens: 2M tokens per step per 2,048 GPUs


def elastor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastor", *args], cwd=REPO, capture_output=True, text=True, check=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,16384", help="GPUs, 8 per node (default: %(default)s)")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "goodput.json"))
    parser.add_argument(
        "--chunks",
        choices=("1", "auto"),
        default="1",
        help="passed to elastor simulate (default: %(default)s)",
    )
    args = parser.parse_args()

    results = {"cpus": os.cpu_count(), "days": args.days, "runs": args.runs, "sizes": []}
    rows = [
        (
            "GPUs",
            "policy",
            "goodput %",
            "recompute %",
            "restart %",
            "wait %",
            "degraded %",
            "cold s",
            "warm s",
        )
    ]
    with tempfile.TemporaryDirectory() as tmp:
        profile = str(Path(tmp) / "llama3-70b-h100.json")
        done = elastor("profile", *PROFILE_ARGS, "--out", profile)
        if done.returncode:
            sys.exit(done.stderr)
        for gpus in (int(n) for n in args.sizes.split(",")):
            nodes, out_dir, cache = gpus // 8, Path(tmp) / f"sim-{gpus}", Path(tmp) / f"plans-{gpus}.json"
            shown = [
                "simulate", "--profile", "p70.json", "--cluster", f"{nodes}x8",
                "--global-batch-size", str(SEQUENCES_PER_2048_GPUS * gpus // 2048),
                "--days", f"{args.days:g}", "--runs", str(args.runs), "--chunks", args.chunks,
            ]  # fmt: skip
            extra = ["--plan-cache", str(cache), "--out-dir", str(out_dir), "--quiet"]
            command = [profile if a == "p70.json" else a for a in shown] + extra
            walls, outputs = [], []
            for _ in range(2):  # cold (every solver call), then warm (the simulation alone)
                started = time.perf_counter()
                done = elastor(*command)
                walls.append(time.perf_counter() - started)
                if done.returncode:
                    sys.exit(done.stderr)
                outputs.append(done.stdout)
            print(outputs[0])
            summary = pd.read_csv(out_dir / "summary.csv")
            results["sizes"].append(
                {
                    "gpus": gpus,
                    "command": "elastor " + " ".join(shown),
                    "simulate_cold_s": round(walls[0], 2),
                    "simulate_warm_s": round(walls[1], 2),
                    "stdout_cold": outputs[0],
                    "stdout_warm": outputs[1],
                    "summary": summary.to_dict(orient="records"),
                }
            )
            for _, s in summary.iterrows():
                rows.append(
                    (
                        f"{gpus:,}",
                        s["policy"],
                        f"{100 * s['goodput_fraction']:.2f} ± {100 * s['goodput_fraction_ci']:.2f}",
                        f"{100 * s['lost_recompute']:.2f}",
                        f"{100 * s['lost_restart']:.2f}",
                        f"{100 * s['lost_wait']:.2f}",
                        f"{100 * s['lost_degraded']:.2f}",
                        f"{walls[0]:.1f}",
                        f"{walls[1]:.1f}",
                    )
                )
    print(format_table(rows))
    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Goodput per recovery policy for llama3-70b on 2,048 and 16,384 H100 GPUs, and what it costs to find out.

    python benchmarks/goodput_bench.py                  # the README table: 30 days x 5 runs per size
    python benchmarks/goodput_bench.py --days 7 --runs 2 --nodes 32   # a smoke run

For each cluster size it runs, as a user would, in a fresh interpreter:
    elastor profile --model llama3-70b --analytic --device-kind H100-80GB --seq-len 4096 --out P
    elastor simulate --profile P --cluster {nodes}x8 --global-batch-size 4096 --days D --runs R
and records the wall time of `elastor simulate` (solver calls included), the goodput of every policy
with its 95% CI and the lost work by cause. Prints a table and writes benchmarks/results/goodput.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from costmodel.table import format_table  # noqa: E402

PROFILE_ARGS = ["--model", "llama3-70b", "--analytic", "--device-kind", "H100-80GB", "--seq-len", "4096"]
GLOBAL_BATCH = 4096  # sequences of 4,096 tokens: 16M tokens per step


def elastor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastor", *args], cwd=REPO, capture_output=True, text=True, check=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="256,2048", help="8-GPU nodes per size (default: %(default)s)")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "goodput.json"))
    args = parser.parse_args()

    results = {"cpus": os.cpu_count(), "days": args.days, "runs": args.runs, "sizes": []}
    rows = [("GPUs", "policy", "goodput %", "recompute %", "restart %", "wait %", "degraded %", "simulate s")]
    with tempfile.TemporaryDirectory() as tmp:
        profile = str(Path(tmp) / "llama3-70b-h100.json")
        done = elastor("profile", *PROFILE_ARGS, "--out", profile)
        if done.returncode:
            sys.exit(done.stderr)
        for nodes in (int(n) for n in args.nodes.split(",")):
            out_dir = Path(tmp) / f"sim-{nodes}"
            command = [
                "simulate", "--profile", profile, "--cluster", f"{nodes}x8",
                "--global-batch-size", str(GLOBAL_BATCH), "--days", f"{args.days:g}",
                "--runs", str(args.runs), "--out-dir", str(out_dir), "--quiet",
            ]  # fmt: skip
            started = time.perf_counter()
            done = elastor(*command)
            wall_s = time.perf_counter() - started
            if done.returncode:
                sys.exit(done.stderr)
            print(done.stdout)
            summary = pd.read_csv(out_dir / "summary.csv")
            results["sizes"].append(
                {
                    "gpus": nodes * 8,
                    "command": "elastor " + " ".join(command[:-3]).replace(profile, "P.json"),
                    "simulate_wall_s": round(wall_s, 2),
                    "stdout": done.stdout,
                    "summary": summary.to_dict(orient="records"),
                }
            )
            for _, s in summary.iterrows():
                rows.append(
                    (
                        f"{nodes * 8:,}",
                        s["policy"],
                        f"{100 * s['goodput_fraction']:.2f} ± {100 * s['goodput_fraction_ci']:.2f}",
                        f"{100 * s['lost_recompute']:.2f}",
                        f"{100 * s['lost_restart']:.2f}",
                        f"{100 * s['lost_wait']:.2f}",
                        f"{100 * s['lost_degraded']:.2f}",
                        f"{wall_s:.1f}",
                    )
                )
    print(format_table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Recovery from each kind of failure `elastor run` handles, timed phase by phase, in one sitting.

    python benchmarks/recovery_bench.py                  # gpt-tiny on three simulated single-GPU nodes
    python benchmarks/recovery_bench.py --steps 40       # longer runs
    python benchmarks/recovery_bench.py --paths 5        # a killed worker: in-process vs restart, 5 runs each

`--paths N`: gpt-tiny on the simulated 2+2 cluster, the worker of n1:1 SIGKILLed after step 5,
N runs of each recovery path alternated (`--recovery in-process`, then `--recovery restart`, then
the in-process path of a bf16 ZeRO-1 run whose lost slice comes back from its peer snapshot, taken
every 4 steps), the median of each phase, of the total (failure to the first resumed step) and of
the steps redone per path, and the ratio of the first two. Writes
benchmarks/results/recovery_paths.json.

Each scenario is one `elastor run --cluster 1,1,1` of gpt-tiny (the repository's CPU profile) that
injects one failure at step 8 (runtime/elastic/faults.py) into a node of the first plan other than
n0 (n1, the planner's second node):
- worker: the worker is SIGKILLed (torchrun notices);
- host: its whole node dies, supervisor included (the others notice when its lease runs out);
- hang: the worker freezes (hang detection notices after --hang-timeout-s);
- leader (etcd only, when an `etcd` server is on PATH): the leader's whole node dies, on an etcd
  the benchmark starts on loopback, and another node takes the office.
The phases are the leader's breakdown (runtime/elastic/report.py): detect, rendezvous, plan,
restart, load, first step. Writes benchmarks/results/recovery_bench.json.
"""

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from costmodel.jsonio import write_json  # noqa: E402
from costmodel.table import format_table  # noqa: E402
from runtime.elastic.launch import free_port  # noqa: E402
from runtime.elastic.report import read_metrics, recoveries  # noqa: E402

PROFILE = REPO / "profiles" / "gpt-tiny-cpu.json"
PHASES = ("detect", "rendezvous", "plan", "restart", "load", "first step")
LEASE_S, HANG_TIMEOUT_S = 5.0, 10.0
RUN_TIMEOUT_S = 600


@contextlib.contextmanager
def _etcd(folder: Path):
    """A one-member etcd on loopback; yields HOST:PORT."""
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            "etcd",
            "--name=bench",
            f"--data-dir={folder}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=bench=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", client), timeout=1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("etcd did not start")
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _run(folder: Path, steps: int, *flags: str, cluster: str = "1,1,1") -> dict:
    command = [
        sys.executable,
        "-m",
        "elastor",
        "run",
        f"--cluster={cluster}",
        f"--profile={PROFILE}",
        "--global-batch-size=8",
        f"--steps={steps}",
        f"--ckpt-dir={folder / 'ckpt'}",
        "--ckpt-every=4",
        f"--lease-s={LEASE_S}",
        f"--hang-timeout-s={HANG_TIMEOUT_S}",
        *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(flags)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    records = read_metrics(folder / "ckpt" / "metrics.jsonl")
    found = recoveries(records)
    if len(found) != 1:
        raise SystemExit(f"{' '.join(flags)}: expected one recovery, found {len(found)}")
    r = found[0]
    failed = next(x["step"] for x in records if x.get("event") == "failure_injected")
    return {
        "path": r.path,
        "phases_s": r.phases_s,
        "total_s": r.total_s,
        "devices": [r.devices_before, r.devices_after],
        "redone_steps": failed - r.step,  # done before the failure and again after it
        "wall_s": time.monotonic() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--paths", type=int, default=0, help="compare the two recovery paths, N runs each")
    args = parser.parse_args()
    if args.paths:
        compare_paths(args.paths, args.steps)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="elastor-recovery-") as tmp:
        tmp = Path(tmp)
        scenarios = {  # the restart path, under torchrun (the in-process one: --paths)
            "worker": ("--recovery=restart", "--inject-failure=n1:0@8"),
            "host": ("--recovery=restart", "--inject-failure=host:n1:0@8"),
            "hang": ("--recovery=restart", "--inject-failure=hang:n1:0@8"),
        }
        for name, flags in scenarios.items():
            print(f"{name} ...", flush=True)
            results[name] = _run(tmp / name, args.steps, *flags)
        if shutil.which("etcd"):
            print("leader (etcd) ...", flush=True)
            with _etcd(tmp / "etcd") as endpoint:
                flags = (
                    "--recovery=restart",
                    "--inject-failure=host:n0:0@8",
                    "--rdzv-backend=etcd",
                    f"--rdzv-endpoint={endpoint}",
                )
                results["leader (etcd)"] = _run(tmp / "leader", args.steps, *flags)
        else:
            print("no etcd on PATH: the lost-leader scenario is skipped")
    rows = [("failure", *(f"{p} s" for p in PHASES), "total s")]
    for name, r in results.items():
        rows.append((name, *(f"{r['phases_s'][p]:.2f}" for p in PHASES), f"{r['total_s']:.2f}"))
    print(format_table(rows))
    out = REPO / "benchmarks" / "results" / "recovery_bench.json"
    write_json(out, {"lease_s": LEASE_S, "hang_timeout_s": HANG_TIMEOUT_S, "steps": args.steps, **results})
    print(f"wrote {out.relative_to(REPO)}")


SNAPSHOT_PATH = "in-process, ZeRO-1 snapshot"


def compare_paths(repeats: int, steps: int) -> None:
    """A killed worker on the 2+2 cluster, recovered in-process and by a restart, alternately; and
    a killed ZeRO-1 worker (bf16) whose slice comes back from its peer snapshot (every 4 steps)."""
    runs: dict[str, list[dict]] = {"in-process": [], "restart": [], SNAPSHOT_PATH: []}
    with tempfile.TemporaryDirectory(prefix="elastor-recovery-") as tmp:
        bf16 = Path(tmp) / "bf16.json"
        profile = [sys.executable, "-m", "elastor", "profile", "--model=gpt-tiny", "--device=cpu"]
        profile += ["--seq-len=32", "--micro-batch-size=1,2", "--tp-degrees=1,2", "--dtype=bfloat16"]
        subprocess.run([*profile, f"--out={bf16}"], cwd=REPO, check=True, capture_output=True)
        for i in range(repeats):
            for k, path in enumerate(runs):
                print(f"{path} {i + 1}/{repeats} ...", flush=True)
                flags = [f"--recovery={path.split(',')[0]}", "--inject-failure=n1:1@5"]
                if path == SNAPSHOT_PATH:
                    flags += [f"--profile={bf16}", "--sharding=zero1", "--peer-snapshot-every=4"]
                found = _run(Path(tmp) / f"{i}-{k}", steps, *flags, cluster="2,2")
                if found["path"] != path.split(",")[0]:
                    raise SystemExit(f"{path} recovered by the {found['path']} path")
                runs[path].append(found)
    phases = ("detect", "rendezvous", "plan", "restart", "load", "re-form", "transfer", "first step")
    medians = {
        path: {p: statistics.median(r["phases_s"].get(p, 0.0) for r in found) for p in phases}
        | {"total": statistics.median(r["total_s"] for r in found)}
        for path, found in runs.items()
    }
    rows = [("path", *(f"{p} s" for p in phases), "total s (median)", "min", "max", "steps redone")]
    for path, found in runs.items():
        totals = [r["total_s"] for r in found]
        cells = (f"{medians[path][p]:.2f}" if any(p in r["phases_s"] for r in found) else "-" for p in phases)
        redone = statistics.median(r["redone_steps"] for r in found)
        rows.append(
            (
                path,
                *cells,
                f"{medians[path]['total']:.2f}",
                f"{min(totals):.2f}",
                f"{max(totals):.2f}",
                f"{redone:g}",
            )
        )
    print(format_table(rows))
    ratio = medians["in-process"]["total"] / medians["restart"]["total"]
    print(f"in-process / restart, median totals: {ratio:.2f}")
    out = REPO / "benchmarks" / "results" / "recovery_paths.json"
    write_json(out, {"repeats": repeats, "steps": steps, "runs": runs, "medians": medians, "ratio": ratio})
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()

"""One-command GPU check: CUDA profiles, a bf16 training run, measured against predicted.

On one CUDA GPU, in a few minutes:
  1. profile gpt-small (sequence 1,024; micro-batches 1, 2, 4, 8) and one llama2-7b block (sequence
     4,096, micro-batch 1) on the GPU, in bf16; both profiles are written to --profiles-dir;
  2. train gpt-small, then the one-block llama2-7b (its embedding, one block and its head: 0.46 B
     parameters, a step of real size for the GPU), in bf16 on that GPU, without and with full
     recomputation, from one-stage plans (`elastor train`, synthetic tokens), and read the step
     times and the `memory` event of each run;
  3. run three more steps of each plan under torch.profiler: the GPU's kernel time per step over
     the step's wall time says whether the step is bound by the GPU (near 1) or by the host
     launching its kernels (well below 1), the regime the cost model's measured times come from;
  4. write measured vs predicted step time, MFU, peak memory (the cost model on the measured
     profile) and the GPU-busy fraction to --out.

    python benchmarks/gpu_check.py                        # on a CUDA GPU
    python benchmarks/gpu_check.py --device cpu --out x   # the same steps, scaled down, as a dry run

`--device cpu` runs every step on gpt-tiny and a narrow llama-shaped block (the test suite does,
`tests/test_gpu_check.py`): it checks the script, not a GPU.
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from costmodel import PRESETS, ClusterSpec, Pipeline, Plan, Stage, flops
from costmodel.estimate import CostModel
from costmodel.jsonio import write_json
from costmodel.table import format_table

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_check.json"

# (model, sequence, micro-batch sizes, repeats) per device; the cpu dry run keeps every step small.
SETTINGS = {
    "cuda": {
        "model": PRESETS["gpt-small"],
        "seq": 1024,
        "sizes": [1, 2, 4, 8],
        "block": dataclasses.replace(PRESETS["llama2-7b"], name="llama2-7b-block", num_blocks=1),
        "block_seq": 4096,
        "repeats": 20,
        "train_mbs": 4,
        "block_train_mbs": 1,
        "micro_batches": 4,
        "steps": 30,
    },
    "cpu": {
        "model": PRESETS["gpt-tiny"],
        "seq": 64,
        "sizes": [2],
        "block": dataclasses.replace(
            PRESETS["llama2-7b"],
            name="llama-narrow-block",
            hidden_size=128,
            intermediate_size=344,
            num_heads=4,
            num_kv_heads=4,
            vocab_size=512,
            num_blocks=1,
        ),
        "block_seq": 64,
        "repeats": 2,
        "train_mbs": 2,
        "block_train_mbs": 1,
        "micro_batches": 2,
        "steps": 4,
    },
}


def one_stage_plan(config, seq: int, mbs: int, micro_batches: int, recompute: str) -> Plan:
    """The model on one device: one pipeline, one stage of every layer, in bf16."""
    stage = Stage(chunks=((0, config.num_layers),), devices=("n0:0",), recompute=recompute)
    return Plan(
        model=config,
        global_batch_size=mbs * micro_batches,
        micro_batch_size=mbs,
        seq_len=seq,
        dtype="bfloat16",
        pipelines=(Pipeline(num_microbatches=micro_batches, stages=(stage,)),),
    ).validate()


def train(plan: Plan, device: str, steps: int, tmp: Path) -> dict:
    """Run `elastor train` in this process; the median step time after the first two, and the
    memory event (measured and predicted peaks)."""
    from elastor.cli import main

    name = f"plan-{plan.model.name}-{plan.pipelines[0].stages[0].recompute}.json"
    plan_path, metrics = tmp / name, tmp / "m.jsonl"
    metrics.unlink(missing_ok=True)
    write_json(plan_path, plan.to_json())
    args = ["train", "--plan", str(plan_path), "--steps", str(steps), "--metrics", str(metrics)]
    code = main([*args, "--device", device, "--warmup-steps", "1"])
    if code != 0:
        raise SystemExit(f"gpu_check: elastor train exited {code}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time_s"] for r in lines if "step_time_s" in r][2:] or [lines[-1]["step_time_s"]]
    memory = next(r for r in lines if r.get("event") == "memory")
    return {"step_time_s": statistics.median(times), "memory": memory}


def gpu_busy(plan: Plan, device: str, steps: int = 3) -> dict:
    """Kernel seconds and kernels per step, and their share of the step's wall time, over `steps`
    steps after two warm-up steps, profiled (torch.profiler). On CPU there are no kernels: None."""
    import torch
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from runtime.distributed import init_distributed
    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    cuda = device == "cuda"
    trainer = Trainer(plan, init_distributed(plan, device=device), optim=OptimConfig())
    try:
        for _ in range(2):
            trainer.train_step()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - started) / steps
    finally:
        trainer.close()
        dist.destroy_process_group()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not cuda:
        return {"profiled_step_s": wall, "kernel_s": None, "kernels": None, "busy": None}
    kernel_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps
    per_step = len(kernels) / steps
    return {"profiled_step_s": wall, "kernel_s": kernel_s, "kernels": per_step, "busy": kernel_s / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default: %(default)s)")
    parser.add_argument("--profiles-dir", type=Path, help="where the profiles go (default: beside --out)")
    args = parser.parse_args(argv)
    import torch

    from profiler.measure import measure_profile

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --device cpu for the dry run.", file=sys.stderr)
        return 2
    s = SETTINGS[args.device]
    started = time.perf_counter()
    profiles_dir = args.profiles_dir or args.out.parent
    results: dict = {"device": args.device, "profiles": {}, "runs": []}
    common = {"tp_degrees": [1], "device": args.device, "dtype": "bfloat16", "repeats": s["repeats"]}
    small = measure_profile(s["model"], micro_batch_sizes=s["sizes"], seq_len=s["seq"], **common)
    block = measure_profile(s["block"], micro_batch_sizes=[1], seq_len=s["block_seq"], **common)
    for profile in (small, block):
        path = profiles_dir / f"{profile.model.name}-{profile.device_kind}.json"
        write_json(path, profile.to_json())
        results["profiles"][profile.model.name] = {"path": path.name, "wall_s": profile.method.get("wall_s")}
    cluster = ClusterSpec.parse("1", small.device_kind)
    trained = ((small, s["seq"], s["train_mbs"]), (block, s["block_seq"], s["block_train_mbs"]))
    with tempfile.TemporaryDirectory() as tmp:
        for (profile, seq, mbs), recompute in itertools.product(trained, ("none", "full")):
            plan = one_stage_plan(profile.model, seq, mbs, s["micro_batches"], recompute)
            predicted = CostModel(profile, cluster).estimate(plan)
            measured = train(plan, args.device, s["steps"], Path(tmp))
            peak = predicted.peak_flops
            device = measured["memory"]["devices"]["n0:0"]
            results["runs"].append(
                {
                    "model": profile.model.name,
                    "recompute": recompute,
                    "measured_step_s": measured["step_time_s"],
                    "predicted_step_s": predicted.step_time_s,
                    "step_ratio": measured["step_time_s"] / predicted.step_time_s,
                    "measured_mfu": None
                    if peak is None
                    else flops.mfu(predicted.model_flops_per_step, measured["step_time_s"], 1, peak),
                    "predicted_mfu": predicted.mfu,
                    "memory": device,
                    "peak_ratio": measured["memory"]["worst_measured_over_predicted"],
                    "gpu": gpu_busy(plan, args.device),
                }
            )
    results["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, results)
    rows = [("run", "measured s", "predicted s", "ratio", "MFU measured", "MFU predicted")]
    rows[0] += ("peak meas/pred", "GPU busy")
    for r in results["runs"]:
        share = [("-" if x is None else f"{x:.1%}") for x in (r["measured_mfu"], r["predicted_mfu"])]
        busy = "-" if r["gpu"]["busy"] is None else f"{r['gpu']['busy']:.0%}"
        times = (f"{r['measured_step_s']:.4f}", f"{r['predicted_step_s']:.4f}", f"{r['step_ratio']:.3f}")
        name = f"{r['model']}, recompute {r['recompute']}"
        rows.append((name, *times, *share, f"{r['peak_ratio']:.3f}", busy))
    print(format_table(rows))
    print(f"gpu_check: {results['wall_s']} s; wrote {args.out.name} and the profiles to {profiles_dir.name}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

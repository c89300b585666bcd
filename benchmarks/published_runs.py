"""Predicted against published: the analytic cost model on the runs of Narayanan et al. 2021, Table 1.

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1: GPT models of
1.7B to 1T parameters on up to 3,072 A100-80GB GPUs (DGX A100 nodes of 8, one 200 Gb/s HDR adapter
per GPU), sequence 2,048, vocabulary 51,200, mixed precision, full activation recomputation, at the
published TP and PP degrees and batch sizes. Their "achieved TFLOP/s per GPU" counts
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step: the recomputed forward included
(`costmodel.flops.hardware_flops_per_token(..., "full")`).

Each GPT becomes a Llama-shaped config with the same parameter count and the same matrix-product
FLOPs per token: multi-head attention (key/value heads = heads), a SwiGLU MLP of width 8h/3 (three
h x 8h/3 matrices hold the 8h² of GPT's two h x 4h ones, and multiply as many FLOPs), tied embeddings
as Megatron's GPT; LayerNorm biases and learned position embeddings (under 1% of the parameters)
are left out. Their attention predates FlashAttention: Megatron-LM computed the b x a x s x s scores,
with the scale, mask and softmax fused into one kernel, and kept them for backward, so the profile
prices the math attention kernel (`elastor profile --analytic --attention math`, which a plan made from
it also runs; `costmodel.profile.ATTENTION_KERNELS`). Each row is then planned with `elastor plan
--method uniform --tp T --pp P --recompute full` on that analytic A100-80GB profile: TP x PP x DP = the
published GPU count, blocks split as Megatron does; the micro-batch size, unpublished, is the solver's
choice among 1, 2, 4 and 8.

    python benchmarks/published_runs.py [--out benchmarks/results/published_runs.json]

Target: every row feasible in the memory model and predicted within +-15% of the published figure.
The device constants are the named kernel efficiencies of `costmodel.analytic` (each from a kernel
microbenchmark), not fitted to these rows.
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import solver
from costmodel import ClusterSpec, ElastorError, ModelConfig
from costmodel import flops as model_flops
from costmodel.analytic import kernel_efficiency
from costmodel.jsonio import write_json
from costmodel.table import format_table
from profiler.analytic import analytic_profile
from solver import parallel
from solver.baselines import Grid

DEFAULT_OUT = Path(__file__).parent / "results" / "published_runs.json"
SEQ, VOCAB, KIND = 2048, 51200, "A100-80GB"
MICRO_BATCH_SIZES = (1, 2, 4, 8)
ATTENTION = "math"  # the unfused attention of Megatron-LM in 2021 (module docstring)
TOLERANCE = 0.15


@dataclass(frozen=True)
class Run:
    """One row of Table 1: the model, its grid, its batch and the published TFLOP/s per GPU."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    def config(self) -> ModelConfig:
        return ModelConfig(
            name=f"gpt-{self.billions}b",
            vocab_size=VOCAB,
            hidden_size=self.hidden,
            intermediate_size=8 * self.hidden // 3,
            num_blocks=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.heads,
            max_seq_len=SEQ,
            tie_embeddings=True,
        )


TABLE_1 = (
    Run(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Run(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Run(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Run(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Run(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Run(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Run(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Run(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Run(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Run(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def predict(run: Run) -> dict:
    """The pinned plan of one row and its prediction beside the published figure."""
    config = run.config()
    started, cpu = time.perf_counter(), parallel.cpu_s()
    profile = analytic_profile(
        config,
        device_kind=KIND,
        micro_batch_sizes=MICRO_BATCH_SIZES,
        tp_degrees=[run.tp],
        seq_len=SEQ,
        attention=ATTENTION,
    )
    cluster = ClusterSpec.from_counts([8] * (run.gpus // 8), KIND)
    row = {"model": config.name, "params": config.param_count, "tp": run.tp, "pp": run.pp, "gpus": run.gpus}
    row.update(batch=run.batch, published_tflops=run.tflops)
    try:
        plan = solver.solve(
            profile, cluster, run.batch, "uniform", grid=Grid(tp=run.tp, pp=run.pp), recompute="full"
        )
    except ElastorError as e:
        return {**row, "feasible": False, "error": str(e)}
    p = plan.predicted
    hardware = model_flops.hardware_flops_per_token(config, SEQ, "full") * SEQ * run.batch
    tflops = hardware / p["step_time_s"] / plan.world_size / 1e12
    peak = max(p["peak_memory_bytes"].values())
    return {
        **row,
        "feasible": True,
        "dp": len(plan.pipelines),
        "micro_batch_size": plan.micro_batch_size,
        "step_time_s": p["step_time_s"],
        "predicted_tflops": tflops,
        "ratio": tflops / run.tflops,
        "within_tolerance": abs(tflops / run.tflops - 1) <= TOLERANCE,
        "mfu": p["mfu"],
        "peak_memory_fraction": peak / p["usable_memory_bytes"],
        "sync_s": p["sync_s"],
        "optimizer_s": p["optimizer_s"],
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(parallel.cpu_s() - cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=len(TABLE_1), help="the first N rows only")
    args = parser.parse_args(argv)
    rows = []
    for run in TABLE_1[: args.rows]:
        rows.append(predict(run))
        print(f"{rows[-1]['model']}: done in {rows[-1].get('wall_s', 0)} s", file=sys.stderr)
    table = [
        (
            "model",
            "TP",
            "PP",
            "DP",
            "GPUs",
            "batch",
            "mbs",
            "published",
            "predicted",
            "ratio",
            "MFU",
            "memory",
        )
    ]
    for r in rows:
        if not r["feasible"]:
            table.append(
                (
                    r["model"],
                    r["tp"],
                    r["pp"],
                    "-",
                    r["gpus"],
                    r["batch"],
                    "-",
                    r["published_tflops"],
                    "-",
                    "-",
                    "-",
                    r["error"],
                )
            )
            continue
        table.append(
            (
                r["model"], r["tp"], r["pp"], r["dp"], r["gpus"], r["batch"], r["micro_batch_size"],
                f"{r['published_tflops']:.0f}", f"{r['predicted_tflops']:.0f}", f"{r['ratio']:.3f}",
                f"{r['mfu']:.1%}", f"{r['peak_memory_fraction']:.0%}",
            )
        )  # fmt: skip
    print(format_table(table))
    held = [r for r in rows if r["feasible"] and r["within_tolerance"]]
    print(f"{len(held)} of {len(rows)} rows feasible and within +-{TOLERANCE:.0%} of the published TFLOP/s")
    write_json(
        args.out,
        {
            "device_kind": KIND,
            "kernel_efficiency": kernel_efficiency(KIND),
            "tolerance": TOLERANCE,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

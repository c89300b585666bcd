"""Predicted vs measured memory: per device in real training steps, and per layer shard, on CPU.

Runtime (the first table): plans of every dtype x sequence parallelism x recompute combination
train two steps under torchrun (`elastor train`, gloo, one process per device); the runtime's
`memory` event holds each device's measured bytes by kind (runtime/memory.py: the storages the
step's operators really allocate, seen by a dispatch mode) beside the cost model's prediction for
the same device (`runtime.memory.predicted_memory`). Target: no device's measured peak above its
prediction (a step's peak over everything it holds: parameters, masters, gradients, optimizer
state, and the step's own allocations).

Predicted: `costmodel.analytic.activation_bytes`, the formula the analytic profiles and the cost
model use. Measured: the bytes of the distinct storages autograd saves for backward when TP rank 0's
shard of the layer runs (`profiler.memory`), parameters excluded. The combinations cover every layer
kind, TP degrees 1-6, micro-batch sizes 1-4, float32 and bfloat16, a sequence length that is not a
multiple of 32, grouped-query attention with tied embeddings, and uneven MLP and vocabulary splits.
A second table checks that layers add up: whole stages of the runtime's `ModelSlice` (TP degree 1,
with the loss when the stage holds the head) against the sum of their layers' predictions, which
over-counts only the fp32 rotary tables that the blocks of a stage share.
An under-prediction means an out-of-memory crash in a plan the cost model called safe: the target
is none beyond 2%.

    python benchmarks/memory_validation.py [--out benchmarks/results/memory_validation.json]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from costmodel.analytic import activation_bytes
from costmodel.config import PRESETS, ModelConfig
from costmodel.jsonio import write_json
from costmodel.table import format_table
from profiler.memory import measured_activation_bytes, measured_stage_activation_bytes
from runtime.elastic.launch import failure_excerpt, run_local_torchrun

UNDER_PREDICTION_LIMIT = 0.02

# Grouped-query attention (6 query heads, 2 key/value heads), tied embeddings, and an MLP width and
# vocabulary that TP degree 2 splits unevenly (rank 0 holds the larger piece).
GQA_UNEVEN = ModelConfig(
    name="gqa-uneven",
    vocab_size=1001,
    hidden_size=96,
    intermediate_size=250,
    num_blocks=2,
    num_heads=6,
    num_kv_heads=2,
    max_seq_len=256,
    tie_embeddings=True,
)

# (model, layer kind, micro-batch size, seq_len, TP degree, dtype)
COMBOS = [
    *[
        ("gpt-tiny", kind, mbs, 128, tp, "float32")
        for kind in ("embed", "block", "head")
        for mbs, tp in ((1, 1), (4, 1), (2, 2), (2, 3), (4, 6))
    ],
    *[("gpt-tiny", kind, 2, 128, tp, "bfloat16") for kind in ("block", "head") for tp in (1, 3)],
    ("gpt-tiny", "block", 2, 100, 2, "float32"),
    ("gpt-tiny", "head", 3, 100, 1, "float32"),
    *[("gqa-uneven", kind, 2, 64, tp, "float32") for kind in ("embed", "block", "head") for tp in (1, 2)],
    ("gqa-uneven", "block", 2, 64, 2, "bfloat16"),
]

# (model, first layer, end layer, micro-batch size, seq_len, dtype): half-open layer ranges.
STAGES = [
    ("gpt-tiny", 0, 6, 2, 128, "float32"),
    ("gpt-tiny", 1, 4, 4, 128, "float32"),
    ("gpt-tiny", 3, 6, 2, 128, "bfloat16"),
    ("gqa-uneven", 0, 4, 2, 64, "float32"),
    ("gqa-uneven", 1, 4, 1, 64, "bfloat16"),
]


def model(name: str) -> ModelConfig:
    return GQA_UNEVEN if name == GQA_UNEVEN.name else PRESETS[name]


def _plan(model_name, pipelines, *, dtype="float32", micro_batch_size=2, seq_len=48) -> dict:
    """A plan from [(micro-batches, [((start, end), devices, {stage fields}), ...]), ...]."""
    config = model(model_name)
    return {
        "schema_version": 1,
        "model": config.to_json(),
        "global_batch_size": sum(m for m, _ in pipelines) * micro_batch_size,
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "dtype": dtype,
        "pipelines": [
            {
                "num_microbatches": m,
                "stages": [
                    {
                        "layers": [list(c) for c in layers] if isinstance(layers[0], tuple) else list(layers),
                        "devices": devices,
                        **fields,
                    }
                    for layers, devices, fields in stages
                ],
            }
            for m, stages in pipelines
        ],
    }


def _split(plan: dict) -> dict:
    """`plan` with every pipeline's backward split (`costmodel.schedule.split_backward`)."""
    for pipe in plan["pipelines"]:
        pipe["split_backward"] = True
    return plan


SP, FULL, SELECTIVE = {"sequence_parallel": True}, {"recompute": "full"}, {"recompute": "selective"}
# (name, plan): every dtype, SP on and off, each recompute mode, one to three stages, TP 1-3,
# two pipelines, tied embeddings with grouped-query attention.
RUNTIME_PLANS = (
    [
        (f"{name} {dtype}", _plan(m, pipes, dtype=dtype))
        for dtype in ("float32", "bfloat16")
        for name, m, pipes in [
            ("one device", "gpt-tiny", [(3, [((0, 6), ["n0:0"], {})])]),
            ("one device, full", "gpt-tiny", [(3, [((0, 6), ["n0:0"], FULL)])]),
            (
                "2 stages, selective",
                "gpt-tiny",
                [(4, [((0, 3), ["n0:0"], SELECTIVE), ((3, 6), ["n0:1"], SELECTIVE)])],
            ),
            ("TP2", "gpt-tiny", [(3, [((0, 6), ["n0:0", "n0:1"], {})])]),
            ("TP2 SP, full", "gpt-tiny", [(3, [((0, 6), ["n0:0", "n0:1"], {**SP, **FULL})])]),
            (
                "TP1 > TP2 SP full > TP3 SP selective",
                "gpt-tiny",
                [
                    (
                        4,
                        [
                            ((0, 2), ["n0:0"], {}),
                            ((2, 4), ["n0:1", "n0:2"], {**SP, **FULL}),
                            ((4, 6), ["n0:3", "n0:4", "n0:5"], {**SP, **SELECTIVE}),
                        ],
                    )
                ],
            ),
            (
                "2 pipelines TP2 SP + TP1 / TP1 full + TP2",
                "gpt-tiny",
                [
                    (3, [((0, 3), ["n0:0", "n0:1"], SP), ((3, 6), ["n0:2"], {})]),
                    (2, [((0, 2), ["n1:0"], FULL), ((2, 6), ["n1:1", "n1:2"], {})]),
                ],
            ),
            (
                "interleaved 2 stages x 2 chunks, 5 micro-batches",
                "gpt-tiny",
                [(5, [(((0, 2), (3, 5)), ["n0:0"], {}), (((2, 3), (5, 6)), ["n0:1"], {})])],
            ),
            (
                "interleaved TP2 SP (full on chunk 0) > TP1 > TP2 SP, 2 chunks",
                "gpt-tiny",
                [
                    (
                        4,
                        [
                            (((0, 1), (3, 4)), ["n0:0", "n0:1"], {**SP, "recompute": ["full", "none"]}),
                            (((1, 2), (4, 5)), ["n0:2"], {}),
                            (((2, 3), (5, 6)), ["n0:3", "n0:4"], SP),
                        ],
                    )
                ],
            ),
            (
                "tied GQA, TP2 SP full beside a replica",
                "gqa-uneven",
                [(2, [((0, 4), ["n0:0", "n0:1"], {**SP, **FULL})]), (2, [((0, 4), ["n1:0"], {})])],
            ),
        ]
    ]
    + [
        # split backward (ZB-H1): activations live until their W, output gradients held from B to W
        (f"split backward, {name} {dtype}", _split(_plan(m, pipes, dtype=dtype)))
        for dtype in ("float32", "bfloat16")
        for name, m, pipes in [
            (
                "TP1 > TP2 SP full > TP1",
                "gpt-tiny",
                [
                    (
                        5,
                        [
                            ((0, 2), ["n0:0"], {}),
                            ((2, 4), ["n0:1", "n0:2"], {**SP, **FULL}),
                            ((4, 6), ["n0:3"], {}),
                        ],
                    )
                ],
            ),
            (
                "interleaved TP2 SP > TP1 selective, 2 chunks",
                "gpt-tiny",
                [(4, [(((0, 2), (3, 5)), ["n0:0", "n0:1"], SP), (((2, 3), (5, 6)), ["n0:2"], SELECTIVE)])],
            ),
        ]
    ]
    + [
        # the math attention kernel keeps each block's b x H x s x s scores (without recompute, and
        # while a selective recomputation reruns the core)
        (f"math attention, {name} {dtype}", {**_plan("gpt-tiny", pipes, dtype=dtype), "attention": "math"})
        for dtype in ("float32", "bfloat16")
        for name, pipes in [
            ("one device", [(3, [((0, 6), ["n0:0"], {})])]),
            ("TP2 SP, selective", [(3, [((0, 6), ["n0:0", "n0:1"], {**SP, **SELECTIVE})])]),
        ]
    ]
)


def validate_runtime(plans=RUNTIME_PLANS, *, steps: int = 2) -> list[dict]:
    """Train each plan `steps` steps; one row per device with measured and predicted bytes."""
    rows = []
    for name, plan in plans:
        with tempfile.TemporaryDirectory() as tmp:
            plan_path, metrics = Path(tmp) / "plan.json", Path(tmp) / "metrics.jsonl"
            plan_path.write_text(json.dumps(plan))
            nproc = sum(len(st["devices"]) for p in plan["pipelines"] for st in p["stages"])
            args = ["-m", "elastor", "train", "--plan", str(plan_path), "--steps", str(steps)]
            code, out = run_local_torchrun(
                nproc, [*args, "--metrics", str(metrics), "--device", "cpu"], timeout_s=300
            )
            if code != 0:
                raise RuntimeError(f"{name}: elastor train failed:\n{failure_excerpt(out)}")
            event = next(
                r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "memory"
            )
        for device, entry in event["devices"].items():
            rows.append(
                {
                    "plan": name,
                    "device": device,
                    "measured": {k: entry[k] for k in entry["predicted"]},
                    "predicted": entry["predicted"],
                    "measured_bytes": entry["measured_total_bytes"],
                    "predicted_bytes": entry["predicted_total_bytes"],
                    "error": (entry["predicted_total_bytes"] - entry["measured_total_bytes"])
                    / entry["measured_total_bytes"],
                }
            )
    return rows


def _row(**fields) -> dict:
    return {
        **fields,
        "error": (fields["predicted_bytes"] - fields["measured_bytes"]) / fields["measured_bytes"],
    }


def validate(combos=COMBOS) -> list[dict]:
    rows = []
    for name, kind, mbs, seq_len, tp, dtype in combos:
        config = model(name)
        rows.append(
            _row(
                model=name,
                layer=kind,
                micro_batch_size=mbs,
                seq_len=seq_len,
                tp_degree=tp,
                dtype=dtype,
                predicted_bytes=activation_bytes(config, kind, mbs, seq_len, tp, dtype),
                measured_bytes=measured_activation_bytes(config, kind, mbs, seq_len, tp, dtype),
            )
        )
    return rows


def validate_stages(stages=STAGES) -> list[dict]:
    rows = []
    for name, start, end, mbs, seq_len, dtype in stages:
        config = model(name)
        predicted = sum(
            activation_bytes(config, config.layer_kind(i), mbs, seq_len, 1, dtype) for i in range(start, end)
        )
        rows.append(
            _row(
                model=name,
                layers=[start, end],
                micro_batch_size=mbs,
                seq_len=seq_len,
                dtype=dtype,
                predicted_bytes=predicted,
                measured_bytes=measured_stage_activation_bytes(config, start, end, mbs, seq_len, dtype),
            )
        )
    return rows


def _report(title: str, rows: list[dict], describe) -> str:
    table = [(title, "predicted B", "measured B", "error %")]
    table += [
        (describe(r), r["predicted_bytes"], r["measured_bytes"], f"{100 * r['error']:+.2f}") for r in rows
    ]
    return format_table(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/memory_validation.json", help="JSON results")
    args = parser.parse_args()
    started = time.perf_counter()
    runtime = validate_runtime()
    print(
        _report(
            "training step, per device (peak over all kinds)",
            runtime,
            lambda r: f"{r['plan']} {r['device']}",
        )
    )
    print()
    rows, stages = validate(), validate_stages()
    print(
        _report(
            "layer shard",
            rows,
            lambda r: (
                f"{r['model']} {r['layer']} mbs={r['micro_batch_size']} s={r['seq_len']} "
                f"tp={r['tp_degree']} {r['dtype']}"
            ),
        )
    )
    print()
    print(
        _report(
            "stage (sum of layers)",
            stages,
            lambda r: (
                f"{r['model']} layers [{r['layers'][0]},{r['layers'][1]}) mbs={r['micro_batch_size']} "
                f"s={r['seq_len']} {r['dtype']}"
            ),
        )
    )
    every = rows + stages
    under = [r for r in every if r["error"] < -UNDER_PREDICTION_LIMIT]
    worst = max(abs(r["error"]) for r in every)
    runtime_under = [r for r in runtime if r["error"] < 0]
    print(
        f"{len({r['plan'] for r in runtime})} plans on {len(runtime)} devices: {len(runtime_under)} "
        f"under-predicted, error {100 * min(r['error'] for r in runtime):+.1f}% .. "
        f"{100 * max(r['error'] for r in runtime):+.1f}%"
    )
    print(
        f"{len(rows)} layer shards and {len(stages)} stages: {len(under)} under-predicted beyond "
        f"{UNDER_PREDICTION_LIMIT:.0%}, largest |error| {100 * worst:.2f}%, "
        f"in {time.perf_counter() - started:.1f} s"
    )
    write_json(
        args.out,
        {
            "benchmark": "memory_validation",
            "under_prediction_limit": UNDER_PREDICTION_LIMIT,
            "under_predictions": len(under),
            "max_abs_error": worst,
            "runtime_under_predictions": len(runtime_under),
            "runtime": runtime,
            "rows": rows,
            "stages": stages,
        },
    )
    print(f"wrote {args.out}")
    return 1 if under or runtime_under else 0


if __name__ == "__main__":
    sys.exit(main())

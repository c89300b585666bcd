"""Predicted vs measured activation memory per layer shard, on CPU.

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
import sys
import time

from costmodel.analytic import activation_bytes
from costmodel.config import PRESETS, ModelConfig
from costmodel.jsonio import write_json
from costmodel.table import format_table
from profiler.memory import measured_activation_bytes, measured_stage_activation_bytes

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
            "rows": rows,
            "stages": stages,
        },
    )
    print(f"wrote {args.out}")
    return 1 if under else 0


if __name__ == "__main__":
    sys.exit(main())

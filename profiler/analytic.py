"""Analytic profiles for hardware you do not have: the same rows a measurement fills, from formulas.

Torch-free, so `elastor profile --analytic` answers in well under a second even for llama2-70b.
Times are a roofline per kernel (`costmodel.analytic.layer_times_s`): each GEMM, the attention
kernel and the elementwise traffic at the device kind's peak times that kernel's named efficiency
(`costmodel.analytic.KERNEL_EFFICIENCY`, each from a published microbenchmark); no end-to-end
utilisation enters. Activation bytes are the formula the CPU measurement validates
(`costmodel.analytic`, `benchmarks/memory_validation.py`).
"""

import time
from collections.abc import Sequence

from costmodel import analytic
from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.hardware import device_kind as lookup_device_kind
from costmodel.profile import LayerCost, LayerProfile, ModelProfile


def analytic_profile(
    config: ModelConfig,
    *,
    device_kind: str,
    micro_batch_sizes: Sequence[int],
    tp_degrees: Sequence[int],
    seq_len: int,
    dtype: str = "bfloat16",
    attention: str = "fused",
) -> ModelProfile:
    started = time.perf_counter()
    device = lookup_device_kind(device_kind)
    if device.kind != "cpu" and dtype == "float32":
        raise ElastorError(
            f"The {device.kind} peak in the hardware table is for 16-bit tensor-core math; profile "
            "analytically with --dtype bfloat16 or float16."
        )
    costs: dict[str, tuple[LayerCost, ...]] = {}
    for kind in ("embed", "block", "head"):
        rows = []
        for t in tp_degrees:
            for mbs in micro_batch_sizes:
                fwd_s, bwd_s = analytic.layer_times_s(config, kind, mbs, seq_len, t, dtype, device, attention)
                rows.append(
                    LayerCost(
                        micro_batch_size=mbs,
                        tp_degree=t,
                        fwd_s=fwd_s,
                        bwd_s=bwd_s,
                        activation_bytes=analytic.activation_bytes(
                            config, kind, mbs, seq_len, t, dtype, attention=attention
                        ),
                        fwd_flops=analytic.forward_flops(config, kind, mbs, seq_len, t),
                        transient_bytes=analytic.backward_transient_bytes(
                            config, kind, mbs, seq_len, t, dtype, attention
                        ),
                    )
                )
        costs[kind] = tuple(rows)
    layers = tuple(
        LayerProfile(
            name=name,
            param_count=config.layer_param_count(i),
            output_bytes_per_sample=analytic.output_bytes_per_sample(
                config, config.layer_kind(i), seq_len, dtype
            ),
            costs=costs[config.layer_kind(i)],
        )
        for i, name in enumerate(config.layer_names())
    )
    return ModelProfile(
        model=config,
        device_kind=device.kind,
        seq_len=seq_len,
        dtype=dtype,
        source="analytic",
        attention=attention,
        layers=layers,
        method={
            "formulas": "costmodel/analytic.py",
            "kernel_efficiency": analytic.kernel_efficiency(device.kind),
            "attention_backward_flops_factor": analytic.ATTENTION_BACKWARD_FLOPS_FACTOR,
            "elementwise_backward_factor": analytic.ELEMENTWISE_BACKWARD_FACTOR,
            "peak_flops": device.peak_flops,
            "memory_bandwidth_gbps": device.memory_bandwidth_gbps,
            "causal_attention_fraction": analytic.CAUSAL_ATTENTION_FRACTION,
            "wall_s": round(time.perf_counter() - started, 4),
        },
    )

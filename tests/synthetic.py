"""Synthetic profiles for tests of the cost model and the solver: known numbers, no measurement."""

import random

from costmodel import PRESETS, LayerCost, LayerProfile, ModelConfig, ModelProfile


def synthetic_profile(
    config: ModelConfig = PRESETS["gpt-tiny"],
    *,
    seq_len: int = 64,
    micro_batch_sizes: tuple[int, ...] = (1, 2),
    tp_degrees: tuple[int, ...] = (1, 2, 3),
    rng: random.Random | None = None,
    device_kind: str = "cpu",
) -> ModelProfile:
    """Per-layer costs proportional to parameters (or random with `rng`); TP divides time and memory."""
    layers = []
    for i, name in enumerate(config.layer_names()):
        base = config.layer_param_count(i) * 1e-9 if rng is None else rng.uniform(1e-4, 1e-2)
        activation = 4 * seq_len * config.hidden_size * (6 if rng is None else rng.randint(1, 12))
        costs = tuple(
            LayerCost(
                micro_batch_size=b,
                tp_degree=t,
                fwd_s=base * b / t,
                bwd_s=2 * base * b / t,
                activation_bytes=activation * b // t,
            )
            for b in micro_batch_sizes
            for t in tp_degrees
        )
        layers.append(
            LayerProfile(
                name=name,
                param_count=config.layer_param_count(i),
                output_bytes_per_sample=4
                * seq_len
                * (config.vocab_size if i == config.num_layers - 1 else config.hidden_size),
                costs=costs,
            )
        )
    return ModelProfile(
        model=config, device_kind=device_kind, seq_len=seq_len, layers=tuple(layers), source="cpu"
    )

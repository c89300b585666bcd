"""Checkpoint test helpers: random valid plans, a deterministic full state, and each rank's pieces of it."""

import random
import zlib

import torch

from costmodel import PRESETS, ModelConfig, Pipeline, Plan, Stage
from costmodel.layout import Box, device_pieces
from runtime.checkpoint import Piece, Wanted
from runtime.checkpoint.format import OPTIMIZER_PREFIXES

TINY = PRESETS["gpt-tiny"]
KINDS = ("", *OPTIMIZER_PREFIXES)


def random_plan(rng: random.Random, config: ModelConfig = TINY, world_size: int | None = None) -> Plan:
    """A valid plan on 1-6 devices: random pipelines, stage boundaries, TP degrees and nodes."""
    tp_choices = [t for t in range(1, 7) if config.num_heads % t == 0 and config.num_kv_heads % t == 0]
    world = world_size or rng.randint(1, 6)
    while True:
        sizes = _composition(rng, world, range(1, world + 1))
        pipelines, next_gpu = [], {}
        for n in sizes:
            stages = None
            for _ in range(50):
                count = rng.randint(1, min(n, config.num_layers))
                degrees = _composition(rng, n, tp_choices, parts=count)
                if degrees:
                    stages = degrees
                    break
            if stages is None:
                break
            bounds = sorted(rng.sample(range(1, config.num_layers), len(stages) - 1))
            edges = [0, *bounds, config.num_layers]
            built = []
            for i, tp in enumerate(stages):
                node = f"n{rng.randint(0, 2)}"
                gpus = range(next_gpu.get(node, 0), next_gpu.get(node, 0) + tp)
                next_gpu[node] = gpus.stop
                built.append(
                    Stage(layers=(edges[i], edges[i + 1]), devices=tuple(f"{node}:{g}" for g in gpus))
                )
            pipelines.append(Pipeline(num_microbatches=rng.randint(1, 3), stages=tuple(built)))
        else:
            batch = sum(p.num_microbatches for p in pipelines)
            plan = Plan(
                model=config,
                global_batch_size=batch,
                micro_batch_size=1,
                seq_len=16,
                pipelines=tuple(pipelines),
            )
            return plan.validate()


def _composition(rng: random.Random, total: int, allowed, parts: int | None = None) -> list[int] | None:
    """A random list of numbers from `allowed` summing to `total` (with `parts` entries if given)."""
    allowed = list(allowed)
    for _ in range(200):
        out, left = [], total
        while left > 0 and (parts is None or len(out) < parts):
            choices = [a for a in allowed if a <= left]
            out.append(rng.choice(choices))
            left -= out[-1]
        if left == 0 and (parts is None or len(out) == parts):
            return out
    return None


def full_tensor(name: str, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """A deterministic full tensor per (name, salt), with random bits in every element."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * salt)
    return torch.randn(shape, generator=generator)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


def rank_pieces(plan: Plan, rank: int, salt: int = 0, optimizer: bool = True) -> list[Piece]:
    """Rank `rank`'s training state: its boxes of every full tensor, parameters and AdamW moments."""
    kinds = KINDS if optimizer else ("",)
    return [
        Piece(
            kind + spec.name,
            spec.shape,
            box.offsets,
            full_tensor(kind + spec.name, spec.shape, salt)[_slices(box)].clone(),
        )
        for spec, box in device_pieces(plan, plan.devices[rank])
        for kind in kinds
    ]


def expected(wanted: list[Wanted], salt: int = 0) -> list[torch.Tensor]:
    return [full_tensor(w.name, w.shape, salt)[_slices(Box(w.offsets, w.sizes))] for w in wanted]

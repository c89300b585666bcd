"""Checkpoint test helpers: random valid plans, a deterministic full state, and each rank's pieces of it."""

import functools
import itertools
import multiprocessing
import os
import random
import signal
import time
import zlib
from pathlib import Path

import torch

from costmodel import PRESETS, ModelConfig, Pipeline, Plan, Stage
from costmodel.layout import Box
from costmodel.plan import BUCKET_BYTES, SHARDING, OptimizerLayout
from costmodel.sharding import state_boxes
from runtime.checkpoint import Piece, Wanted
from runtime.checkpoint.format import OPTIMIZER_PREFIXES
from solver.interleave import chunk_ranges

TINY = PRESETS["gpt-tiny"]
KINDS = ("", *OPTIMIZER_PREFIXES)


def random_plan(rng: random.Random, config: ModelConfig = TINY, world_size: int | None = None) -> Plan:
    """A valid plan on 1-6 devices: random pipelines, stage boundaries (some interleaved, two layer
    chunks per stage), TP degrees and nodes."""
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
            chunks = [((edges[i], edges[i + 1]),) for i in range(len(stages))]
            counts = [b - a for a, b in itertools.pairwise(edges)]
            if len(stages) > 1 and min(counts) >= 2 and rng.random() < 0.7:  # interleaved, 2 chunks
                chunks = chunk_ranges(
                    tuple((a, b, tp) for (a, b), tp in zip(itertools.pairwise(edges), stages, strict=True)), 2
                )
            built = []
            for i, tp in enumerate(stages):
                node = f"n{rng.randint(0, 2)}"
                gpus = range(next_gpu.get(node, 0), next_gpu.get(node, 0) + tp)
                next_gpu[node] = gpus.stop
                built.append(Stage(chunks=chunks[i], devices=tuple(f"{node}:{g}" for g in gpus)))
            pipelines.append(Pipeline(num_microbatches=rng.randint(1, 3), stages=tuple(built)))
        else:
            batch = sum(p.num_microbatches for p in pipelines)
            # Optimizer state on every holder or sharded (ZeRO-1), in buckets of various sizes.
            optimizer = OptimizerLayout(rng.choice(SHARDING), rng.choice([BUCKET_BYTES, 4096, 1000]))
            plan = Plan(
                optimizer=optimizer,
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


@functools.lru_cache(maxsize=4096)
def full_tensor(name: str, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """A deterministic full tensor per (name, salt), with random bits in every element (cached: read-only)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * salt)
    return torch.randn(shape, generator=generator)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


def rank_pieces(plan: Plan, rank: int, salt: int = 0, optimizer: bool = True) -> list[Piece]:
    """Rank `rank`'s training state: the boxes it keeps (`costmodel.sharding.state_boxes`: under
    ZeRO-1 only its slices) of every full tensor, parameters and AdamW moments."""
    kinds = KINDS if optimizer else ("",)
    return [
        Piece(
            kind + spec.name,
            spec.shape,
            box.offsets,
            full_tensor(kind + spec.name, spec.shape, salt)[_slices(box)].clone(),
        )
        for spec, box in state_boxes(plan)[plan.devices[rank]]
        for kind in kinds
    ]


def expected(wanted: list[Wanted], salt: int = 0) -> list[torch.Tensor]:
    return [full_tensor(w.name, w.shape, salt)[_slices(Box(w.offsets, w.sizes))] for w in wanted]


def save_in_process(directory, plan: Plan, step: int, salt: int, **options) -> None:
    """Save under `plan`, simulating its ranks in this process (each saves from its own thread)."""
    from runtime.checkpoint import Checkpointer

    checkpointers = [
        Checkpointer(directory, plan, r, session="00000000cafe", **options) for r in range(plan.world_size)
    ]
    for rank, checkpointer in enumerate(checkpointers):
        checkpointer.save(step, rank_pieces(plan, rank, salt=salt), {"step": step, "salt": salt})
    for checkpointer in checkpointers:
        checkpointer.wait()


# ---- processes ----------------------------------------------------------------------------------
def run_processes(
    target, args_per_rank: list[tuple], *, context: str = "spawn", timeout: float = 120.0
) -> list:
    """Run `target(*args)` in one process per entry; returns their exit codes. Kills them all (by pid)
    on timeout or when the caller is interrupted."""
    ctx = multiprocessing.get_context(context)
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_rank]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()


def gloo_reshard_worker(
    rank: int, world: int, port: int, directory: str, pairs: list[tuple[dict, dict]]
) -> None:
    """One rank of a real multi-process run: for each plan pair, save under A (the ranks A has, with
    the session broadcast over their gloo group), then load under B and compare bit for bit."""
    import torch.distributed as dist

    from runtime.checkpoint import Checkpointer, load_checkpoint, wanted_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for i, (a_json, b_json) in enumerate(pairs):
            a, b = Plan.from_json(a_json), Plan.from_json(b_json)
            group = dist.new_group(list(range(a.world_size)))
            target = f"{directory}/pair{i}"
            if rank < a.world_size:
                checkpointer = Checkpointer(
                    target, a, rank, group=group, chunk_bytes=4096, piece_bytes=1 << 16
                )
                checkpointer.save(7, rank_pieces(a, rank, salt=i), {"step": 7, "pair": i})
                checkpointer.wait()
            dist.barrier()
            if rank < b.world_size:
                wanted = wanted_for(b, rank)
                tensors, meta = load_checkpoint(target, wanted, model=b.model)
                assert meta == {"step": 7, "pair": i}
                for got, want, w in zip(tensors, expected(wanted, salt=i), wanted, strict=True):
                    assert torch.equal(got, want), (
                        f"pair {i}: {w.name} at {w.offsets} differs after resharding"
                    )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def crash_worker(rank: int, plan_json: dict, directory: str, session: str, first_step: int, log: str) -> None:
    """Save steps first_step, first_step + 1, ... back to back until killed; rank 0 logs each commit.
    `log`-ready-<rank> appears once the worker is about to save its first step."""
    from runtime.checkpoint import Checkpointer

    torch.set_num_threads(1)
    plan = Plan.from_json(plan_json)
    checkpointer = Checkpointer(
        directory, plan, rank, keep=2, session=session, chunk_bytes=4096, piece_bytes=1 << 16
    )
    Path(f"{log}-ready-{rank}").touch()
    step = first_step
    while True:
        checkpointer.save(step, rank_pieces(plan, rank, salt=step), {"step": step})
        if checkpointer.wait() is not None:
            with open(log, "a") as f:
                f.write(f"{step}\n")
        step += 1

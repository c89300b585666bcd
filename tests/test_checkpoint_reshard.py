"""Save under plan A, load under plan B: bit-identical parameters and AdamW moments, for any A and B.

Most pairs simulate A's ranks in this process (each rank's Checkpointer saves from its own background
thread, rank 0 commits when all fragments are in: the same code path as separate processes); one
launch runs real gloo processes for a few pairs.
"""

import random
from collections import Counter
from itertools import pairwise

import pytest
import torch
from checkpoint_support import (
    TINY,
    expected,
    gloo_reshard_worker,
    random_plan,
    run_processes,
    save_in_process,
)

from costmodel import PRESETS, Pipeline, Plan, Stage
from runtime.checkpoint import CheckpointReader, load_checkpoint, wanted_for
from runtime.checkpoint.assign import assign_writers, holdings
from runtime.elastic.launch import free_port

PAIRS = 60
KINDS_FP32 = {"": 4, "optim.exp_avg.": 4, "optim.exp_avg_sq.": 4}


@pytest.mark.slow  # minutes; the default suite reshards through real processes and every writer below
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_random_plan_pairs_reshard_bit_identically(tmp_path, chunk):
    """PAIRS random (A, B) pairs in three groups, each with different chunk and piece sizes."""
    rng = random.Random(1000 + chunk)
    chunk_bytes, piece_bytes = [(1 << 20, 32 << 20), (4096, 1 << 16), (512, 8192)][chunk]
    worlds, shardings, schedules = Counter(), Counter(), Counter()
    for i in range(PAIRS // 3):
        a, b = random_plan(rng), random_plan(rng)
        worlds[(a.world_size, b.world_size)] += 1
        shardings[(a.optimizer.sharding, b.optimizer.sharding)] += 1
        schedules[(_interleaved(a), _interleaved(b))] += 1
        directory = tmp_path / f"pair{i}"
        save_in_process(directory, a, step=i, salt=i, chunk_bytes=chunk_bytes, piece_bytes=piece_bytes)
        for rank in range(b.world_size):
            wanted = wanted_for(b, rank)
            tensors, meta = load_checkpoint(directory, wanted, model=b.model)
            assert meta == {"step": i, "salt": i}
            for got, want, w in zip(tensors, expected(wanted, salt=i), wanted, strict=True):
                assert torch.equal(got, want), f"{a.summary()}\n->\n{b.summary()}\n{w.name} at {w.offsets}"
    assert len({w for pair in worlds for w in pair}) >= 4, "the random plans should span world sizes"
    assert shardings[("zero1", "none")] + shardings[("none", "zero1")] >= 6, shardings  # mixed pairs
    assert schedules[(True, False)] + schedules[(False, True)] >= 2, schedules  # interleaved <-> 1F1B


def _interleaved(plan) -> bool:
    return any(p.num_chunks > 1 for p in plan.pipelines)


def test_random_plans_cover_the_plan_space():
    rng = random.Random(1000)
    plans = [random_plan(rng) for _ in range(2 * PAIRS)]
    assert {p.world_size for p in plans} == set(range(1, 7))
    assert {len(p.pipelines) for p in plans} >= {1, 2, 3}
    assert {s.tp_degree for p in plans for q in p.pipelines for s in q.stages} >= {1, 2, 3}
    assert len({tuple(s.chunks for s in q.stages) for p in plans for q in p.pipelines}) > 10
    assert sum(_interleaved(p) for p in plans) >= 10


def test_real_processes_reshard_over_gloo(tmp_path):
    rng = random.Random(7)
    pairs = [(random_plan(rng, world_size=4), random_plan(rng, world_size=w)) for w in (3, 2)]
    pairs.append((random_plan(rng, world_size=3), random_plan(rng, world_size=4)))
    pairs = [(a.to_json(), b.to_json()) for a, b in pairs]
    port = free_port()
    codes = run_processes(
        gloo_reshard_worker, [(r, 4, port, str(tmp_path), pairs) for r in range(4)], timeout=150
    )
    assert codes == [0, 0, 0, 0]


def test_every_piece_is_written_once_by_one_of_its_holders():
    rng = random.Random(3)
    for _ in range(30):
        plan = random_plan(rng)
        held = holdings(plan)
        kept: dict[tuple[str, int], list] = {}  # (parameter, rank) -> the boxes it keeps
        for name, (_, holders) in held.items():
            for rank, box in holders:
                kept.setdefault((name, rank), []).append(box)
        items = assign_writers(plan, KINDS_FP32, piece_bytes=4096)
        by_name: dict[str, list] = {}
        for item in items:
            by_name.setdefault(item.name, []).append(item)
            param = item.name.removeprefix("optim.exp_avg.").removeprefix("optim.exp_avg_sq.")
            d = item.split_dim
            assert any(  # the writer keeps all of the piece
                box.offsets[d] <= item.start and item.stop <= box.offsets[d] + box.sizes[d]
                for box in kept.get((param, item.writer), ())
            ), item
        assert len(by_name) == 3 * len(held)
        for name, parts in by_name.items():
            parts.sort(key=lambda i: i.start)
            assert parts[0].start == 0 and parts[-1].stop == parts[0].shape[parts[0].split_dim], name
            assert all(p.stop == q.start for p, q in pairwise(parts)), name
        assert assign_writers(plan, KINDS_FP32, 4096) == items, "the assignment must be deterministic"


def test_replicated_state_is_written_in_parallel_with_balanced_bytes():
    """gpt-small on 4 data-parallel replicas, and on two TP=2 replicas: every rank writes ~1/4."""
    small = PRESETS["gpt-small"]
    for stages in (
        [Stage(chunks=((0, small.num_layers),), devices=(f"n0:{g}",)) for g in range(4)],
        [Stage(chunks=((0, small.num_layers),), devices=(f"n0:{g}", f"n0:{g + 1}")) for g in (0, 2)],
    ):
        pipelines = tuple(Pipeline(num_microbatches=1, stages=(s,)) for s in stages)
        plan = Plan(
            model=small, global_batch_size=len(stages), micro_batch_size=1, seq_len=64, pipelines=pipelines
        )
        written = Counter()
        for item in assign_writers(plan, KINDS_FP32, piece_bytes=32 << 20):
            written[item.writer] += item.nbytes
        assert sum(written.values()) == 12 * small.param_count
        assert max(written.values()) / min(written.values()) < 1.05, written


def test_a_load_reads_only_the_bytes_its_boxes_need(tmp_path):
    """One replica saved whole; a TP=3 rank reads its third of each split tensor plus at most two
    partial checksum chunks per run, never whole pieces."""
    chunk = 4096
    one = Plan(
        model=TINY,
        global_batch_size=1,
        micro_batch_size=1,
        seq_len=16,
        pipelines=(Pipeline(num_microbatches=1, stages=(Stage(chunks=((0, 6),), devices=("n0:0",)),)),),
    )
    three = Plan(
        model=TINY,
        global_batch_size=1,
        micro_batch_size=1,
        seq_len=16,
        pipelines=(
            Pipeline(num_microbatches=1, stages=(Stage(chunks=((0, 6),), devices=("n0:0", "n0:1", "n0:2")),)),
        ),
    )
    save_in_process(tmp_path, one, step=1, salt=0, chunk_bytes=chunk, piece_bytes=1 << 20)
    for rank in range(3):
        wanted = wanted_for(three, rank)
        with CheckpointReader(tmp_path, TINY) as reader:
            tensors = [reader.read(w) for w in wanted]
            needed = sum(t.numel() * t.element_size() for t in tensors)
            runs = len(wanted)  # one piece per tensor here, so one byte run per wanted box
            assert needed <= reader.bytes_read <= needed + 2 * chunk * runs
            assert reader.bytes_read < 0.5 * sum(reader.entry(w.name).nbytes for w in wanted)
        for got, want in zip(tensors, expected(wanted), strict=True):
            assert torch.equal(got, want)

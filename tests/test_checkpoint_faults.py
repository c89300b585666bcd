"""Corruption, truncation, another model's checkpoint, and the save protocol's guarantees."""

import dataclasses
import random
import shutil

import pytest
import torch
from checkpoint_support import TINY, expected, random_plan, rank_pieces, save_in_process
from helpers import run_elastor

from runtime.checkpoint import Checkpointer, CheckpointError, latest_checkpoint, load_checkpoint, wanted_for
from runtime.checkpoint.format import LATEST, MANIFEST
from runtime.checkpoint.store import committed
from runtime.checkpoint.verify import verify_checkpoint

FAULTS = 24


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One checkpoint saved by 3 ranks, small checksum chunks."""
    rng = random.Random(5)
    plan = random_plan(rng, world_size=3)
    directory = tmp_path_factory.mktemp("pristine")
    save_in_process(directory, plan, step=3, salt=3, chunk_bytes=4096, piece_bytes=1 << 16)
    return latest_checkpoint(directory)


def load_everything(path, rng) -> None:
    """Load the whole state under a random plan: every byte of the checkpoint is read by some rank."""
    b = random_plan(rng)
    for rank in range(b.world_size):
        load_checkpoint(path, wanted_for(b, rank), model=TINY)


def inject(path, rng) -> str:
    """One random fault in a copy of a checkpoint; returns the damaged file's name."""
    files = sorted(p.name for p in path.iterdir())
    name = rng.choice(files)
    target = path / name
    data = bytearray(target.read_bytes())
    if rng.random() < 0.6:
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)) :]
    target.write_bytes(bytes(data))
    return name


def test_every_injected_fault_is_detected_by_verify_and_by_load(pristine, tmp_path):
    rng = random.Random(11)
    damaged = set()
    for i in range(FAULTS):
        copy = tmp_path / f"fault{i}" / pristine.name
        shutil.copytree(pristine, copy)
        name = inject(copy, rng)
        damaged.add(name)
        report = verify_checkpoint(copy)
        assert report.problems and name in report.problems[0], (name, report.problems)
        assert all(p.endswith(".") and p.count(". ") == 0 for p in report.problems)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load_everything(copy, rng)
    assert MANIFEST in damaged and len(damaged) >= 3, "faults should hit the manifest and the data files"
    assert not verify_checkpoint(pristine).problems


def test_cli_verify_names_the_bad_file_and_exits_non_zero(pristine, tmp_path):
    copy = tmp_path / pristine.name
    shutil.copytree(pristine, copy)
    ok = run_elastor("ckpt", "verify", str(copy))
    assert ok.returncode == 0 and "every CRC32C matches" in ok.stdout
    victim = sorted(copy.glob("data-*.bin"))[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    bad = run_elastor("ckpt", "verify", str(copy))
    assert bad.returncode == 2
    assert victim.name in bad.stderr and "corrupt" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_inspect_and_errors(pristine, tmp_path):
    shown = run_elastor("ckpt", "inspect", str(pristine.parent))
    assert shown.returncode == 0, shown.stderr
    for text in (
        "step 3",
        "gpt-tiny",
        "saved under",
        "optim.exp_avg_sq.head.output.weight",
        "data-00000.bin",
    ):
        assert text in shown.stdout
    missing = run_elastor("ckpt", "inspect", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    empty = run_elastor("ckpt", "verify", str(tmp_path))
    assert empty.returncode == 2 and "no complete checkpoint" in empty.stderr


def test_a_checkpoint_of_another_model_is_refused(pristine):
    other = dataclasses.replace(TINY, rope_theta=500000.0)
    b = random_plan(random.Random(1), world_size=1)
    with pytest.raises(
        CheckpointError, match=r"differs from 'gpt-tiny' in rope_theta 10000.0 \(expected 500000.0\)"
    ):
        load_checkpoint(pristine, wanted_for(b, 0), model=other)
    wider = dataclasses.replace(TINY, name="gpt-tiny-wide", hidden_size=192)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(pristine, [], model=wider)


def test_save_snapshots_then_returns_and_keeps_the_last_k(tmp_path):
    plan = random_plan(random.Random(2), world_size=1)
    checkpointer = Checkpointer(tmp_path, plan, 0, keep=2)
    for step in (1, 2, 3):
        pieces = rank_pieces(plan, 0, salt=step)
        checkpointer.save(step, pieces, {"step": step})
        for piece in pieces:  # training goes on: the save must hold the values at save()
            piece.tensor.add_(1.0)
    checkpointer.wait()
    assert [p.name for p in committed(tmp_path)] == ["step-00000002", "step-00000003"]
    assert (tmp_path / LATEST).read_text().strip() == "step-00000003"
    wanted = wanted_for(plan, 0)
    tensors, _ = checkpointer.load(wanted)
    assert all(torch.equal(g, w) for g, w in zip(tensors, expected(wanted, salt=3), strict=True))
    checkpointer.save(3, rank_pieces(plan, 0, salt=4), {"step": 3})
    assert checkpointer.wait().name == "step-00000003-1", "a repeated step gets a new name, never overwrites"
    tensors, _ = checkpointer.load(wanted)
    assert all(torch.equal(g, w) for g, w in zip(tensors, expected(wanted, salt=4), strict=True))


def test_restore_fills_pieces_in_place(tmp_path):
    rng = random.Random(4)
    a, b = random_plan(rng, world_size=2), random_plan(rng, world_size=3)
    save_in_process(tmp_path, a, step=9, salt=9)
    for rank in range(b.world_size):
        pieces = rank_pieces(b, rank, salt=0)
        meta = Checkpointer(tmp_path, b, rank, session="00000000000a").restore(pieces)
        assert meta["step"] == 9
        for piece, want in zip(pieces, expected(wanted_for(b, rank), salt=9), strict=True):
            assert torch.equal(piece.tensor, want)


def test_a_missing_rank_fails_the_save_without_committing(tmp_path):
    plan = random_plan(random.Random(8), world_size=2)
    rank0 = Checkpointer(tmp_path, plan, 0, session="00000000000b", commit_timeout_s=0.3)
    rank0.save(1, rank_pieces(plan, 0), {})
    with pytest.raises(CheckpointError, match=r"Rank\(s\) 1 did not finish writing step 1"):
        rank0.wait()
    assert latest_checkpoint(tmp_path) is None


def test_ranks_that_save_different_kinds_of_state_fail_the_commit(tmp_path):
    plan = random_plan(random.Random(9), world_size=2)
    ranks = [Checkpointer(tmp_path, plan, r, session="00000000000b") for r in range(2)]
    ranks[1].save(1, rank_pieces(plan, 1, optimizer=False), {})
    ranks[0].save(1, rank_pieces(plan, 0), {})
    ranks[1].wait()
    with pytest.raises(CheckpointError, match="nothing was committed"):
        ranks[0].wait()
    assert latest_checkpoint(tmp_path) is None


def test_bad_pieces_and_metadata_are_refused_at_save(tmp_path):
    plan = random_plan(random.Random(10), world_size=1)
    checkpointer = Checkpointer(tmp_path, plan, 0)
    pieces = rank_pieces(plan, 0)
    with pytest.raises(CheckpointError, match="JSON"):
        checkpointer.save(1, pieces, {"rng": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="not part of model"):
        checkpointer.save(
            1, [*pieces, ("blocks.9.attn.wq.weight", (96, 96), (0, 0), torch.zeros(96, 96))], {}
        )
    with pytest.raises(CheckpointError, match="holds no piece"):
        checkpointer.save(1, pieces[3:], {})

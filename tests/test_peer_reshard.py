"""Resharding from the survivors' memory (runtime/elastic/peers.py): which survivor sends which rows,
and the point-to-point exchange that moves them.

The plan of transfers is checked on random plan pairs against a brute force over rows: every row a
rank of the new plan keeps arrives exactly once per state kind (master, both moments), from a
survivor that holds it, from the rank itself where it holds it, and a row is listed missing exactly
when no survivor holds it. Replaying the transfers on the pieces of a deterministic full state gives
every new rank exactly its boxes. Then three gloo processes, the survivors of a four-device plan
that lost one device, run the exchange and end with the new plan's state, bit for bit.
"""

import dataclasses
import json
import multiprocessing
import os
import random

import pytest
import torch
from checkpoint_support import KINDS, TINY, full_tensor, random_plan, rank_pieces

from costmodel import Pipeline, Plan, Stage
from costmodel.plan import OptimizerLayout
from costmodel.sharding import state_boxes
from runtime.checkpoint import Piece
from runtime.elastic.launch import free_port
from runtime.elastic.peers import Pieces, plan_transfers, split_dim


def _renamed(plan: Plan, devices: list[str]) -> Plan:
    """`plan` with its devices (in rank order) renamed to `devices`."""
    name = dict(zip(plan.devices, devices, strict=True))
    pipelines = tuple(
        dataclasses.replace(
            p,
            stages=tuple(dataclasses.replace(s, devices=tuple(name[d] for d in s.devices)) for s in p.stages),
        )
        for p in plan.pipelines
    )
    return dataclasses.replace(plan, pipelines=pipelines)


def _kept_rows(plan: Plan, device: str) -> dict[str, set[int]]:
    rows: dict[str, set[int]] = {}
    for spec, box in state_boxes(plan)[device]:
        d = split_dim(spec)
        rows.setdefault(spec.name, set()).update(range(box.offsets[d], box.offsets[d] + box.sizes[d]))
    return rows


def _empty_pieces(plan: Plan, device: str) -> list[Piece]:
    return [
        Piece(kind + spec.name, spec.shape, box.offsets, torch.full(box.sizes, float("nan")))
        for spec, box in state_boxes(plan)[device]
        for kind in KINDS
    ]


def _expected(piece: Piece) -> torch.Tensor:
    box = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.tensor.shape, strict=True))
    return full_tensor(piece.name, piece.shape)[box]


def _case(seed: int) -> tuple[Plan, Plan, list[str]]:
    rng = random.Random(seed)
    old = random_plan(rng, world_size=rng.randint(2, 6))
    lost = set(rng.sample(old.devices, rng.randint(1, len(old.devices) - 1)))
    survivors = [d for d in old.devices if d not in lost]
    new = _renamed(random_plan(rng, world_size=len(survivors)), survivors)
    return old, new, survivors


def _seeds(count: int, default: int) -> list:
    """`count` seeds, those past the first `default` -m slow (make test's time budget)."""
    return [pytest.param(s, marks=pytest.mark.slow) if s >= default else s for s in range(count)]


@pytest.mark.parametrize("seed", _seeds(60, 6))
def test_every_kept_row_arrives_once_from_a_survivor_that_holds_it(seed):
    old, new, survivors = _case(seed)
    transfers = plan_transfers(old, new, survivors)
    held = {d: _kept_rows(old, d) for d in survivors}
    for target in new.devices:
        mine = held.get(target, {})
        for name, rows in _kept_rows(new, target).items():
            arrived = {kind: [] for kind in KINDS}
            for move in transfers.moves:
                base = move.rows.name.removeprefix("optim.exp_avg_sq.").removeprefix("optim.exp_avg.")
                if move.target == target and base == name:
                    span = range(move.rows.start, move.rows.stop)
                    assert set(span) <= held[move.source].get(name, set()), move  # the source holds them
                    if set(span) <= mine.get(name, set()):
                        assert move.local, move  # what a rank holds itself is copied, not sent
                    arrived[move.rows.name[: len(move.rows.name) - len(name)]] += list(span)
            lost = [
                r
                for t, m in transfers.missing
                if t == target and m.name == name
                for r in range(m.start, m.stop)
            ]
            holders = set().union(*(h.get(name, set()) for h in held.values()))
            assert set(lost) == rows - holders  # missing exactly where no survivor holds the row
            for kind, got in arrived.items():
                assert sorted(got + lost) == sorted(rows), (kind, name)


def _complete_case(seed: int):
    """The first case from `seed` on whose survivors hold every row the new plan keeps (no lost
    ZeRO-1 slice, no row the lost devices alone held): those the storage checkpoint completes."""
    for k in range(1000):
        old, new, survivors = _case(seed * 1000 + k)
        transfers = plan_transfers(old, new, survivors)
        if transfers.complete:
            return old, new, survivors, transfers
    raise AssertionError("no complete case")


@pytest.mark.parametrize("seed", _seeds(20, 2))
def test_replaying_the_transfers_builds_every_new_rank_state(seed):
    old, new, survivors, transfers = _complete_case(seed)
    held = {d: Pieces(rank_pieces(old, old.devices.index(d))) for d in survivors}
    for target in new.devices:
        pieces = _empty_pieces(new, target)
        wanted = Pieces(pieces)
        for move in transfers.moves:
            if move.target == target:
                wanted.rows(move.rows).copy_(held[move.source].rows(move.rows))
        for piece in pieces:
            assert torch.equal(piece.tensor, _expected(piece)), piece.name


def _two_replicas(sharding: str) -> Plan:
    """Two pipelines of gpt-tiny: a TP2 stage then a TP1 stage on n0, one whole-model stage on n1."""
    stages = (Stage(chunks=((0, 3),), devices=("n0:0", "n0:1")), Stage(chunks=((3, 6),), devices=("n0:2",)))
    return Plan(
        model=TINY,
        global_batch_size=4,
        micro_batch_size=1,
        seq_len=16,
        optimizer=OptimizerLayout(sharding),
        pipelines=(
            Pipeline(num_microbatches=2, stages=stages),
            Pipeline(num_microbatches=2, stages=(Stage(chunks=((0, 6),), devices=("n1:0",)),)),
        ),
    ).validate()


def test_data_parallel_replicas_cover_a_lost_device_and_zero1_slices_do_not():
    survivors = ["n0:0", "n0:1", "n1:0"]  # n0:2 is lost
    new = _renamed(
        Plan(
            model=TINY,
            global_batch_size=4,
            micro_batch_size=1,
            seq_len=16,
            pipelines=(
                Pipeline(
                    num_microbatches=4, stages=(Stage(chunks=((0, 6),), devices=("a:0", "a:1", "a:2")),)
                ),
            ),
        ),
        survivors,
    )
    whole = plan_transfers(_two_replicas("none"), new, survivors)
    assert whole.complete and whole.sent_bytes() > 0
    sharded = plan_transfers(_two_replicas("zero1"), new, survivors)
    assert not sharded.complete  # n0:2's ZeRO-1 slices were kept nowhere else
    lost = _kept_rows(_two_replicas("zero1"), "n0:2")
    for _, rows in sharded.missing:
        assert set(range(rows.start, rows.stop)) <= lost.get(rows.name, set()), rows
    # fetch_state refuses before any message (no process group is needed to find out)
    from runtime.elastic.peers import MissingRows, fetch_state

    with pytest.raises(MissingRows, match="held by no survivor"):
        fetch_state([], _two_replicas("zero1"), new, survivors, "n0:0", rank_of={})


def _survivor(rank: int, port: int, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=3)
        old = _two_replicas("none")
        survivors = ["n0:0", "n0:1", "n1:0"]
        new = _renamed(random_plan(random.Random(5), world_size=3), survivors)
        me = survivors[rank]
        transfers = plan_transfers(old, new, survivors)
        assert transfers.complete
        pieces = _empty_pieces(new, me)
        from runtime.elastic.peers import exchange

        received = exchange(
            transfers,
            me,
            Pieces(rank_pieces(old, old.devices.index(me))),
            Pieces(pieces),
            rank_of={d: i for i, d in enumerate(survivors)},
            round_bytes=64 << 10,  # several rounds
        )
        assert received == sum(m.rows.numel * 4 for m in transfers.moves if m.target == me and not m.local)
        for piece in pieces:
            assert torch.equal(piece.tensor, _expected(piece)), piece.name
        torch.distributed.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}: {e!r}")
        raise


@pytest.mark.slow  # make test's budget: the re-plan test below exchanges over gloo too
def test_three_survivors_exchange_the_new_plan_state_over_gloo():
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    procs = [context.Process(target=_survivor, args=(r, port, errors)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not alive and not failures and all(p.exitcode == 0 for p in procs), failures


# the phase of step 5 the lost process dies in -> the step the survivors' state is at
PHASES = {"boundary": 4, "forward": 4, "reduction": 4, "optimizer": 5}


@pytest.mark.parametrize(
    "phase", [p if p == "reduction" else pytest.param(p, marks=pytest.mark.slow) for p in PHASES]
)
def test_survivors_replan_in_process_and_train_on_as_one_process(phase, tmp_path):
    """Four processes train two replicas (TP2 > TP1 on one node, the whole model on another); the TP1
    device's process dies after step 4 or inside step 5 (in its pipeline schedule, its gradient
    reduction, or just before its optimizer step, after the step's all-reduce). The three survivors
    notice (a collective with it fails), agree on the step their state is at, and go on in the same
    processes under a plan of two replicas (TP2, and the other node's), their state fetched from each
    other's memory with no checkpoint; the step in flight is redone. The steps after and the final
    weights equal one uninterrupted process."""
    from dist_helpers import plan_json, run_worker
    from test_runtime_parity import STEPS, check_parity

    model = TINY.to_json()
    before = plan_json(
        model, [(2, [((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2"])]), (2, [((0, 6), ["n1:0"])])]
    )
    after = plan_json(model, [(2, [((0, 6), ["n0:0", "n0:1"])]), (2, [((0, 6), ["n1:0"])])])
    (tmp_path / "after.json").write_text(json.dumps(after))
    extra = [
        "--replan",
        str(tmp_path / "after.json"),
        "--replan-after",
        "4",
        "--lose",
        "n0:2",
        "--lose-in",
        phase,
    ]
    # A survivor blocked in a collective whose other members are survivors that have left for the
    # new group (not the lost process itself) is freed by the group's timeout: gloo has no abort
    # that closes its connections (runtime.distributed.leave_job), so keep it short here.
    extra += ["--timeout-s", "5"]
    result = run_worker(before, tmp_path, steps=STEPS, extra=extra, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    if phase != "boundary":
        noticed = [int(f.read_text()) for f in tmp_path.glob("noticed*")]
        assert sorted(noticed) == [PHASES[phase]] * 3, noticed  # every survivor, on one step
    check_parity(after, tmp_path, first_step=PHASES[phase])
    phases = [json.loads((tmp_path / f"replan{r}.json").read_text()) for r in range(3)]
    assert sum(p["received_bytes"] for p in phases) > 0  # n0:0 and n0:1 took blocks 3-5 from n1:0
    assert not list(tmp_path.glob("**/step-*"))  # no checkpoint anywhere


# ---- peer snapshots (runtime/elastic/snapshots.py) ------------------------------------------------


def test_each_device_has_one_buddy_and_one_ward_on_another_node_where_the_ring_allows():
    from runtime.elastic.snapshots import buddies

    plan = _two_replicas("zero1")  # n0 holds three devices, n1 one
    ring = buddies(plan)
    assert sorted(ring) == sorted(plan.devices) and sorted(ring.values()) == sorted(plan.devices)
    assert all(keeper != device for device, keeper in ring.items())
    assert ring["n0:0"] == "n1:0" and ring["n1:0"] == "n0:1"  # interleaved by node: n0:0 n1:0 n0:1 n0:2
    even = _renamed(_two_replicas("zero1"), ["a:0", "a:1", "b:0", "b:1"])
    assert all(d.split(":")[0] != k.split(":")[0] for d, k in buddies(even).items())


def test_a_lost_zero1_slice_is_covered_by_its_keepers_snapshot_and_only_by_it():
    from runtime.elastic.snapshots import buddies, needed

    survivors = ["n0:0", "n0:1", "n1:0"]  # n0:2 is lost
    old = _two_replicas("zero1")
    assert needed(old) and not needed(_two_replicas("none"))
    new = _renamed(random_plan(random.Random(5), world_size=3), survivors)
    keeper = buddies(old)["n0:2"]
    covered = plan_transfers(old, new, survivors, stand_ins={"n0:2": keeper})
    assert covered.complete
    lost, own = _kept_rows(old, "n0:2"), _kept_rows(old, keeper)
    # what the keeper sends beyond its own rows are the lost device's rows (from its copy)
    from_copy = [
        m
        for m in covered.moves
        if m.source == keeper
        and not set(range(m.rows.start, m.rows.stop)) <= own.get(_base(m.rows.name), set())
    ]
    assert from_copy and all(
        set(range(m.rows.start, m.rows.stop)) <= lost[_base(m.rows.name)] for m in from_copy
    )
    # a stand-in that is not a survivor covers nothing
    assert not plan_transfers(old, new, survivors, stand_ins={"n0:2": "n0:2"}).complete


def _base(name: str) -> str:
    for prefix in KINDS:
        if prefix and name.startswith(prefix):
            return name[len(prefix) :]
    return name


def test_the_rollback_step_is_the_newest_every_survivor_and_every_lost_copy_holds():
    from runtime.elastic.snapshots import buddies, rollback_step

    plan = _two_replicas("zero1")
    order = ["n0:0", "n0:1", "n1:0"]  # n0:2 lost; its copy is kept by n0:0 (the ring wraps)
    assert buddies(plan)["n0:2"] == "n0:0"
    # [agreed step, pending step, pending's ward copy arrived]
    assert rollback_step(plan, order, [[6, 9, 1], [6, 9, 1], [6, 9, 0]], ["n0:2"]) == 9
    assert rollback_step(plan, order, [[6, 9, 0], [6, 9, 1], [6, 9, 1]], ["n0:2"]) == 6  # not arrived
    assert rollback_step(plan, order, [[6, 9, 1], [9, -1, 0], [6, 9, 1]], ["n0:2"]) == 9
    assert rollback_step(plan, order, [[3, 6, 1], [6, 9, 1], [6, 9, 1]], ["n0:2"]) == 6
    assert rollback_step(plan, order, [[-1, 0, 0], [0, -1, 0], [0, -1, 0]], ["n0:2"]) is None
    # the keeper lost too: nothing to roll back to
    assert rollback_step(plan, ["n0:1", "n1:0"], [[6, 9, 1], [6, 9, 1]], ["n0:0", "n0:2"]) is None

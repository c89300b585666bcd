"""The solver's interleaved templates (solver/interleave.py) against the cost model's estimate of the
plans they become, and what choosing chunks buys."""

import dataclasses
import functools
import random

import pytest

import solver
import solver.core
import solver.master
import solver.placement
from costmodel import PRESETS, ClusterSpec, schedule
from costmodel.estimate import CostModel
from costmodel.schedule import interleaved_time_s
from profiler.analytic import analytic_profile
from solver import baselines, interleave
from solver.core import tp_degrees
from solver.interleave import chunk_ranges, interleaved, stage_peaks
from solver.skeletons import generate_skeletal, splitter_of
from solver.stages import stage_table, sync_terms
from solver.templates import Template


@pytest.fixture(scope="module")
def p7():
    return analytic_profile(
        PRESETS["llama2-7b"],
        device_kind="H100-80GB",
        micro_batch_sizes=[1],
        tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )


def test_chunks_deal_each_stage_its_layer_count():
    stages = ((0, 5, 2), (5, 12, 1), (12, 14, 4))
    chunks = chunk_ranges(stages, 2)
    # stage 0's 5 layers as 3 + 2, stage 1's 7 as 4 + 3, stage 2's 2 as 1 + 1; virtual pipeline 0
    # first (embedding first), then virtual pipeline 1 (head last)
    assert chunks == (((0, 3), (8, 10)), ((3, 7), (10, 13)), ((7, 8), (13, 14)))


def test_variant_is_priced_like_the_plan_it_becomes(p7):
    """An interleaved template's line A + (m - 1) M is the estimate's pipeline time of its plan."""
    cluster = ClusterSpec.parse("8", p7.device_kind)
    cm = CostModel(p7, cluster)
    tables = {t: stage_table(cm, t, 1) for t in tp_degrees(p7, cluster)}
    L = p7.model.num_layers
    base = Template(
        stages=((0, 12, 2), (12, 23, 2), (23, 34, 4)),
        runs=(0, 0, 0),
        pipeline_s=0,
        bottleneck_s=0,
        max_params=0,
        optimizer_s=0,
    )
    unsplit = {}
    for v, split in [(2, False), (3, False), (4, False), (1, True), (2, True), (3, True)]:
        variant = interleaved(base, tables, v, split=split)
        assert variant is not None and variant.chunks == v and variant.split_backward == split
        plan = solver.placement.place(cm, cluster, 8, 1, [(variant, 8)], [(8, (8,))])
        assert plan.pipelines[0].num_chunks == v and plan.pipelines[0].stages[-1].chunks[-1][1] == L
        assert plan.pipelines[0].split_backward == split
        estimate = cm.estimate(plan)
        assert variant.time_s(8) == pytest.approx(estimate.pipeline_times_s[0], rel=1e-9)
        fwd = [s.cost.fwd_s for s in estimate.stages]
        bwd = [s.cost.bwd_s for s in estimate.stages]
        wgrad = [s.cost.wgrad_s for s in estimate.stages] if split else None
        p2p = [s.p2p_s for s in estimate.stages[:-1]]
        wrap = cm.exchange_s(estimate.stages[-1].cost, 2, True, False) if v > 1 else 0.0
        want = interleaved_time_s(fwd, bwd, [*p2p, wrap], 8, v, wgrad)
        assert estimate.pipeline_times_s[0] == pytest.approx(want)
        if split and v > 1:  # splitting the backward is faster at the same chunk count
            assert estimate.pipeline_times_s[0] < unsplit[v]
        unsplit.setdefault(v, estimate.pipeline_times_s[0])


def test_choosing_chunks_is_never_slower_and_cuts_the_bubble(p7):
    cluster = ClusterSpec.parse("4,4", p7.device_kind)
    cm = CostModel(p7, cluster)
    plain = solver.solve(p7, cluster, 16)
    chunked = solver.solve(p7, cluster, 16, interleave=True)
    estimate = cm.estimate(chunked.validate(cluster))
    assert estimate.fits and chunked.predicted["step_time_s"] == estimate.step_time_s
    assert chunked.predicted["step_time_s"] <= plain.predicted["step_time_s"] * (1 + 1e-12)
    assert max(p.num_chunks for p in chunked.pipelines) > 1
    assert chunked.predicted["step_time_s"] < plain.predicted["step_time_s"]


def test_a_chunked_search_stopped_by_its_time_limit_never_returns_a_slower_plan(p7, monkeypatch):
    """The search with chunks is a larger space that may stop at its time limit holding a poor plan;
    the search without chunks then runs bounded by it, so the answer is never slower than the plan
    found without chunks, and it says it is not proven."""
    cluster = ClusterSpec.parse("4,4,4", p7.device_kind)
    plain = solver.solve(p7, cluster, 16)
    poor = solver.solve(p7, ClusterSpec.parse("4", p7.device_kind), 16)  # one node of the three
    poor_s = CostModel(p7, cluster).estimate(poor).step_time_s
    assert poor_s > plain.predicted["step_time_s"] * 1.01
    search = solver.search

    def stopped_early(*args, mode, **kwargs):
        if not mode.interleave:
            return search(*args, mode=mode, **kwargs)
        found = search(*args, mode=mode, **kwargs)
        return dataclasses.replace(found, plan=poor, objective_s=poor_s, proven=False)

    monkeypatch.setattr(solver, "search", stopped_early)
    chunked = solver.solve(p7, cluster, 16, interleave=True)
    assert chunked.predicted["step_time_s"] <= plain.predicted["step_time_s"] * (1 + 1e-12)
    assert chunked.solver["status"] == "FEASIBLE"
    assert chunked.solver["not_proven"] == [solver.NOT_PROVEN_TIME_LIMIT]


@pytest.fixture(scope="module")
def p70():
    return analytic_profile(
        PRESETS["llama3-70b"],
        device_kind="H100-80GB",
        micro_batch_sizes=[1],
        tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )


@pytest.mark.parametrize(
    ("tp", "pp", "chunks", "gbs", "given_back"),
    [(4, 11, 6, 16, False), (4, 12, 6, 24, True), (4, 10, 8, 20, True)],
)
def test_giving_back_recomputation_keeps_an_interleaved_plan_within_memory(
    p70, tp, pp, chunks, gbs, given_back
):
    """An interleaved stage's peak weighs its chunks by what each keeps, and without recomputation
    the head's chunk keeps far more than under full recomputation: the lighter mode must be judged
    by its own weights. Judged by the full mode's, each of these grids came back from the
    relaxation no longer fitting (on llama3-70b on 32 nodes of 8 a last stage so relaxed needed
    104 GiB of the 73.6 usable, and the solve, taking that for one short of NCCL buffers, planned
    29% slower)."""
    cluster = ClusterSpec.parse("8,8,8,8,8,8", p70.device_kind)
    full = CostModel(p70, cluster, recompute="full")
    plan = baselines.grid_plan(full, cluster, gbs, baselines._Candidate(1, tp, pp, 1), chunks)
    exact = CostModel(p70, cluster)
    assert exact.estimate(plan).fits
    relaxed = solver.relax_recompute(exact, plan)
    assert exact.estimate(relaxed).fits
    assert any(s.recompute != "full" for s in relaxed.pipelines[0].stages) == given_back


def test_a_bigger_cluster_keeps_the_grid_depth_a_smaller_one_interleaves(p70):
    """The skeleton family offers TP-4 pipelines on nodes of 8 in whole nodes: 42 stages on a
    cluster of 256 nodes, too many for 2 chunks of 82 layers, where 251 nodes of 8 got 41-stage
    ones from a baseline's seed and planned 7.9% faster. The grid seed of any depth
    (`baselines.deep_grids`) is no slower on the bigger cluster, and it brings the smaller one's
    grid (with each chunk's gradients reduced behind the other chunks' backwards, 14 TP-4 stages of
    5 chunks; the grid takes the fewest pipelines for its micro-batch count, as more of them add
    to the sync)."""
    small, big = (ClusterSpec.parse(",".join(["8"] * n), p70.device_kind) for n in (251, 256))
    seeds = {
        n: baselines.deep_grids(p70, c, 512, [1], "selective", interleave=True)
        for n, c in ((251, small), (256, big))
    }
    assert seeds[256][0] <= seeds[251][0] * (1 + 1e-12)
    shapes = {
        n: {(len(p.stages), p.num_chunks, s.tp_degree) for p in plan.pipelines for s in p.stages}
        for n, (_, plan) in seeds.items()
    }
    assert shapes[256] == shapes[251] == {(14, 5, 4)}


@pytest.mark.slow
def test_llama3_70b_at_2m_tokens_with_chunks_plans_no_slower_on_more_nodes(p70):
    steps = [
        solver.solve(
            p70, ClusterSpec.parse(",".join(["8"] * n), p70.device_kind), 512, interleave=True
        ).predicted["step_time_s"]
        for n in (251, 256)
    ]
    assert steps[1] <= steps[0] * (1 + 1e-9)


def test_an_interleaved_answer_fits_as_the_solver_checked_it(p7):
    """The solver's memory check of an interleaved template holds at every micro-batch count: on
    8+7 GPUs at 128 sequences the answer (TP-1 stages of 6 chunks, the first chunk of a stage
    twice the others) was 388 MiB short at its 43 micro-batches, though it fitted at 9, and the
    solve took it for one short of NCCL buffers and searched seven times (9.7 s, not proven)."""
    cluster = ClusterSpec.parse("8,7", p7.device_kind)
    plan = solver.solve(p7, cluster, 128, interleave=True)
    assert "nccl_reserve_bytes" not in plan.solver and plan.solver["status"] == "OPTIMAL"
    assert CostModel(p7, cluster).estimate(plan.validate(cluster)).fits


def test_the_solvers_stage_peaks_are_the_walked_ones_and_hold_every_micro_batch_count():
    """`solver.interleave.stage_peaks` reads an interleaved stage's live bytes off weighted prefix
    sums of the forward table, for m in [S, 6S); at each m it must be `costmodel.schedule.peak_live`
    (which walks the stage's program), and its most the most over every m, here up to 12S, on
    random shapes with chunks of unequal weight. There the peak need not come at the largest first
    group: stage 1 of 5 with 6 chunks, the first twice the others, peaks higher at m = 43 than at 9
    (what the solver's check at m = 2S - 1 alone missed), and stage 0 of 9 with 6 chunks of weights
    below peaks first at m = 44 (m in [S, 4S) alone missed that)."""
    rng = random.Random(5)
    shapes = [(9, 6, 0, [0.77, 2.04, 1.05, 0.83, 1.0, 1.48])]
    for _ in range(150):
        S, v = rng.randint(2, 12), rng.randint(2, 8)
        weights = [rng.choice([0.5, 0.8, 1.0, 1.5, 2.0, 3.0]) * rng.uniform(0.9, 1.1) for _ in range(v)]
        shapes.append((S, v, rng.randrange(S), weights))
    for S, v, stage, weights in shapes:
        fast = stage_peaks(stage, S, v, tuple(weights))
        walked = [schedule.peak_live(stage, S, v, m, weights) for m in range(S, 12 * S)]
        assert fast == pytest.approx(walked[: 5 * S], rel=1e-12), (S, v, stage)
        assert max(fast) == pytest.approx(max(walked), rel=1e-12), (S, v, stage)
    heavy_first = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert schedule.peak_live(1, 5, 6, 43, heavy_first) > schedule.peak_live(1, 5, 6, 9, heavy_first)


def test_the_solvers_split_peaks_are_the_walked_ones_and_hold_every_micro_batch_count():
    """Under split backward B frees a chunk's activation and holds what its W reads (more or less
    than the activation); `stage_peaks` with `held` is `costmodel.schedule.peak_live` with `held` at
    every m in [S, 6S), and their most is the most over every m up to 12S, at one chunk too."""
    rng = random.Random(6)
    for _ in range(100):
        S, v = rng.randint(2, 10), rng.randint(1, 6)
        stage = rng.randrange(S)
        weights = [rng.choice([0.5, 1.0, 2.0]) * rng.uniform(0.9, 1.1) for _ in range(v)]
        held = [w * rng.uniform(0.3, 1.8) for w in weights]
        fast = stage_peaks(stage, S, v, tuple(weights), tuple(held))
        walked = [schedule.peak_live(stage, S, v, m, weights, held) for m in range(S, 12 * S)]
        assert fast == pytest.approx(walked[: 5 * S], rel=1e-12), (S, v, stage)
        assert max(fast) == pytest.approx(max(walked), rel=1e-12), (S, v, stage)


def test_the_first_overflowing_micro_batch_count_is_the_walks_whatever_the_room():
    """`solver.interleave.first_overflow` looks at the peaks in spans of m, the unsplit ones below
    2S in closed form, and stops at the first span that overflows; it must name the fewest m whose
    walked peak (`costmodel.schedule.peak_live`) exceeds the room, or None where none below its
    bound does, for rooms that bind anywhere from m = S to nowhere, split and unsplit. Integer
    weights, as the solver's bytes are: the comparison with the room is then exact."""
    rng = random.Random(7)
    found = {"at S": 0, "above S": 0, "none": 0}
    for _ in range(300):
        S, v = rng.randint(2, 10), rng.randint(1, 6)
        stage, split = rng.randrange(S), v == 1 or rng.random() < 0.5
        weights = tuple(float(rng.randint(1, 1000)) for _ in range(v))
        held = tuple(float(rng.randint(1, 1500)) for _ in range(v)) if split else None
        walked = [
            schedule.peak_live(stage, S, v, m, list(weights), held and list(held)) for m in range(S, 6 * S)
        ]
        room = rng.uniform(min(walked) * 0.95, max(walked) * 1.02)
        below = rng.choice([6 * S, rng.randint(S + 1, 6 * S)])
        over = [S + i for i, peak in enumerate(walked[: below - S]) if peak > room]
        expected = over[0] if over else None
        assert interleave.first_overflow(stage, S, v, weights, held, room, below) == expected, (S, v, stage)
        found["none" if expected is None else "at S" if expected == S else "above S"] += 1
    assert min(found.values()) >= 30, found  # every outcome was asked


def test_a_variants_sync_is_priced_like_the_plan_it_becomes(p7):
    """The chunk windows the solver gives a variant (solver.interleave.chunk_windows) are the ones
    the estimate gives its plan: the same exposed gradient sync, below what one window per stage
    would leave."""
    cluster = ClusterSpec.parse("8,8", p7.device_kind)
    cm = CostModel(p7, cluster)
    tables = {t: stage_table(cm, t, 1) for t in tp_degrees(p7, cluster)}
    stages, runs = ((0, 12, 2), (12, 23, 2), (23, 34, 4)), (0, 0, 0)
    widest = max(tables[tp].params[s][e] for s, e, tp in stages)
    base = Template(stages, runs, 0.0, 0.0, widest, 0.0, *sync_terms(tables, stages, runs))
    sync = solver.core.sync(cm, True)
    for v in (2, 3):
        variant = interleaved(base, tables, v)
        plan = solver.placement.place(
            cm, cluster, 16, 1, [(variant, 8), (variant, 8)], [(8, (8,)), (8, (8,))]
        )
        estimate = cm.estimate(plan)
        priced = sync(2, variant).exposed_s(variant.hide_s)
        assert estimate.sync_s == pytest.approx(priced, rel=1e-9)
        assert priced < sync(2, base).exposed_s(base.hide_s)
    # split backward: the gradients come from the deferred W ops, later than B, so the windows
    # shrink (never grow) and the plan prices them as the variant does, at one chunk too
    for v in (1, 2, 3):
        variant = interleaved(base, tables, v, split=True)
        plan = solver.placement.place(
            cm, cluster, 16, 1, [(variant, 8), (variant, 8)], [(8, (8,)), (8, (8,))]
        )
        estimate = cm.estimate(plan)
        priced = sync(2, variant).exposed_s(variant.hide_s)
        assert estimate.sync_s == pytest.approx(priced, rel=1e-9)
        unsplit = base if v == 1 else interleaved(base, tables, v)
        assert variant.hide_s <= unsplit.hide_s


def test_the_variant_search_skips_only_variants_that_cannot_win(p7, monkeypatch):
    """`fastest_variant` skips a variant by a bound on its window before working its memory and
    windows out: the bound holds every window, and skipping changes no variant chosen; a sync
    with chunk terms is priced as the cost model prices it (`SyncCost.with_partial`)."""
    cluster = ClusterSpec.parse("8,7", p7.device_kind)
    cm = CostModel(p7, cluster)
    tables = {t: stage_table(cm, t, 1) for t in tp_degrees(p7, cluster)}
    found = generate_skeletal(tables, p7.model.num_layers, [8, 7], single_node=False, max_runs=3)
    templates = [t for t in found if t.num_stages > 1]
    sync = solver.core.sync(cm, True)
    rng = random.Random(5)
    built = {"quick": 0, "full": 0}
    counting = "quick"
    make = interleave._variant

    def counted(*args):
        built[counting] += 1
        return make(*args)

    monkeypatch.setattr(interleave, "_variant", counted)
    chosen = 0
    for template in rng.sample(templates, 150):
        links = interleave._links(template, tables)
        for v, split, _, _ in interleave._lines_of(template, tables):
            window, _ = interleave.chunk_windows(template.stages, v, split, tables, links)
            assert window <= interleave._hide_bound(template.stages, v, split, tables, links)
        m = template.num_stages + rng.randrange(3 * template.num_stages)
        copies = rng.choice([2, 3, 4])
        plain = sync(copies, dataclasses.replace(template, hide_terms=()))

        exposed = functools.partial(interleave._exposed_s, sync, copies)

        counting = "quick"
        quick = interleave.fastest_variant(template, tables, m, exposed, plain)
        counting = "full"
        full = interleave.fastest_variant(template, tables, m, exposed)
        assert (quick is None) == (full is None)
        if full is not None:
            assert (quick.chunks, quick.split_backward) == (full.chunks, full.split_backward)
            assert quick.time_s(m) + exposed(quick) == full.time_s(m) + exposed(full)
            chosen += 1
            for P in (2, 5):
                args = (cm, True, P, full.max_params, full.last_params, full.hide_terms)
                assert sync(P, full) == solver.core.pipeline_sync(*args)
                alone = sync(P, dataclasses.replace(full, hide_terms=()))  # terms only raise the floor
                assert (sync(P, full).reduce_s, sync(P, full).gather_s) == (alone.reduce_s, alone.gather_s)
                assert sync(P, full).floor_s >= alone.floor_s
    assert chosen > 100 and built["quick"] < 0.95 * built["full"]


def test_a_variant_whose_warm_up_outgrows_memory_takes_fewer_micro_batches(p70):
    """Below 2S micro-batches the first group is all of them, so the warm-up grows with m: 14 TP-4
    stages of llama3-70b with 5 chunks (selective recomputation; the 2M-token plan's pipelines) fit
    up to 16 micro-batches. The variant says so, and `balance` never gives its pipelines more."""
    cluster = ClusterSpec.parse(",".join(["8"] * 256), p70.device_kind)
    cm = CostModel(p70, cluster, recompute="selective")
    tables = {t: stage_table(cm, t, 1) for t in (4, 8)}
    L = p70.model.num_layers
    kinds, _ = baselines._grid_templates(splitter_of(tables, L), baselines._tp_groups(cluster, 4), 4, 14, 36)
    variant = interleaved(kinds[0], tables, 5)
    S, cap = 14, variant.max_microbatches
    assert S <= cap < 2 * S

    def fits(m: int) -> bool:  # the schedule's walked peak of every stage against its room
        for si, ((s, e, tp), chunks) in enumerate(
            zip(variant.stages, chunk_ranges(variant.stages, 5), strict=True)
        ):
            weights = [tables[tp].kept_bytes[a][b] for a, b in chunks]
            if (
                schedule.peak_live(si, S, 5, m, weights)
                > tables[tp].max_in_flight[s][e] * tables[tp].kept_bytes[s][e]
            ):
                return False
        return True

    assert all(fits(m) for m in range(S, cap + 1)) and not fits(cap + 1)
    assert solver.master.balance([variant, variant], 2 * cap + 1) is None
    counts = solver.master.balance([variant, kinds[0]], 3 * cap)
    assert counts[0] <= cap and sum(counts) == 3 * cap


def test_a_witnessed_plan_that_best_fit_would_not_pack_is_placed():
    """The master's knapsack witness packs pipeline by pipeline, the most GPUs first, and the answer
    it makes must be placed the same way: llama2-7b with chunks on nodes of 7, 7, 7 and 8 GPUs was
    found so, and packing all its runs at once, largest first, left a run without a node (the
    what-if sweep of the solver benchmark stopped on it)."""
    p7 = analytic_profile(
        PRESETS["llama2-7b"], device_kind="H100-80GB", micro_batch_sizes=[1, 2], tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )  # fmt: skip
    plan = solver.solve(p7, ClusterSpec.parse("7,7,7,8", p7.device_kind), 128, interleave=True)
    assert CostModel(p7, ClusterSpec.parse("7,7,7,8", p7.device_kind)).estimate(plan).fits
    assert len(plan.devices) <= 29

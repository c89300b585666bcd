"""The cost model's stage costs for every layer range at once, as tables the planner can index fast.

`CostModel.planned(start, end, tp, mbs)` builds one `StageCost` at a time (sequence parallel where the
TP degree divides the sequence, in the cost model's recompute mode); a planner looks at every range
[s, e) of the layer list (3,403 of them for llama2-70b) at every TP degree. This module asks the cost
model for the single-layer stages [i, i+1) only and combines them the way `CostModel._stage` does:
times, TP collectives, activation bytes and parameters add up over layers, the transient working
memory is the largest layer's, the boundary is the last layer's output. One exception: with tied
embeddings a stage holding the head but not the embedding keeps a copy of the embedding, which the
single-layer head stage counts, so the whole-model range [0, L) is taken from the cost model directly.
What a stage receives and keeps of its input is its first layer's, of its output its last layer's.
`tests/test_solver_stages.py` holds every entry equal to `CostModel.stage`.

The combined fields are numpy arrays indexed [s, e], wrapped in a `StageCost` so that its own methods
(`fwd_s`, `memory_bytes`, ...) and the cost model's `exchange_s` compute on them: the formulas stay
in `costmodel/estimate.py`.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel import communicators
from costmodel.estimate import CostModel, StageCost, buckets_of, hide_window_s
from solver.memo import IdentityMemo

# Tables already built, for the searches of one solve (the main one, the node-drop seed, the
# baselines) and of solves alike: keyed by the profile's identity, the device and the links.
_BUILT: IdentityMemo["StageTable"] = IdentityMemo(limit=256)
NO_FIT = -1  # `max_in_flight` of a stage that does not fit even without activations
UNBOUNDED = 1 << 40  # `max_in_flight` of a stage that keeps no activations


@dataclass(frozen=True)
class StageTable:
    """Every stage [s, e) of the layer list at one TP degree and micro-batch size (lists of lists).

    time_s[s][e]: forward + backward per micro-batch, TP collectives included.
    params[s][e]: parameters the device holds (sets gradient-sync and optimizer time).
    max_in_flight[s][e]: the most micro-batches whose activations fit next to everything else the
        stage keeps (NO_FIT if none); 1F1B makes stage s of p hold p - s of them.
    exchange_s[(t, inter)][e]: one micro-batch's exchange across the boundary from a stage ending at
        e to a stage of TP degree t, inside a node or across nodes (`CostModel.exchange_s`).
    bwd_s[s][e]: backward per micro-batch (the window its gradient reduction overlaps).
    wgrad_s[s][e], held_bytes[s][e]: the split backward's W time and what B leaves for it.
    kept_bytes[s][e]: the activations one more micro-batch in flight adds (what max_in_flight
        divides the free memory by; an interleaved stage keeps its chunks' own, `solver.interleave`).
    """

    tp: int
    micro_batch_size: int
    time_s: list[list[float]]
    params: list[list[int]]
    max_in_flight: list[list[int]]
    exchange_s: dict[tuple[int, bool], list[float]]
    optimizer_s: list[list[float]]
    bwd_s: list[list[float]]
    bucket_bytes: int  # of the gradient buckets (the plans' optimizer layout)
    kept_bytes: list[list[int]]
    # split backward (`costmodel.estimate.StageCost.wgrad_s`, `held_bytes`): the weight-gradient
    # part of bwd_s, and what a micro-batch holds from its B to its W
    wgrad_s: list[list[float]]
    held_bytes: list[list[int]]


def sync_terms(
    tables: dict[int, StageTable], stages: Sequence[tuple[int, int, int]], runs: Sequence[int]
) -> tuple[float, int]:
    """What a pipeline's gradient sync depends on besides its widest stage, from its stages (start,
    end, tp) and runs: how much of it backward hides (`costmodel.estimate.hide_window_s`), and the
    parameters backward produces last (the first stage's first layer)."""
    bwd = [tables[tp].bwd_s[s][e] for s, e, tp in stages]
    buckets = [buckets_of(tables[tp].params[s][e], tables[tp].bucket_bytes) for s, e, tp in stages]
    first = stages[0][2]
    return hide_window_s(bwd, exchanges_s(tables, stages, runs), buckets), tables[first].params[0][1]


def exchanges_s(
    tables: dict[int, StageTable], stages: Sequence[tuple[int, int, int]], runs: Sequence[int]
) -> list[float]:
    """Each stage boundary's exchange time: stages are (start, end, tp) front to back, runs their
    node runs (intra-node links inside a run, inter-node between runs)."""
    return [
        tables[tp].exchange_s[(stages[i + 1][2], runs[i] != runs[i + 1])][end]
        for i, (_, end, tp) in enumerate(stages[:-1])
    ]


def stage_grid(cm: CostModel, tp: int, mbs: int) -> StageCost:
    """A `StageCost` whose fields are [s, e] arrays over all ranges (entries with e <= s are 0)."""
    num_layers = cm.model.num_layers
    # A layer's cost is its kind's (an embedding first, a head last, blocks of one shape between)
    # at its profiled cost: layers alike in both are priced once (a block-uniform llama2-70b: 3 of its 82).
    alike: dict[tuple, StageCost] = {}
    singles = []
    for i in range(num_layers):
        key = (cm.model.layer_kind(i), cm.profile.cost(i, mbs, tp))
        if key not in alike:
            alike[key] = cm.planned(i, i + 1, tp, mbs)
        singles.append(alike[key])

    def summed(field: str) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum([float(getattr(c, field)) for c in singles])])
        return np.triu(prefix[None, :] - prefix[:, None])

    transient = np.zeros((num_layers + 1, num_layers + 1))
    for s in range(num_layers):
        transient[s, s + 1 :] = np.maximum.accumulate([c.transient_bytes for c in singles[s:]])
    boundary = np.array([0.0] + [float(c.boundary_bytes) for c in singles])
    # what a stage [s, e) receives and keeps of its input is its first layer's, of its output its last's
    received = np.array([float(c.input_bytes) for c in singles] + [0.0])
    input_kept = np.array([float(c.input_kept_bytes) for c in singles] + [0.0])
    output_kept = np.array([0.0] + [float(c.output_kept_bytes) for c in singles])
    params, optimizer, tensors = summed("param_count"), summed("optimizer_s"), summed("param_tensors")
    whole = cm.planned(0, num_layers, tp, mbs)
    ends = np.arange(num_layers + 1)
    params[0, num_layers], optimizer[0, num_layers] = whole.param_count, whole.optimizer_s
    tensors[0, num_layers] = whole.param_tensors
    return StageCost(
        start=0,
        end=num_layers,
        tp=tp,
        compute_fwd_s=summed("compute_fwd_s"),
        compute_bwd_s=summed("compute_bwd_s"),
        tp_comm_fwd_s=summed("tp_comm_fwd_s"),
        tp_comm_bwd_s=summed("tp_comm_bwd_s"),
        param_count=params,
        activation_bytes=summed("activation_bytes"),
        transient_bytes=transient,
        boundary_bytes=np.broadcast_to(boundary[None, :], (num_layers + 1, num_layers + 1)),
        optimizer_s=optimizer,
        input_bytes=np.broadcast_to(received[:, None], (num_layers + 1, num_layers + 1)),
        param_tensors=tensors,
        input_kept_bytes=np.broadcast_to(input_kept[:, None], (num_layers + 1, num_layers + 1)),
        output_kept_bytes=np.broadcast_to(output_kept[None, :], (num_layers + 1, num_layers + 1)),
        dtype_bytes=whole.dtype_bytes,
        sequence_parallel=whole.sequence_parallel,
        recompute=whole.recompute,
        comm_bytes=communicators.stage_reserve(
            cm.cluster.device.kind, tp, ends[:, None], ends[None, :], num_layers, cm.model.tie_embeddings
        ),
        row_numel=whole.row_numel,
        sharded_over=whole.sharded_over,
        bucket_bytes=whole.bucket_bytes,
        wgrad_s=summed("wgrad_s"),
        held_bytes=summed("held_bytes"),
    )


def stage_table(cm: CostModel, tp: int, mbs: int) -> StageTable:
    """The table of one TP degree and micro-batch size; it depends on the profile, the device and
    the links, not on the nodes, so clusters that differ only in their nodes share it."""
    cluster = cm.cluster.to_json()
    key = (
        json.dumps([cluster["device"], cluster["links"]], sort_keys=True),
        tp,
        mbs,
        cm.recompute,
        cm.optimizer,
        cm.replicas,
    )
    return _BUILT.get((cm.profile,), key, lambda: _build(cm, tp, mbs))


def _build(cm: CostModel, tp: int, mbs: int) -> StageTable:
    grid = stage_grid(cm, tp, mbs)
    idle = np.rint(sum(grid.memory_bytes(0).values())).astype(np.int64)
    # What one more micro-batch in flight adds: its activations (the peak is linear in the count).
    per_micro_batch = np.rint(sum(grid.memory_bytes(1).values())).astype(np.int64) - idle
    room = cm.usable_memory_bytes - idle
    fits = np.where(per_micro_batch > 0, room // np.maximum(per_micro_batch, 1), UNBOUNDED)
    fits = np.where(room >= 0, np.minimum(fits, UNBOUNDED), NO_FIT)
    return StageTable(
        tp=tp,
        micro_batch_size=mbs,
        time_s=np.asarray(grid.fwd_s + grid.bwd_s).tolist(),
        params=np.rint(np.asarray(grid.param_count)).astype(np.int64).tolist(),
        max_in_flight=fits.tolist(),
        exchange_s={
            (back, inter): _by_end(cm.exchange_s(grid, back, cm.sequence_parallel(back), inter))
            for back in cm.profile.tp_degrees()
            for inter in (False, True)
        },
        optimizer_s=np.asarray(grid.optimizer_s).tolist(),
        bwd_s=np.asarray(grid.bwd_s).tolist(),
        bucket_bytes=cm.optimizer.bucket_bytes,
        kept_bytes=per_micro_batch.tolist(),
        wgrad_s=np.asarray(grid.wgrad_s).tolist(),
        held_bytes=np.rint(np.asarray(grid.held_bytes)).astype(np.int64).tolist(),
    )


def _by_end(grid_values) -> list[float]:
    """A [s, e] grid's values that depend on e only (a stage's boundary is its last layer's), by e."""
    return np.asarray(grid_values)[0].tolist()

"""Why no plan exists: one sentence naming the binding constraint, checked from the coarsest up."""

import math

from costmodel import ClusterSpec
from costmodel.estimate import FP32_BYTES, STATE_WORDS_PER_PARAM, CostModel
from costmodel.hardware import GIB
from costmodel.profile import ModelProfile
from solver.stages import StageTable, stage_table


def infeasible_reason(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch_size: int,
    micro_batch_sizes: list[int],
    tps: list[int],
) -> str:
    model, kind = profile.model, cluster.device.kind
    healthy = cluster.world_size
    if not micro_batch_sizes:
        sizes = ", ".join(map(str, profile.micro_batch_sizes()))
        return (
            f"The global batch size {global_batch_size} is not a multiple of any micro-batch size the "
            f"profile measured ({sizes}); choose a multiple of one of them or profile another size."
        )
    largest = max(len(n.gpus) for n in cluster.nodes)
    if not tps:
        return (
            f"The profile has no tensor-parallel degree that divides {model.name}'s {model.num_heads} "
            f"attention heads and {model.num_kv_heads} key/value heads and fits on a node of {largest} GPUs."
        )
    cm = CostModel(profile, cluster, recompute="full")  # the most memory any plan can save
    masters = 0 if profile.bytes_per_param == FP32_BYTES else profile.bytes_per_param
    state_bytes = model.param_count * (STATE_WORDS_PER_PARAM * FP32_BYTES + masters)
    needed = math.ceil(state_bytes / cm.usable_memory_bytes)
    if healthy < needed:
        return (
            f"{model.name} needs at least {needed} {kind} GPUs for weights, gradients and optimizer "
            f"state; {healthy} {'is' if healthy == 1 else 'are'} healthy."
        )
    mbs = min(micro_batch_sizes)
    tables = {t: stage_table(cm, t, mbs) for t in tps}
    names = model.layer_names()
    for i in range(model.num_layers):
        if all(tables[t].max_in_flight[i][i + 1] < 1 for t in tps):
            need = min(sum(cm.planned(i, i + 1, t, mbs).memory_bytes(1).values()) for t in tps)
            return (
                f"Layer {names[i]} of {model.name} alone needs {need / GIB:.1f} GiB per GPU even at TP "
                f"{max(tps)} with one micro-batch of {mbs}, more than the {cm.usable_memory_bytes / GIB:.1f} "
                f"GiB usable on a {kind}."
            )
    fewest = fewest_stages(tables, model.num_layers, healthy)
    most = global_batch_size // mbs
    if fewest is not None and fewest > most:
        return (
            f"The global batch size {global_batch_size} makes at most {most} micro-batch(es), but every "
            f"pipeline of {model.name} that fits needs at least {fewest} stages and 1F1B needs a "
            f"micro-batch per stage; use a global batch size of at least {fewest * mbs}."
        )
    return (
        f"No pipeline of {model.name} fits on the {healthy} healthy {kind} GPUs: 1F1B keeps one "
        f"micro-batch in flight per later stage, and however the layers are split some GPU needs more "
        f"than the {cm.usable_memory_bytes / GIB:.1f} GiB usable; add GPUs or shorten the sequence."
    )


def fewest_stages(tables: dict[int, StageTable], num_layers: int, gpus: int) -> int | None:
    """The fewest stages of any pipeline whose stages fit in memory on at most `gpus` GPUs in total.

    From the back: fewest[k][l] = fewest GPUs covering layers [l, L) with k stages.
    """
    L = num_layers
    reach = {L: 0}
    for k in range(1, min(gpus, L) + 1):
        nxt: dict[int, int] = {}
        for ell, used in reach.items():
            for t, tab in tables.items():
                for s in range(ell):
                    if used + t <= gpus and tab.max_in_flight[s][ell] >= k:
                        nxt[s] = min(nxt.get(s, gpus + 1), used + t)
        if 0 in nxt:
            return k
        reach = nxt
    return None

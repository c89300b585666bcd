"""From the master's answer (pipelines, and run sizes per node) to a Plan with device names.

Nodes of one healthy count are interchangeable and so are the GPUs of a node, so any assignment that
gives every run a slot of its size on some node realises the master's plan. Two runs of one pipeline
that land on the same node are fine: their transfer becomes intra-node, which only makes the plan
faster than the master assumed.
"""

from collections import defaultdict
from collections.abc import Sequence

from costmodel import ClusterSpec, Pipeline, Plan
from costmodel.estimate import CostModel
from solver.interleave import chunk_ranges
from solver.templates import Template


def place(
    cm: CostModel,
    cluster: ClusterSpec,
    global_batch_size: int,
    micro_batch_size: int,
    pipelines: Sequence[tuple[Template, int]],
    node_runs: Sequence[tuple[int, tuple[int, ...]]],
) -> Plan:
    """Assign each run of each pipeline to a node slot of its size, then GPUs in ascending order."""
    nodes_by_count = defaultdict(list)
    for node in cluster.nodes:
        if node.gpus:
            nodes_by_count[len(node.gpus)].append(node)
    slots = defaultdict(list)  # run size -> free (node, first GPU index) slots
    for capacity, runs in node_runs:
        if not nodes_by_count[capacity]:
            raise AssertionError(f"the master used more nodes of {capacity} GPUs than the cluster has")
        node = nodes_by_count[capacity].pop(0)
        offset = 0
        for size in runs:
            slots[size].append((node, offset))
            offset += size
    built = []
    for template, m in pipelines:
        stages, where = [], {}
        chunks = chunk_ranges(template.stages, template.chunks)
        for (_, _, tp), run, layers in zip(template.stages, template.runs, chunks, strict=True):
            if run not in where:
                size = template.run_sizes[run]
                if not slots[size]:
                    raise AssertionError(f"no node slot left for a run of {size} GPUs")
                where[run] = list(slots[size].pop(0))
            node, offset = where[run]
            devices = tuple(f"{node.name}:{g}" for g in node.gpus[offset : offset + tp])
            where[run][1] = offset + tp
            stages.append(cm.planned_stage(layers, devices, template.recompute))
        built.append(
            Pipeline(num_microbatches=m, stages=tuple(stages), split_backward=template.split_backward)
        )
    plan = Plan(
        model=cm.profile.model,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        seq_len=cm.profile.seq_len,
        dtype=cm.profile.dtype,
        attention=cm.profile.attention,
        optimizer=cm.optimizer,
        pipelines=tuple(built),
    )
    return plan.validate(cluster)

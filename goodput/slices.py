"""Clusters beyond the solver's practical reach, planned as slices: an explicit approximation.

The solver answers for 2,048 H100 GPUs in seconds, but one plan for 16,384 takes it tens of minutes,
and a month of failures needs dozens of plans. `elastor simulate --slices K` therefore cuts the
cluster into K slices of equal node count, plans each slice with the real solver for 1/K of the
global batch, and takes the sum of the slices' throughputs as the cluster's:
    X(cluster) = sum over slices of X_solver(slice's healthy set, global batch / K)
The slices' pipelines together form one valid plan of the whole cluster, so this is what the
whole-cluster solver could at least reach, up to two effects this sum ignores:
- gradient sync: the ring all-reduce runs over the pipelines of all slices, and its per-device
  traffic 2(P-1)/P grows a little with P (from 0.94 to 0.99 of the gradient bytes for 18 -> 144
  pipelines);
- batch split: with a slice slower than the others, the global batch must be split in proportion to
  the slices' throughputs; the sum assumes a slice's throughput does not depend on its share, true
  when every pipeline runs many micro-batches (the 1F1B bubble is then small).
Damaged nodes (dead or partial) are dealt to the slices in turn, worst first, as failures at random
nodes of a fixed partition would fall: the slices stay alike, which keeps the batch-split effect
small, and each holds only a few damaged nodes, so few distinct slice plans serve a whole month (on
16,384 GPUs with the Llama 3 failure mix, 7 slice plans against 66 with the damage gathered into one
slice).
"""

from collections import defaultdict
from collections.abc import Sequence

from costmodel import ElastorError
from goodput.plans import Oracle, PlanPoint, Signature, expand, signature

SLICE_GPUS = 2048  # the largest slice `auto_slices` makes (llama3-70b: about a second per plan)


def auto_slices(gpus_per_node: Sequence[int], global_batch_size: int) -> int:
    """`--slices auto`: the fewest slices of at most SLICE_GPUS GPUs that split the nodes and the batch
    evenly; 1 (the whole cluster) when it is no larger, has unequal nodes or admits no such split."""
    nodes = len(gpus_per_node)
    if sum(gpus_per_node) <= SLICE_GPUS or len(set(gpus_per_node)) != 1:
        return 1
    for k in range(2, nodes + 1):
        if nodes % k == 0 and global_batch_size % k == 0 and nodes // k * gpus_per_node[0] <= SLICE_GPUS:
            return k
    return 1


class SlicedOracle:
    def __init__(self, slice_oracle: Oracle, num_nodes: int, gpus_per_node: int, slices: int):
        if slices < 1 or num_nodes % slices:
            raise ElastorError(f"--slices {slices} does not divide the cluster's {num_nodes} nodes.")
        self.slice_oracle = slice_oracle
        self.num_nodes, self.gpus_per_node, self.slices = num_nodes, gpus_per_node, slices
        self.per_slice = num_nodes // slices

    def slice_signatures(self, sig: Signature) -> list[Signature]:
        """Each slice's healthy set: the damaged nodes, worst first, dealt in turn (module docstring)."""
        counts = expand(sig)
        if len(counts) > self.num_nodes:
            raise ElastorError(f"Signature {sig} has more nodes than the cluster's {self.num_nodes}.")
        damaged = [0] * (self.num_nodes - len(counts)) + sorted(c for c in counts if c < self.gpus_per_node)
        out = []
        for i in range(self.slices):
            mine = damaged[i :: self.slices]
            out.append(signature(mine + [self.gpus_per_node] * (self.per_slice - len(mine))))
        return out

    def __call__(self, sig: Signature) -> PlanPoint | None:
        parts = [(s, self.slice_oracle(s) if s else None) for s in self.slice_signatures(sig)]
        found = [p for _, p in parts if p is not None]
        if not found:
            return None
        # GPUs used per node in the whole signature's order: nodes with equal healthy counts are
        # interchangeable, so gather the slices' usages per healthy count, largest count first.
        used: dict[int, list[int]] = defaultdict(list)
        for s, point in parts:
            counts = expand(s)
            if point is None:
                per_node = [0] * len(counts)
            else:
                per_node = counts if point.used_per_node is None else list(point.used_per_node)
            for count, u in zip(counts, per_node, strict=True):
                used[count].append(u)
        return PlanPoint(
            samples_per_s=sum(p.samples_per_s for p in found),
            num_pipelines=sum(p.num_pipelines for p in found),
            used_per_node=tuple(u for count in sorted(used, reverse=True) for u in used[count]),
            status="SLICED",
            gap=max(p.gap for p in found),
        )

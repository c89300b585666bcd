"""NCCL's communicator buffers: the device memory a plan's process groups and point-to-point peers take.

NCCL keeps, per channel and per connection to a peer, a FIFO for each of its three protocols, at
their documented defaults (NCCL user guide, environment variables: NCCL_BUFFSIZE 4 MiB for Simple;
LL128 and LL at 4,915,200 and 524,288 bytes, the sizes NCCL derives from its thread and step
counts): 9,633,792 bytes, allocated at the 2 MiB granularity of CUDA's virtual memory API, so
10 MiB per connection (the allocation size NVIDIA/nccl issue #1685 reports per channel and peer on
H100). Memory grows linearly with channels and with communicators; a ring keeps one receive
connection per channel whatever the group's size (NVIDIA/nccl issue #986, NCCL's maintainer).

So a rank pays, on a device kind with `nccl_channels` channels (costmodel.hardware):
  - per communicator it belongs to (`plan_groups`, and the whole job's group when it has two ranks
    or more): nccl_channels connections;
  - per point-to-point peer (`p2p_peers`): nccl_channels connections to a peer on its node,
    NET_CHANNELS_PER_PEER to one across nodes (NCCL's NCCL_NCHANNELS_PER_NET_PEER default, NVIDIA/nccl
    issue #1424). 1F1B's batched exchanges run on the job's communicator; the interleaved schedule's
    single sends get a communicator per pair of ranks from torch, priced alike.
Tree and NVLink-SHARP buffers (connected only where NCCL picks those algorithms), the CUDA context
and cuBLAS workspaces stay in the cost model's MEMORY_HEADROOM. Groups of one rank make no
communicator, and gloo (the cpu kind, and ZeRO-1's private ring groups, which exist on gloo only)
keeps no per-channel device buffers.

The runtime creates exactly `plan_groups` (runtime.distributed.ProcessGroups iterates it), and its
point-to-point routes are `costmodel.boundary.routes`, which `p2p_peers` walks too; tests hold both.

Planner: its stage tables are built before any plan exists, so a planned stage reserves
`planned_bytes`: the job's communicator, its TP group, the gradient-sync groups of a plan whose
pipelines cut alike (its shard's holders; under TP the replicated norm weights' holders; with tied
embeddings, for the first and the last stage, the embedding's holders) and a point-to-point peer
on its node for each neighbouring stage (none for a stage of the whole model, one for the first
and the last). The reserve is neither a bound nor exact: a single-GPU plan needs none of it, and
a plan whose pipelines cut or shard differently, or an interleaved first or last stage (two
neighbours), can need more. The solver checks every answer's exact count and, where it does not
fit, searches again with less memory (`solver._within_nccl_buffers`).
"""

from collections.abc import Iterator

from costmodel.boundary import routes, stage_ranges
from costmodel.cluster import parse_device
from costmodel.hardware import DEVICE_KINDS
from costmodel.layout import sync_buckets
from costmodel.plan import Plan, Stage

MIB = 1 << 20
CONNECTION_BYTES = 10 * MIB  # one channel's connection: three protocols' FIFOs, rounded to 2 MiB
NET_CHANNELS_PER_PEER = 2  # point-to-point channels to a peer on another node
PLANNED_P2P_PEERS = 2  # a middle stage's neighbours


def channels(kind: str) -> int:
    """NCCL channels per communicator on device kind `kind`; 0 where no NCCL buffers are modelled
    (the cpu kind, and kinds outside the hardware table)."""
    known = DEVICE_KINDS.get(kind)
    return known.nccl_channels if known else 0


def group_bytes(kind: str) -> int:
    """What one communicator's ring buffers take on each of its ranks."""
    return channels(kind) * CONNECTION_BYTES


def peer_bytes(kind: str, inter_node: bool) -> int:
    """What one point-to-point peer's connections take on a rank."""
    if not channels(kind):
        return 0
    return (NET_CHANNELS_PER_PEER if inter_node else channels(kind)) * CONNECTION_BYTES


def planned_bytes(kind: str, tp: int, peers: int = PLANNED_P2P_PEERS, tied: int = 0):
    """A planned stage's reserve (module docstring): the job's group, its TP group, the gradient-sync
    groups of a plan whose pipelines cut alike (its shard's holders, under TP the replicated
    weights' holders, and with `tied` the tied embedding's holders, which span the first and the
    last stage), and `peers` neighbouring stages on its node (arrays work too)."""
    groups = 1 + (tp > 1) + 1 + (tp > 1) + tied  # the job's, the TP group, the sync groups
    return groups * group_bytes(kind) + peers * peer_bytes(kind, inter_node=False)


def stage_reserve(kind: str, tp: int, start, end, num_layers: int, tie_embeddings: bool):
    """`planned_bytes` of a planned stage of layers [start, end) (ints, or arrays of them): a
    neighbour in front unless it starts the model, one behind unless it ends it, and the tied
    embedding's holders where it holds one end of a tied model but not both."""
    neighbours = (start > 0) * 1 + (end < num_layers)
    tied = tie_embeddings * ((start == 0) != (end == num_layers))
    return planned_bytes(kind, tp, neighbours, tied)


def plan_groups(plan: Plan) -> list[tuple[str, ...]]:
    """Every process group of two or more devices that the runtime makes for `plan`, in its order
    (devices in rank order, each rank set once): the TP group of each stage, pipelines and stages in
    order, then the holders of each gradient-sync bucket (`costmodel.layout.sync_buckets`)."""
    rank = {d: i for i, d in enumerate(plan.devices)}
    seen: dict[tuple[str, ...], None] = {}
    tp_groups = [st.devices for pipe in plan.pipelines for st in pipe.stages if st.tp_degree > 1]
    for devices in [*tp_groups, *sync_buckets(plan)]:
        ordered = tuple(sorted(devices, key=rank.__getitem__))
        if len(ordered) > 1:
            seen.setdefault(ordered)
    return list(seen)


def p2p_peers(plan: Plan) -> dict[str, set[str]]:
    """Per device, the devices it sends to or receives from across its pipeline's boundaries
    (forward and backward routes of `costmodel.boundary`; under interleaving also the wrap-around
    from the last stage to the first)."""
    peers: dict[str, set[str]] = {d: set() for d in plan.devices}
    for pipe in plan.pipelines:
        stages, S = pipe.stages, len(pipe.stages)
        links = [(s, s + 1) for s in range(S - 1)]
        if pipe.num_chunks > 1 and S > 1:
            links.append((S - 1, 0))
        for a, b in links:
            for src, dst in _pairs(stages[a], stages[b], plan.seq_len):
                if src != dst:
                    peers[src].add(dst)
                    peers[dst].add(src)
    return peers


def _pairs(front: Stage, back: Stage, seq_len: int) -> Iterator[tuple[str, str]]:
    """(sender, receiver) of every transfer across the front -> back boundary, both directions."""
    front_ranges = stage_ranges(seq_len, front.tp_degree, front.sequence_parallel)
    back_ranges = stage_ranges(seq_len, back.tp_degree, back.sequence_parallel)
    for t in routes(front_ranges, back_ranges):  # activations forward
        yield front.devices[t.src], back.devices[t.dst]
    for t in routes(back_ranges, front_ranges):  # their gradients backward
        yield back.devices[t.src], front.devices[t.dst]


def device_bytes(plan: Plan, kind: str) -> dict[str, int]:
    """Per device of `plan`, the bytes its NCCL communicators' buffers take on device kind `kind`."""
    if not channels(kind):
        return dict.fromkeys(plan.devices, 0)
    per_group = group_bytes(kind)
    count = dict.fromkeys(plan.devices, 1 if len(plan.devices) > 1 else 0)  # the whole job's group
    for group in plan_groups(plan):
        for device in group:
            count[device] += 1
    node = {d: parse_device(d)[0] for d in plan.devices}
    return {
        d: count[d] * per_group + sum(peer_bytes(kind, node[p] != node[d]) for p in peers)
        for d, peers in p2p_peers(plan).items()
    }

"""Where every piece of every parameter lives under a plan, and which pieces must be reduced together.

Tensor parallelism inside a stage follows Megatron-LM (Shoeybi et al. 2019, section 3): wq, wk, wv,
gate and up are column-parallel (split along dim 0, attention in whole heads), wo and down are
row-parallel (split along dim 1), the embedding and the output projection are vocabulary-parallel
(split along dim 0), norms are replicated. Splits may be uneven (larger shards first), so any TP
degree that divides the heads works, whatever the MLP width or vocabulary.

A parameter's replicas live in different pipelines, possibly split by different TP degrees. For the
data-parallel gradient sum, `sync_buckets` cuts each parameter at every shard boundary that any
holder induces; each resulting segment is held whole by a set of devices, and exactly those devices
reduce it. Segments with the same holder set form one bucket: one collective per bucket, and no
device moves bytes of a parameter it does not hold. Torch-free, shared by the runtime and the cost
model so that what is predicted is what is run.

The TP ranks of one stage that replicate a parameter (the norms) already hold identical, complete
gradients: the column-parallel layers after a norm all-reduce its output gradient. So a segment needs
a reduction only when its holders sit in two or more stages; in that reduction, each stage's first
holder contributes its gradient and its other TP ranks contribute zeros (`contributes`), so nothing
is counted twice. Under sequence parallelism a stage's norms see only their rank's tokens: there
every TP rank contributes its partial gradient, and the segment is reduced even when one stage holds
it all.
"""

from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise

from costmodel.config import ModelConfig
from costmodel.plan import Plan


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a tensor: `offsets` and `sizes` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def contains(self, other: "Box") -> bool:
        return all(
            o <= p and p + q <= o + s
            for o, s, p, q in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of `outer` (which must contain it): for slicing a local shard."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets, strict=True)), self.sizes)


@dataclass(frozen=True)
class ParamSpec:
    name: str  # global name, e.g. "blocks.3.attn.wq.weight"
    shape: tuple[int, ...]  # global shape
    shard_dim: int | None  # the dimension TP splits; None for replicated parameters
    unit: int = 1  # shards are whole multiples of `unit` along shard_dim (a head for attention)

    def full_box(self) -> Box:
        return Box((0,) * len(self.shape), self.shape)


def shard_size(full: int, parts: int, index: int) -> int:
    """Size of piece `index` when `full` is split into `parts` contiguous pieces, larger ones first."""
    return full // parts + (1 if index < full % parts else 0)


def shard_box(spec: ParamSpec, tp_degree: int, tp_rank: int) -> Box:
    """The box of `spec` that TP rank `tp_rank` of `tp_degree` holds."""
    if spec.shard_dim is None or tp_degree == 1:
        return spec.full_box()
    units = spec.shape[spec.shard_dim] // spec.unit
    start = sum(shard_size(units, tp_degree, r) for r in range(tp_rank)) * spec.unit
    size = shard_size(units, tp_degree, tp_rank) * spec.unit
    offsets = [0] * len(spec.shape)
    sizes = list(spec.shape)
    offsets[spec.shard_dim], sizes[spec.shard_dim] = start, size
    return Box(tuple(offsets), tuple(sizes))


def layer_params(config: ModelConfig, index: int) -> list[ParamSpec]:
    """Parameters of entry `index` of the layer list, in module order."""
    h, v = config.hidden_size, config.vocab_size
    kind = config.layer_kind(index)
    if kind == "embed":
        return [ParamSpec("embed.weight", (v, h), 0)]
    if kind == "head":
        specs = [ParamSpec("head.norm.weight", (h,), None)]
        if not config.tie_embeddings:
            specs.append(ParamSpec("head.output.weight", (v, h), 0))
        return specs
    p, d, w = f"blocks.{index - 1}.", config.head_dim, config.intermediate_size
    projections = []
    for name, rows in (("wq", config.q_size), ("wk", config.kv_size), ("wv", config.kv_size)):
        projections.append(ParamSpec(p + f"attn.{name}.weight", (rows, h), 0, unit=d))
        if config.qkv_bias:  # split with its rows: a column-parallel projection's bias
            projections.append(ParamSpec(p + f"attn.{name}.bias", (rows,), 0, unit=d))
    return [
        ParamSpec(p + "attn_norm.weight", (h,), None),
        *projections,
        ParamSpec(p + "attn.wo.weight", (h, config.q_size), 1, unit=d),
        ParamSpec(p + "mlp_norm.weight", (h,), None),
        ParamSpec(p + "mlp.gate.weight", (w, h), 0),
        ParamSpec(p + "mlp.up.weight", (w, h), 0),
        ParamSpec(p + "mlp.down.weight", (h, w), 1),
    ]


def stage_params(config: ModelConfig, start: int, end: int) -> list[ParamSpec]:
    """Parameters a stage holding layers [start, end) keeps, in module order (see `chunk_params`)."""
    return chunk_params(config, ((start, end),))


def chunk_params(config: ModelConfig, chunks) -> list[ParamSpec]:
    """Parameters a stage holding the layer ranges `chunks` keeps, in module order (layer order).

    With tied embeddings, a stage that holds the head but not the embedding keeps its own copy of
    `embed.weight`; the gradient sync sums both copies' gradients like any replicated parameter.
    """
    specs = [s for start, end in chunks for i in range(start, end) for s in layer_params(config, i)]
    holds_head = any(end == config.num_layers for _, end in chunks)
    if config.tie_embeddings and holds_head and not any(start == 0 for start, _ in chunks):
        specs.insert(0, layer_params(config, 0)[0])
    return specs


def device_pieces(plan: Plan, device: str) -> list[tuple[ParamSpec, Box]]:
    """Every (parameter, box) that `device` holds under `plan`."""
    pi, si = plan.placement(device)
    stage = plan.pipelines[pi].stages[si]
    tp_rank = stage.devices.index(device)
    return [
        (spec, shard_box(spec, stage.tp_degree, tp_rank)) for spec in chunk_params(plan.model, stage.chunks)
    ]


def holder_sets(plan: Plan) -> dict[tuple[str, ...], tuple[bool, list[tuple[ParamSpec, Box]]]]:
    """Every segment of every parameter, grouped by its holder devices (in rank order): holders ->
    (whether the segment needs a reduction, its (parameter, segment) list in layer order).

    A segment needs a reduction when its holders sit in two or more stages, or in one stage under
    sequence parallelism (see the module docstring). Iteration order is deterministic (parameters in
    layer order, devices in rank order), so every rank builds the same groups in the same order.

    A parameter's segments and their holders depend only on its shape, how TP splits it and the
    stages holding it, so parameters alike in those (a block's wq in every layer that the same
    stages hold) are cut once: on a 61-GPU plan of llama2-70b, 74 cuts for its 723 parameters.
    """
    rank = {d: i for i, d in enumerate(plan.devices)}
    holding: dict[str, list[tuple[int, int]]] = defaultdict(list)  # name -> (pipeline, stage) holding it
    specs: dict[str, ParamSpec] = {}
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            for spec in chunk_params(plan.model, stage.chunks):
                holding[spec.name].append((pi, si))
                specs[spec.name] = spec
    cut: dict[tuple, list[tuple[tuple[str, ...], bool, Box]]] = {}
    sets: dict[tuple[str, ...], tuple[bool, list[tuple[ParamSpec, Box]]]] = {}
    for name in _layer_order(plan.model, specs):
        spec = specs[name]
        key = (spec.shape, spec.shard_dim, spec.unit, tuple(holding[name]))
        if key not in cut:
            cut[key] = _segments_held(plan, spec, holding[name], rank)
        for owners, reduced, segment in cut[key]:
            sets.setdefault(owners, (reduced, []))[1].append((spec, segment))
    return dict(sorted(sets.items(), key=lambda kv: [rank[d] for d in kv[0]]))


def _segments_held(
    plan: Plan, spec: ParamSpec, stages: list[tuple[int, int]], rank: dict[str, int]
) -> list[tuple[tuple[str, ...], bool, Box]]:
    """(holders in rank order, whether it needs a reduction, segment) of each segment of `spec`
    when the stages `stages` (pipeline, stage) hold it."""
    held = []  # (device, its stage, its box)
    for pi, si in stages:
        stage = plan.pipelines[pi].stages[si]
        held += [(d, (pi, si), shard_box(spec, stage.tp_degree, r)) for r, d in enumerate(stage.devices)]
    out = []
    for segment in segments(spec, [box for _, _, box in held]):
        inside = sorted((rank[d], d, at) for d, at, box in held if box.contains(segment))
        owners = tuple(d for _, d, _ in inside)
        across = len({at for _, _, at in inside}) > 1
        reduced = across or (len(owners) > 1 and _sequence_parallel(plan, owners[0]))
        out.append((owners, reduced, segment))
    return out


def sync_buckets(plan: Plan) -> dict[tuple[str, ...], list[tuple[str, Box]]]:
    """Gradient-sync buckets: holder devices (in rank order) -> the (parameter, segment) they reduce.

    Only segments that need a reduction appear (`holder_sets`), in the same deterministic order.
    """
    return {
        owners: [(spec.name, box) for spec, box in segs]
        for owners, (reduced, segs) in holder_sets(plan).items()
        if reduced
    }


def contributes(plan: Plan, device: str, holders: tuple[str, ...]) -> bool:
    """Whether `device` adds its gradient to a segment's reduction among `holders`, or zeros: one
    holder per stage contributes (the first in rank order), because a stage's TP replicas of a
    parameter hold the same gradient; under sequence parallelism every holder does (partial sums)."""
    if _sequence_parallel(plan, device):
        return True
    placement = plan.placement(device)
    return next(d for d in holders if plan.placement(d) == placement) == device


def _sequence_parallel(plan: Plan, device: str) -> bool:
    pi, si = plan.placement(device)
    return plan.pipelines[pi].stages[si].sequence_parallel


def _layer_order(config: ModelConfig, specs: dict[str, ParamSpec]) -> list[str]:
    ordered = [s.name for i in range(config.num_layers) for s in layer_params(config, i)]
    return [n for n in ordered if n in specs]


def segments(spec: ParamSpec, boxes: list[Box]) -> list[Box]:
    """Cut the full tensor at every boundary any holder's box has along the shard dimension."""
    if spec.shard_dim is None:
        return [spec.full_box()]
    dim = spec.shard_dim
    cuts = sorted(
        {0, spec.shape[dim]}
        | {b.offsets[dim] for b in boxes}
        | {b.offsets[dim] + b.sizes[dim] for b in boxes}
    )
    segments = []
    for lo, hi in pairwise(cuts):
        offsets = [0] * len(spec.shape)
        sizes = list(spec.shape)
        offsets[dim], sizes[dim] = lo, hi - lo
        segments.append(Box(tuple(offsets), tuple(sizes)))
    return segments

"""One rank's part of the model under a plan: its stage's layers, sharded as costmodel/layout.py says.

The shapes come from the layout (`device_pieces`), not from a second copy of the split rules, and the
module checks at construction that it holds exactly the layout's pieces: the gradient sync and the
checkpoint address the same boxes. Initial values are the layout's box of `init_tensor(seed, name)`,
so every plan starts from the same model as the single-process reference.

The stage's `recompute` (one for all its chunks, or one per chunk) applies to their blocks: "full"
wraps each block's forward in `torch.utils.checkpoint` (non-reentrant, so the recomputed forward, TP
collectives included, gives bit-identical gradients; only each block's input is kept), "selective"
the attention core of each (`Attention.recompute_core`). With `sequence_parallel`, activations
between blocks are this rank's sequence slice (runtime/tensor_parallel.py).
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from costmodel.layout import Box, device_pieces
from costmodel.plan import Plan
from runtime.model import Block, init_tensor, rotary_tables
from runtime.tensor_parallel import (
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_tensor_parallel,
    vocab_parallel_cross_entropy_sum,
)


def box_slices(box: Box) -> tuple[slice, ...]:
    """Index a full tensor with this to get the box."""
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


class StageModule(nn.Module):
    """The layer chunks of `device`'s stage, its TP shard, with global parameter names.

    `forward(x, chunk)` runs chunk `chunk` (one, or several under the interleaved schedule). Input:
    token ids [batch, seq] for a chunk that starts at layer 0, else hidden states [batch, seq,
    hidden] (under sequence parallelism, [batch, seq / tp, hidden]: this rank's slice). Output: this
    rank's vocabulary columns of the logits for a chunk that ends with the head, else hidden states
    (complete and identical on every TP rank of the stage, or this rank's slice under sequence
    parallelism).
    """

    def __init__(self, plan: Plan, device: str, group, *, seed: int):
        super().__init__()
        config = plan.model
        pi, si = plan.placement(device)
        stage = plan.pipelines[pi].stages[si]
        tp_degree, tp_rank = stage.tp_degree, stage.devices.index(device)
        self.config, self.group = config, group
        sp = stage.sequence_parallel
        self.sequence_shards = tp_degree if sp else 1
        self.chunks = stage.chunks
        self.full_recompute = [stage.chunk_recompute(k) == "full" for k in range(stage.num_chunks)]
        self.is_first = any(start == 0 for start, _ in self.chunks)  # holds the embedding (reads tokens)
        self.is_last = any(end == config.num_layers for _, end in self.chunks)  # holds the head (the loss)
        self.pieces: dict[str, tuple] = {spec.name: (spec, box) for spec, box in device_pieces(plan, device)}

        vocab_piece = self.pieces.get("embed.weight") or self.pieces.get("head.output.weight")
        rows, self.vocab_offset = (
            (vocab_piece[1].sizes[0], vocab_piece[1].offsets[0]) if vocab_piece else (0, 0)
        )
        has_embedding = "embed.weight" in self.pieces
        self.embed = (
            VocabParallelEmbedding(rows, config.hidden_size, self.vocab_offset, group, sp)
            if has_embedding
            else None
        )
        self.blocks = nn.ModuleDict()
        self._chunk_blocks: list[list[str]] = []
        for k in range(stage.num_chunks):
            names = [str(i) for i in self._block_range(k)]
            for name in names:
                block = apply_tensor_parallel(Block(config, tp_degree, tp_rank), group, sp)
                block.attn.recompute_core = stage.chunk_recompute(k) == "selective"
                block.attn.kernel = plan.attention
                self.blocks[name] = block
            self._chunk_blocks.append(names)
        self.head = VocabParallelHead(config, rows, group, sp) if self.is_last else None
        self._rotary: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._initialise(seed)

    def _block_range(self, chunk: int) -> range:
        """Block indices of a chunk (layer 0 is the embedding, layer num_layers - 1 the head)."""
        start, end = self.chunks[chunk]
        return range(max(start, 1) - 1, min(end, self.config.num_layers - 1) - 1)

    def starts(self, chunk: int) -> bool:
        """Whether `chunk` begins with the embedding (its input is token ids)."""
        return self.chunks[chunk][0] == 0

    def ends(self, chunk: int) -> bool:
        """Whether `chunk` ends with the head (its output is logits)."""
        return self.chunks[chunk][1] == self.config.num_layers

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        params = dict(self.named_parameters())
        if set(params) != set(self.pieces):
            raise RuntimeError(
                f"stage {list(self.chunks)} builds {sorted(set(params) ^ set(self.pieces))} "
                "differently from costmodel.layout"
            )
        for name, param in params.items():
            spec, box = self.pieces[name]
            if tuple(param.shape) != box.sizes:
                raise RuntimeError(f"{name}: module shard {tuple(param.shape)} but layout box {box.sizes}")
            param.copy_(init_tensor(name, spec.shape, self.config, seed)[box_slices(box)])

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        if self.starts(chunk):
            x = self.embed(x)
        names = self._chunk_blocks[chunk]
        if names:
            seq_len = x.shape[1] * self.sequence_shards  # attention sees the whole sequence
            key = (seq_len, x.device)
            if key not in self._rotary:
                self._rotary[key] = rotary_tables(self.config, seq_len, device=x.device)
            cos, sin = self._rotary[key]
            full = self.full_recompute[chunk] and torch.is_grad_enabled()
            for name in names:
                block = self.blocks[name]
                x = checkpoint(block, x, cos, sin, use_reentrant=False) if full else block(x, cos, sin)
        if self.ends(chunk):
            x = self.head(x, self.embed.weight if self.head.output is None else None)
        return x

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of a last stage's (vocabulary-sharded) logits; the same on every TP rank."""
        return vocab_parallel_cross_entropy_sum(logits, targets, self.vocab_offset, self.group)

"""The two shapes a training state takes at the checkpoint's boundary: pieces to save, boxes to load."""

from typing import NamedTuple

import torch

from costmodel.plan import Plan
from costmodel.sharding import state_boxes
from runtime.checkpoint.format import OPTIMIZER_PREFIXES


class Piece(NamedTuple):
    """Part of a global tensor that this rank holds: `tensor` is the box at `offsets` of `shape`."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


def as_piece(piece) -> Piece:
    """A `Piece` from a (name, global shape, offsets, tensor) tuple or an object with those fields
    (`name`, `global_shape` or `shape`, `offsets`, `tensor`, as runtime.state.StatePiece has)."""
    if isinstance(piece, tuple):
        name, shape, offsets, tensor = piece
    else:
        name, offsets, tensor = piece.name, piece.offsets, piece.tensor
        shape = getattr(piece, "global_shape", None) or piece.shape
    return Piece(name, tuple(shape), tuple(offsets), tensor)


class Wanted(NamedTuple):
    """A box of a global tensor to load: `sizes` at `offsets` of the tensor `name` of `shape`."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype


def wanted_for(
    plan: Plan, rank: int, *, optimizer: bool = True, dtype: torch.dtype = torch.float32
) -> list[Wanted]:
    """What rank `rank` keeps under `plan` (`costmodel.sharding.state_boxes`: its rows of every
    parameter, under ZeRO-1 only its slices): the fp32 masters, and their AdamW moments if `optimizer`."""
    prefixes = ("", *OPTIMIZER_PREFIXES) if optimizer else ("",)
    return [
        Wanted(prefix + spec.name, spec.shape, box.offsets, box.sizes, dtype)
        for spec, box in state_boxes(plan)[plan.devices[rank]]
        for prefix in prefixes
    ]

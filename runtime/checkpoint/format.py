"""The on-disk format: a directory of data files and one JSON manifest, never pickle.

A checkpoint directory (`step-00000100`) holds:

- `data-00000.bin`, `data-00001.bin`, ...: raw tensor bytes, one file per writer. The number in a
  name only tells files apart; what a file holds is read from the manifest alone, so nothing in a
  file name encodes the plan a checkpoint was saved under.
- `manifest.json`, written last: every tensor by its global name (`blocks.3.attn.wq.weight`,
  `optim.exp_avg.blocks.3.attn.wq.weight`) with dtype, global shape and `split_dim`, and its pieces;
  each piece is a box of the global tensor with the file, byte offset, length, the CRC32C of the
  whole piece and the CRC32C of every `chunk_bytes` chunk of it. Also: step, model config, the plan
  it was saved under, the runtime's metadata (data cursor, LR schedule, RNG states), and the CRC32C
  of the manifest itself.

Storage order: a piece is the global tensor's rows `[start, stop)` along `split_dim` (the dimension
tensor parallelism splits; 0 for replicated tensors), stored with `split_dim` moved to the front,
row-major. Every shard any plan can ask for is then one contiguous byte run per piece it overlaps:
column-parallel weights are stored as they are, row-parallel ones (`wo`, `down`, split along dim 1)
are stored transposed. A load reads only the chunks that overlap its rows (at most one partial chunk
at each end of a run) and checks each chunk's CRC32C, so a partial read is verified without
reading the whole piece.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

from costmodel.errors import ElastorError
from costmodel.jsonio import SCHEMA_VERSION

FORMAT = "elastor-checkpoint"
MANIFEST = "manifest.json"
LATEST = "latest"
# Checksum granularity: the most a load over-reads at each end of a byte run, and the resolution of
# `verify`'s "which bytes are bad". At 1 MiB a 70B-parameter state has under a million checksums.
CHUNK_BYTES = 1 << 20
# Pieces are cut at most this large so that replicated tensors balance across writers.
PIECE_BYTES = 32 << 20
OPTIMIZER_PREFIXES = ("optim.exp_avg.", "optim.exp_avg_sq.")

_STEP_DIR = re.compile(r"^step-(\d{8,})(?:-(\d+))?$")

# Model state is floating point: parameters and their AdamW moments. A save of anything else is
# refused (`dtype_name`), and so is a manifest that names anything else (`checks`).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ElastorError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model."""


def crc(data, value: int = 0) -> int:
    """CRC32C (Castagnoli; hardware-accelerated) of a bytes-like object, continuing from `value`."""
    return crc32c.crc32c(data, value)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(
            f"Tensors of dtype {dtype} cannot be checkpointed; use one of {', '.join(DTYPES)}."
        )
    return DTYPE_NAMES[dtype]


def kind_of(name: str) -> str:
    """The kind of a state tensor, as its name prefix: "" for a parameter, "optim.exp_avg." ..."""
    return next((prefix for prefix in OPTIMIZER_PREFIXES if name.startswith(prefix)), "")


def base_name(name: str) -> str:
    """The parameter a state tensor belongs to: `optim.exp_avg.embed.weight` -> `embed.weight`."""
    return name[len(kind_of(name)) :]


def step_dir_name(step: int, revision: int = 0) -> str:
    return f"step-{step:08d}" + (f"-{revision}" if revision else "")


def parse_step_dir(name: str) -> tuple[int, int] | None:
    """(step, revision) of a committed checkpoint's directory name, None for anything else."""
    m = _STEP_DIR.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


@dataclass(frozen=True, kw_only=True)
class PieceEntry:
    """Rows [start, stop) of a tensor along its split dimension, stored at file[offset : offset + nbytes]."""

    start: int
    stop: int
    file: str
    offset: int
    nbytes: int
    crc32c: int
    chunk_crc32c: tuple[int, ...]

    def to_json(self, shape: tuple[int, ...], split_dim: int) -> dict[str, Any]:
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[split_dim], sizes[split_dim] = self.start, self.stop - self.start
        return {
            "offsets": offsets,
            "sizes": sizes,
            "file": self.file,
            "offset": self.offset,
            "bytes": self.nbytes,
            "crc32c": self.crc32c,
            "chunk_crc32c": list(self.chunk_crc32c),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], split_dim: int) -> "PieceEntry":
        start = data["offsets"][split_dim]
        return cls(
            start=start,
            stop=start + data["sizes"][split_dim],
            file=data["file"],
            offset=data["offset"],
            nbytes=data["bytes"],
            crc32c=data["crc32c"],
            chunk_crc32c=tuple(data["chunk_crc32c"]),
        )


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    split_dim: int
    pieces: tuple[PieceEntry, ...]  # sorted by start

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the split dimension (one stored row)."""
        n = self.itemsize
        for d, s in enumerate(self.shape):
            if d != self.split_dim:
                n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.row_bytes * (self.shape[self.split_dim] if self.shape else 1)

    def storage_shape(self) -> tuple[int, ...]:
        """The shape a piece of all rows has on disk: split_dim first, the others in order."""
        if not self.shape:
            return ()
        rest = [s for d, s in enumerate(self.shape) if d != self.split_dim]
        return (self.shape[self.split_dim], *rest)

    def gaps(self) -> str | None:
        """A description of the first gap or overlap among the pieces, None when they tile the tensor."""
        extent = self.shape[self.split_dim] if self.shape else 1
        position = 0
        for p in self.pieces:
            if p.start != position:
                kind = "overlap" if p.start < position else "gap"
                return f"an {kind} at row {min(p.start, position)} of dim {self.split_dim}"
            if p.nbytes != (p.stop - p.start) * self.row_bytes:
                return f"a piece of rows [{p.start}, {p.stop}) with {p.nbytes} bytes"
            position = p.stop
        return None if position == extent else f"a gap from row {position} of dim {self.split_dim}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "split_dim": self.split_dim,
            "pieces": [p.to_json(self.shape, self.split_dim) for p in self.pieces],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TensorEntry":
        split_dim = data["split_dim"]
        pieces = sorted((PieceEntry.from_json(p, split_dim) for p in data["pieces"]), key=lambda p: p.start)
        return cls(
            name=data["name"],
            dtype=data["dtype"],
            shape=tuple(data["shape"]),
            split_dim=split_dim,
            pieces=tuple(pieces),
        )


def manifest_checksum(body: dict[str, Any]) -> int:
    """CRC32C of the manifest's canonical JSON, without its own checksum field."""
    canonical = {k: v for k, v in body.items() if k != "manifest_crc32c"}
    return crc(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The parsed, checked `manifest.json` of one checkpoint directory."""

    path: Path  # the checkpoint directory
    step: int
    created_time_s: float
    model: dict[str, Any]
    plan: dict[str, Any]
    meta: dict[str, Any]
    chunk_bytes: int
    files: dict[str, int]  # data file -> its size in bytes
    tensors: dict[str, TensorEntry]

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        """The manifest of `directory`, refused unless it passes every check of `checks`."""
        from runtime.checkpoint import checks  # it builds on this module's names

        path = directory / MANIFEST
        if not (path.exists() or path.is_symlink()):
            raise CheckpointError(
                f"{directory} is not a complete checkpoint: it has no {MANIFEST}, "
                "so its save never committed."
            )
        text = checks.read_manifest_text(path)
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"The checkpoint manifest {path} is corrupt: not valid JSON ({e.msg})."
            ) from None
        except RecursionError:
            raise CheckpointError(f"The checkpoint manifest {path} is nested too deeply to read.") from None
        if not isinstance(body, dict):
            raise CheckpointError(f"The checkpoint manifest {path} is corrupt: it is not a JSON object.")
        if body.get("manifest_crc32c") != manifest_checksum(body):
            raise CheckpointError(f"The checkpoint manifest {path} is corrupt: its CRC32C does not match.")
        if body.get("format") != FORMAT or body.get("schema_version") != SCHEMA_VERSION:
            raise CheckpointError(
                f"{path} is not an Elastor checkpoint manifest of schema_version {SCHEMA_VERSION}."
            )
        checks.check_body(body, path)
        tensors = [TensorEntry.from_json(t) for t in body["tensors"]]
        return cls(
            path=directory,
            step=body["step"],
            created_time_s=body["created_time_s"],
            model=body["model"],
            plan=body["plan"],
            meta=body["meta"],
            chunk_bytes=body["chunk_bytes"],
            files={f["file"]: f["bytes"] for f in body["files"]},
            tensors={t.name: t for t in tensors},
        )

    def check_files(self) -> None:
        """Every data file present, regular (not a link, FIFO or device) and of its listed size."""
        from runtime.checkpoint import checks

        for file, expected in self.files.items():
            os.close(checks.open_sized(self.path, file, expected))


def manifest_body(
    *,
    step: int,
    model: dict[str, Any],
    plan: dict[str, Any],
    meta: dict[str, Any],
    chunk_bytes: int,
    files: dict[str, int],
    tensors: list[TensorEntry],
    created_time_s: float,
) -> dict[str, Any]:
    """The JSON object `manifest.json` holds, checksum included."""
    body = {
        "schema_version": SCHEMA_VERSION,
        "format": FORMAT,
        "step": step,
        "created_time_s": created_time_s,
        "model": model,
        "plan": plan,
        "meta": meta,
        "chunk_bytes": chunk_bytes,
        "files": [{"file": f, "bytes": n} for f, n in sorted(files.items())],
        "tensors": [t.to_json() for t in tensors],
    }
    body["manifest_crc32c"] = manifest_checksum(body)
    return body

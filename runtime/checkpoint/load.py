"""Loading into any plan: read only the byte ranges a rank's shards need, verify them, build the shards.

A wanted box covers rows [a, b) of a tensor along its split dimension. Each stored piece it
overlaps contributes one contiguous byte run (see `format`); the run is widened to whole checksum
chunks, chunks lying wholly inside the run are read straight into the output tensor, the at most
two partial ones at its ends go through a two-chunk bounce buffer, and every chunk's CRC32C is
checked before its bytes are used. Host memory is the output tensors plus two chunks.

A box that is not whole along the other dimensions (no Elastor plan asks for one) is read as its
full rows and sliced.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from costmodel.config import ModelConfig
from runtime.checkpoint.checks import open_sized
from runtime.checkpoint.format import DTYPES, CheckpointError, Manifest, TensorEntry, crc
from runtime.checkpoint.pieces import Wanted, as_piece
from runtime.checkpoint.store import resolve

_files_opened = 0  # manifests and data files this process has opened to read a checkpoint


def files_opened() -> int:
    """Checkpoint files (manifests, data files) this process has opened for reading so far: the
    in-process recovery asserts it reads none (runtime/elastic/inprocess.py)."""
    return _files_opened


class ModelMismatch(CheckpointError):
    """A checkpoint of another model: refused, never skipped for an older one."""


def check_model(manifest: Manifest, model: ModelConfig) -> None:
    """Refuse a checkpoint of another model, naming the fields that differ."""
    saved = ModelConfig.from_json(manifest.model)
    if saved == model:
        return
    ours, theirs = model.to_json(), saved.to_json()
    differ = [f"{k} {theirs[k]!r} (expected {ours[k]!r})" for k in ours if ours[k] != theirs.get(k)]
    raise ModelMismatch(
        f"The checkpoint {manifest.path} holds model {saved.name!r}, which differs from {model.name!r} in "
        f"{', '.join(differ)}; point --ckpt-dir at a checkpoint of this model."
    )


class CheckpointReader:
    """Reads boxes of tensors from one checkpoint directory; `model` (if given) must match its config."""

    def __init__(self, path: str | os.PathLike, model: ModelConfig | None = None):
        global _files_opened
        self.path = resolve(path)
        _files_opened += 1
        self.manifest = Manifest.read(self.path)
        if model is not None:
            check_model(self.manifest, model)
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    def entry(self, name: str) -> TensorEntry:
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"The checkpoint {self.path} has no tensor {name!r}.")
        return entry

    def read(self, want: Wanted | tuple) -> torch.Tensor:
        """The box `want` describes, as a new contiguous tensor of the wanted dtype."""
        name, shape, offsets, sizes, dtype = want
        entry = self.entry(name)
        if tuple(shape) != entry.shape:
            raise CheckpointError(
                f"Tensor {name!r} has shape {entry.shape} in the checkpoint {self.path}, not {tuple(shape)}."
            )
        if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            raise CheckpointError(
                f"The box {tuple(sizes)} at {tuple(offsets)} lies outside {name!r} {tuple(shape)}."
            )
        d = entry.split_dim
        a, b = offsets[d], offsets[d] + sizes[d]
        rest = [s for k, s in enumerate(entry.shape) if k != d]
        stored = torch.empty((b - a, *rest), dtype=DTYPES[entry.dtype])
        self._read_rows(entry, a, b, stored.view(-1).view(torch.uint8) if stored.numel() else stored)
        logical = stored.movedim(0, d)
        boxed = [slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
        boxed[d] = slice(None)  # the rows read are exactly the box's along the split dimension
        return logical[tuple(boxed)].to(dtype).contiguous()

    def _read_rows(self, entry: TensorEntry, a: int, b: int, out: torch.Tensor) -> None:
        """Rows [a, b) of `entry` in storage order into the byte tensor `out`."""
        row = entry.row_bytes
        for piece in entry.pieces:
            r0, r1 = max(a, piece.start), min(b, piece.stop)
            if r0 >= r1:
                continue
            lo, hi = (r0 - piece.start) * row, (r1 - piece.start) * row  # bytes of the run, in the piece
            dest = (r0 - a) * row  # where byte `lo` of the piece goes in `out`
            self._read_run(entry, piece, lo, hi, out, dest)

    def _read_run(self, entry, piece, lo: int, hi: int, out: torch.Tensor, dest: int) -> None:
        size = self.manifest.chunk_bytes
        fd = self._open(piece.file)
        first, last = lo // size, (hi - 1) // size
        k = first
        whole_piece = lo == 0 and hi == piece.nbytes
        running = 0
        while k <= last:
            c0, c1 = k * size, min((k + 1) * size, piece.nbytes)
            if lo <= c0 and c1 <= hi:
                # A run of whole chunks: straight into the output, then checked there.
                j = k
                while j + 1 <= last and min((j + 2) * size, piece.nbytes) <= hi:
                    j += 1
                end = min((j + 1) * size, piece.nbytes)
                target = out[dest + c0 - lo : dest + end - lo].numpy()
                self._pread(fd, piece, c0, target)
                for m in range(k, j + 1):
                    chunk = target[m * size - c0 : min((m + 1) * size, piece.nbytes) - c0]
                    self._check_chunk(entry, piece, m, chunk)
                    if whole_piece:
                        running = crc(chunk, running)
                k = j + 1
            else:
                # A chunk the run covers only in part: through a bounce buffer, then the needed bytes.
                bounce = torch.empty(c1 - c0, dtype=torch.uint8).numpy()
                self._pread(fd, piece, c0, bounce)
                self._check_chunk(entry, piece, k, bounce)
                u0, u1 = max(lo, c0), min(hi, c1)
                out[dest + u0 - lo : dest + u1 - lo].numpy()[:] = bounce[u0 - c0 : u1 - c0]
                k += 1
        if whole_piece and running != piece.crc32c:
            raise CheckpointError(
                f"Checkpoint file {self.path / piece.file} is corrupt: rows [{piece.start}, {piece.stop}) of "
                f"{entry.name!r} fail their CRC32C check."
            )

    def _pread(self, fd: int, piece, begin: int, target) -> None:
        """Fill `target` from the piece's bytes [begin, begin + len(target))."""
        view = memoryview(target).cast("B")
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], piece.offset + begin + done)
            except OSError as e:
                raise CheckpointError(
                    f"Checkpoint file {self.path / piece.file} cannot be read ({e.strerror or e})."
                ) from None
            if n == 0:
                raise CheckpointError(
                    f"Checkpoint file {self.path / piece.file} is truncated: it ends before byte "
                    f"{piece.offset + begin + done}."
                )
            done += n
        self.bytes_read += done

    def _check_chunk(self, entry, piece, k: int, data) -> None:
        if crc(data) != piece.chunk_crc32c[k]:
            size = self.manifest.chunk_bytes
            raise CheckpointError(
                f"Checkpoint file {self.path / piece.file} is corrupt: bytes {piece.offset + k * size}.."
                f"{piece.offset + k * size + len(data)} (tensor {entry.name!r}) fail their CRC32C check."
            )

    def _open(self, file: str) -> int:
        global _files_opened
        fd = self._fds.get(file)
        if fd is None:
            _files_opened += 1
            fd = open_sized(self.path, file, self.manifest.files[file])
            self._fds[file] = fd
        return fd


def load_checkpoint(
    path: str | os.PathLike, wanted: Sequence[Wanted | tuple], *, model: ModelConfig | None = None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The wanted boxes (in order) and the saved metadata, from DIR (a checkpoint or a --ckpt-dir)."""
    with CheckpointReader(path, model) as reader:
        return [reader.read(w) for w in wanted], reader.meta


def restore(
    path: str | os.PathLike, pieces: Sequence[tuple], *, model: ModelConfig | None = None
) -> dict[str, Any]:
    """Fill the state's pieces (name, global shape, offsets, tensor) in place; returns the metadata."""
    with CheckpointReader(path, model) as reader:
        for name, shape, offsets, tensor in map(as_piece, pieces):
            value = reader.read(Wanted(name, shape, offsets, tuple(tensor.shape), tensor.dtype))
            with torch.no_grad():
                tensor.copy_(value)
        return reader.meta


def checkpoint_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any], int]:
    """(checkpoint directory, metadata, step) of DIR without reading any tensor."""
    manifest = Manifest.read(resolve(path))
    return manifest.path, manifest.meta, manifest.step

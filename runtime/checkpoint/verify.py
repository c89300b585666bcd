"""Whole-checkpoint checks: every file present and of the listed size, every tensor tiled by its
pieces, every chunk's and every piece's CRC32C. Streams each piece through one chunk-sized buffer."""

import os
from dataclasses import dataclass

import torch

from runtime.checkpoint.checks import open_regular, open_sized
from runtime.checkpoint.format import CheckpointError, Manifest, crc
from runtime.checkpoint.store import resolve


@dataclass(frozen=True)
class VerifyReport:
    path: os.PathLike
    step: int
    tensors: int
    pieces: int
    bytes_checked: int
    problems: tuple[str, ...]  # one sentence each, naming the file and the tensor


def verify_checkpoint(path: str | os.PathLike) -> VerifyReport:
    """Check everything in DIR (a checkpoint or a --ckpt-dir's newest); problems are reported, not raised.

    A DIR that holds no checkpoint at all raises CheckpointError.
    """
    directory = resolve(path)
    try:
        manifest = Manifest.read(directory)
    except CheckpointError as e:
        return VerifyReport(directory, -1, 0, 0, 0, (str(e),))
    problems: list[str] = []
    bad_files: set[str] = set()
    for file, expected in manifest.files.items():
        try:
            os.close(open_sized(directory, file, expected))
        except CheckpointError as e:
            problems.append(str(e))
            bad_files.add(file)
    checked = pieces = 0
    buffer = torch.empty(manifest.chunk_bytes, dtype=torch.uint8).numpy()
    for entry in manifest.tensors.values():  # `Manifest.read` checked that the pieces tile it
        for piece in entry.pieces:
            pieces += 1
            if piece.file in bad_files:
                continue
            problem = _check_piece(directory, manifest.chunk_bytes, entry.name, piece, buffer)
            checked += piece.nbytes
            if problem:
                problems.append(problem)
    return VerifyReport(directory, manifest.step, len(manifest.tensors), pieces, checked, tuple(problems))


def _check_piece(directory, chunk_bytes: int, name: str, piece, buffer) -> str | None:
    running = 0
    path = directory / piece.file
    with open(open_regular(directory, piece.file), "rb", buffering=0) as f:
        f.seek(piece.offset)
        for k, expected in enumerate(piece.chunk_crc32c):
            size = min(chunk_bytes, piece.nbytes - k * chunk_bytes)
            view = memoryview(buffer)[:size]
            if f.readinto(view) != size:
                return f"Checkpoint file {path} is truncated inside {name!r}."
            if crc(view) != expected:
                begin = piece.offset + k * chunk_bytes
                return (
                    f"Checkpoint file {path} is corrupt: bytes {begin}..{begin + size} (tensor {name!r}) "
                    "fail their CRC32C check."
                )
            running = crc(view, running)
    if running != piece.crc32c or len(piece.chunk_crc32c) * chunk_bytes < piece.nbytes:
        rows = f"[{piece.start}, {piece.stop})"
        return f"Checkpoint file {path} is corrupt: rows {rows} of {name!r} fail their CRC32C check."
    return None

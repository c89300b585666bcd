"""Whole-checkpoint checks: every file present and of the listed size, every tensor tiled by its
pieces, every chunk's and every piece's CRC32C. Streams each piece through one chunk-sized buffer."""

import os
from dataclasses import dataclass

import torch

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
        p = directory / file
        if not p.is_file():
            problems.append(f"Checkpoint file {p} is missing.")
            bad_files.add(file)
        elif p.stat().st_size != expected:
            actual = p.stat().st_size
            kind = "truncated" if actual < expected else "too long"
            problems.append(
                f"Checkpoint file {p} is {kind}: {actual} bytes, not the {expected} its manifest lists."
            )
            bad_files.add(file)
    checked = pieces = 0
    buffer = torch.empty(manifest.chunk_bytes, dtype=torch.uint8).numpy()
    for entry in manifest.tensors.values():
        gap = entry.gaps()
        if gap:
            problems.append(f"Tensor {entry.name!r} in {directory / 'manifest.json'} has {gap}.")
        for piece in entry.pieces:
            pieces += 1
            if piece.file in bad_files or piece.file not in manifest.files:
                if piece.file not in manifest.files:
                    problems.append(
                        f"Tensor {entry.name!r} lists file {piece.file}, which the manifest does not."
                    )
                continue
            problem = _check_piece(directory / piece.file, manifest.chunk_bytes, entry.name, piece, buffer)
            checked += piece.nbytes
            if problem:
                problems.append(problem)
    return VerifyReport(directory, manifest.step, len(manifest.tensors), pieces, checked, tuple(problems))


def _check_piece(path, chunk_bytes: int, name: str, piece, buffer) -> str | None:
    running = 0
    with open(path, "rb", buffering=0) as f:
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

"""Asynchronous, deduplicated, crash-safe saves: `Checkpointer`.

The training loop calls `save(step, pieces, meta)` and is blocked only while this rank copies the
parts it writes (see `assign`) into a page-aligned host buffer, reused across saves (pinned on CUDA);
checksums, the file write (O_DIRECT where the file system allows it), fsyncs and the commit run in a
background thread. At most one save is in flight: the next `save` first waits for the previous one.
Host memory: one buffer of this rank's share, about the state's size divided by the world size.

Ranks coordinate through the file system, not through collectives: each rank's background thread
writes its data file and then its index fragment into the save's temporary directory, and rank 0's
thread commits once every fragment is there (or fails after `commit_timeout_s`). A collective inside
a background thread would race with the training loop's own collectives on the same group (gloo and
NCCL order operations per group), and a dedicated group would still block rank 0's thread on a dead
peer with no clearer error. The only collective is one broadcast at construction, in the caller's
thread, that agrees on a session id: the temporary directories of this run are named after it, so
fragments left by a crashed run are never mixed into a new save (and rank 0 removes them first).
This needs a file system every rank sees (a local disk for one node, a shared one across nodes).
"""

import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from costmodel.plan import Plan
from runtime.checkpoint import store
from runtime.checkpoint.assign import WriteItem, assign_writers, holdings
from runtime.checkpoint.commit import ALIGN, SaveJob
from runtime.checkpoint.format import (
    CHUNK_BYTES,
    OPTIMIZER_PREFIXES,
    PIECE_BYTES,
    CheckpointError,
    base_name,
    dtype_name,
    kind_of,
)
from runtime.checkpoint.load import load_checkpoint, restore
from runtime.checkpoint.pieces import Piece, Wanted, as_piece


class Checkpointer:
    """Saves one rank's share of the training state under `plan` into `directory` (a --ckpt-dir).

    Every rank of the plan constructs one, in the same order relative to its other collectives.
    `session` is an id shared by all ranks of this run; when it is None and the plan has more than
    one rank, it is broadcast from rank 0 over `group` (default: the world), so torch.distributed
    must be initialised.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        plan: Plan,
        rank: int,
        *,
        keep: int = 2,
        session: str | None = None,
        group=None,
        piece_bytes: int = PIECE_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        commit_timeout_s: float = 600.0,
    ):
        if keep < 1:
            raise CheckpointError(
                f"keep must be at least 1, not {keep}; the newest checkpoint is always kept."
            )
        self.directory = Path(directory)
        self.plan, self.rank, self.keep = plan, rank, keep
        self.piece_bytes, self.chunk_bytes, self.commit_timeout_s = piece_bytes, chunk_bytes, commit_timeout_s
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"The checkpoint directory {directory} cannot be created ({e.strerror})."
            ) from None
        if session is not None and not store.SESSION.fullmatch(session):
            raise CheckpointError(
                f"A save session id is 12 lowercase hex digits, not {session!r}: the id names the save's "
                "temporary directories, and only names of that form are ever cleaned up."
            )
        provided = session
        if session is None:
            session = secrets.token_hex(6) if rank == 0 else ""
        if rank == 0:
            store.remove_stale(self.directory, session)
        if provided is None and plan.world_size > 1:
            session = _broadcast_session(session, group)
        self.session = session
        self._params = {name: spec for name, (spec, _) in holdings(plan).items()}
        self._saves = 0
        self._assignments: dict[tuple, list[WriteItem]] = {}
        self._buffer: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._abandoned = threading.Event()
        self.last_path: Path | None = None  # the newest checkpoint this rank 0 committed
        # Seconds of the last save from save() until this rank's part was durable (rank 0: committed,
        # `latest` updated; pruning older checkpoints comes after).
        self.last_save_s: float | None = None

    # ---- public API -----------------------------------------------------------------------------
    def save(self, step: int, pieces: Sequence[Piece | tuple], meta: dict[str, Any]) -> float:
        """Snapshot this rank's share and return; write and commit in the background.

        Returns the seconds the caller was blocked (waiting for the previous save, plus the copy).
        """
        began = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        meta_text = _json_text(meta)
        pieces = [as_piece(p) for p in pieces]
        kinds = self._kinds(pieces)
        key = tuple(kinds.items())
        if key not in self._assignments:  # the same for every save of the same kinds of state
            items = assign_writers(self.plan, kinds, self.piece_bytes)
            self._assignments[key] = [i for i in items if i.writer == self.rank]
        mine = list(self._assignments[key])
        # Larger item sizes first, so every piece's offset is a multiple of its item size (no padding).
        mine.sort(key=lambda i: -kinds[kind_of(i.name)])
        layout, total = [], 0
        for item in mine:
            layout.append(total)
            total += item.nbytes
        buffer = self._snapshot(pieces, mine, layout, total)
        tmp = self.directory / store.tmp_name(self.session, self._saves)
        self._saves += 1
        dtypes = {p.name: dtype_name(p.tensor.dtype) for p in pieces}
        job = SaveJob(self, step, tmp, mine, layout, buffer[:total], dtypes, meta_text, started)
        self._thread = threading.Thread(target=job.run, name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - began

    def wait(self) -> Path | None:
        """Wait for the save in flight; re-raise its error. Returns the committed path on rank 0."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        result, self._result = self._result, None
        return result

    def settle(self) -> None:
        """Wait for the save in flight, if any, and drop its outcome: for a job that is ending on
        another error (a save's own error is raised by `wait`)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._error = self._result = None

    def abandon(self) -> None:
        """Give up the save in flight, if it is not committed yet: rank 0 stops waiting for the other
        ranks' parts and removes it (a peer that died will never write its part); the other ranks
        finish writing theirs. Then settle. For a job whose ranks are re-forming in-process."""
        self._abandoned.set()
        self.settle()
        self._abandoned.clear()

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the directory, None if it has none."""
        return store.latest_checkpoint(self.directory)

    def load(
        self, wanted: Sequence[Wanted | tuple], path: str | os.PathLike | None = None
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The wanted boxes and the metadata from `path` (default: the newest checkpoint here).

        Whatever plan the checkpoint was saved under; a checkpoint of another model is refused.
        """
        return load_checkpoint(path or self.directory, wanted, model=self.plan.model)

    def restore(
        self, pieces: Sequence[Piece | tuple], path: str | os.PathLike | None = None
    ) -> dict[str, Any]:
        """Fill this rank's pieces in place from `path` (default: the newest checkpoint here)."""
        return restore(path or self.directory, pieces, model=self.plan.model)

    # ---- the blocking part ----------------------------------------------------------------------
    def _kinds(self, pieces: list[Piece]) -> dict[str, int]:
        """Name prefix -> item size of each kind of state; checks names and shapes against the plan."""
        kinds: dict[str, int] = {}
        for p in pieces:
            base = base_name(p.name)
            spec = self._params.get(base)
            if spec is None:
                raise CheckpointError(
                    f"Tensor {p.name!r} is not part of model {self.plan.model.name!r}'s state."
                )
            if p.shape != spec.shape:
                raise CheckpointError(
                    f"Tensor {p.name!r} has global shape {p.shape}, not the model's {spec.shape}."
                )
            prefix = kind_of(p.name)
            size = p.tensor.element_size()
            if kinds.setdefault(prefix, size) != size:
                raise CheckpointError(
                    f"The {prefix or 'parameter'} tensors must share one dtype to be saved."
                )
        if "" not in kinds:
            raise CheckpointError("A saved state needs the model's parameters, not only optimizer states.")
        return {prefix: kinds[prefix] for prefix in ("", *OPTIMIZER_PREFIXES) if prefix in kinds}

    def _snapshot(
        self, pieces: list[Piece], mine: list[WriteItem], layout: list[int], total: int
    ) -> torch.Tensor:
        """Copy this rank's share into the reused host buffer, in storage order."""
        on_cuda = any(p.tensor.is_cuda for p in pieces)
        if self._buffer is None or self._buffer.numel() < total or self._buffer.is_pinned() != on_cuda:
            self._buffer = None  # free the old one first
            storage = torch.empty(total + ALIGN, dtype=torch.uint8, pin_memory=on_cuda)
            start = -storage.data_ptr() % ALIGN  # page-aligned, for O_DIRECT writes
            self._buffer = storage[start : start + total]
        by_name: dict[str, list[Piece]] = {}
        for p in pieces:
            by_name.setdefault(p.name, []).append(p)
        for item, offset in zip(mine, layout, strict=True):
            source = _rows(by_name.get(item.name, []), item, self.rank)
            target = self._buffer[offset : offset + item.nbytes].view(source.dtype)
            target = target.view(source.movedim(item.split_dim, 0).shape)
            target.copy_(source.movedim(item.split_dim, 0), non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.current_stream().synchronize()
        return self._buffer


def _rows(pieces: list[Piece], item: WriteItem, rank: int) -> torch.Tensor:
    """Rows [item.start, item.stop) of the local piece that holds them, in global layout."""
    d = item.split_dim
    for p in pieces:
        lo, size = p.offsets[d], p.tensor.shape[d]
        full_elsewhere = all(
            p.offsets[k] == 0 and p.tensor.shape[k] == s for k, s in enumerate(p.shape) if k != d
        )
        if full_elsewhere and lo <= item.start and item.stop <= lo + size:
            return p.tensor.detach().narrow(d, item.start - lo, item.stop - item.start)
    raise CheckpointError(
        f"Rank {rank} writes rows [{item.start}, {item.stop}) of {item.name!r} but holds no piece with them; "
        "its pieces must be the boxes costmodel.layout.device_pieces gives its device."
    )


def _json_text(meta: dict[str, Any]) -> str:
    """`meta` as JSON text, checked now (in the caller's thread) so a bad value fails at once."""
    try:
        return json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"The checkpoint metadata must be JSON-serialisable: {e}.") from None


def _broadcast_session(session: str, group) -> str:
    """Rank 0's session id, on every rank (one int64 broadcast; no pickling)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CheckpointError(
            "A multi-rank Checkpointer needs torch.distributed initialised, or an explicit session id."
        )
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    value = torch.tensor([int(session, 16) if session else 0], dtype=torch.int64, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(value, src=src, group=group)
    return f"{value.item():012x}"

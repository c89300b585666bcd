"""The background half of a save: checksums, the data file, the index fragment, and rank 0's commit.

See `save` for who runs this and `store` for the commit protocol. Everything here runs in the save's
background thread; errors are handed to the training loop at its next `wait()` or `save()`.
"""

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from runtime.checkpoint import store
from runtime.checkpoint.format import (
    MANIFEST,
    OPTIMIZER_PREFIXES,
    CheckpointError,
    PieceEntry,
    TensorEntry,
    base_name,
    crc,
    kind_of,
    manifest_body,
    step_dir_name,
)

_POLL_S = 0.005
_WRITE_BYTES = 8 << 20  # per write() call
ALIGN = 4096  # O_DIRECT's alignment of memory, file offsets and lengths (the page size on Linux)


class SaveJob:
    """The background half of one save: checksums, the data file, the fragment, and (rank 0) the commit."""

    def __init__(self, owner, step, tmp, items, layout, buffer, dtypes, meta_text, started):
        self.owner = owner
        self.started = started
        self.step, self.tmp, self.items, self.layout = step, tmp, items, layout
        self.buffer, self.dtypes, self.meta_text = buffer, dtypes, meta_text
        self.committed = False  # set once the rename made the checkpoint durable

    def run(self) -> None:
        try:
            self.owner._result = self._run()
        except OSError as e:  # disk full, a read-only or vanished directory: one sentence, no debris
            what = f"Saving step {self.step} to {self.owner.directory} failed ({e.strerror or e})"
            if self.committed:  # only `latest` or retention failed
                outcome = "after its commit, so the new checkpoint is complete"
            elif self.owner.rank == 0:  # the committer: no other rank's part can be committed now
                shutil.rmtree(self.tmp, ignore_errors=True)
                outcome = "the partial save was removed and the previous checkpoint is intact"
            else:  # rank 0 waits for this rank's part in vain, then removes the save
                outcome = "it will not be committed, and the previous checkpoint is intact"
            self.owner._error = CheckpointError(f"{what}; {outcome}.")
        except BaseException as e:  # handed to the training loop at its next wait() or save()
            self.owner._error = e

    def _run(self) -> Path | None:
        owner = self.owner
        self.tmp.mkdir(parents=True, exist_ok=True)
        data_name = f"data-{owner.rank:05d}.bin"
        raw = self.buffer.numpy()
        entries = []
        for item, offset in zip(self.items, self.layout, strict=True):
            view = raw[offset : offset + item.nbytes]
            chunk = owner.chunk_bytes
            chunks = tuple(crc(view[c : c + chunk]) for c in range(0, item.nbytes, chunk))
            piece = PieceEntry(
                start=item.start,
                stop=item.stop,
                file=data_name,
                offset=offset,
                nbytes=item.nbytes,
                crc32c=crc(view),
                chunk_crc32c=chunks,
            )
            entries.append(
                {
                    "name": item.name,
                    "dtype": self.dtypes[item.name],
                    "shape": list(item.shape),
                    "split_dim": item.split_dim,
                    "piece": piece.to_json(item.shape, item.split_dim),
                }
            )
        files = {}
        if self.items:
            write_file(self.tmp / data_name, memoryview(raw))
            files[data_name] = len(raw)
        fragment = {
            "rank": owner.rank,
            "step": self.step,
            "chunk_bytes": owner.chunk_bytes,
            "files": files,
            "pieces": entries,
        }
        if owner.rank == 0:
            fragment["meta"] = json.loads(self.meta_text)
        store.write_durable(self.tmp / f"fragment-{owner.rank:05d}.json", json.dumps(fragment).encode())
        if owner.rank != 0:
            owner.last_save_s = time.perf_counter() - self.started
            return None
        path = self._commit()
        owner.last_path = path
        return path

    def _commit(self) -> Path:
        owner = self.owner
        fragments = self._gather_fragments()
        files: dict[str, int] = {}
        tensors: dict[str, dict[str, Any]] = {}
        for fragment in fragments:
            files.update(fragment["files"])
            for e in fragment["pieces"]:
                t = tensors.setdefault(e["name"], {**e, "pieces": []})
                if (t["dtype"], t["shape"], t["split_dim"]) != (e["dtype"], e["shape"], e["split_dim"]):
                    raise CheckpointError(
                        f"The ranks disagree on the dtype or shape of {e['name']!r}; nothing was committed."
                    )
                t["pieces"].append(e["piece"])
        kinds = {kind_of(name) for name in tensors}
        absent = [k + n for n in owner._params for k in sorted(kinds) if k + n not in tensors]
        if absent:
            raise CheckpointError(
                f"No rank saved {absent[0]!r}{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}; "
                "every rank must save the same kinds of state, so nothing was committed."
            )
        entries = []
        for name in sorted(tensors, key=_state_order(owner)):
            entry = TensorEntry.from_json(tensors[name])
            problem = entry.gaps()
            if problem:
                raise CheckpointError(
                    f"The ranks' pieces of {name!r} leave {problem}; every rank must save the same kinds of "
                    "state, so nothing was committed."
                )
            entries.append(entry)
        body = manifest_body(
            step=self.step,
            model=owner.plan.model.to_json(),
            plan=owner.plan.to_json(),
            meta=fragments[0]["meta"],
            chunk_bytes=owner.chunk_bytes,
            files=files,
            tensors=entries,
            created_time_s=time.time(),
        )
        for fragment_file in self.tmp.glob("fragment-*.json"):
            fragment_file.unlink()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(json.dumps(body, separators=(",", ":")).encode())
            f.flush()
            os.fsync(f.fileno())
        store.fsync_dir(self.tmp)
        name = store.next_name(owner.directory, step_dir_name(self.step))
        final = owner.directory / name
        os.replace(self.tmp, final)
        self.committed = True
        store.fsync_dir(owner.directory)
        store.point_latest(owner.directory, name)
        owner.last_save_s = time.perf_counter() - self.started
        store.prune(owner.directory, owner.keep, owner.session)
        return final

    def _gather_fragments(self) -> list[dict[str, Any]]:
        """Every rank's fragment, waiting for the slower ranks up to the commit timeout."""
        owner = self.owner
        deadline = time.monotonic() + owner.commit_timeout_s
        paths = [self.tmp / f"fragment-{r:05d}.json" for r in range(owner.plan.world_size)]
        while True:
            missing = [r for r, p in enumerate(paths) if not p.is_file()]
            if not missing:
                break
            if owner._abandoned.is_set():
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise CheckpointError(f"The save of step {self.step} was abandoned: rank(s) {missing} left.")
            if time.monotonic() > deadline:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise CheckpointError(
                    f"Rank(s) {', '.join(map(str, missing))} did not finish writing step {self.step} within "
                    f"{owner.commit_timeout_s:.0f} s, so it was not committed."
                )
            time.sleep(_POLL_S)
        fragments = [json.loads(p.read_text()) for p in paths]
        for fragment in fragments:
            if fragment["chunk_bytes"] != owner.chunk_bytes:
                raise CheckpointError(
                    f"Rank {fragment['rank']} checksums {fragment['chunk_bytes']}-byte chunks while rank 0 "
                    f"checksums {owner.chunk_bytes}-byte ones; every rank must use the same chunk_bytes."
                )
            if fragment["step"] != self.step:
                raise CheckpointError(
                    f"Rank {fragment['rank']} saved step {fragment['step']} while rank 0 saved step "
                    f"{self.step}; "
                    "every rank must call save() with the same steps."
                )
        return fragments


def write_file(path: Path, data: memoryview) -> None:
    """Write `data` (page-aligned in memory) to a new file `path` and fsync it.

    The page-aligned bulk goes with O_DIRECT where the file system supports it: straight from the
    buffer to the device, without copying through the page cache (measured here: 2.5-3.2 GB/s direct
    against 0.2-1.5 GB/s buffered for the same bytes, the buffered rate swinging with the page cache's
    state), and without evicting the training job's useful cached pages. The unaligned tail, or the
    whole file where O_DIRECT is refused, is written through the page cache.
    """
    aligned = len(data) // ALIGN * ALIGN if hasattr(os, "O_DIRECT") else 0
    done = 0
    if aligned:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:  # e.g. tmpfs: no O_DIRECT
            fd = None
        if fd is not None:
            try:
                while done < aligned:
                    done += os.write(fd, data[done : min(aligned, done + _WRITE_BYTES)])
            except OSError:  # a file system that accepts the flag but not the write: buffered instead
                done = 0
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if done else os.O_TRUNC), 0o644)
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done : done + _WRITE_BYTES], done)
        os.fsync(fd)  # the file's data, the direct part included, and its size
    finally:
        os.close(fd)


def _state_order(owner):
    """Sort key: parameters in layer order, each followed by its optimizer states."""
    position = {name: i for i, name in enumerate(owner._params)}
    prefixes = ("", *OPTIMIZER_PREFIXES)

    def key(name: str) -> tuple[int, int]:
        return position[base_name(name)], prefixes.index(kind_of(name))

    return key

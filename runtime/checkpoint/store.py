"""The checkpoint directory: durable writes, atomic commit, `latest`, retention, and finding checkpoints.

A `--ckpt-dir` holds committed checkpoints `step-00000100` (a repeated save of the same step gets
`step-00000100-1`, ...), the file `latest` naming the newest one, and transient `.tmp-*` (a save in
progress) and `.trash-*` (a deletion in progress) directories that are never read.

Commit protocol (one writer: rank 0, after every rank's data is durable):
1. every rank writes its data file into `.tmp-<session>-<n>/`, fsyncs it, then its index fragment
   (temporary name, fsync, rename, fsync the directory);
2. rank 0 merges the fragments into `manifest.json` (fsync), fsyncs the directory, renames it to its
   final name (atomic on POSIX) and fsyncs the parent: from here on the checkpoint is durable;
3. `latest` is replaced by write-temporary-and-rename, and only then are checkpoints beyond the newest
   `keep` deleted (renamed to `.trash-*` first, so a half-deleted one never looks complete).

A directory with a `step-*` name always has its manifest (it is written before the rename), so
"newest complete" is simply the newest `step-*` directory; `latest` agrees with it except after a
crash between steps 2 and 3, when the scan still finds the newer, complete checkpoint.

One job writes to a --ckpt-dir at a time: a new job's rank 0 removes the temporary directories that
earlier (crashed) jobs left.
"""

import os
import shutil
from pathlib import Path

from runtime.checkpoint.format import LATEST, MANIFEST, CheckpointError, parse_step_dir

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably: temporary file, fsync, rename, fsync directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def committed(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoints of `ckpt_dir`, oldest first."""
    found = []
    if ckpt_dir.is_dir():
        for child in ckpt_dir.iterdir():
            key = parse_step_dir(child.name)
            if key is not None and (child / MANIFEST).is_file():
                found.append((key, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a `--ckpt-dir`, None if it has none."""
    found = committed(Path(ckpt_dir))
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """One checkpoint's directory from DIR: a checkpoint itself, or a --ckpt-dir (its newest)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"The checkpoint directory {p} does not exist.")
    if (p / MANIFEST).is_file():
        return p
    if parse_step_dir(p.name) is not None or p.name.startswith(TMP_PREFIX):
        raise CheckpointError(
            f"{p} is not a complete checkpoint: it has no {MANIFEST}, so its save never committed."
        )
    newest = latest_checkpoint(p)
    if newest is None:
        raise CheckpointError(f"{p} holds no complete checkpoint (no step-* directory with a {MANIFEST}).")
    return newest


def next_name(ckpt_dir: Path, base: str) -> str:
    """`base`, or `base-1`, `base-2` ... if a checkpoint of that step exists already."""
    name, revision = base, 0
    while (ckpt_dir / name).exists():
        revision += 1
        name = f"{base}-{revision}"
    return name


def point_latest(ckpt_dir: Path, name: str) -> None:
    write_durable(ckpt_dir / LATEST, (name + "\n").encode())


def prune(ckpt_dir: Path, keep: int, token: str) -> None:
    """Delete all but the newest `keep` committed checkpoints; `token` makes trash names unique."""
    for old in committed(ckpt_dir)[:-keep]:
        trash = ckpt_dir / f"{TRASH_PREFIX}{old.name}-{token}"
        os.replace(old, trash)
        fsync_dir(ckpt_dir)
        shutil.rmtree(trash, ignore_errors=True)


def remove_stale(ckpt_dir: Path, session: str) -> None:
    """Remove what crashed saves left: temporary directories of other sessions, and trash."""
    if not ckpt_dir.is_dir():
        return
    for child in ckpt_dir.iterdir():
        stale_tmp = child.name.startswith(TMP_PREFIX) and not child.name.startswith(f"{TMP_PREFIX}{session}-")
        if stale_tmp or child.name.startswith(TRASH_PREFIX):
            shutil.rmtree(child, ignore_errors=True)

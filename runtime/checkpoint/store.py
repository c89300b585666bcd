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

One job writes to a --ckpt-dir at a time, holding its lock (`lock`): a new job's rank 0 removes the
temporary directories that earlier (crashed) jobs left, and nothing that Elastor did not name.
"""

import os
import re
import secrets
import shutil
from pathlib import Path

from costmodel.jsonio import fsync_dir
from runtime.checkpoint.format import LATEST, MANIFEST, CheckpointError, parse_step_dir

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
SESSION = re.compile(r"[0-9a-f]{12}")  # a save session's id: 6 random bytes in hex, as rank 0 draws it


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably: temporary file, fsync, rename, fsync directory.

    The temporary name is random and created exclusively without following links, so a link planted
    in the directory cannot turn the write onto a file outside it; `path` itself is replaced, never
    written through.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def committed(ckpt_dir: Path, *, refuse_links: bool = True) -> list[Path]:
    """Committed checkpoints of `ckpt_dir`, oldest first. A `step-*` entry that is a symlink is not
    one: a checkpoint directory's checkpoints lie inside it, and a link could make a resume read any
    directory on the machine. Readers refuse the directory while it has one (`refuse_links`);
    retention passes over it, so that a planted link cannot fail the saves."""
    found = []
    if ckpt_dir.is_dir():
        for child in ckpt_dir.iterdir():
            key = parse_step_dir(child.name)
            if key is None:
                continue
            if child.is_symlink():
                if refuse_links:
                    raise CheckpointError(
                        f"{child} is a symbolic link; the checkpoints of {ckpt_dir} must lie inside it, so "
                        "replace the link by the directory it points to."
                    )
                continue
            manifest = child / MANIFEST  # whatever it is: `Manifest.read` refuses all but a file
            if manifest.exists() or manifest.is_symlink():
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
    if (p / MANIFEST).exists() or (p / MANIFEST).is_symlink():  # `Manifest.read` checks what it is
        return p
    if parse_step_dir(p.name) is not None or p.name.startswith(TMP_PREFIX):
        raise CheckpointError(
            f"{p} is not a complete checkpoint: it has no {MANIFEST}, so its save never committed."
        )
    newest = latest_checkpoint(p)
    if newest is None:
        raise CheckpointError(f"{p} holds no complete checkpoint (no step-* directory with a {MANIFEST}).")
    return newest


def set_aside(checkpoint: Path) -> Path:
    """Rename a checkpoint that failed its checks to `<name>.damaged` (`-1`, `-2` ... if taken): out
    of every scan and of retention, and kept for whoever wants to look at it."""
    target, n = checkpoint.with_name(f"{checkpoint.name}.damaged"), 0
    while target.exists() or target.is_symlink():
        n += 1
        target = checkpoint.with_name(f"{checkpoint.name}.damaged-{n}")
    os.replace(checkpoint, target)
    fsync_dir(checkpoint.parent)
    return target


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
    for old in committed(ckpt_dir, refuse_links=False)[:-keep]:
        trash = ckpt_dir / trash_name(old.name, token)
        os.replace(old, trash)
        fsync_dir(ckpt_dir)
        shutil.rmtree(trash, ignore_errors=True)


def tmp_name(session: str, n: int) -> str:
    """The temporary directory of a save: the session's 12 hex digits and the save's number."""
    return f"{TMP_PREFIX}{session}-{n:06d}"


def trash_name(checkpoint: str, token: str) -> str:
    return f"{TRASH_PREFIX}{checkpoint}-{token}"


# Exactly the names `tmp_name` and `trash_name` make: nothing else in a --ckpt-dir is ever removed.
_OWN_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}({SESSION.pattern})-\d{{6}}$")
_OWN_TRASH = re.compile(rf"^{re.escape(TRASH_PREFIX)}step-\d{{8,}}(?:-\d+)?-{SESSION.pattern}$")


def remove_stale(ckpt_dir: Path, session: str) -> None:
    """Remove what crashed saves left: temporary directories of other sessions, and trash. Only
    entries named exactly as Elastor names them, and only directories, are touched. `elastor train`
    and `elastor run` hold the directory's lock (`lock`) meanwhile, so no other job's save is in
    progress; a program that uses `Checkpointer` directly should hold it too."""
    if not ckpt_dir.is_dir():
        return
    for child in ckpt_dir.iterdir():
        tmp = _OWN_TMP.match(child.name)
        ours = (tmp and tmp.group(1) != session) or _OWN_TRASH.match(child.name)
        if ours and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)

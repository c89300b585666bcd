"""Reading and writing the files that cross stage boundaries, and checking the values they hold.

Each file carries `schema_version`; readers refuse a version they do not know and name every missing
field in one sentence, so a hand-edited file fails clearly instead of deep inside the planner. The
field checks (`is_integer`, `is_number`, `text`) are the one definition of a value's JSON type,
finiteness and range that every file type uses: `"tie_embeddings": "no"` or `"memory_bytes": "abc"`
is a sentence naming the field, never a silently wrong model or a traceback.

Every output file goes through `output_path` and `atomic_output` (`write_atomic`, `write_json`):
- an existing regular file is replaced atomically (a temporary file beside it, then a rename), so a
  reader never sees half a file and a failed write (read-only directory, disk full) leaves the old
  file as it was and no temporary file behind;
- a symlink is written *through*: its target gets the new content and the link stays, as a shell's
  `>` does (so `--out latest.json`, a link to a run's file, updates that file);
- anything else that exists (a directory, a device such as /dev/null, a FIFO, a socket) is refused:
  replacing it with a regular file, which root could do, is never what was meant.
"""

import json
import math
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from costmodel.errors import ElastorError

SCHEMA_VERSION = 1
# The largest file a reader accepts: a profile of llama3-70b at every micro-batch size and TP degree
# is under a megabyte and a month's plan cache a few; a bigger input (or /dev/zero) is a mistake,
# refused before it fills memory.
MAX_INPUT_BYTES = 256 << 20
_SHOWN_CHARS = 40  # a bad value is quoted in an error up to this length


# ---- reading --------------------------------------------------------------------------------------
def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Load a JSON object from `path`; `what` names the file in errors ("plan", "profile")."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise ElastorError(f"The {what} file {p} does not exist.") from None
    except OSError as e:
        raise ElastorError(f"The {what} file {p} cannot be read: {e.strerror}.") from None
    if len(raw) > MAX_INPUT_BYTES:
        raise ElastorError(
            f"The {what} file {p} holds more than {MAX_INPUT_BYTES >> 20} MiB, more than any Elastor file."
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ElastorError(f"The {what} file {p} is not UTF-8 text (byte {e.start}), so not JSON.") from None
    except json.JSONDecodeError as e:
        raise ElastorError(
            f"The {what} file {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})."
        ) from None
    except RecursionError:
        raise ElastorError(f"The {what} file {p} nests JSON too deeply to be an Elastor file.") from None
    except ValueError:  # an integer of thousands of digits
        raise ElastorError(f"The {what} file {p} holds a number too long to read.") from None
    if not isinstance(data, dict):
        raise ElastorError(f"The {what} file {p} must hold a JSON object, not {type(data).__name__}.")
    return data


def check_schema(data: dict[str, Any], what: str) -> None:
    """Refuse files of an unknown schema version (and anything that is not a JSON object)."""
    if not isinstance(data, dict):
        raise ElastorError(f"The {what} must be a JSON object, not {type(data).__name__}.")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ElastorError(
            f"The {what} has schema_version {shown(version)}; this Elastor reads version {SCHEMA_VERSION}."
        )


def require(data: dict[str, Any], what: str, *keys: str) -> None:
    """Name every missing required field of `data` in one sentence."""
    if not isinstance(data, dict):
        raise ElastorError(f"The {what} must be a JSON object, not {type(data).__name__}.")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ElastorError(f"The {what} lacks the required field(s) {', '.join(missing)}.")


# ---- checking values ------------------------------------------------------------------------------
def shown(value: Any) -> str:
    """`repr(value)`, cut short: an error quotes what it refused, not a megabyte of it."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def span(low: float | None = None, high: float | None = None, above: float | None = None) -> str:
    """The range a check allows, as its error and a flag's help state it: "in 1..4,096", "above 0"."""
    if above is not None:
        return f"above {_number(above)}" + (f" and at most {_number(high)}" if high is not None else "")
    if low is not None and high is not None:
        return f"in {_number(low)}..{_number(high)}"
    if low is not None:
        return f"of at least {_number(low)}"
    return f"of at most {_number(high)}" if high is not None else ""


def _number(x: float) -> str:
    whole = isinstance(x, int) or (float(x).is_integer() and abs(x) < 1e15)
    return f"{int(x):,}" if whole else f"{x:g}"


def _in_range(value: float, low: float | None, high: float | None, above: float | None = None) -> bool:
    return not (
        (low is not None and value < low)
        or (high is not None and value > high)
        or (above is not None and value <= above)
    )


def is_integer(value: Any, low: int | None = None, high: int | None = None) -> bool:
    """A JSON integer (not true, not 2.0, not "2") in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and _in_range(value, low, high)


def is_number(
    value: Any, low: float | None = None, high: float | None = None, above: float | None = None
) -> bool:
    """A finite JSON number (not true, not "1", not an integer past any float) in [low, high] and
    above `above`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer of hundreds of digits
        return False
    return finite and _in_range(value, low, high, above)


def text(value: Any, what: str) -> str:
    """`value` if it is a non-empty JSON string."""
    if not isinstance(value, str) or not value:
        raise ElastorError(f"{what} must be a non-empty string, not {shown(value)}.")
    return value


# ---- writing --------------------------------------------------------------------------------------
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def output_path(path: str | os.PathLike) -> Path:
    """The file an output named `path` is written to: `path` with every symlink resolved.

    A symlink is followed on purpose, so the write goes through it to its target and the link
    stays. An existing path that is not a regular file (directory, device such as /dev/null, FIFO,
    socket) is refused in one sentence, before anything is written. Commands call this on their
    output flags first, so a bad --out fails before minutes of work, not after.
    """
    p = Path(path)
    target = Path(os.path.realpath(p))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ElastorError(f"The output {p} cannot be written: {e.strerror}.") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ElastorError(f"The output {p} is {kind}, not a regular file; name a file to write.")
    return target


def output_dir(path: str | os.PathLike) -> Path:
    """The directory an output directory flag names, created if absent; an existing non-directory
    is refused in one sentence."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ElastorError(f"The output directory {p} exists and is not a directory; name a directory.")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ElastorError(f"The output directory {p} cannot be created: {e.strerror}.") from None
    return p


@contextmanager
def atomic_output(path: str | os.PathLike, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file whose content replaces `output_path(path)` when the block ends without error.

    The temporary file sits beside the target (same file system, so the rename is atomic) and keeps
    an existing target's permissions. On any error it is removed and the target is left as it was;
    an `OSError` (read-only directory, disk full) becomes one sentence. `durable` also fsyncs the
    file and its directory, so the new content survives a power loss once the block returns.
    """
    target = output_path(path)
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # the umask may have cut bits the old file had
        os.replace(tmp, target)
        tmp = None
        if durable:
            fsync_dir(target.parent)
    except OSError as e:
        _remove(tmp)
        raise ElastorError(f"The output {path} cannot be written: {e.strerror or e}.") from None
    except BaseException:
        _remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = False) -> None:
    """Write `data` to `path` by the output rules above."""
    with atomic_output(path, durable=durable) as f:
        f.write(data)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON by the output rules above."""
    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


def _remove(tmp: Path | None) -> None:
    if tmp is not None:
        with suppress(OSError):  # the directory went away or turned read-only: nothing to clean
            tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""What a manifest may say: the checks that make a checkpoint directory safe to read.

A checkpoint is written by the job, but its directory can be damaged, edited or planted by anyone
who can write to it, and the manifest's CRC32C is an integrity check, not a signature: whoever
edits a manifest can recompute it. So nothing a manifest says is used before it passes these
checks, and a refusal is one sentence naming the manifest and the field:

- every data file is a plain name inside its step directory (no separator, no `..`, not absolute),
  opened without following a symlink and without blocking, and used only if it is a regular file
  of the size the manifest lists (so a FIFO, a device or a link to a file outside is refused);
- every number has its type and range: step, sizes and offsets non-negative integers, CRCs 32-bit,
  the checksum chunk between 1 byte and `MAX_CHUNK_BYTES` (the most `verify` allocates);
- every tensor is named once, is a parameter of the manifest's model (or an AdamW moment of one)
  with that parameter's shape and split dimension, has a floating dtype of `format.DTYPES`, and is
  tiled by its pieces, each lying inside its file with one CRC per chunk.

Together these bound every allocation a read makes by the model's own tensor sizes and the bytes
on disk. What is not checked is whether the numbers are the ones training produced: a manifest
whose writer recomputes every CRC is trusted as far as the directory's write permission is.
"""

import os
import re
import stat
from pathlib import Path
from typing import Any

from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.layout import layer_params
from runtime.checkpoint.format import DTYPES, CheckpointError, TensorEntry, base_name

# The largest checksum chunk accepted: the buffer `verify` streams through, and the most a load
# over-reads at each end of a run. Elastor writes 1 MiB chunks; 64 MiB leaves room for tuning.
MAX_CHUNK_BYTES = 64 << 20
# The largest manifest read: a 405B-parameter state (fp32 weights and two moments) at 1 MiB chunks
# lists about 5 million CRCs, some 60 MB of JSON; a larger file is refused before it is parsed,
# which bounds the parse's Python objects at a few GB.
MAX_MANIFEST_BYTES = 256 << 20
# Save times are Unix seconds; 1e11 is the year 5138, past any real one and inside every date type.
MAX_TIME_S = 1e11
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_U32 = 1 << 32
_MAX_BYTES = 1 << 60


def open_regular(directory: Path, name: str, what: str = "Checkpoint file") -> int:
    """A read-only descriptor of the regular file `directory/name`; refuses links, FIFOs and devices.

    O_NOFOLLOW refuses a symlink, O_NONBLOCK keeps a FIFO from blocking the open, and fstat on the
    descriptor (not the path) checks the very file that will be read.
    """
    path = directory / name
    flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing.") from None
    except OSError as e:
        raise CheckpointError(
            f"{what} {path} cannot be opened ({e.strerror}); it must be a regular file, not a link."
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{what} {path} is not a regular file, so it is not read.")
    return fd


def open_sized(directory: Path, name: str, expected: int) -> int:
    """`open_regular`, refusing a file whose size is not the `expected` bytes its manifest lists."""
    fd = open_regular(directory, name)
    actual = os.fstat(fd).st_size
    if actual != expected:
        os.close(fd)
        kind = "truncated" if actual < expected else "too long"
        raise CheckpointError(
            f"Checkpoint file {directory / name} is {kind}: {actual} bytes, not the {expected} its "
            "manifest lists."
        )
    return fd


def read_manifest_text(path: Path) -> str:
    """The manifest's text, read through `open_regular` and bounded by `MAX_MANIFEST_BYTES`."""
    fd = open_regular(path.parent, path.name, "The checkpoint manifest")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"The checkpoint manifest {path} is {size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a "
                "manifest may have."
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"The checkpoint manifest {path} is corrupt: it is not UTF-8 text.") from None


class _Fields:
    """Typed access to one JSON object of the manifest; every refusal names the manifest and the field."""

    def __init__(self, data: Any, where: str, what: str):
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: {what} must be a JSON object, not {type(data).__name__}.")
        self.data, self.where, self.what = data, where, what

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {self.what} {message}.")

    def get(self, key: str) -> Any:
        if key not in self.data:
            raise self.fail(f"lacks {key!r}")
        return self.data[key]

    def integer(self, key: str, lo: int = 0, hi: int = _MAX_BYTES) -> int:
        value = self.get(key)
        if type(value) is not int or not lo <= value < hi:
            raise self.fail(f"has {key} {value!r}; it must be an integer in [{lo}, {hi})")
        return value

    def integers(self, key: str, count: int | None = None, lo: int = 0, hi: int = _MAX_BYTES) -> list[int]:
        value = self.get(key)
        if not isinstance(value, list) or (count is not None and len(value) != count):
            raise self.fail(f"has {key} {_short(value)}; it must be a list of {count or 'some'} integers")
        if any(type(v) is not int or not lo <= v < hi for v in value):
            raise self.fail(f"has {key} {_short(value)}; each must be an integer in [{lo}, {hi})")
        return value

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value or len(value) > 512:
            raise self.fail(f"has {key} {_short(value)}; it must be a non-empty string")
        return value

    def items(self, key: str) -> list:
        value = self.get(key)
        if not isinstance(value, list):
            raise self.fail(f"has {key} of type {type(value).__name__}; it must be a list")
        return value

    def mapping(self, key: str) -> dict:
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.fail(f"has {key} of type {type(value).__name__}; it must be an object")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_body(body: Any, path: Path) -> None:
    """Refuse a manifest whose fields have the wrong types or ranges, or that does not describe a
    tiled state of its own model (module docstring)."""
    where = f"The checkpoint manifest {path}"
    top = _Fields(body, where, "the manifest")
    top.integer("step")
    created = top.get("created_time_s")
    if type(created) not in (int, float) or not 0 <= created < MAX_TIME_S:
        raise top.fail(
            f"has created_time_s {created!r}; it must be seconds since 1970 before {MAX_TIME_S:.0e}"
        )
    for key in ("model", "plan", "meta"):
        top.mapping(key)
    chunk_bytes = top.integer("chunk_bytes", 1, MAX_CHUNK_BYTES + 1)
    files: dict[str, int] = {}
    for i, item in enumerate(top.items("files")):
        entry = _Fields(item, where, f"files[{i}]")
        name = entry.text("file")
        if not _PLAIN_NAME.match(name):
            raise entry.fail(
                f"names {name!r}; a data file must be a plain name inside the checkpoint's directory"
            )
        if name in files:
            raise entry.fail(f"lists {name!r} a second time")
        files[name] = entry.integer("bytes")
    params = _model_params(top.get("model"), where)
    seen: set[str] = set()
    for i, item in enumerate(top.items("tensors")):
        tensor = _Fields(item, where, f"tensors[{i}]")
        name = tensor.text("name")
        tensor.what = f"tensor {name!r}"
        if name in seen:
            raise tensor.fail("is listed a second time")
        seen.add(name)
        _check_tensor(tensor, name, params, files, chunk_bytes)


def _model_params(model: Any, where: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every parameter of the manifest's model: name -> (shape, split dimension)."""
    try:
        config = ModelConfig.from_json(model)
    except ElastorError as e:
        raise CheckpointError(f"{where}: its model is not valid ({e}).") from None
    return {
        spec.name: (spec.shape, 0 if spec.shard_dim is None else spec.shard_dim)
        for index in range(config.num_layers)
        for spec in layer_params(config, index)
    }


def _check_tensor(tensor: _Fields, name: str, params, files: dict[str, int], chunk_bytes: int) -> None:
    known = params.get(base_name(name))
    if known is None:
        raise tensor.fail("is neither a parameter of the checkpoint's model nor an optimizer moment of one")
    shape, split_dim = known
    dtype = tensor.get("dtype")
    if dtype not in DTYPES:
        raise tensor.fail(f"has dtype {_short(dtype)}; model state is one of {', '.join(DTYPES)}")
    if tuple(tensor.integers("shape")) != shape:
        raise tensor.fail(f"has shape {_short(tensor.get('shape'))}, not the model's {list(shape)}")
    if tensor.integer("split_dim", 0, 8) != split_dim:
        raise tensor.fail(f"has split_dim {tensor.get('split_dim')}, not {split_dim}")
    for k, item in enumerate(tensor.items("pieces")):
        piece = _Fields(item, tensor.where, f"piece {k} of tensor {name!r}")
        offsets = piece.integers("offsets", len(shape))
        sizes = piece.integers("sizes", len(shape))
        for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            whole = o == 0 and s == shape[d]
            if (d != split_dim and not whole) or o + s > shape[d]:
                raise piece.fail(f"covers {s} at {o} of dimension {d}, which has {shape[d]}")
        file = piece.text("file")
        if file not in files:
            raise piece.fail(f"names file {file!r}, which the manifest's files do not list")
        offset, nbytes = piece.integer("offset"), piece.integer("bytes")
        if offset + nbytes > files[file]:
            raise piece.fail(f"lies at bytes {offset}..{offset + nbytes}, past the end of {file}")
        piece.integer("crc32c", 0, _U32)
        piece.integers("chunk_crc32c", -(-nbytes // chunk_bytes), 0, _U32)
    problem = TensorEntry.from_json(tensor.data).gaps()  # tiling, and each piece's bytes for its rows
    if problem:
        raise tensor.fail(f"has {problem}")

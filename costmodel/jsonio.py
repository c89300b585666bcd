"""Reading and writing the JSON files that cross stage boundaries.

Each file carries `schema_version`; readers refuse a version they do not know and name every missing
field in one sentence, so a hand-edited file fails clearly instead of deep inside the planner.
"""

import json
import os
from pathlib import Path
from typing import Any

from costmodel.errors import ElastorError

SCHEMA_VERSION = 1


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Load a JSON object from `path`; `what` names the file in errors ("plan", "profile")."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ElastorError(f"The {what} file {p} does not exist.") from None
    except OSError as e:
        raise ElastorError(f"The {what} file {p} cannot be read: {e.strerror}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ElastorError(
            f"The {what} file {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})."
        ) from None
    if not isinstance(data, dict):
        raise ElastorError(f"The {what} file {p} must hold a JSON object, not {type(data).__name__}.")
    return data


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write `data` atomically (temporary file, then rename), so readers never see half a file."""
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, p)


def check_schema(data: dict[str, Any], what: str) -> None:
    """Refuse files of an unknown schema version."""
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ElastorError(
            f"The {what} has schema_version {version!r}; this Elastor reads version {SCHEMA_VERSION}."
        )


def require(data: dict[str, Any], what: str, *keys: str) -> None:
    """Name every missing required field of `data` in one sentence."""
    if not isinstance(data, dict):
        raise ElastorError(f"The {what} must be a JSON object, not {type(data).__name__}.")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ElastorError(f"The {what} lacks the required field(s) {', '.join(missing)}.")

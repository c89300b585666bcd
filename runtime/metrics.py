"""The metrics file of docs/DESIGN.md: JSON lines written by rank 0, one per step and one per event.

Appended to, so a run resumed by the elastic supervisor continues the same file. Each line is flushed
as it is written: a crash loses at most the line being written.
"""

import json
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: str | Path):
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._file = p.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, "time_s": time.time(), **fields})

    def close(self) -> None:
        self._file.close()

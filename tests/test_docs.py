"""The repository speaks for itself: no source file, notebook or document points a reader at a
tracker's issue ("issue 4", "the Checkpoint issue", "the issue's bar"), which a reader of the
repository cannot open."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (
    "costmodel",
    "solver",
    "profiler",
    "runtime",
    "goodput",
    "elastor",
    "benchmarks",
    "tests",
    "notebooks",
)
TRACKER = re.compile(r"\bissues? \d+\b|\bissue's\b|\b[A-Z][\w-]* issues?\b|\(issue\b")


def documents() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "profiles" / "README.md"]
    for folder in SOURCES:
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb", ".md"))
    return [p for p in files if p.is_file()]


def test_no_file_refers_to_a_tracker_issue():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in documents()
        if path.name != "test_docs.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_pattern_finds_what_it_should():
    for line in ("Search space (issue 4): any", "as issue 6 describes it", "the Solver and Elastic issues"):
        assert TRACKER.search(line), line
    assert not TRACKER.search("in the global issue order")

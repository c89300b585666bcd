"""The repository speaks for itself: no source file, notebook or document points a reader at a
tracker's issue ("issue 4", "the Checkpoint issue", "the issue's bar"), which a reader of the
repository cannot open."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

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


def lines_matching(pattern: re.Pattern) -> list[str]:
    """`path:line: text` of every line of the documents (this file aside) that `pattern` finds."""
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in documents()
        if path.name != "test_docs.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_file_refers_to_a_tracker_issue():
    found = lines_matching(TRACKER)
    assert not found, "\n".join(found)


def test_the_pattern_finds_what_it_should():
    for line in ("Search space (issue 4): any", "as issue 6 describes it", "the Solver and Elastic issues"):
        assert TRACKER.search(line), line
    assert not TRACKER.search("in the global issue order")


def test_every_document_a_file_cites_is_in_the_repository():
    """Docstrings and documents cite the design document (and the repository's other documents) by
    path: each must be in the repository, not outside it."""
    cited = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)")
    outside = re.compile(r"(?<![\w/.-])DESIGN\.md")  # the design document, named without its place
    bare = lines_matching(outside)
    assert not bare, "cite docs/DESIGN.md:\n" + "\n".join(bare)
    missing = sorted(
        {
            f"{path.relative_to(ROOT)}: {match}"
            for path in [*documents(), *(ROOT / "docs").glob("*.md")]
            for match in cited.findall(path.read_text(encoding="utf-8"))
            if not (ROOT / match).exists() and "*" not in match
        }
    )
    assert not missing, "\n".join(missing)


# ---- the README's commands paste and run as written -----------------------------------------------
# Subcommands cheap enough to run here, in the README's order, in a scratch copy of its inputs; plan
# only on clusters of at most this many GPUs (the large what-if plans take minutes).
QUICK = ("profile", "validate", "plan", "estimate")
QUICK_PLAN_GPUS = 64


def readme_commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, as the shell splits it ($(...) expanded)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", line)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    words = []
    for line in lines:
        if "$(" not in line:
            words.append(shlex.split(line))
            continue
        split = subprocess.run(  # the shell expands what it substitutes
            ["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True, check=True
        ).stdout
        words.append(split.rstrip("\0").split("\0"))
    return words


def elastor_argv(words: list[str]) -> list[str] | None:
    """The arguments after `elastor` (or `python -m elastor`, under torchrun too), else None."""
    for i, word in enumerate(words):
        if word == "elastor" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1 :]
    return None


def test_every_readme_command_parses_and_the_quick_ones_run(tmp_path, monkeypatch, capsys):
    from elastor.cli import build_parser, main

    commands = [argv for words in readme_commands() if (argv := elastor_argv(words))]
    assert len(commands) >= 20, "the README's commands were not found"
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the README's `elastor {' '.join(argv)}` does not parse: {capsys.readouterr().err}")
    for folder in ("examples", "profiles"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    ran = []
    for argv in commands:
        args, name = parser.parse_args(argv), argv[0]
        quick = name in QUICK and (name != "profile" or args.analytic)
        if name == "plan":
            counts = args.cluster.split(",")
            quick = all(n.isdigit() for n in counts) and sum(map(int, counts)) <= QUICK_PLAN_GPUS
        if quick:
            assert main(argv) == 0, f"`elastor {' '.join(argv)}`: {capsys.readouterr().err[-2000:]}"
            ran.append(name)
    assert {"profile", "validate", "plan", "estimate"} <= set(ran), ran

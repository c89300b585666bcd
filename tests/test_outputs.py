"""Nothing is lost: the rules every output file follows (costmodel.jsonio.output_path / atomic_output).

A regular file or a new path is written atomically; a symlink is written through to its target and
stays a link; a directory, FIFO or device is refused before anything is written; a failed write
(read-only directory, disk full) is one sentence, leaves the old content, and no temporary file.
"""

import errno
import json
import os
import stat

import pytest
from helpers import REPO

from costmodel import ElastorError
from costmodel.jsonio import atomic_output, output_dir, output_path, write_atomic, write_json
from elastor.cli import main

PROFILE = str(REPO / "profiles" / "gpt-tiny-cpu.json")
DEV_NULL = "The output /dev/null is a character device, not a regular file; name a file to write."
PLAN_ARGS = ["plan", "--profile", PROFILE, "--cluster", "2", "--global-batch-size", "4", "--time-limit", "5"]


def listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ---- what may be written -------------------------------------------------------------------------------
def test_a_regular_file_is_replaced_and_keeps_its_mode(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    os.chmod(path, 0o640)
    write_json(path, {"new": 1})
    assert json.loads(path.read_text()) == {"new": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert listing(tmp_path) == ["plan.json"]


def test_a_new_path_is_created_with_its_directories(tmp_path):
    path = tmp_path / "a" / "b" / "plan.json"
    write_atomic(path, b"data")
    assert path.read_bytes() == b"data"
    assert listing(path.parent) == ["plan.json"]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "runs" / "7.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert output_path(link) == target.resolve()
    write_json(link, {"step": 7})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"step": 7}
    assert listing(tmp_path) == ["latest.json", "runs"] and listing(target.parent) == ["7.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "made" / "later.json")
    write_atomic(link, b"x")
    assert link.is_symlink() and (tmp_path / "made" / "later.json").read_bytes() == b"x"


# ---- what is refused, before anything is written -------------------------------------------------------
def test_dev_null_is_refused_without_writing():
    before = os.stat("/dev/null")
    with pytest.raises(ElastorError) as e:
        output_path("/dev/null")
    assert (
        str(e.value)
        == "The output /dev/null is a character device, not a regular file; name a file to write."
    )
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to("/dev/null")
    with pytest.raises(
        ElastorError, match=r"^The output .*out.json is a character device, not a regular file"
    ):
        write_atomic(link, b"x")
    assert link.is_symlink() and listing(tmp_path) == ["out.json"]


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(ElastorError, match=r"is a FIFO, not a regular file; name a file to write.$"):
        write_json(fifo, {})
    assert stat.S_ISFIFO(fifo.stat().st_mode) and listing(tmp_path) == ["out.json"]


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "out.json").mkdir()
    with pytest.raises(ElastorError, match=r"is a directory, not a regular file"):
        write_json(tmp_path / "out.json", {})
    assert (tmp_path / "out.json").is_dir() and listing(tmp_path / "out.json") == []


def test_an_output_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "report").write_text("x")
    with pytest.raises(ElastorError, match=r"exists and is not a directory; name a directory.$"):
        output_dir(tmp_path / "report")
    assert output_dir(tmp_path / "new" / "dir").is_dir()


def test_the_command_line_refuses_dev_null_before_solving(capsys):
    assert main([*PLAN_ARGS, "--out", "/dev/null"]) == 2
    assert capsys.readouterr().err == f"elastor: error: {DEV_NULL}\n"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_the_command_line_writes_through_a_symlink(tmp_path, capsys):
    target = tmp_path / "plans" / "first.json"
    target.parent.mkdir()
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    assert main([*PLAN_ARGS, "--out", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["global_batch_size"] == 4


# ---- failed writes ---------------------------------------------------------------------------------------
@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no file can be created in: chmod for a user; root ignores permissions, but nobody
    creates files in sysfs."""
    if os.geteuid() == 0:
        yield "/sys"
        return
    path = tmp_path / "read-only"
    path.mkdir()
    os.chmod(path, 0o555)
    yield str(path)
    os.chmod(path, 0o755)


def test_a_read_only_directory_is_one_sentence(read_only_dir):
    with pytest.raises(ElastorError) as e:
        write_json(os.path.join(read_only_dir, "plan.json"), {})
    assert str(e.value) == f"The output {read_only_dir}/plan.json cannot be written: Permission denied."
    assert not os.path.exists(os.path.join(read_only_dir, "plan.json"))


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.fixture
def full_disk(monkeypatch):
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FullDisk(real(fd, *a, **k)))


def test_a_full_disk_keeps_the_old_file_and_removes_the_temporary(tmp_path, full_disk):
    path = tmp_path / "plan.json"
    path.write_text("old")
    with pytest.raises(ElastorError) as e:
        write_json(path, {"new": 1})
    assert str(e.value) == f"The output {path} cannot be written: No space left on device."
    assert path.read_text() == "old" and listing(tmp_path) == ["plan.json"]


def test_a_full_disk_on_the_command_line_is_exit_2_and_one_line(tmp_path, full_disk, capsys):
    out = tmp_path / "plan.json"
    assert main([*PLAN_ARGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"elastor: error: The output {out} cannot be written: No space left on device."
    assert [line for line in err if "error" in line] == err[-1:]
    assert listing(tmp_path) == []


def test_an_error_inside_the_block_removes_the_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    with pytest.raises(RuntimeError), atomic_output(path) as f:
        f.write(b"half a file")
        raise RuntimeError("the checkpoint reader failed")
    assert listing(tmp_path) == []

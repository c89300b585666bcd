"""One job per --ckpt-dir: an advisory lock held for the job's lifetime.

Two jobs writing one checkpoint directory race: one dies in a rename, the other's checkpoints
replace its run, or a job resumes from another's save in progress. So the process that owns a job's
checkpoints (`elastor train`'s rank 0, or the leading supervisor of `elastor run` for every round
of its job) holds `flock(LOCK_EX)` on `<ckpt-dir>/.elastor-lock` while the job lives. The lock
belongs to the open file, so the kernel drops it when its holder exits in any way, SIGKILL and
crashes included: a dead job never holds a directory. (On NFS, Linux emulates flock with a
byte-range lock that the server keeps only while the client's lease lives, so a crashed host's lock
lapses with its lease; there a second lock taken by the same process is not refused.) The file's
text names the holder (host, pid, job id, since when) so that a refusal can say who has the
directory.

Workers started by a supervisor that holds the lock inherit the job id in `ENV_JOB`; finding the
lock held by a job of that id, they go on without it. That is cooperation between the processes of
one job, not authentication: the id is readable in the lock file, and a process given it on purpose
joins the job (anyone who can write the directory can damage it anyway).
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from runtime.checkpoint.format import CheckpointError

LOCK_FILE = ".elastor-lock"
ENV_JOB = "ELASTOR_CKPT_JOB"  # the id of the job whose supervisor holds the lock


class DirectoryLock:
    """The held lock of one --ckpt-dir; `release()` (or the holder's exit) lets it go."""

    def __init__(self, directory: Path, fd: int | None, job: str):
        self.directory, self._fd, self.job = directory, fd, job

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_directory(directory: str | os.PathLike, job: str | None = None) -> DirectoryLock:
    """Hold the lock of `directory` (created if need be) for job `job`; refuse if another job has it.

    With `job` None the job id comes from `ENV_JOB`: a worker whose supervisor holds the lock for
    that job gets a lock object that holds nothing, and a process outside any job takes the lock.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"The checkpoint directory {directory} cannot be created ({e.strerror})."
        ) from None
    inherited = os.environ.get(ENV_JOB) if job is None else None
    job = job or inherited or os.urandom(6).hex()
    path = directory / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"The checkpoint directory's lock {path} cannot be opened ({e.strerror})."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        if inherited and holder.get("job") == inherited:
            return DirectoryLock(directory, None, inherited)
        raise CheckpointError(
            f"The checkpoint directory {directory} is in use by another job ({_describe(holder)}); "
            "give this job its own --ckpt-dir, or stop the other one."
        ) from None
    record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return DirectoryLock(directory, fd, job)


def _holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder["since"])))
        host, job = str(holder["host"])[:100], str(holder["job"])[:40]
        return f"pid {int(holder['pid'])} on {host}, job {job}, since {since}"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return "its holder did not say who it is"

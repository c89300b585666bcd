"""`elastor run` stops restarting when a restart cannot help, with the workers' error in one sentence.

The workers of these runs fail at start-up, every time, the same way (their data file does not exist):
the run must end with exit 2 after two rounds (the second failing like the first, from the same
checkpoint on the same GPUs), or after one with `--max-restarts 0`, never restart forever. How a
round's error is read from its workers' output is tested on the shapes of real logs.
"""

import json
from pathlib import Path

import pytest
from dist_helpers import elastor_run, launch

from runtime.elastic.supervisor import worker_error

RUN_TIMEOUT_S = 120  # rounds take a few seconds each; a run that restarts forever ends here


def _run(tmp: Path, *flags: str):
    flags = ("--ckpt-every=2", f"--data={tmp / 'missing.bin'}", *flags)
    command = elastor_run(tmp, *flags, steps=6)
    done = launch(command, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert not done.stragglers
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastor: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"{tmp / 'missing.bin'} does not exist" in errors[0]  # the workers' own sentence
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return errors[0], sum(r.get("event") == "replanned" for r in records)


def test_the_same_error_twice_without_progress_stops_the_run(tmp_path):
    error, rounds = _run(tmp_path)
    assert rounds == 2
    assert "Rounds 0 and 1 failed with the same error" in error
    assert str(tmp_path / "metrics-logs" / "round-1-n0.log") in error  # where to look


@pytest.mark.slow  # about 8 s; the same-error case runs in make test
def test_max_restarts_is_honoured(tmp_path):
    error, rounds = _run(tmp_path, "--max-restarts=0")
    assert rounds == 1
    assert "failed in 1 round(s), more than --max-restarts 0 allows" in error


# Shapes of worker output under torchrun, cut down from real rounds' logs.
_TORCHRUN_FAILED = (
    "E1201 23:40:15.149000 5503 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: {code}) local_rank: 1 (pid: 5510) of binary: python\n"
    "Traceback (most recent call last):\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "  exitcode  : {code} (pid: 5510)\n"
)
_GLOO = "[rank0]: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:10959: Connection reset by peer.\n"


@pytest.mark.parametrize(
    ("output", "error"),
    [
        (
            "[rank0]: elastor: error: The data file x.bin does not exist.\n"
            + _TORCHRUN_FAILED.format(code=2),
            "The data file x.bin does not exist.",
        ),
        (
            "elastor train: error: argument --lr: must be a finite number, not 'nan'\n"
            + _TORCHRUN_FAILED.format(code=2),
            "argument --lr: must be a finite number, not 'nan'",
        ),
        (
            "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: Invalid learning rate: nan\n"
            + _TORCHRUN_FAILED.format(code=1),
            "ValueError: Invalid learning rate: nan",
        ),
        (_GLOO + _TORCHRUN_FAILED.format(code=-9), "a worker was killed by SIGKILL"),  # gloo: a consequence
        (_TORCHRUN_FAILED.format(code=3), "a worker exited with code 3"),
        ("", "a worker exited with code 1"),
    ],
)
def test_the_error_of_a_round_is_read_from_its_workers_output(tmp_path, output, error):
    log = tmp_path / "round-0-n0.log"
    log.write_text(output)
    assert worker_error(log, 1) == error

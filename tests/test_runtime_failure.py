"""A failing rank makes the whole job exit non-zero within a bounded time, never a hang.

Rank 1 of a 3-process plan fails after step 2 by raising, by SIGKILL, or by hanging. With the process
group timeout at 600 s, the first two cases must end well before it: the dead rank's sockets close
(its gloo peers fail at once) and torchrun stops the other workers when one exits non-zero. A hung
rank is caught by the collective timeout: here 5 s, after which its peers raise and torchrun stops it.
"""

import pytest
from dist_helpers import plan_json, run_worker

from costmodel import PRESETS

# One pipeline of two stages beside a data-parallel replica: rank 1 (the second stage) fails while
# its first stage waits on point-to-point and the replica waits in the gradient sync.
PLAN = plan_json(
    PRESETS["gpt-tiny"].to_json(),
    [(2, [((0, 3), ["n0:0"]), ((3, 6), ["n0:1"])]), (2, [((0, 6), ["n1:0"])])],
)
FAIL_AFTER_S = 30  # bound from the failure to the job's exit (torchrun polls every 0.1 s)
HANG_TIMEOUT_S = 5  # the process-group timeout of the hang case


@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_failing_rank_ends_the_job(how, tmp_path):
    result = run_worker(
        PLAN, tmp_path, steps=50, timeout=180, extra=("--fail", how, "--fail-rank", "1", "--timeout-s", "600")
    )
    assert result.returncode != 0 and not result.stragglers
    assert (tmp_path / "failed_at").exists(), result.stderr[-3000:]
    assert not (tmp_path / "losses.json").exists()
    assert _seconds_after_failure(tmp_path, result) < FAIL_AFTER_S


@pytest.mark.slow
def test_hung_rank_is_caught_by_the_collective_timeout(tmp_path):
    extra = ("--fail", "hang", "--fail-rank", "1", "--timeout-s", str(HANG_TIMEOUT_S))
    result = run_worker(PLAN, tmp_path, steps=50, timeout=180, extra=extra)
    assert result.returncode != 0 and not result.stragglers
    assert (tmp_path / "failed_at").exists(), result.stderr[-3000:]
    assert _seconds_after_failure(tmp_path, result) < HANG_TIMEOUT_S + FAIL_AFTER_S


def _seconds_after_failure(out, result) -> float:
    return result.ended_at - float((out / "failed_at").read_text())

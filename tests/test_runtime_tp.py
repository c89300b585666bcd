"""Each tensor-parallel layer against its plain single-device counterpart, forward and backward.

Three ranks, so the MLP width (100 -> 34/33/33) and the vocabulary (250 -> 84/83/83) split unevenly,
with grouped-query attention (6 heads on 3 key/value heads). Tolerance: 1e-5 absolute on values of
order one (fp32; the only differences are the order of summation across ranks).
"""

import json

from dist_helpers import WORKER, launch, torchrun

TOLERANCE = 1e-5
RANKS = 3


def test_tp_layers_match_plain_layers(tmp_path):
    result = launch(torchrun(RANKS, str(WORKER), "tp-layers", str(tmp_path)), timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(RANKS):
        diffs = json.loads((tmp_path / f"tp{rank}.json").read_text())
        assert len(diffs) == 8 + 9  # embedding 2, head 4, block output and input gradient 2, 9 parameters
        worst = {k: v for k, v in diffs.items() if not v <= TOLERANCE}
        assert not worst, f"rank {rank}: {worst}"

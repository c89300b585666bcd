"""A stage boundary sends each receiver exactly the tokens it needs, in the plan's dtype, on the sockets.

A TP1 stage feeds a sequence-parallel TP4 stage, which feeds a sequence-parallel TP2 stage
(`costmodel.boundary` routes). Every rank counts the bytes its process writes to its sockets while
its pipeline exchanges run (Linux /proc/self/io wchar, gloo's headers included; every send of an
exchange is waited for inside it) over two training steps. The bytes the receivers need are derived
here from the plan alone: per micro-batch, forward, each receiver's token range (its sequence slice
under SP) and backward each sender's, times micro-batch x hidden x dtype bytes. Measured on the
sockets must lie between that and that plus a header of at most HEADER_BYTES per message (gloo's
framing: measured here 144 bytes a message), and far below what full copies to every receiver would
send (TP1 -> TP4: four copies; TP4 -> TP2: two). The busiest senders send what the cost model prices
(`costmodel.boundary.busiest_shares`).
"""

import json
import sys

import pytest
from dist_helpers import plan_json, run_worker

from costmodel import ModelConfig
from costmodel.boundary import busiest_shares

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux's")

EIGHT_HEADS = ModelConfig(
    name="eight-heads", vocab_size=256, hidden_size=64, intermediate_size=128, num_blocks=2,
    num_heads=8, num_kv_heads=8, max_seq_len=64,
).to_json()  # fmt: skip
STEPS, MICRO_BATCHES, MBS, SEQ = 2, 3, 2, 32
HEADER_BYTES = 256


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_boundaries_send_only_the_needed_tokens(dtype, tmp_path):
    plan = plan_json(
        EIGHT_HEADS,
        [
            (
                MICRO_BATCHES,
                [
                    ((0, 2), ["n0:0"]),
                    ((2, 3), ["n0:1", "n0:2", "n0:3", "n0:4"]),
                    ((3, 4), ["n0:5", "n0:6"]),
                ],
            )
        ],
        micro_batch_size=MBS,
        seq_len=SEQ,
    )
    plan["dtype"] = dtype
    for stage in plan["pipelines"][0]["stages"][1:]:
        stage["sequence_parallel"] = True
    result = run_worker(plan, tmp_path, steps=STEPS, extra=("--measure-p2p",))
    assert result.returncode == 0, result.stderr[-4000:]
    counts = [json.loads((tmp_path / f"p2p{r}.json").read_text()) for r in range(7)]

    token_bytes = MBS * 64 * (4 if dtype == "float32" else 2)
    # TP1 -> TP4 SP: forward the 4 receivers need 8 tokens each, backward the sender needs all 32;
    # TP4 SP -> TP2 SP: forward 2 receivers x 16 tokens, backward 4 senders x 8 tokens.
    needed_tokens = (4 * 8 + 32) + (2 * 16 + 4 * 8)
    needed = STEPS * MICRO_BATCHES * needed_tokens * token_bytes
    payload = sum(c["payload_bytes"] for c in counts)
    socket = sum(c["socket_bytes"] for c in counts)
    assert payload == needed  # what the schedule posts is exactly what the receivers need
    messages = sum(c["messages"] for c in counts)
    assert needed <= socket <= needed + HEADER_BYTES * messages, (socket, needed, messages)
    full_copies = STEPS * MICRO_BATCHES * ((4 * 32 + 32) + (2 * 32 + 4 * 32)) * token_bytes
    assert socket < 0.6 * full_copies
    # The cost model prices a boundary by its busiest rank: the TP1 rank sends the whole activation
    # forward (boundary 0's forward share), each TP2 rank half the gradient backward (boundary 1's).
    activations = STEPS * MICRO_BATCHES * SEQ * token_bytes
    forward_0, _ = busiest_shares(SEQ, (1, False), (4, True))
    _, backward_1 = busiest_shares(SEQ, (4, True), (2, True))
    assert counts[0]["payload_bytes"] == forward_0 * activations
    assert counts[5]["payload_bytes"] == counts[6]["payload_bytes"] == backward_1 * activations

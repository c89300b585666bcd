"""runtime/split_backward.py: a block's backward split into its input gradient (B) and its deferred
weight gradients (W), against one ordinary backward of the same block."""

import pytest
import torch
from test_runtime_parity import TIED
from torch.utils.checkpoint import checkpoint

from costmodel import ModelConfig
from runtime.model import Block, rotary_tables
from runtime.split_backward import DEFERRED_LINEARS, DeferredWeightGradients

CONFIG = ModelConfig.from_json(TIED)  # grouped-query attention with q/k/v biases


def _blocks(seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleDict({"0": Block(CONFIG), "1": Block(CONFIG)})
    for p in blocks.parameters():  # norm weights away from ones, biases away from zeros
        p.data.add_(0.05 * torch.randn_like(p))
    return blocks


def _run(blocks, x, recompute: bool = False):
    cos, sin = rotary_tables(CONFIG, x.shape[1])
    for block in blocks.values():
        x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
    return x


@pytest.mark.parametrize("recompute", [False, True])
def test_b_then_w_gives_the_unsplit_gradients_and_each_hook_fires_once(recompute):
    x = torch.randn(2, 16, CONFIG.hidden_size)
    grad_out = torch.randn(2, 16, CONFIG.hidden_size)
    plain, split = _blocks(), _blocks()
    x_plain = x.clone().requires_grad_()
    torch.autograd.backward(_run(plain, x_plain, recompute), grad_out)

    store = DeferredWeightGradients()
    store.install(split)
    fired: dict[str, int] = {}
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda _p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1)
        )
    x_split = x.clone().requires_grad_()
    y = _run(split, x_split, recompute)
    with store.deferring((0, 0)):
        torch.autograd.backward(y, grad_out)

    # B: the input gradient and the small gradients are there, the projections' are not yet
    torch.testing.assert_close(x_split.grad, x_plain.grad, rtol=1e-6, atol=1e-7)
    deferred = {
        n for n, _ in split.named_parameters() if n.rsplit(".", 1)[0].split(".", 1)[1] in DEFERRED_LINEARS
    }
    assert any(n.endswith(".bias") for n in deferred)  # q/k/v biases are deferred with their weights
    for name, p in split.named_parameters():
        assert (p.grad is None) == (name in deferred), name
    assert store.pending == 1

    store.run((0, 0))  # W
    assert store.pending == 0
    plain_params = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    assert fired == dict.fromkeys(plain_params, 1)


def test_weight_gradients_of_several_micro_batches_are_held_apart():
    """W of micro-batch 1 runs before W of micro-batch 0: each uses its own inputs and the sums
    match two unsplit backwards."""
    inputs = [torch.randn(1, 8, CONFIG.hidden_size) for _ in range(2)]
    plain, split = _blocks(), _blocks()
    for x in inputs:
        _run(plain, x.clone().requires_grad_()).sum().backward()
    store = DeferredWeightGradients()
    store.install(split)
    for i, x in enumerate(inputs):
        y = _run(split, x.clone().requires_grad_())
        with store.deferring((i, 0)):
            y.sum().backward()
    store.run((1, 0))
    store.run((0, 0))
    plain_params = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_backward_outside_deferring_is_an_error_and_evaluation_defers_nothing():
    blocks = _blocks()
    store = DeferredWeightGradients()
    store.install(blocks)
    x = torch.randn(1, 8, CONFIG.hidden_size)
    with torch.no_grad():
        _run(blocks, x)
    assert store.pending == 0
    with pytest.raises(RuntimeError, match="outside `deferring`"):
        _run(blocks, x.requires_grad_()).sum().backward()

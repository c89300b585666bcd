"""The reference model: any split of the layer list computes exactly what the whole model computes.

Bit-for-bit comparisons (`torch.equal`) are deliberate: a slice runs the same float32 operations on
the same values in the same order as the whole model, so there is no tolerance to state.
"""

import pytest
import torch
from helpers import TIED_TINY

from costmodel import PRESETS, ModelConfig
from runtime.model import ModelSlice, build_model, cross_entropy_sum

GPT_TINY = PRESETS["gpt-tiny"]
CONFIGS = [GPT_TINY, TIED_TINY]
BATCH, SEQ = 2, 16


def tokens(config: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, [BATCH, SEQ] each."""
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


def splits(config: ModelConfig) -> list[int]:
    return list(range(1, config.num_layers))


# ---- forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_two_slices_equal_the_whole_model_bit_for_bit(config):
    x, _ = tokens(config)
    with torch.no_grad():
        whole = build_model(config, seed=3)(x)
        for k in splits(config):
            hidden = ModelSlice(config, 0, k, seed=3)(x)
            assert hidden.shape == (BATCH, SEQ, config.hidden_size), k
            logits = ModelSlice(config, k, config.num_layers, seed=3)(hidden)
            assert torch.equal(logits, whole), f"split at layer {k}"
    assert whole.shape == (BATCH, SEQ, config.vocab_size)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_one_layer_at_a_time_equals_the_whole_model(config):
    x, _ = tokens(config)
    with torch.no_grad():
        whole = build_model(config)(x)
        out = x
        for i in range(config.num_layers):
            out = ModelSlice(config, i, i + 1)(out)
    assert torch.equal(out, whole)


def test_the_split_changes_nothing_but_a_wrong_weight_does():
    # Guards the comparison above against passing vacuously: one changed weight changes the output.
    x, _ = tokens(GPT_TINY)
    with torch.no_grad():
        whole = build_model(GPT_TINY)(x)
        first, second = ModelSlice(GPT_TINY, 0, 3), ModelSlice(GPT_TINY, 3, GPT_TINY.num_layers)
        second.blocks["2"].mlp.down.weight[0, 0] += 1e-3
        assert not torch.equal(second(first(x)), whole)


# ---- initialisation -----------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_initial_weights_do_not_depend_on_the_partition(config):
    full = params(build_model(config, seed=7))
    seen = set()
    for start in range(config.num_layers):
        for end in range(start + 1, config.num_layers + 1):
            part = params(ModelSlice(config, start, end, seed=7))
            for name, tensor in part.items():
                assert name in full, f"[{start}, {end}) invents {name}"
                assert torch.equal(tensor, full[name]), f"{name} differs in [{start}, {end})"
            seen |= part.keys()
    assert seen == full.keys()


def test_parameter_names_are_global():
    names = set(params(ModelSlice(GPT_TINY, 3, 4)))
    assert names == {
        "blocks.2.attn_norm.weight",
        "blocks.2.attn.wq.weight",
        "blocks.2.attn.wk.weight",
        "blocks.2.attn.wv.weight",
        "blocks.2.attn.wo.weight",
        "blocks.2.mlp_norm.weight",
        "blocks.2.mlp.gate.weight",
        "blocks.2.mlp.up.weight",
        "blocks.2.mlp.down.weight",
    }
    assert set(params(ModelSlice(GPT_TINY, 0, 1))) == {"embed.weight"}
    assert set(params(ModelSlice(GPT_TINY, 5, 6))) == {"head.norm.weight", "head.output.weight"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_each_layer_holds_the_parameters_the_cost_model_counts(config):
    for i in range(config.num_layers):
        count = sum(p.numel() for p in ModelSlice(config, i, i + 1).parameters())
        tied_copy = config.vocab_size * config.hidden_size if config.tie_embeddings and i > 0 else 0
        expected = config.layer_param_count(i) + (tied_copy if i == config.num_layers - 1 else 0)
        assert count == expected, config.layer_names()[i]


def test_tied_head_slice_holds_the_embedding_of_the_whole_model():
    last = TIED_TINY.num_layers - 1
    head_only = ModelSlice(TIED_TINY, last, last + 1, seed=5)
    assert set(params(head_only)) == {"embed.weight", "head.norm.weight"}
    assert head_only.head.output is None
    assert torch.equal(head_only.embed.weight, params(build_model(TIED_TINY, seed=5))["embed.weight"])
    # Untied, the head owns its own output matrix and no embedding.
    assert "embed.weight" not in params(ModelSlice(GPT_TINY, GPT_TINY.num_layers - 1))


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (params(build_model(GPT_TINY, seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    for name in a:
        if name.endswith("norm.weight"):
            assert torch.equal(a[name], c[name]), name  # norms start at ones whatever the seed
        else:
            assert not torch.equal(a[name], c[name]), name


def test_initial_statistics():
    weights = params(build_model(GPT_TINY))
    assert torch.equal(weights["blocks.0.attn_norm.weight"], torch.ones(GPT_TINY.hidden_size))
    assert weights["embed.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / (2 * GPT_TINY.num_blocks) ** 0.5
    assert weights["blocks.1.mlp.down.weight"].std().item() == pytest.approx(residual, rel=0.05)
    # Two matrices of the same shape are not copies of one another.
    assert not torch.equal(weights["blocks.0.attn.wq.weight"], weights["blocks.1.attn.wq.weight"])


@pytest.mark.parametrize(("start", "end"), [(0, 0), (3, 2), (-1, 2), (0, 7)])
def test_slice_outside_the_layer_list(start, end):
    with pytest.raises(ValueError, match="is not inside \\[0, 6\\)"):
        ModelSlice(GPT_TINY, start, end)


# ---- backward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_split_gradients_equal_the_whole_models(config):
    x, y = tokens(config)
    whole = build_model(config)
    loss = cross_entropy_sum(whole(x), y) / y.numel()
    loss.backward()
    expected = {n: p.grad for n, p in whole.named_parameters()}

    for k in splits(config):
        first, second = ModelSlice(config, 0, k), ModelSlice(config, k, config.num_layers)
        # Backward across the stage boundary as a pipeline does it: the receiver's input is a leaf,
        # its gradient is sent back and fed to the sender's backward.
        sent = first(x)
        received = sent.detach().requires_grad_()
        split_loss = cross_entropy_sum(second(received), y) / y.numel()
        split_loss.backward()
        sent.backward(received.grad)
        assert torch.equal(split_loss, loss), k

        grads: dict[str, torch.Tensor] = {}
        for part in (first, second):
            for name, p in part.named_parameters():
                # A tied embedding lives in both slices; its gradient is the sum of the two copies'.
                grads[name] = p.grad if name not in grads else grads[name] + p.grad
        assert grads.keys() == expected.keys(), k
        for name, grad in grads.items():
            assert torch.equal(grad, expected[name]), f"{name} at split {k}"

"""Export to safetensors in the Hugging Face Llama layout: the same logits from `transformers`."""

import json
import random

import pytest
import torch
from checkpoint_support import TINY, random_plan
from helpers import QWEN_TINY, SCALED_TINY, TIED_TINY, run_elastor

from costmodel.layout import device_pieces
from runtime.checkpoint import Checkpointer
from runtime.checkpoint.export import export_safetensors, hf_name
from runtime.model import build_model

# Elastor's model and transformers' compute the same operations in the same order in fp32; what
# differs is the attention kernel's reduction order, so logits agree to a few ulps of their size.
LOGIT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def trained_looking_model(config, seed: int):
    """The reference model with weights moved off their initial values (norms too)."""
    model = build_model(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def save_model(directory, model, plan) -> None:
    """Save `model`'s weights as `plan`'s ranks would hold them (with their tied copies)."""
    full = dict(model.named_parameters())
    checkpointers = [Checkpointer(directory, plan, r, session="00000000000e") for r in range(plan.world_size)]
    for rank, checkpointer in enumerate(checkpointers):
        pieces = []
        for spec, box in device_pieces(plan, plan.devices[rank]):
            where = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
            value = full[spec.name].detach()[where]
            pieces.append((spec.name, spec.shape, box.offsets, value))
            for moment, fake in (("exp_avg", value * 0.1), ("exp_avg_sq", value * value)):  # not exported
                pieces.append((f"optim.{moment}.{spec.name}", spec.shape, box.offsets, fake))
        checkpointer.save(5, pieces, {"step": 5})
    for checkpointer in checkpointers:
        checkpointer.wait()


@pytest.mark.parametrize("config", [TINY, TIED_TINY, QWEN_TINY, SCALED_TINY], ids=lambda c: c.name)
def test_export_matches_transformers_logits(tmp_path, config):
    """Llama, with tied embeddings, Qwen2's q/k/v biases, and Llama 3.1's rotary scaling: the exported
    folder loads as its own architecture and gives the same logits."""
    transformers = pytest.importorskip("transformers")
    model = trained_looking_model(config, seed=1).eval()
    plan = random_plan(random.Random(config.num_heads), config, world_size=3)
    save_model(tmp_path / "ckpt", model, plan)
    _, config_json = export_safetensors(tmp_path / "ckpt", tmp_path / "hf" / "model.safetensors")
    assert json.loads(config_json.read_text())["num_key_value_heads"] == config.num_kv_heads

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM")
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, **LOGIT_TOLERANCE)


def test_export_writes_every_parameter_under_its_hugging_face_name(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    model = trained_looking_model(TINY, seed=2)
    save_model(tmp_path / "ckpt", model, random_plan(random.Random(4), world_size=4))
    result = run_elastor(
        "ckpt", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x" / "model.safetensors")
    )
    assert result.returncode == 0, result.stderr
    with safetensors.safe_open(tmp_path / "x" / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == {hf_name(n) for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            assert torch.equal(f.get_tensor(hf_name(name)), p.detach())
    assert (tmp_path / "x" / "config.json").is_file()


def test_export_refuses_to_replace_an_earlier_export_without_force(tmp_path):
    """An existing export (or a config.json beside it) is named and kept; --force replaces both."""
    save_model(
        tmp_path / "ckpt", trained_looking_model(TINY, seed=3), random_plan(random.Random(5), world_size=2)
    )
    out = tmp_path / "x" / "model.safetensors"
    out.parent.mkdir()
    (out.parent / "config.json").write_text('{"model_type": "someone else\'s"}\n')
    args = ("ckpt", "export", str(tmp_path / "ckpt"), "--out", str(out))
    refused = run_elastor(*args)
    assert refused.returncode == 2 and "config.json" in refused.stderr and "--force" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and not out.exists()
    assert "someone else" in (out.parent / "config.json").read_text()
    assert run_elastor(*args, "--force").returncode == 0
    assert out.is_file() and json.loads((out.parent / "config.json").read_text())["model_type"] == "llama"
    again = run_elastor(*args)
    assert again.returncode == 2 and "model.safetensors" in again.stderr

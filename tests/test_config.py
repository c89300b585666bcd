"""ModelConfig (presets, Hugging Face configs, JSON, validation) and ModelProfile (JSON, validation)."""

import dataclasses
import json

import pytest
from helpers import TIED_TINY
from synthetic import synthetic_profile

from costmodel import PRESETS, ElastorError, LayerCost, LayerProfile, ModelConfig, ModelProfile
from costmodel.config import load_model_config
from costmodel.jsonio import write_json

# Published parameter counts: the sums over the released safetensors checkpoints, as the Hugging Face
# model cards report them (Llama 2: Touvron et al. 2023; Llama 3: Dubey et al. 2024).
PUBLISHED_PARAM_COUNTS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}

# meta-llama/Llama-2-7b-hf config.json, the fields Elastor reads plus a few it ignores.
LLAMA2_7B_HF = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}

# meta-llama/Llama-3.2-1B config.json without its rope_scaling block: tied embeddings, counted once.
LLAMA32_1B_HF = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
LLAMA32_1B_PARAMS = 1_235_814_400

# Qwen/Qwen2-0.5B config.json (the fields Elastor reads or checks): q/k/v biases, tied embeddings.
QWEN2_05B_HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 24,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
}


def tiny(**overrides) -> ModelConfig:
    fields = dict(
        name="t",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_blocks=2,
        num_heads=4,
        num_kv_heads=2,
    )
    return ModelConfig(**{**fields, **overrides})


# ---- parameter counts ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAM_COUNTS))
def test_preset_param_count_matches_published(name):
    assert PRESETS[name].param_count == PUBLISHED_PARAM_COUNTS[name]


def test_gpt_small_is_gpt2_124m_without_position_embeddings_and_biases():
    # GPT-2 124M has 124,439,808 parameters. Its Llama form drops the learned position embeddings
    # (1024 x 768), every bias (per block: qkv 3*768, attn proj 768, fc 3072, mlp proj 768, two norm
    # biases 2*768) and the final norm's bias; SwiGLU width 2048 keeps the MLP's weight count.
    h, blocks = 768, 12
    biases = blocks * (3 * h + h + 4 * h + h + 2 * h) + h
    assert PRESETS["gpt-small"].param_count == 124_439_808 - 1024 * h - biases
    assert PRESETS["gpt-small"].tie_embeddings


def test_gpt_tiny_param_count_equals_its_torch_model():
    from runtime.model import build_model

    model = build_model(PRESETS["gpt-tiny"])
    assert PRESETS["gpt-tiny"].param_count == sum(p.numel() for p in model.parameters())


def test_gpt_tiny_keeps_its_promises():
    tiny_cfg = PRESETS["gpt-tiny"]
    assert tiny_cfg.num_blocks >= 4
    assert 100_000 <= tiny_cfg.param_count <= 1_000_000
    for tp in (2, 3, 6):
        assert tiny_cfg.num_heads % tp == 0 and tiny_cfg.num_kv_heads % tp == 0, tp
    for tp in range(1, 7):
        assert tiny_cfg.vocab_size % tp == 0, tp
        assert tiny_cfg.intermediate_size % tp == 0, tp


def test_hf_config_json_loads_with_the_published_count(tmp_path):
    path = tmp_path / "Llama-2-7b-hf" / "config.json"
    write_json(path, LLAMA2_7B_HF)
    config = load_model_config(str(path))
    assert config.name == "Llama-2-7b-hf"
    assert config.param_count == PUBLISHED_PARAM_COUNTS["llama2-7b"]
    assert dataclasses.replace(config, name="llama2-7b") == PRESETS["llama2-7b"]


def test_hf_config_without_name_takes_its_directory_name(tmp_path):
    data = {k: v for k, v in LLAMA2_7B_HF.items() if k != "_name_or_path"}
    path = tmp_path / "my-llama" / "config.json"
    write_json(path, data)
    assert load_model_config(str(path)).name == "my-llama"


def test_hf_config_in_a_file_of_its_own_takes_the_file_stem(tmp_path):
    data = {k: v for k, v in LLAMA2_7B_HF.items() if k != "_name_or_path"}
    for name in ("x.config.json", "x.json"):
        path = tmp_path / "hidden" / name
        write_json(path, data)
        assert load_model_config(str(path)).name == "x"


def test_hf_config_with_tied_embeddings_counts_them_once():
    config = ModelConfig.from_hf_config(LLAMA32_1B_HF, name="llama3.2-1b")
    assert config.tie_embeddings and config.num_kv_heads == 8 and config.rope_theta == 500000.0
    assert config.param_count == LLAMA32_1B_PARAMS
    head = config.layer_param_count(config.num_layers - 1)
    assert head == config.hidden_size  # only the final norm; the output matrix is embed's


def test_hf_config_defaults_kv_heads_to_heads():
    data = {k: v for k, v in LLAMA2_7B_HF.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf_config(data, name="x").num_kv_heads == 32


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    preset = PRESETS[name]
    assert ModelConfig.from_hf_config(preset.to_hf_config(), name=name) == preset


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"attention_bias": True}, "sets attention_bias (biases on every attention projection"),
        ({"mlp_bias": True}, "sets mlp_bias = true (MLP biases)"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 32.0}},
            "rope_scaling that lacks low_freq_factor",
        ),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "has rope_scaling type 'yarn'; Elastor"),
        ({"model_type": "gpt2"}, "has model_type 'gpt2'; Elastor implements llama, qwen2, mistral"),
        ({"model_type": "mixtral"}, "has model_type 'mixtral'"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sets sliding_window = 4096 (a sliding"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sets use_sliding_window = true"),
        ({"num_local_experts": 8}, "sets num_local_experts = 8 (mixture-of-experts layers)"),
        ({"hidden_act": "gelu"}, 'sets hidden_act = "gelu" (an MLP activation other than SiLU)'),
    ],
)
def test_hf_config_features_elastor_lacks_are_refused(change, sentence):
    with pytest.raises(ElastorError, match=r"^The Hugging Face config 'x' ") as e:
        ModelConfig.from_hf_config({**LLAMA2_7B_HF, **change}, name="x")
    assert sentence in str(e.value)


def test_llama31_rope_scaling_and_qwen2_biases_are_read_with_their_published_counts():
    llama31 = {
        **LLAMA2_7B_HF, "intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    }  # fmt: skip
    config = ModelConfig.from_hf_config(llama31, name="llama3.1-8b")
    assert config.param_count == 8_030_261_248  # meta-llama/Llama-3.1-8B
    assert config.rope_scaling.factor == 8.0 and config.rope_scaling.original_max_seq_len == 8192
    assert ModelConfig.from_json(config.to_json()) == config
    assert ModelConfig.from_hf_config(config.to_hf_config(), name="again") == dataclasses.replace(
        config, name="again"
    )
    qwen = ModelConfig.from_hf_config(QWEN2_05B_HF, name="qwen2-0.5b")
    assert qwen.qkv_bias and qwen.param_count == 494_032_768  # Qwen/Qwen2-0.5B
    assert ModelConfig.from_hf_config(qwen.to_hf_config(), name="qwen2-0.5b") == qwen
    assert "qkv_bias" not in PRESETS["llama2-7b"].to_json()  # absent unless used: older files unchanged


def test_hf_config_names_every_missing_field():
    data = {k: v for k, v in LLAMA2_7B_HF.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ElastorError, match=r"lacks the field\(s\) hidden_size, vocab_size."):
        ModelConfig.from_hf_config(data, name="x")


# ---- presets, names, JSON -----------------------------------------------------------------------


def test_load_model_config_accepts_preset_names_and_model_blocks(tmp_path):
    assert load_model_config("llama3-8b") is PRESETS["llama3-8b"]
    path = tmp_path / "tied.json"
    write_json(path, TIED_TINY.to_json())
    assert load_model_config(str(path)) == TIED_TINY


def test_load_model_config_refuses_unknown_names():
    with pytest.raises(ElastorError, match=r"^Unknown model 'llama9-1t'; use a preset \(gpt-tiny, "):
        load_model_config("llama9-1t")


def test_load_model_config_refuses_missing_file(tmp_path):
    with pytest.raises(ElastorError, match=r"does not exist"):
        load_model_config(str(tmp_path / "absent.json"))


@pytest.mark.parametrize("config", [*PRESETS.values(), TIED_TINY], ids=lambda c: c.name)
def test_model_config_json_round_trip(config):
    text = json.dumps(config.to_json())
    data = json.loads(text)
    assert data["num_layers"] == config.num_blocks + 2
    assert ModelConfig.from_json(data) == config


def test_model_config_from_json_ignores_extra_fields():
    assert ModelConfig.from_json({**TIED_TINY.to_json(), "comment": "hand-written"}) == TIED_TINY


def test_layer_list():
    config = tiny(num_blocks=3)
    assert config.layer_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [config.layer_kind(i) for i in range(5)] == ["embed", "block", "block", "block", "head"]
    with pytest.raises(IndexError):
        config.layer_kind(5)
    assert config.head_dim == 8  # hidden_size // num_heads when not given


def test_layer_param_counts():
    config = tiny()
    # block: wq 32*32 + wk, wv 2 * 32*16 + wo 32*32 + MLP 3 * 32*48 + two norms 2*32
    assert config.block_param_count() == 1024 + 1024 + 1024 + 4608 + 64
    assert config.layer_param_count(0) == 64 * 32
    assert config.layer_param_count(3) == 32 + 64 * 32
    assert tiny(tie_embeddings=True).layer_param_count(3) == 32
    assert config.param_count == sum(config.layer_param_count(i) for i in range(config.num_layers))


# ---- construction errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        ({"vocab_size": 0}, "Model 't' needs a positive integer vocab_size, not 0."),
        ({"hidden_size": -32}, "Model 't' needs a positive integer hidden_size, not -32."),
        ({"num_blocks": 2.0}, "Model 't' needs a positive integer num_blocks, not 2.0."),
        ({"num_kv_heads": 0}, "Model 't' needs a positive integer num_kv_heads, not 0."),
        ({"max_seq_len": 0}, "Model 't' needs a positive integer max_seq_len, not 0."),
        ({"num_kv_heads": 3}, "Model 't' has 4 attention heads, which its 3 key/value heads do not divide."),
        ({"head_dim": 7}, "Model 't' has an odd head dimension 7; rotary embeddings need an even one."),
        ({"norm_eps": 0.0}, "Model 't' needs positive norm_eps and rope_theta."),
        ({"rope_theta": -1.0}, "Model 't' needs positive norm_eps and rope_theta."),
    ],
)
def test_model_config_construction_errors(overrides, sentence):
    with pytest.raises(ElastorError) as e:
        tiny(**overrides)
    assert str(e.value) == sentence


def test_model_config_from_json_names_every_missing_field():
    data = TIED_TINY.to_json()
    del data["vocab_size"], data["num_heads"]
    with pytest.raises(ElastorError) as e:
        ModelConfig.from_json(data)
    assert str(e.value) == "The model block lacks the required field(s) vocab_size, num_heads."


def test_model_config_from_json_checks_num_layers():
    with pytest.raises(ElastorError) as e:
        ModelConfig.from_json({**TIED_TINY.to_json(), "num_layers": 4})
    assert str(e.value) == (
        "Model 'tied-tiny' says num_layers=4 but has 3 blocks, so its layer list has 5 entries."
    )


def test_model_config_from_json_needs_an_object():
    with pytest.raises(ElastorError, match=r"^The model block must be a JSON object."):
        ModelConfig.from_json(["gpt-tiny"])


# ---- ModelProfile -------------------------------------------------------------------------------


def test_profile_json_round_trip(tmp_path):
    profile = synthetic_profile(TIED_TINY)
    path = tmp_path / "profile.json"
    write_json(path, profile.to_json())
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    assert [layer["name"] for layer in data["layers"]] == TIED_TINY.layer_names()
    again = ModelProfile.from_json(data)
    assert again == profile
    assert again.cost(2, 2, 1).fwd_s == pytest.approx(TIED_TINY.layer_param_count(2) * 1e-9 * 2)


def test_profile_queries():
    profile = synthetic_profile(PRESETS["gpt-tiny"], micro_batch_sizes=(4, 1), tp_degrees=(3, 1))
    assert profile.micro_batch_sizes() == [1, 4]
    assert profile.tp_degrees() == [1, 3]
    assert profile.bytes_per_param == 4
    assert (
        profile.cost(1, 4, 3).activation_bytes == 4 * 64 * 96 * 6 * 4 // 3
    )  # fp32 x seq x hidden x 6 x mbs / tp
    with pytest.raises(ElastorError) as e:
        profile.cost(1, 2, 3)
    assert str(e.value) == (
        "The profile has no measurement of blocks.0 at micro-batch size 2 and TP degree 3; "
        "profile it with those settings."
    )


def test_profile_refuses_layers_of_another_model():
    profile = synthetic_profile(TIED_TINY)
    with pytest.raises(ElastorError, match=r"^The profile's layers do not match model 'tied-tiny'"):
        dataclasses.replace(profile, layers=profile.layers[:-1])


def test_profile_refuses_a_wrong_param_count():
    profile = synthetic_profile(TIED_TINY)
    layers = list(profile.layers)
    layers[1] = dataclasses.replace(layers[1], param_count=layers[1].param_count + 1)
    with pytest.raises(ElastorError) as e:
        dataclasses.replace(profile, layers=tuple(layers))
    count = TIED_TINY.block_param_count()
    assert str(e.value) == (
        f"The profile says blocks.0 has {count + 1} parameters but model 'tied-tiny' gives it {count}."
    )


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"dtype": "int8"}, "Profile dtype 'int8' is not one of float32, bfloat16, float16."),
        ({"source": "tpu"}, "Profile source 'tpu' is not one of cpu, cuda, analytic."),
        ({"attention": "sparse"}, "Profile attention 'sparse' is not one of fused, math."),
    ],
)
def test_profile_refuses_unknown_dtype_and_source(change, sentence):
    with pytest.raises(ElastorError) as e:
        dataclasses.replace(synthetic_profile(TIED_TINY), **change)
    assert str(e.value) == sentence


@pytest.mark.parametrize("version", [2, None, "1"])
def test_profile_refuses_unknown_schema_version(version):
    data = synthetic_profile(TIED_TINY).to_json()
    data["schema_version"] = version
    with pytest.raises(ElastorError) as e:
        ModelProfile.from_json(data)
    assert str(e.value) == f"The profile has schema_version {version!r}; this Elastor reads version 1."


def test_profile_names_missing_fields():
    data = synthetic_profile(TIED_TINY).to_json()
    del data["seq_len"]
    del data["layers"][0]["param_count"]
    with pytest.raises(ElastorError, match=r"^The profile lacks the required field\(s\) seq_len.$"):
        ModelProfile.from_json(data)
    data["seq_len"] = 16
    with pytest.raises(ElastorError, match=r"^The profile layer lacks the required field\(s\) param_count.$"):
        ModelProfile.from_json(data)


@pytest.mark.parametrize(
    "change",
    [{"micro_batch_size": 0}, {"tp_degree": 0}, {"fwd_s": -1.0}, {"activation_bytes": -1}],
)
def test_layer_cost_errors(change):
    fields = dict(micro_batch_size=1, tp_degree=1, fwd_s=1.0, bwd_s=2.0, activation_bytes=10)
    LayerCost(**fields)
    with pytest.raises(ElastorError, match=r"^A layer cost "):
        LayerCost(**{**fields, **change})


def test_layer_profile_defaults():
    layer = LayerProfile.from_json({"name": "embed", "param_count": 5})
    assert layer == LayerProfile(name="embed", param_count=5)
    assert LayerProfile.from_json(layer.to_json()) == layer

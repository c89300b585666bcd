"""Model configuration: the Llama-family shape every part of Elastor plans, profiles and trains.

The layer list is `embed`, `blocks.0` ... `blocks.{n-1}`, `head` (final norm + output projection);
stages own half-open ranges of it. Parameter counts follow the layout of Hugging Face's
`LlamaForCausalLM` exactly, so a preset's count matches its published figure
(Llama-2-7B: 6,738,415,616) and a model's `config.json` can be read as it is.

Two variants of the family are implemented: Llama 3.1's rotary frequency scaling (`rope_scaling`
of type llama3, Dubey et al. 2024; the frequencies as Meta's reference code scales them) and
Qwen2's biases on the query, key and value projections (`qkv_bias`; Yang et al. 2024). A Hugging
Face config that asks for anything else the model does not compute (another `model_type`, a
sliding window, experts, another activation or rotary scaling, biases elsewhere) is refused in one
sentence naming the field, never read as plain Llama.
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from costmodel.errors import ElastorError
from costmodel.jsonio import is_integer, is_number, read_json, require, shown, text

# The largest value each integer field may take: a generous multiple of the largest published
# model's (Llama 3 405B: hidden 16,384, MLP 53,248, 126 blocks, 128 heads; Gemma's 256,000-token
# vocabulary; million-token contexts), so a typo or a hostile file fails here, not by building a
# billion-entry layer list or weight matrix further on.
MAX_FIELD = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "num_blocks": 1 << 12,
    "num_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "head_dim": 1 << 12,
    "max_seq_len": 1 << 24,
}
# Rotary bases in use run from 10^4 (Llama 2) to 5 x 10^5 (Llama 3) and 10^6 (long-context models).
MAX_ROPE_THETA = 1e12
MAX_ROPE_FACTOR = 1024.0  # Llama 3.1 stretches its rotary wavelengths by 8
# Hugging Face model types read here: Llama's shape, and Qwen2's (q/k/v biases); Mistral's is
# Llama's when it has no sliding window.
HF_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary scaling: wavelengths longer than original_max_seq_len / low_freq_factor
    are stretched by `factor`, shorter than original_max_seq_len / high_freq_factor kept, and the
    band between interpolated (`runtime.model.rotary_frequencies`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        numbers = (self.factor, self.low_freq_factor, self.high_freq_factor)
        if not (
            all(is_number(x, above=0, high=MAX_ROPE_FACTOR) for x in numbers)
            and self.factor >= 1
            and self.low_freq_factor < self.high_freq_factor
            and is_integer(self.original_max_seq_len, 1, MAX_FIELD["max_seq_len"])
        ):
            raise ElastorError(
                "rope_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor (each at most "
                f"{MAX_ROPE_FACTOR:g}) and a positive original_max_seq_len, not {shown(numbers)} and "
                f"{shown(self.original_max_seq_len)}."
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_heads
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None  # Llama 3.1's; None: plain rotary
    qkv_bias: bool = False  # Qwen2's biases on the query, key and value projections

    def __post_init__(self) -> None:
        """The one check of every field's type and range (presets, model blocks, HF configs)."""
        text(self.name, "A model's name")
        for field, high in MAX_FIELD.items():
            value, low = getattr(self, field), 0 if field == "head_dim" else 1
            if not is_integer(value, low, high):
                bound = f" of at most {high:,}" if is_integer(value, low) else ""
                raise ElastorError(
                    f"Model {self.name!r} needs a positive integer {field}{bound}, not {shown(value)}."
                )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim == 0:
            raise ElastorError(
                f"Model {self.name!r} has {self.num_heads} heads of {self.hidden_size} // "
                f"{self.num_heads} = 0 dimensions; give it fewer heads or a head_dim."
            )
        # floats: norms divide by sqrt(mean + eps); rotary angles are position / theta^(2i/d)
        eps, theta = self.norm_eps, self.rope_theta
        if not (is_number(eps, above=0, high=1) and is_number(theta, above=0, high=MAX_ROPE_THETA)):
            if is_number(eps, high=0) or is_number(theta, high=0):
                raise ElastorError(f"Model {self.name!r} needs positive norm_eps and rope_theta.")
            raise ElastorError(
                f"Model {self.name!r} needs a finite norm_eps of at most 1 and a finite rope_theta of at "
                f"most {MAX_ROPE_THETA:g}, not {shown(eps)} and {shown(theta)}."
            )
        object.__setattr__(self, "norm_eps", float(eps))
        object.__setattr__(self, "rope_theta", float(theta))
        for flag in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, flag), bool):
                raise ElastorError(
                    f"Model {self.name!r} needs {flag} true or false, not {shown(getattr(self, flag))}."
                )
        if isinstance(self.rope_scaling, dict):  # from JSON
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling, self.name))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ElastorError(
                f"Model {self.name!r} needs rope_scaling null or an object, not {shown(self.rope_scaling)}."
            )
        if self.num_heads % self.num_kv_heads:
            raise ElastorError(
                f"Model {self.name!r} has {self.num_heads} attention heads, which its "
                f"{self.num_kv_heads} key/value heads do not divide."
            )
        if self.head_dim % 2:
            raise ElastorError(
                f"Model {self.name!r} has an odd head dimension {self.head_dim}; "
                "rotary embeddings need an even one."
            )

    # ---- the layer list -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Entries of the layer list: embed + blocks + head."""
        return self.num_blocks + 2

    def layer_names(self) -> list[str]:
        return ["embed", *(f"blocks.{i}" for i in range(self.num_blocks)), "head"]

    def layer_kind(self, index: int) -> str:
        """`embed`, `block` or `head` for entry `index` of the layer list."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} is outside 0..{self.num_layers - 1}")
        if index == 0:
            return "embed"
        return "head" if index == self.num_layers - 1 else "block"

    # ---- parameter counts (Hugging Face LlamaForCausalLM layout) ---------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def block_param_count(self) -> int:
        h = self.hidden_size
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h  # wq, wk, wv, wo
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h
        biases = self.q_size + 2 * self.kv_size if self.qkv_bias else 0
        return attention + mlp + norms + biases

    def layer_param_count(self, index: int) -> int:
        """Parameters owned by one entry of the layer list; a tied output matrix counts once, in embed."""
        kind = self.layer_kind(index)
        embedding = self.vocab_size * self.hidden_size
        if kind == "embed":
            return embedding
        if kind == "head":
            return self.hidden_size + (0 if self.tie_embeddings else embedding)
        return self.block_param_count()

    @property
    def param_count(self) -> int:
        return sum(self.layer_param_count(i) for i in range(self.num_layers))

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = {**asdict(self), "num_layers": self.num_layers}
        for variant in ("rope_scaling", "qkv_bias"):  # written only when used: older files stay as they were
            if not data[variant]:
                del data[variant]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ElastorError("The model block must be a JSON object.")
        known = {f.name for f in fields(cls)}
        require(data, "model block", *_REQUIRED)
        config = cls(**{k: v for k, v in data.items() if k in known})
        if "num_layers" in data and data["num_layers"] != config.num_layers:
            raise ElastorError(
                f"Model {config.name!r} says num_layers={data['num_layers']} but has "
                f"{config.num_blocks} blocks, so its layer list has {config.num_layers} entries."
            )
        return config

    @classmethod
    def from_hf_config(cls, data: dict[str, Any], name: str) -> "ModelConfig":
        """Read a Hugging Face Llama-family `config.json`."""
        required = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        kind = data.get("model_type", "llama")
        if kind not in HF_MODEL_TYPES:
            raise ElastorError(
                f"The Hugging Face config {name!r} has model_type {shown(kind)}; Elastor implements "
                f"{', '.join(HF_MODEL_TYPES)} (Llama's shape, Qwen2's q/k/v biases)."
            )
        missing = [k for k in required if k not in data]
        if missing:
            raise ElastorError(f"The Hugging Face config {name!r} lacks the field(s) {', '.join(missing)}.")
        _refuse_unimplemented(data, name, kind)
        heads = data["num_attention_heads"]

        def given(key: str, default: Any) -> Any:  # null in a Hugging Face config means "the default"
            return default if data.get(key) is None else data[key]

        return cls(
            name=name,
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_blocks=data["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=given("num_key_value_heads", heads),
            head_dim=given("head_dim", 0),  # 0: hidden_size // num_heads
            max_seq_len=given("max_position_embeddings", 2048),
            norm_eps=given("rms_norm_eps", 1e-6),
            rope_theta=given("rope_theta", 10000.0),
            tie_embeddings=given("tie_word_embeddings", False),
            rope_scaling=_hf_rope_scaling(data, name),
            qkv_bias=kind == "qwen2",
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` of this model (used by checkpoint export)."""
        qwen = self.qkv_bias
        scaling = self.rope_scaling
        return {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_blocks,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            **({"use_sliding_window": False} if qwen else {"attention_bias": False, "mlp_bias": False}),
            "rope_scaling": None
            if scaling is None
            else {
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len,
            },
            "torch_dtype": "float32",
        }


def _rope_scaling(data: dict[str, Any], model: str) -> RopeScaling:
    """A model block's rope_scaling object."""
    require(data, f"model {model!r}'s rope_scaling", *(f.name for f in fields(RopeScaling)))
    return RopeScaling(**{f.name: data[f.name] for f in fields(RopeScaling)})


def _hf_rope_scaling(data: dict[str, Any], name: str) -> RopeScaling | None:
    """Llama 3.1's scaling from a Hugging Face `rope_scaling` (or transformers 5's `rope_parameters`);
    None for none (absent, null, {} or the default type); any other type is refused."""
    scaling = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if not isinstance(scaling, dict):
        raise ElastorError(f"The Hugging Face config {name!r} has a rope_scaling that is not an object.")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ElastorError(
            f"The Hugging Face config {name!r} has rope_scaling type {shown(kind)}; Elastor implements "
            "llama3 scaling only."
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if missing := [k for k in keys if k not in scaling]:
        raise ElastorError(
            f"The Hugging Face config {name!r} has a rope_scaling that lacks {', '.join(missing)}."
        )
    return RopeScaling(
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_seq_len=scaling["original_max_position_embeddings"],
    )


# Fields of a Hugging Face config that ask for computation Elastor's model does not do, each with the
# value that means "not used": (field, is it off, what it is).
_UNIMPLEMENTED = (
    ("sliding_window", lambda v: v is None, "a sliding attention window"),
    ("use_sliding_window", lambda v: not v, "a sliding attention window"),
    ("num_local_experts", lambda v: not v, "mixture-of-experts layers"),
    ("num_experts", lambda v: not v, "mixture-of-experts layers"),
    ("hidden_act", lambda v: v in (None, "silu"), "an MLP activation other than SiLU"),
    ("mlp_bias", lambda v: not v, "MLP biases"),
    ("attention_dropout", lambda v: not v, "attention dropout"),
    ("pretraining_tp", lambda v: v in (None, 1), "Meta's sliced pretraining_tp matmuls"),
)


def _refuse_unimplemented(data: dict[str, Any], name: str, kind: str) -> None:
    for field_name, off, what in _UNIMPLEMENTED:
        if field_name == "sliding_window" and kind == "qwen2":
            continue  # Qwen2 writes a window size that only use_sliding_window turns on
        if field_name in data and not off(data[field_name]):
            raise ElastorError(
                f"The Hugging Face config {name!r} sets {field_name} = {json.dumps(data[field_name])} "
                f"({what}), which Elastor's model does not implement."
            )
    if data.get("attention_bias"):
        raise ElastorError(
            f"The Hugging Face config {name!r} sets attention_bias (biases on every attention projection, "
            "the output's too), which Elastor's model does not implement; Qwen2's q/k/v biases it does."
        )


_REQUIRED = (
    "name",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_blocks",
    "num_heads",
    "num_kv_heads",
)

PRESETS: dict[str, ModelConfig] = {
    # Small enough to train in seconds on CPU; 6 heads, 6 kv heads, MLP width 240 and vocabulary 960
    # are divisible by every tensor-parallel degree 1..6, so tests can exercise TP=3, 5 and 6.
    "gpt-tiny": ModelConfig(
        name="gpt-tiny",
        vocab_size=960,
        hidden_size=96,
        intermediate_size=240,
        num_blocks=4,
        num_heads=6,
        num_kv_heads=6,
        max_seq_len=256,
    ),
    # GPT-2 124M's shape (Radford et al. 2019: 12 layers, 768 wide, 12 heads, tied embeddings) in
    # Llama form; SwiGLU width 2048 = 8/3 * 768 keeps the MLP's parameter count equal to GPT-2's.
    "gpt-small": ModelConfig(
        name="gpt-small",
        vocab_size=50257,
        hidden_size=768,
        intermediate_size=2048,
        num_blocks=12,
        num_heads=12,
        num_kv_heads=12,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # Touvron et al. 2023, "Llama 2", table 1 and the released config.json files.
    "llama2-7b": ModelConfig(
        name="llama2-7b",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_blocks=32,
        num_heads=32,
        num_kv_heads=32,
        max_seq_len=4096,
    ),
    "llama2-13b": ModelConfig(
        name="llama2-13b",
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_blocks=40,
        num_heads=40,
        num_kv_heads=40,
        max_seq_len=4096,
    ),
    "llama2-70b": ModelConfig(
        name="llama2-70b",
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_blocks=80,
        num_heads=64,
        num_kv_heads=8,
        max_seq_len=4096,
    ),
    # Dubey et al. 2024, "The Llama 3 Herd of Models", table 3 and the released config.json files.
    "llama3-8b": ModelConfig(
        name="llama3-8b",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_blocks=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_blocks=80,
        num_heads=64,
        num_kv_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


def load_model_config(spec: str) -> ModelConfig:
    """A preset name, or the path of a JSON file: Elastor's model block or a Hugging Face config.json."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.suffix == ".json":
        raise ElastorError(
            f"Unknown model {spec!r}; use a preset ({', '.join(PRESETS)}) or a config.json path."
        )
    data = read_json(path, "model config")
    if "num_hidden_layers" in data:
        return ModelConfig.from_hf_config(data, name=_hf_name(data, path))
    return ModelConfig.from_json(data)


def _hf_name(data: dict, path: Path) -> str:
    """A Hugging Face config's model name: its own `_name_or_path` (last part), else the file's stem
    (`llama-mini.config.json` -> llama-mini), else, for a file named config.json as a model folder
    holds it, the folder's name."""
    own = data.get("_name_or_path")
    if isinstance(own, str) and own.strip("/"):
        return own.strip("/").split("/")[-1]
    stem = path.name.removesuffix(".json").removesuffix(".config")
    return stem if stem != "config" else (path.resolve().parent.name or "model")

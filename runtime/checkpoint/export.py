"""Export a checkpoint's model as one safetensors file in the Hugging Face Llama layout, plus config.json.

Elastor's model already follows `LlamaForCausalLM`'s conventions (rotate-half rotary embeddings,
[out, in] linear weights), so export renames tensors and permutes nothing. The safetensors file is
written by streaming one consolidated tensor at a time (format: an 8-byte little-endian header
length, a JSON header of dtype, shape and data offsets per tensor, then the raw bytes), so host
memory stays at one tensor whatever the model size. Optimizer states are not exported.
"""

import json
import os
import re
import struct
from pathlib import Path

import torch

from costmodel.config import ModelConfig
from costmodel.jsonio import atomic_output, write_atomic
from runtime.checkpoint.format import DTYPES, CheckpointError
from runtime.checkpoint.load import CheckpointReader, Wanted, checkpoint_meta

_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
}

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """Hugging Face `LlamaForCausalLM` name of an Elastor parameter."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "head.norm.weight":
        return "model.norm.weight"
    if name == "head.output.weight":
        return "lm_head.weight"
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise CheckpointError(f"Parameter {name!r} has no Hugging Face Llama name.")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_tokenizer(checkpoint: str | os.PathLike, folder: Path, tokenizer: str | None) -> list[Path]:
    """Copy the tokenizer (`tokenizer`, else the one the checkpoint's data was encoded with, if that
    file is still there) into `folder` as `tokenizer.json`, with a `tokenizer_config.json` naming the
    fast tokenizer class, so that `transformers.AutoTokenizer.from_pretrained(folder)` loads it.
    Returns the files written (none without a tokenizer)."""
    from runtime.data import tokenizer_file

    if tokenizer is None:
        _, meta, _ = checkpoint_meta(checkpoint)
        tokenizer = meta.get("data", {}).get("tokenizer")
        if tokenizer is None or not Path(tokenizer).is_file():
            return []
    source = tokenizer_file(tokenizer).read_bytes()
    written = [folder / name for name in TOKENIZER_FILES]
    write_atomic(written[0], source, durable=True)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    write_atomic(written[1], (json.dumps(settings, indent=2) + "\n").encode(), durable=True)
    return written


def export_safetensors(path: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Path]:
    """Write the model of DIR to `out` (safetensors) and `config.json` beside it; returns both paths."""
    out = Path(out)
    with CheckpointReader(path) as reader:
        reader.manifest.check_files()  # every size on disk before any tensor is allocated
        model = ModelConfig.from_json(reader.manifest.model)
        params = [e for e in reader.manifest.tensors.values() if not e.name.startswith("optim.")]
        header: dict[str, dict] = {
            "__metadata__": {"format": "pt", "elastor_step": str(reader.manifest.step)}
        }
        offset = 0
        for entry in params:
            nbytes = entry.nbytes
            header[hf_name(entry.name)] = {
                "dtype": _SAFETENSORS_DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        with atomic_output(out, durable=True) as f:  # the output rules of costmodel.jsonio
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for entry in params:
                full = Wanted(
                    entry.name, entry.shape, (0,) * len(entry.shape), entry.shape, DTYPES[entry.dtype]
                )
                f.write(memoryview(reader.read(full).view(-1).view(torch.uint8).numpy()))
    config = out.parent / "config.json"
    write_atomic(config, (json.dumps(model.to_hf_config(), indent=2) + "\n").encode(), durable=True)
    return out, config

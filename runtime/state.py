"""The training state of one rank as checkpoint pieces, and back: the contract with runtime/checkpoint/.

`training_state(trainer)` returns

- a list of `StatePiece(name, global_shape, offsets, tensor)`: for every run of rows whose optimizer
  state this rank keeps (runtime/dist_optim.py; `costmodel.sharding.state_boxes` of the plan), its
  fp32 master (name = the global parameter name, e.g. "blocks.3.attn.wq.weight") and its AdamW
  moments ("optim.exp_avg.<name>", "optim.exp_avg_sq.<name>") in the same box. `tensor` is a live
  view in the global layout, not a copy: snapshot it before training continues. Replicas (data-
  parallel copies without ZeRO-1, a stage's TP ranks sharing a norm) appear on every rank that
  keeps them; which rank writes which bytes is the checkpoint's choice. Under ZeRO-1 each slice
  appears on its owner only, so its owner writes it;
- a JSON-able dict: `step` (optimizer steps done; every parameter's AdamW step count equals it),
  `data` (`cursor`, the next sample index, and the source), `lr_schedule` (the `OptimConfig`,
  which with `step` fixes every future learning rate), `seed`, `rng` (base64 torch RNG states and
  Python's), `model` (the model config) and `plan` (the plan it was saved under).

`restore_training_state(trainer, tensors, meta)` is the inverse on a trainer built for any plan of
the same model: `tensors` maps each (name, offsets) of `state_pieces(trainer)` to a tensor of that
piece's shape (the boxes to load are those pieces' boxes under the new plan); it copies them in,
publishes the masters into the module (under ZeRO-1 an all-gather: every rank restores together),
sets the AdamW step counts, step, cursor, schedule, seed, data stream and RNG states (a synthetic
stream resumes with its saved seed; a file stream with the trainer's file, which must be one). A
checkpoint of another model is an `ElastorError`. No part of a training step draws random numbers
(no dropout; data are a function of the sample index), so restoring RNG states is for completeness:
it makes later random use resumable.
"""

import base64
import random
from dataclasses import dataclass
from typing import Any

import torch

from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.plan import Plan
from runtime.data import SyntheticTokens
from runtime.optim import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StatePiece:
    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # where `tensor` starts in the global tensor, per dimension
    tensor: torch.Tensor  # local shard, contiguous, on the rank's device


def state_pieces(trainer) -> list[StatePiece]:
    """Masters, then their AdamW moments, in the order of the rank's buckets."""
    pieces = []
    for piece in trainer.main.pieces:
        spec, box = piece.rows.spec, piece.rows.box
        pieces.append(StatePiece(spec.name, spec.shape, box.offsets, piece.global_view(piece.param)))
    for piece in trainer.main.pieces:
        spec, box = piece.rows.spec, piece.rows.box
        state = trainer.optimizer.state[piece.param]
        for moment in MOMENTS:
            pieces.append(
                StatePiece(
                    f"optim.{moment}.{spec.name}", spec.shape, box.offsets, piece.global_view(state[moment])
                )
            )
    return pieces


def training_state(trainer) -> tuple[list[StatePiece], dict[str, Any]]:
    meta = {
        "step": trainer.step,
        "data": {"cursor": trainer.cursor, **trainer.source.describe()},
        "lr_schedule": trainer.optim.to_json(),
        "seed": trainer.seed,
        "rng": _rng_state(trainer.ctx.device),
        "model": trainer.plan.model.to_json(),
        "plan": trainer.plan.to_json(),
    }
    return state_pieces(trainer), meta


def check_meta(meta: Any, where) -> None:
    """Refuse, in one sentence, checkpoint metadata that `restore_training_state` could not use:
    the manifest that carries it is checked for shape, and this checks its contents."""
    from runtime.checkpoint.format import CheckpointError

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"The checkpoint {where} has unusable metadata: {what}.")

    if not isinstance(meta, dict):
        raise fail("it is not an object")
    for key in ("step", "seed"):
        if type(meta.get(key)) is not int or meta[key] < 0:
            raise fail(f"{key} {meta.get(key)!r} is not a non-negative integer")
    data, rng = meta.get("data"), meta.get("rng")
    if not isinstance(data, dict) or type(data.get("cursor")) is not int or data["cursor"] < 0:
        raise fail("its data cursor is not a non-negative integer")
    if data.get("kind") == "synthetic" and type(data.get("seed")) is not int:
        raise fail("its synthetic data has no integer seed")
    if data.get("kind") != "synthetic" and not isinstance(data.get("path"), str):
        raise fail(f"its data kind {data.get('kind')!r} names no file")
    try:
        OptimConfig.from_json(meta.get("lr_schedule"))
        ModelConfig.from_json(meta.get("model"))
        Plan.from_json(meta.get("plan"))
    except (ElastorError, TypeError) as e:
        raise fail(str(e).rstrip(".")) from None
    if not isinstance(rng, dict) or not _valid_rng(rng):
        raise fail("its random-number-generator states are not the ones a save writes")


def _valid_rng(rng: dict[str, Any]) -> bool:
    """Whether the saved generator states are ones `_set_rng_state` can set: Python's is tried on a
    generator of its own, torch's are base64 of the right length."""
    python = rng.get("python")
    if not (isinstance(python, list) and len(python) == 3 and isinstance(python[1], list)):
        return False
    if python[2] is not None and type(python[2]) is not float:
        return False
    try:
        random.Random().setstate((python[0], tuple(python[1]), python[2]))
        cpu = _decode(rng.get("torch_cpu"))
        cuda = rng.get("torch_cuda")
        if cuda is not None:
            _decode(cuda)
    except (TypeError, ValueError, OverflowError):
        return False
    return cpu.numel() == torch.get_rng_state().numel()


@torch.no_grad()
def restore_training_state(trainer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    saved, ours = ModelConfig.from_json(meta["model"]), trainer.plan.model
    if saved != ours:
        raise ElastorError(
            f"The checkpoint holds model {saved.name!r} ({saved.param_count:,} parameters), not the plan's "
            f"model {ours.name!r} ({ours.param_count:,}); point --ckpt-dir at a checkpoint of this model."
        )
    for piece in state_pieces(trainer):
        loaded = tensors.get((piece.name, piece.offsets))
        if loaded is None:
            raise ElastorError(f"The checkpoint lacks {piece.name} at offsets {piece.offsets}.")
        if tuple(loaded.shape) != tuple(piece.tensor.shape):
            raise ElastorError(
                f"The checkpoint's {piece.name} piece has shape {tuple(loaded.shape)}, "
                f"not {tuple(piece.tensor.shape)}."
            )
        piece.tensor.copy_(loaded)
    trainer.main.publish()
    for piece in trainer.main.pieces:
        trainer.optimizer.state[piece.param]["step"].fill_(float(meta["step"]))
    trainer.step, trainer.cursor = int(meta["step"]), int(meta["data"]["cursor"])
    trainer.optim = OptimConfig.from_json(meta["lr_schedule"])
    trainer.seed = int(meta["seed"])
    _restore_source(trainer, meta["data"])
    _set_rng_state(meta["rng"], trainer.ctx.device)


def _restore_source(trainer, data: dict[str, Any]) -> None:
    """The synthetic stream continues from its saved seed; a file stream continues in the trainer's
    file (paths differ between machines), which must be a file too."""
    if data["kind"] == "synthetic":
        config = trainer.plan.model
        trainer.use_source(SyntheticTokens(config.vocab_size, trainer.plan.seq_len, int(data["seed"])))
    elif trainer.source.describe()["kind"] != data["kind"]:
        raise ElastorError(
            f"The checkpoint was trained on the data file {data['path']}; pass it (or a copy) with --data."
        )
    else:  # the same windows in the same order, or the resumed run would not be the one it continues
        now = trainer.source.describe()
        saved = {"shuffle_seed": data.get("shuffle_seed"), "eval_fraction": data.get("eval_fraction", 0.0)}
        if (now["shuffle_seed"], now["eval_fraction"]) != (saved["shuffle_seed"], saved["eval_fraction"]):
            order = (
                "in order (--no-shuffle)"
                if saved["shuffle_seed"] is None
                else f"shuffled by --seed {saved['shuffle_seed']}"
            )
            raise ElastorError(
                f"The checkpoint read {data['path']} {order} with --eval-fraction "
                f"{saved['eval_fraction']:g}; resume with the same, so that its samples follow the ones "
                "it trained on."
            )


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state(device: torch.device) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {
        "torch_cpu": _encode(torch.get_rng_state()),
        "torch_cuda": _encode(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
    }


def _set_rng_state(rng: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(_decode(rng["torch_cpu"]))
    if device.type == "cuda" and rng.get("torch_cuda"):
        torch.cuda.set_rng_state(_decode(rng["torch_cuda"]), device)
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))

"""Malicious and damaged checkpoints: every one refused in one sentence, nothing read outside it.

A real checkpoint is made once by `elastor train` (one process, gpt-tiny, two steps). Each case
copies it and damages it as a writer of the directory could: manifests that name files outside the
directory, links, FIFOs, device files, offsets and lengths past the data, shapes and dtypes that are
not the model's, duplicated names, absurd chunk sizes, broken JSON. A forger recomputes the
manifest's CRC32C (it is an integrity check, not a signature), so most cases do.

Each case goes through `ckpt inspect`, `ckpt verify`, `ckpt export` and a resume (`resume()` into
a one-process trainer; one case also through `elastor train` itself) and must be refused with one
sentence (exit 2 on the command line) that names the check that caught it, within a time bound (a
FIFO must not hang a read). Five more cases damage only the training metadata (plan, RNG states,
schedule, data cursor), which a resume alone reads. An audit hook records every file the process
opens: no case may open the sentinel file that lies beside the checkpoint directory except with
O_NOFOLLOW (which refuses the link instead of reading through it).
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from dist_helpers import launch, plan_json

from costmodel import PRESETS, Plan
from costmodel.jsonio import write_json
from elastor.cli import main
from runtime.checkpoint import CheckpointError, latest_checkpoint
from runtime.checkpoint.format import MANIFEST, manifest_checksum

MODEL = PRESETS["gpt-tiny"].to_json()
PLAN = plan_json(MODEL, [(2, [((0, 6), ["n0:0"])])], micro_batch_size=2)
TIME_LIMIT_S = 20  # per operation: far above a legitimate read of this checkpoint (well under 1 s)
SENTINEL = b"sentinel: bytes that lie outside every checkpoint directory\n" * 64

_opened: list[tuple[str, int]] | None = None


def _audit(event: str, args) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append((os.fsdecode(args[0]), args[2] if isinstance(args[2], int) else 0))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crafted")
    write_json(root / "plan.json", PLAN)
    ckpt = root / "ckpt"
    done = launch([*_train(root), f"--ckpt-dir={ckpt}", "--ckpt-every=2"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return latest_checkpoint(ckpt)


def _train(root: Path) -> list[str]:
    """`elastor train` of the plan in `root` for two steps, one process."""
    plan, metrics = root / "plan.json", root / "metrics.jsonl"
    return [sys.executable, "-m", "elastor", "train", f"--plan={plan}", "--steps=2", f"--metrics={metrics}"]


# ---- the cases: each damages the copy `step` (a step directory) of the pristine checkpoint --------
def _edit(mutate, recompute: bool = True):
    """A case that edits the manifest's JSON with `mutate(body, step, outside)`, re-signing it."""

    def apply(step: Path, outside: Path) -> None:
        body = json.loads((step / MANIFEST).read_text())
        mutate(body, step, outside)
        if recompute:
            body["manifest_crc32c"] = manifest_checksum(body)
        (step / MANIFEST).write_text(json.dumps(body))

    return apply


def _files(value):
    def mutate(body, step, outside):
        name = body["files"][0]["file"]
        target = value(step, outside) if callable(value) else value
        body["files"][0]["file"] = target
        for tensor in body["tensors"]:
            for piece in tensor["pieces"]:
                if piece["file"] == name:
                    piece["file"] = target

    return _edit(mutate)


def _first_tensor(**changes):
    return _edit(lambda body, step, outside: body["tensors"][0].update(changes))


def _first_piece(**changes):
    return _edit(lambda body, step, outside: body["tensors"][0]["pieces"][0].update(changes))


def _top(**changes):
    return _edit(lambda body, step, outside: body.update(changes))


def _replace_data(make):
    def apply(step: Path, outside: Path) -> None:
        data = step / json.loads((step / MANIFEST).read_text())["files"][0]["file"]
        data.unlink()
        make(data, outside)

    return apply


def _raw_manifest(text: bytes):
    def apply(step: Path, outside: Path) -> None:
        (step / MANIFEST).write_bytes(text)

    return apply


def _manifest_link(step: Path, outside: Path) -> None:
    forged = outside.parent / "forged-manifest.json"
    shutil.copy(step / MANIFEST, forged)
    (step / MANIFEST).unlink()
    (step / MANIFEST).symlink_to(forged)


def _manifest_fifo(step: Path, outside: Path) -> None:
    (step / MANIFEST).unlink()
    os.mkfifo(step / MANIFEST)


def _step_link(step: Path, outside: Path) -> None:
    real = outside.parent / "elsewhere"
    shutil.move(step, real)
    step.symlink_to(real, target_is_directory=True)


def _duplicate_tensor(body, step, outside):
    body["tensors"].append(body["tensors"][0])


def _drop_rows(body, step, outside):
    """The first piece of the first tensor loses its second half: a gap no other piece fills."""
    tensor = body["tensors"][0]
    piece, split = tensor["pieces"][0], tensor["split_dim"]
    piece["sizes"][split] //= 2
    piece["bytes"] //= 2
    piece["chunk_crc32c"] = piece["chunk_crc32c"][: -(-piece["bytes"] // body["chunk_bytes"])]


def _overlap_piece(body, step, outside):
    tensor = body["tensors"][0]
    tensor["pieces"].append(tensor["pieces"][0])


def _transpose(body, step, outside):
    tensor = next(t for t in body["tensors"] if len(t["shape"]) == 2 and t["shape"][0] != t["shape"][1])
    tensor["shape"] = tensor["shape"][::-1]


def _nest(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _bool_bytes(body, step, outside):
    body["files"][0]["bytes"] = True


def _model_zero_heads(body, step, outside):
    body["model"]["num_heads"] = 0


def _model_tie_string(body, step, outside):
    body["model"]["tie_embeddings"] = "no"


CASES = {
    "traversal": _files(lambda step, outside: f"../../{outside.name}"),
    "traversal-dotdot": _files(".."),
    "absolute": _files(lambda step, outside: str(outside)),
    "dev-zero": _files("/dev/zero"),
    "separator": _files("sub/data-00000.bin"),
    "empty-name": _files(""),
    "hidden-dot": _files("."),
    "data-symlink-out": _replace_data(lambda data, outside: data.symlink_to(outside)),
    "data-symlink-dev": _replace_data(lambda data, outside: data.symlink_to("/dev/zero")),
    "data-fifo": _replace_data(lambda data, outside: os.mkfifo(data)),
    "data-directory": _replace_data(lambda data, outside: data.mkdir()),
    "data-missing": _replace_data(lambda data, outside: None),
    "manifest-symlink": _manifest_link,
    "manifest-fifo": _manifest_fifo,
    "step-symlink": _step_link,
    "offset-past-end": _first_piece(offset=1 << 40),
    "offset-negative": _first_piece(offset=-4096),
    "bytes-negative": _first_piece(bytes=-1),
    "bytes-not-rows": _first_piece(bytes=3),
    "size-listed-larger": _edit(lambda body, step, outside: body["files"][0].update(bytes=1 << 40)),
    "bytes-bool": _edit(_bool_bytes),
    "huge-shape": _first_tensor(shape=[1 << 40, 1 << 40]),
    "shape-transposed": _edit(_transpose),
    "shape-strings": _first_tensor(shape=["960", "96"]),
    "dtype-int32": _first_tensor(dtype="int32"),
    "dtype-unknown": _first_tensor(dtype="complex128"),
    "split-dim-wrong": _first_tensor(split_dim=5),
    "duplicate-name": _edit(_duplicate_tensor),
    "unknown-tensor": _first_tensor(name="blocks.99.attn.wq.weight"),
    "piece-gap": _edit(_drop_rows),
    "piece-overlap": _edit(_overlap_piece),
    "chunk-huge": _top(chunk_bytes=1 << 40),
    "chunk-zero": _top(chunk_bytes=0),
    "chunk-crcs-short": _first_piece(chunk_crc32c=[]),
    "crc-out-of-range": _first_piece(crc32c=1 << 33),
    "no-tensors": _edit(lambda body, step, outside: body.pop("tensors")),
    "tensors-not-list": _top(tensors={"a": 1}),
    "files-not-list": _top(files="data-00000.bin"),
    "step-negative": _top(step=-1),
    "step-string": _top(step="abc"),
    "model-zero-heads": _edit(_model_zero_heads),
    "model-tie-string": _edit(_model_tie_string),
    "crc-not-recomputed": _edit(lambda body, step, outside: body.update(step=7), recompute=False),
    "not-json": _raw_manifest(b"{ this is not json"),
    "binary": _raw_manifest(bytes(range(256)) * 8),
    "nested": _raw_manifest(_nest(100_000)),
    "json-list": _raw_manifest(b"[1, 2, 3]"),
    "empty": _raw_manifest(b""),
}


# What each refusal must name: the check that caught the case, not a later failure.
EXPECTED = {
    "traversal": "a data file must be a plain name",
    "traversal-dotdot": "a data file must be a plain name",
    "absolute": "a data file must be a plain name",
    "dev-zero": "a data file must be a plain name",
    "separator": "a data file must be a plain name",
    "empty-name": "has file ''; it must be a non-empty string",
    "hidden-dot": "a data file must be a plain name",
    "data-symlink-out": "it must be a regular file, not a link",
    "data-symlink-dev": "it must be a regular file, not a link",
    "data-fifo": "is not a regular file, so it is not read",
    "data-directory": "is not a regular file, so it is not read",
    "data-missing": "data-00000.bin is missing",
    "manifest-symlink": "manifest.json cannot be opened",
    "manifest-fifo": "manifest.json is not a regular file",
    "step-symlink": "is a symbolic link",
    "offset-past-end": "past the end of data-00000.bin",
    "offset-negative": "has offset -4096",
    "bytes-negative": "has bytes -1",
    "bytes-not-rows": "with 3 bytes",
    "size-listed-larger": "is truncated",
    "bytes-bool": "has bytes True",
    "huge-shape": "not the model's [960, 96]",
    "shape-transposed": "has shape [96, 960], not the model's [960, 96]",
    "shape-strings": "has shape ['960', '96']",
    "dtype-int32": "has dtype 'int32'",
    "dtype-unknown": "has dtype 'complex128'",
    "split-dim-wrong": "has split_dim 5",
    "duplicate-name": "is listed a second time",
    "unknown-tensor": "is neither a parameter of the checkpoint's model",
    "piece-gap": "has a gap from row 480",
    "piece-overlap": "has an overlap at row 0",
    "chunk-huge": "has chunk_bytes 1099511627776",
    "chunk-zero": "has chunk_bytes 0",
    "chunk-crcs-short": "has chunk_crc32c []",
    "crc-out-of-range": "has crc32c 8589934592",
    "no-tensors": "lacks 'tensors'",
    "tensors-not-list": "has tensors of type dict",
    "files-not-list": "has files of type str",
    "step-negative": "has step -1",
    "step-string": "has step 'abc'",
    "model-zero-heads": "num_heads",
    "model-tie-string": "tie_embeddings",
    "crc-not-recomputed": "its CRC32C does not match",
    "not-json": "not valid JSON",
    "binary": "it is not UTF-8 text",
    "nested": "nested too deeply",
    "json-list": "it is not a JSON object",
    "empty": "not valid JSON",
}


def _meta(mutate):
    return _edit(lambda body, step, outside: mutate(body["meta"]))


# Metadata only a resume reads: `ckpt inspect`, `verify` and `export` have no use for it.
META_CASES = {
    "meta-plan-without-pipelines": (_meta(lambda m: m["plan"].pop("pipelines")), "unusable metadata"),
    "meta-rng-index": (_meta(lambda m: m["rng"]["python"][1].__setitem__(624, 10**6)), "random-number"),
    "meta-lr-nan": (_meta(lambda m: m["lr_schedule"].update(lr=float("nan"))), "lr is nan"),
    "meta-cursor-negative": (_meta(lambda m: m["data"].update(cursor=-5)), "data cursor"),
    "meta-not-object": (_edit(lambda body, step, outside: body.update(meta={})), "unusable metadata"),
}
ALL_CASES = {**CASES, **{name: case for name, (case, _) in META_CASES.items()}}
EXPECTED.update({name: said for name, (_, said) in META_CASES.items()})


def test_every_case_states_what_its_refusal_names():
    assert sorted(EXPECTED) == sorted(ALL_CASES) and len(CASES) >= 30


@pytest.fixture
def crafted(request, pristine, tmp_path) -> Path:
    """A --ckpt-dir holding one damaged copy of the pristine checkpoint; a sentinel beside it."""
    outside = tmp_path / "sentinel.bin"
    outside.write_bytes(SENTINEL)
    ckpt = tmp_path / "ckpt"
    step = ckpt / pristine.name
    shutil.copytree(pristine, step)
    ALL_CASES[request.param](step, outside)
    return ckpt


class _TimeLimit:
    def __enter__(self):
        def expire(*_):
            raise TimeoutError(f"the operation ran past {TIME_LIMIT_S} s")

        signal.signal(signal.SIGALRM, expire)
        signal.alarm(TIME_LIMIT_S)

    def __exit__(self, *exc):
        signal.alarm(0)


def _watch_opens(operation, sentinel: Path):
    """Run `operation` with the audit hook on; fail if it opened the sentinel following links."""
    global _opened
    _opened = []
    try:
        with _TimeLimit():
            return operation()
    finally:
        opened, _opened = _opened, None
        target = os.path.realpath(sentinel)
        for path, flags in opened:
            followed = not flags & getattr(os, "O_NOFOLLOW", 0)
            assert not (os.path.exists(path) and os.path.realpath(path) == target and followed), (
                f"{path} was opened, reading the sentinel outside the checkpoint"
            )


def _one_sentence(err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastor: error: "), err
    assert "Traceback" not in err and str(SENTINEL[:20]) not in err
    assert str(len(SENTINEL)) not in err, "the sentinel's size was disclosed"


@pytest.mark.parametrize("crafted", sorted(CASES), indirect=True)
@pytest.mark.parametrize("action", ["inspect", "verify", "export"])
def test_a_crafted_checkpoint_is_refused_by_the_command_line(crafted, action, capsys, tmp_path, request):
    out = tmp_path / "export" / "model.safetensors"
    args = ["ckpt", action, str(crafted)] + (["--out", str(out)] if action == "export" else [])
    code = _watch_opens(lambda: main(args), crafted.parent / "sentinel.bin")
    captured = capsys.readouterr()
    assert code == 2, (code, captured.out, captured.err)
    _one_sentence(captured.err)
    assert EXPECTED[request.node.callspec.params["crafted"]] in captured.err, captured.err
    assert not out.exists() or SENTINEL not in out.read_bytes()


@pytest.fixture(scope="module")
def trainer():
    import torch.distributed as dist

    from runtime.distributed import init_distributed
    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    plan = Plan.from_json(PLAN).validate()
    made = Trainer(plan, init_distributed(plan, device="cpu"), optim=OptimConfig(), seed=0)
    yield made
    made.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("crafted", sorted(ALL_CASES), indirect=True)
def test_a_crafted_checkpoint_is_refused_by_resume(crafted, trainer, capfd, request):
    from runtime.checkpointing import resume

    with pytest.raises(CheckpointError) as refused:
        _watch_opens(lambda: resume(trainer, crafted, None), crafted.parent / "sentinel.bin")
    assert "\n" not in str(refused.value) and str(len(SENTINEL)) not in str(refused.value)
    said = str(refused.value) + capfd.readouterr().err  # the skipped checkpoint's reason is printed
    assert EXPECTED[request.node.callspec.params["crafted"]] in said, said


@pytest.mark.parametrize("crafted", ["traversal"], indirect=True)
def test_elastor_train_refuses_to_resume_from_a_crafted_checkpoint(crafted, tmp_path):
    write_json(tmp_path / "plan.json", PLAN)
    done = launch([*_train(tmp_path), f"--ckpt-dir={crafted}"], timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastor: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]

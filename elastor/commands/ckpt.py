"""`elastor ckpt inspect|verify|export DIR`: look into, check, or export a checkpoint.

DIR is a --ckpt-dir (meaning its newest complete checkpoint) or one checkpoint's directory.
"""

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from costmodel import ElastorError, ModelConfig, Plan
from costmodel.jsonio import output_path, shown
from costmodel.table import format_table
from elastor.commands import subcommand


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "ckpt",
        "Inspect, verify or export a checkpoint (DIR: a --ckpt-dir, meaning its newest, or one checkpoint).",
        "elastor ckpt export ckpt/ --format safetensors --out hf/model.safetensors",
    )
    p.add_argument("action", choices=("inspect", "verify", "export"), help="what to do with the checkpoint")
    p.add_argument("dir", metavar="DIR", help="a --ckpt-dir or one checkpoint's directory")
    p.add_argument("--format", default="safetensors", choices=("safetensors",), help="export format")
    p.add_argument(
        "--out",
        default="model.safetensors",
        help="export file; config.json is written beside it (default: %(default)s)",
    )
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer (tokenizer.json, or a folder holding one) to write beside the export "
        "(default: the one the checkpoint was trained with, where that file still exists)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="export over an existing export file, or config.json or tokenizer files beside it",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "export":
        out = output_path(args.out)  # a bad --out fails before the checkpoint is read
        from runtime.checkpoint.export import TOKENIZER_FILES  # export needs torch anyway

        beside = [Path(args.out).parent / name for name in ("config.json", *TOKENIZER_FILES)]
        existing = [p for p in (out, *beside) if p.exists()]
        if existing and not args.force:
            names, where = " and ".join(shown(p.name) for p in existing), shown(str(Path(args.out).parent))
            raise ElastorError(
                f"{names} already exist{'s' if len(existing) == 1 else ''} in {where}; "
                "export elsewhere, or pass --force to replace."
            )
    # Imported here: the checkpoint needs torch, which the other subcommands do not.
    from runtime.checkpoint.export import export_safetensors, export_tokenizer
    from runtime.checkpoint.format import Manifest
    from runtime.checkpoint.store import resolve
    from runtime.checkpoint.verify import verify_checkpoint

    if args.action == "inspect":
        manifest = Manifest.read(resolve(args.dir))
        manifest.check_files()  # the sizes it lists are the ones on disk, read from regular files only
        print(_inspect(manifest))
        return 0
    if args.action == "verify":
        report = verify_checkpoint(args.dir)
        for problem in report.problems:
            print(f"elastor: error: {problem}", file=sys.stderr)
        if report.problems:
            return 2
        print(
            f"{report.path}: step {report.step}, {report.tensors} tensors in {report.pieces} pieces, "
            f"{_mb(report.bytes_checked)} checked: every CRC32C matches."
        )
        return 0
    out, config = export_safetensors(args.dir, args.out)
    written = [config, *export_tokenizer(args.dir, out.parent, args.tokenizer)]
    print(f"wrote {out} ({_mb(out.stat().st_size)}) and {', '.join(str(p) for p in written)}")
    return 0


def _inspect(manifest) -> str:
    model = ModelConfig.from_json(manifest.model)
    saved = datetime.fromtimestamp(manifest.created_time_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    total = sum(manifest.files.values())
    lines = [
        f"checkpoint {manifest.path}",
        f"step {manifest.step}, model {model.name} ({model.param_count:,} parameters), saved {saved}, "
        f"{_mb(total)} in {len(manifest.files)} data file(s), CRC32C per {_mb(manifest.chunk_bytes)} chunk",
        "",
        "saved under " + Plan.from_json(manifest.plan).summary(),
        "",
        format_table([("data file", "bytes"), *((f, f"{n:,}") for f, n in sorted(manifest.files.items()))]),
        "",
    ]
    rows = [("tensor", "dtype", "shape", "split dim", "pieces", "bytes")]
    for t in manifest.tensors.values():
        shape = "x".join(map(str, t.shape))
        rows.append((t.name, t.dtype, shape, str(t.split_dim), str(len(t.pieces)), f"{t.nbytes:,}"))
    lines.append(format_table(rows))
    return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:,} B"

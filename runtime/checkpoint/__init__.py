"""Partition-agnostic, asynchronous, crash-safe checkpoints: save under one plan, load under any other.

- `format`: the directory layout, manifest and storage order (read this first);
- `assign`: which rank writes which piece, a pure function of the plan;
- `pieces`: `Piece` (what a rank saves) and `Wanted` (what it loads);
- `save`: `Checkpointer`, the asynchronous save (the blocking snapshot);
- `commit`: the save's background half: checksums, O_DIRECT writes, fragments, rank 0's commit;
- `store`: durable writes, atomic commit, `latest`, retention, finding the newest checkpoint;
- `checks`: what a manifest may say, checked before anything it names is read; `lock`: one job per directory;
- `load`: reading only the byte ranges a rank needs, checksummed;
- `verify`, `export`: whole-checkpoint checks and the Hugging Face safetensors export.
"""

from runtime.checkpoint.format import CheckpointError
from runtime.checkpoint.load import CheckpointReader, checkpoint_meta, load_checkpoint, restore
from runtime.checkpoint.pieces import Piece, Wanted, wanted_for
from runtime.checkpoint.save import Checkpointer
from runtime.checkpoint.store import latest_checkpoint, resolve

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Checkpointer",
    "Piece",
    "Wanted",
    "checkpoint_meta",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve",
    "restore",
    "wanted_for",
]

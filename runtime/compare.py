"""Two training runs of the same global batch compared: per-step losses and the final saved state.

Invariant 1 of the design (any plan trains to the same losses as one process) and invariant 2 (a
checkpoint resharded to another plan continues as an uninterrupted run) are checked with this, at
the runtime's parity tolerance.
"""

from pathlib import Path

import torch

from runtime.checkpoint import CheckpointReader, Wanted, latest_checkpoint

# The runtime's parity tolerance: losses within 1e-5 relative, weights and moments within 1e-5.
TOLERANCE = 1e-5


def compare_runs(records, reference, ckpt_dir: Path, reference_ckpt_dir: Path) -> dict:
    """Metrics records of a run and of its reference, and their checkpoint directories.

    Losses: the last value logged for each step (a step redone after a restart replaces the lost
    one). State: the newest checkpoints, every tensor (weights and AdamW moments) compared whole.
    """
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    expected = {r["step"]: r["loss"] for r in reference if "loss" in r}
    common = sorted(losses.keys() & expected.keys())
    loss_diff = max((abs(losses[s] - expected[s]) / abs(expected[s]) for s in common), default=float("inf"))
    mine, theirs = full_state(ckpt_dir), full_state(reference_ckpt_dir)
    same_tensors = mine.keys() == theirs.keys()
    param_diff = max(
        ((mine[n] - theirs[n]).abs().max().item() for n in theirs if n in mine), default=float("inf")
    )
    steps_match = losses.keys() == expected.keys()
    return {
        "steps_match": steps_match,
        "loss_max_rel_diff": loss_diff,
        "param_max_abs_diff": param_diff,
        "tensors_compared": len(theirs),
        "equal": steps_match and same_tensors and loss_diff <= TOLERANCE and param_diff <= TOLERANCE,
    }


def full_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint in `ckpt_dir`, whole, as fp32."""
    with CheckpointReader(latest_checkpoint(ckpt_dir)) as reader:
        return {
            name: reader.read(Wanted(name, e.shape, (0,) * len(e.shape), e.shape, torch.float32))
            for name, e in reader.manifest.tensors.items()
        }

"""Types for numeric flags: each checks type, finiteness and range when the command line is parsed.

A bad value is argparse's one error line (exit 2): `argument --lr: must be a finite number above 0
and at most 10, not 'inf'`. `str()` of a type is the range it allows ("in 1..4,096"), so a flag's
--help states the same bound its check enforces. The bounds that describe data (cluster sizes, the
global batch) live beside the data's type in costmodel; the ones here bound only a flag.
"""

import argparse
from collections.abc import Callable

from costmodel.cluster import MAX_CLUSTER_GPUS, MAX_GPUS_PER_NODE
from costmodel.jsonio import is_number, shown, span
from costmodel.plan import MAX_GLOBAL_BATCH_SIZE

# A day per solver call: far past the seconds to minutes the benchmarks' largest cases take, and
# short of a time limit that never returns.
MAX_SOLVER_TIME_LIMIT_S = 86_400.0
# Seeds are one 32-bit word, the widest every consumer (numpy, torch, random) takes alike.
MAX_SEED = 2**32 - 1
# A billion optimizer steps: more than any training run makes (Llama 3 405B: about a million).
MAX_STEPS = 10**9


class Bounded:
    """A `type=` callable: `parse` the text, then check it lies in the range (`span` spells it)."""

    def __init__(
        self,
        parse: Callable[[str], float],
        kind: str,
        low: float | None = None,
        high: float | None = None,
        above: float | None = None,
    ):
        self.parse, self.kind, self.low, self.high, self.above = parse, kind, low, high, above
        self.__name__ = kind  # argparse names the type in its "invalid value" message

    def __str__(self) -> str:
        return span(self.low, self.high, self.above)

    def __call__(self, text: str) -> float:
        try:
            value = self.parse(text)
        except ValueError:
            value = None
        if value is None or not is_number(value, self.low, self.high, self.above):
            bounds = f" {self}" if str(self) else ""
            raise argparse.ArgumentTypeError(f"must be {self.kind}{bounds}, not {shown(text)}")
        return value


def integer(low: int | None = None, high: int | None = None) -> Bounded:
    """Whole numbers in [low, high]: "2.0" and "1e3" are not integers."""
    return Bounded(int, "an integer", low, high)


def real(low: float | None = None, high: float | None = None, above: float | None = None) -> Bounded:
    """Finite numbers in [low, high] and above `above`: "inf" and "nan" are refused."""
    return Bounded(float, "a finite number", low, high, above)


GLOBAL_BATCH_SIZE = integer(1, MAX_GLOBAL_BATCH_SIZE)
SEED = integer(0, MAX_SEED)
STEPS = integer(0, MAX_STEPS)
SOLVER_TIME_LIMIT_S = real(above=0.0, high=MAX_SOLVER_TIME_LIMIT_S)
# What every --cluster help adds: the bounds costmodel.cluster checks.
CLUSTER_BOUNDS = f"at most {MAX_CLUSTER_GPUS:,} GPUs, {MAX_GPUS_PER_NODE} per node"


def add_gpus_per_node(p: argparse.ArgumentParser) -> None:
    """`--gpus-per-node`: the GPUs of a whole node, for the commands that take `--cluster`."""
    p.add_argument(
        "--gpus-per-node",
        type=integer(1, MAX_GPUS_PER_NODE),
        help="GPUs of a node when all are healthy (default: the largest count of the short form, or the "
        "cluster file's gpus_per_node); node-drop keeps only nodes with all of them, so "
        "--cluster 7,7 --gpus-per-node 8 has no whole node",
    )

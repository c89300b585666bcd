"""The sample stream: a deterministic sequence of token windows, split across pipelines per step.

Sample i is a function of (source, i) alone, so any plan, any resume point and the single-process
reference see the same data. Step k consumes samples [cursor, cursor + B) with cursor = k * B from a
fresh start; the cursor is saved with the training state. Within a step, pipelines take consecutive
ranges in plan order, each `num_microbatches * micro_batch_size` samples, and cut them into
micro-batches in order.

Sources: synthetic tokens by default (a random walk over the vocabulary with steps 1, 2 or 3, so a
model can learn it and the loss visibly falls), a `.bin` file of uint16 tokens (nanoGPT's format),
or any other file read as UTF-8 text tokenised by bytes (vocabulary 256). A file is cut into
non-overlapping windows of seq_len + 1 tokens that sample i takes in turn (i modulo their number).

`Prefetcher` prepares the next steps' batches on a background thread while a step runs.
"""

import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from costmodel.errors import ElastorError
from costmodel.plan import Plan

WALK_STEPS = (1, 2, 3)  # synthetic tokens move forward by one of these ...
WALK_PROBS = (0.6, 0.3, 0.1)  # ... with these probabilities: about 0.9 nats of entropy per token
BYTE_VOCAB = 256


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        start = rng.integers(self.vocab_size)
        steps = rng.choice(WALK_STEPS, size=self.seq_len, p=WALK_PROBS)
        return (start + np.concatenate([[0], np.cumsum(steps)])) % self.vocab_size

    def describe(self) -> dict[str, Any]:
        return {"kind": "synthetic", "seed": self.seed}


class TokenFile:
    def __init__(self, path: str, vocab_size: int, seq_len: int):
        p = Path(path)
        if not p.is_file():
            raise ElastorError(f"The data file {p} does not exist.")
        if p.suffix == ".bin":
            size = p.stat().st_size
            if size == 0 or size % 2:
                raise ElastorError(
                    f"The data file {p} holds {size} bytes, not a whole number of 2-byte uint16 tokens."
                )
            self.tokens = np.memmap(p, dtype=np.uint16, mode="r")
            self.kind = "uint16"
        else:
            raw = p.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ElastorError(
                    f"The data file {p} is neither a .bin file of uint16 tokens nor UTF-8 text."
                ) from None
            if vocab_size < BYTE_VOCAB:
                raise ElastorError(
                    f"The text file {p} is tokenised by bytes (256 tokens) but the model's vocabulary "
                    f"has {vocab_size}; use a model with at least 256 tokens or a .bin token file."
                )
            self.tokens = np.frombuffer(raw, dtype=np.uint8)
            self.kind = "utf8-bytes"
        self.path, self.vocab_size, self.seq_len = p, vocab_size, seq_len
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise ElastorError(
                f"The data file {p} holds {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}."
            )

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.windows) * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if window.max() >= self.vocab_size:
            raise ElastorError(
                f"The data file {self.path} holds token {int(window.max())} at or after position {start}, "
                f"outside the model's vocabulary of {self.vocab_size}."
            )
        return window

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path)}


def open_source(path: str | None, vocab_size: int, seq_len: int, seed: int):
    """Synthetic tokens without a path, else the token or text file at `path`."""
    return (
        SyntheticTokens(vocab_size, seq_len, seed) if path is None else TokenFile(path, vocab_size, seq_len)
    )


def pipeline_samples(plan: Plan, pipeline: int) -> tuple[int, int]:
    """(offset within the step, number of samples) of pipeline `pipeline`."""
    sizes = [p.num_microbatches * plan.micro_batch_size for p in plan.pipelines]
    return sum(sizes[:pipeline]), sizes[pipeline]


def fetch(source, first: int, count: int) -> torch.Tensor:
    """Samples [first, first + count) as a [count, seq_len + 1] int64 tensor."""
    return torch.from_numpy(np.stack([source.sample(i) for i in range(first, first + count)]))


class Prefetcher:
    """Produces `fetch(source, cursor + offset, count)` for cursor, cursor + stride, ... on a thread.

    `get(cursor)` returns the batch of that cursor; asking for a cursor other than the next one
    (after a restore) restarts the thread there. An error on the thread is raised by `get`.
    """

    DEPTH = 2  # batches prepared ahead

    def __init__(self, source, offset: int, count: int, stride: int, pin: bool = False):
        self.source, self.offset, self.count, self.stride, self.pin = source, offset, count, stride, pin
        self._thread: threading.Thread | None = None
        self._next: int | None = None

    def _start(self, cursor: int) -> None:
        self.close()
        self._queue: queue.Queue = queue.Queue(self.DEPTH)
        self._stop = threading.Event()
        self._next = cursor
        self._thread = threading.Thread(target=self._produce, args=(cursor,), daemon=True, name="prefetch")
        self._thread.start()

    def _produce(self, cursor: int) -> None:
        while not self._stop.is_set():
            try:
                batch = fetch(self.source, cursor + self.offset, self.count)
                item = batch.pin_memory() if self.pin else batch
            except Exception as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put((cursor, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            cursor += self.stride

    def get(self, cursor: int) -> torch.Tensor:
        if self._thread is None or cursor != self._next:
            self._start(cursor)
        got, item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        assert got == cursor
        self._next = cursor + self.stride
        return item

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

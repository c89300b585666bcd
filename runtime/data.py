"""The sample stream: a deterministic sequence of token windows, split across pipelines per step.

Sample i is a function of (source, i) alone, so any plan, any resume point and the single-process
reference see the same data. Step k consumes samples [cursor, cursor + B) with cursor = k * B from a
fresh start; the cursor is saved with the training state. Within a step, pipelines take consecutive
ranges in plan order, each `num_microbatches * micro_batch_size` samples, and cut them into
micro-batches in order.

Sources: synthetic tokens by default (a random walk over the vocabulary with steps 1, 2 or 3, so a
model can learn it and the loss visibly falls), or token data (`TokenFile`: `.npy` uint16/uint32,
`.bin` uint16, UTF-8 text by bytes or by a Hugging Face tokenizer, or a directory of shards), cut
into windows of seq_len + 1 tokens, shuffled per epoch by the seed, with an optional held-out tail
for evaluation.

`Prefetcher` prepares the next steps' batches on a background thread while a step runs.
"""

import hashlib
import math
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

    def sample(self, index: int, stream: int = 0) -> np.ndarray:
        """Sample `index` of the training stream (0) or of the held-out one (1)."""
        rng = np.random.default_rng([self.seed, index] if stream == 0 else [self.seed, index, stream])
        start = rng.integers(self.vocab_size)
        steps = rng.choice(WALK_STEPS, size=self.seq_len, p=WALK_PROBS)
        return (start + np.concatenate([[0], np.cumsum(steps)])) % self.vocab_size

    def held_out(self) -> "HeldOut":
        """Evaluation samples: the same walk, drawn from a stream training never uses."""
        return HeldOut(self)

    def describe(self) -> dict[str, Any]:
        return {"kind": "synthetic", "seed": self.seed}


class TokenFile:
    """Token windows from a file or a directory of shards, with a seeded shuffle and a held-out tail.

    Formats: `.npy` (a 1-D array of uint16 or uint32: numpy's self-describing header, so a Llama 3
    vocabulary of 128,256 fits), `.bin` (raw uint16, nanoGPT's), any other file as UTF-8 text
    tokenised by bytes or by `tokenizer` (a Hugging Face tokenizer.json), or a directory whose
    `.npy` and `.bin` files, in name order, are the shards of one stream. Each file is cut into
    non-overlapping windows of seq_len + 1 tokens (none crosses a file's end); the windows of all
    shards are numbered in order.

    The last `eval_fraction` of the windows (at least one when it is positive) is the evaluation
    split (`held_out`), never trained on. With `shuffle_seed`, training sample i is window
    P_e(i mod W) of the W training windows, where e = i // W is the epoch and P_e a permutation of
    [0, W) chosen by (seed, e) (`_Permutation`): sample i is a function of (files, seed, i) alone, so
    resumes and re-plans see exactly the order an uninterrupted run does.
    """

    def __init__(
        self,
        path: str,
        vocab_size: int,
        seq_len: int,
        *,
        shuffle_seed: int | None = None,
        eval_fraction: float = 0.0,
        tokenizer: str | None = None,
    ):
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix in (".npy", ".bin") and f.is_file())
            if not files:
                raise ElastorError(f"The data directory {p} holds no .npy or .bin token shards.")
        elif p.is_file():
            files = [p]
        else:
            raise ElastorError(f"The data file {p} does not exist.")
        self.files, self.tokenizer = files, tokenizer
        encode = None if tokenizer is None else load_tokenizer(tokenizer, vocab_size)
        self.shards = [_read_tokens(f, vocab_size, text_ok=not p.is_dir(), encode=encode) for f in files]
        self.kind = self.shards[0][1] if len(self.shards) == 1 else "shards"
        self.path, self.vocab_size, self.seq_len = p, vocab_size, seq_len
        counts = [(len(tokens) - 1) // seq_len for tokens, _ in self.shards]
        self.starts = np.cumsum([0, *counts])  # the first window of each shard
        total = int(self.starts[-1])
        if total < 1:
            raise ElastorError(
                f"The data {p} holds fewer tokens than seq_len + 1 = {seq_len + 1} in every file."
            )
        if not 0.0 <= eval_fraction < 1.0:
            raise ElastorError(f"--eval-fraction must be in [0, 1), not {eval_fraction:g}.")
        held = math.ceil(total * eval_fraction) if eval_fraction > 0 else 0
        if held and held >= total:
            raise ElastorError(
                f"The data {p} has {total} window(s) of {seq_len + 1} tokens: too few to hold out "
                f"{eval_fraction:g} of them for evaluation and train on the rest."
            )
        self.windows, self.eval_windows = total - held, held
        self.shuffle_seed, self.eval_fraction = shuffle_seed, eval_fraction
        self._order: tuple[int, _Permutation] | None = None  # the epoch sampled last, and its order

    def _window(self, w: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, w, side="right")) - 1
        tokens, _ = self.shards[shard]
        start = (w - int(self.starts[shard])) * self.seq_len
        window = np.asarray(tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if window.max() >= self.vocab_size:
            raise ElastorError(
                f"The data file {self.files[shard]} holds token {int(window.max())} at or after position "
                f"{start}, outside the model's vocabulary of {self.vocab_size}."
            )
        return window

    def sample(self, index: int) -> np.ndarray:
        epoch, i = divmod(index, self.windows)
        if self.shuffle_seed is not None:
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, _Permutation(self.windows, (self.shuffle_seed, epoch)))
            i = self._order[1](i)
        return self._window(i)

    def held_out(self) -> "HeldOut":
        """The evaluation split: its windows in order, sample i being window i mod their number."""
        if not self.eval_windows:
            raise ElastorError(
                f"--eval-every needs an evaluation split of {self.path}: give --eval-fraction."
            )
        return HeldOut(self)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path),
            "shuffle_seed": self.shuffle_seed,
            "eval_fraction": self.eval_fraction,
            **({"tokenizer": str(Path(self.tokenizer).resolve())} if self.tokenizer else {}),
        }


class HeldOut:
    """A source's evaluation samples (`TokenFile.held_out`, `SyntheticTokens.held_out`)."""

    def __init__(self, source):
        self.source = source

    def sample(self, index: int) -> np.ndarray:
        s = self.source
        if isinstance(s, SyntheticTokens):
            return s.sample(index, stream=1)
        return s._window(s.windows + index % s.eval_windows)


class _Permutation:
    """A bijection of [0, size) chosen by `key`: a 4-round Feistel network over the smallest even
    number of bits that covers `size`, walking the cycle back into range (Black and Rogaway 2002,
    "Ciphers with arbitrary finite domains"). Constant memory whatever the number of windows, where
    a stored permutation of a trillion-token corpus would take gigabytes."""

    ROUNDS = 4

    def __init__(self, size: int, key) -> None:
        bits = max(2, (size - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask, self.size = (1 << self.half) - 1, size
        self.keys = [
            hashlib.blake2b(repr((key, r)).encode(), digest_size=16).digest() for r in range(self.ROUNDS)
        ]

    def _f(self, r: int, x: int) -> int:
        digest = hashlib.blake2b(x.to_bytes(8, "little"), digest_size=8, key=self.keys[r]).digest()
        return int.from_bytes(digest, "little") & self.mask

    def __call__(self, i: int) -> int:
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for r in range(self.ROUNDS):
                left, right = right, left ^ self._f(r, right)
            x = (left << self.half) | right
            if x < self.size:
                return x


def tokenizer_file(path: str) -> Path:
    """A Hugging Face tokenizer's `tokenizer.json`: the file itself, or in the folder given."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ElastorError(f"--tokenizer {path} is neither a tokenizer.json file nor a folder holding one.")
    return file


def load_tokenizer(path: str, vocab_size: int):
    """The `encode` of the Hugging Face tokenizer at `path` (the `tokenizers` package), checked to
    fit the model's vocabulary."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ElastorError("--tokenizer needs the tokenizers package (pip install tokenizers).") from None
    file = tokenizer_file(path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the package raises its own exception types for a malformed file
        raise ElastorError(
            f"--tokenizer {file} is not a tokenizer the tokenizers package reads ({e})."
        ) from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise ElastorError(
            f"The tokenizer {file} has {tokenizer.get_vocab_size():,} tokens but the model's vocabulary "
            f"{vocab_size:,}; use a model with at least as many."
        )
    return lambda text: np.asarray(tokenizer.encode(text).ids, dtype=np.uint32)


def _read_tokens(p: Path, vocab_size: int, *, text_ok: bool, encode=None) -> tuple[np.ndarray, str]:
    """A file's tokens (memory-mapped where the format allows) and their kind."""
    if p.suffix == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ElastorError(f"The data file {p} is not a readable .npy array ({e}).") from None
        if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
            raise ElastorError(
                f"The data file {p} holds a {tokens.ndim}-D {tokens.dtype} array; token files are 1-D "
                "uint16 or uint32 (numpy.save(path, tokens.astype(np.uint32)))."
            )
        return tokens, f"npy-{tokens.dtype}"
    if p.suffix == ".bin":
        size = p.stat().st_size
        if size == 0 or size % 2:
            raise ElastorError(
                f"The data file {p} holds {size} bytes, not a whole number of 2-byte uint16 tokens."
            )
        return np.memmap(p, dtype=np.uint16, mode="r"), "uint16"
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ElastorError(
            f"The data file {p} is neither a .npy or .bin token file nor UTF-8 text."
        ) from None
    if not text_ok:
        raise ElastorError(f"The data shard {p} is text; shards are .npy or .bin token files.")
    if encode is not None:
        return encode(raw.decode("utf-8")), "text-tokenized"
    if vocab_size < BYTE_VOCAB:
        raise ElastorError(
            f"The text file {p} is tokenised by bytes (256 tokens) but the model's vocabulary "
            f"has {vocab_size}; use a model with at least 256 tokens or a .npy token file."
        )
    return np.frombuffer(raw, dtype=np.uint8), "utf8-bytes"


def open_source(
    path: str | None,
    vocab_size: int,
    seq_len: int,
    seed: int,
    *,
    shuffle: bool = True,
    eval_fraction: float = 0.0,
    tokenizer: str | None = None,
):
    """Synthetic tokens without a path, else the token data at `path` (`TokenFile`), shuffled by
    `seed` unless `shuffle` is false."""
    if path is None:
        return SyntheticTokens(vocab_size, seq_len, seed)
    return TokenFile(
        path,
        vocab_size,
        seq_len,
        shuffle_seed=seed if shuffle else None,
        eval_fraction=eval_fraction,
        tokenizer=tokenizer,
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

"""Real data: self-describing token files, shards, a seeded shuffle, and a held-out split that the
training loop evaluates (runtime/data.py, `Trainer.evaluate`)."""

import json
import sys

import numpy as np
import pytest
from dist_helpers import launch, plan_json, torchrun

from costmodel import PRESETS, ElastorError
from costmodel.jsonio import write_json
from runtime.data import TokenFile, _Permutation
from runtime.elastic.report import read_metrics


def _shards(folder, sizes, *, dtype=np.uint32, high=960, seed=0):
    """Token shards of `sizes` tokens each, named so that their order is the listing's."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, size in enumerate(sizes):
        np.save(folder / f"shard-{i:03d}.npy", rng.integers(0, high, size).astype(dtype))
    return folder


def test_npy_files_hold_uint16_or_uint32_tokens_and_say_what_else_they_hold(tmp_path):
    big = np.array([128_000, 5, 70_000, 1, 2, 3, 4, 5, 6, 7], dtype=np.uint32)  # a Llama 3 vocabulary's
    np.save(tmp_path / "big.npy", big)
    assert TokenFile(str(tmp_path / "big.npy"), vocab_size=128_256, seq_len=4).sample(0).tolist() == [
        128_000, 5, 70_000, 1, 2
    ]  # fmt: skip
    np.save(tmp_path / "small.npy", np.arange(20, dtype=np.uint16))
    assert TokenFile(str(tmp_path / "small.npy"), vocab_size=960, seq_len=4).windows == 4
    for name, array in (("f.npy", np.ones(20, np.float32)), ("m.npy", np.ones((4, 5), np.uint16))):
        np.save(tmp_path / name, array)
        with pytest.raises(ElastorError, match=r"token files are 1-D uint16 or uint32"):
            TokenFile(str(tmp_path / name), vocab_size=960, seq_len=4)


def test_a_directory_is_one_stream_of_shards_and_no_window_crosses_a_file(tmp_path):
    folder = _shards(tmp_path / "d", [23, 11, 9])  # 5, 2 and 2 windows of 4 + 1 tokens
    source = TokenFile(str(folder), vocab_size=960, seq_len=4)
    assert source.windows == 9 and source.describe()["kind"] == "shards"
    second = np.load(folder / "shard-001.npy")
    assert (
        source.sample(5).tolist() == second[:5].tolist() and source.sample(6).tolist() == second[4:9].tolist()
    )
    (folder / "notes.txt").write_text("ignored: shards are .npy and .bin files")
    assert TokenFile(str(folder), vocab_size=960, seq_len=4).windows == 9
    with pytest.raises(ElastorError, match=r"holds no \.npy or \.bin token shards"):
        TokenFile(str(tmp_path), vocab_size=960, seq_len=4)


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000, 4097])
def test_the_shuffle_is_a_permutation_of_every_epoch_chosen_by_the_seed(size):
    orders = [
        [_Permutation(size, (seed, epoch))(i) for i in range(size)]
        for seed, epoch in ((0, 0), (0, 1), (1, 0))
    ]
    for order in orders:
        assert sorted(order) == list(range(size))
    if size > 7:
        assert orders[0] != orders[1] and orders[0] != orders[2]
    assert orders[0] == [_Permutation(size, (0, 0))(i) for i in range(size)]  # a function of the key alone


def test_shuffled_samples_cover_each_window_once_an_epoch_and_never_the_held_out_ones(tmp_path):
    folder = _shards(tmp_path / "d", [41, 41, 41])  # 8 windows each of 5 tokens: 24
    source = TokenFile(str(folder), vocab_size=960, seq_len=5, shuffle_seed=3, eval_fraction=0.25)
    assert (source.windows, source.eval_windows) == (18, 6)
    plain = TokenFile(str(folder), vocab_size=960, seq_len=5)
    windows = {tuple(plain.sample(w)) for w in range(24)}
    held = {tuple(plain.sample(w)) for w in range(18, 24)}
    assert {tuple(source.held_out().sample(i)) for i in range(6)} == held
    for epoch in range(2):
        seen = [tuple(source.sample(epoch * 18 + i)) for i in range(18)]
        assert len(set(seen)) == 18 and set(seen) == windows - held
    again = TokenFile(str(folder), vocab_size=960, seq_len=5, shuffle_seed=3, eval_fraction=0.25)
    assert [again.sample(i).tolist() for i in (40, 3, 17)] == [source.sample(i).tolist() for i in (40, 3, 17)]
    with pytest.raises(ElastorError, match=r"--eval-every needs an evaluation split"):
        plain.held_out()


MODEL = PRESETS["gpt-tiny"].to_json()
ONE = plan_json(MODEL, [(4, [((0, 6), ["n0:0"])])], micro_batch_size=2)
# Two pipelines, so evaluation runs both schedules forward only: an interleaved one (two stages of two
# chunks each: the chunk ring) and a 1F1B one of two stages.
MIXED = plan_json(
    MODEL,
    [
        (2, [(((0, 2), (4, 5)), ["n0:0"]), (((2, 4), (5, 6)), ["n0:1"])]),
        (2, [((0, 3), ["n1:0"]), ((3, 6), ["n1:1"])]),
    ],
    micro_batch_size=2,
)


def test_held_out_loss_is_the_same_under_any_plan_and_training_data_is_shuffled_alike(tmp_path):
    data = _shards(tmp_path / "data", [700, 500, 300], dtype=np.uint16)
    found = {}
    for name, plan, nproc in (("one", ONE, 1), ("mixed", MIXED, 4)):
        write_json(tmp_path / f"{name}.json", plan)
        args = [
            "-m",
            "elastor",
            "train",
            f"--plan={tmp_path / f'{name}.json'}",
            "--steps=4",
            f"--data={data}",
        ]
        args += [
            "--eval-fraction=0.2",
            "--eval-every=2",
            "--eval-batches=2",
            f"--metrics={tmp_path / name}.jsonl",
        ]
        done = launch(torchrun(nproc, *args) if nproc > 1 else [sys.executable, *args], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        records = read_metrics(tmp_path / f"{name}.jsonl")
        found[name] = (
            [r["loss"] for r in records if "loss" in r],
            [(r["step"], r["eval_loss"]) for r in records if r.get("event") == "eval"],
        )
    (losses, evals), (mixed_losses, mixed_evals) = found["one"], found["mixed"]
    assert [step for step, _ in evals] == [2, 4] == [step for step, _ in mixed_evals]
    np.testing.assert_allclose(mixed_losses, losses, rtol=1e-5)
    np.testing.assert_allclose([e for _, e in mixed_evals], [e for _, e in evals], rtol=1e-5)
    assert all(0 < e < 2 * losses[0] for _, e in evals)  # a loss of held-out tokens, not a placeholder


def _word_tokenizer(path, text: str) -> None:
    """A small word-level Hugging Face tokenizer of `text`'s words, saved as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel(unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([text], trainer=trainer)
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path))


def test_text_encoded_by_a_tokenizer_trains_and_the_export_generates_with_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    words = "the quick brown fox jumps over the lazy dog and the cat sat on the mat".split()  # noqa: SIM905
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(words, 4000))
    (tmp_path / "corpus.txt").write_text(text)
    _word_tokenizer(tmp_path / "tokenizer.json", text)
    write_json(tmp_path / "plan.json", ONE)
    args = [
        "-m",
        "elastor",
        "train",
        f"--plan={tmp_path / 'plan.json'}",
        "--steps=3",
        f"--data={tmp_path / 'corpus.txt'}",
    ]
    args += [f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--ckpt-dir={tmp_path / 'ckpt'}"]
    done = launch([sys.executable, *args, f"--metrics={tmp_path / 'm.jsonl'}"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    restored = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in restored if "loss" in r] == [1, 2, 3]

    out = tmp_path / "hf" / "model.safetensors"
    export = launch(
        [sys.executable, "-m", "elastor", "ckpt", "export", str(tmp_path / "ckpt"), "--out", str(out)],
        timeout=120,
    )
    assert export.returncode == 0, export.stderr
    assert "tokenizer.json" in export.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    prompt = tokenizer("the quick brown", return_tensors="pt")
    ids = [
        json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"][w]
        for w in ("the", "quick", "brown")
    ]
    assert prompt.input_ids.tolist()[0] == ids  # the tokenizer the data was encoded with
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)
    assert tokenizer.decode(generated[0, :3]) == "the quick brown"  # 3 steps teach no words: ids only

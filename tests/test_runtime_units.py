"""Single-process tests of the runtime's parts: data stream, schedule, ownership, stage, training state."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_helpers import plan_json
from test_runtime_parity import PLANS
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel import PRESETS, ElastorError, ModelConfig, Plan
from costmodel.analytic import main_gradient_bytes
from costmodel.layout import contributes, device_pieces, sync_buckets
from costmodel.plan import OptimizerLayout
from costmodel.sharding import buckets
from runtime.data import Prefetcher, SyntheticTokens, TokenFile, fetch, pipeline_samples
from runtime.dist_optim import square_sum
from runtime.distributed import init_distributed
from runtime.model import build_model
from runtime.optim import OptimConfig, build_optimizer, decay_groups, set_lr
from runtime.stage import StageModule, box_slices
from runtime.state import restore_training_state, training_state
from runtime.trainer import Trainer

TINY = PRESETS["gpt-tiny"].to_json()


# ---- data ---------------------------------------------------------------------------------------
def test_synthetic_samples_depend_on_seed_and_index_only():
    a, b = SyntheticTokens(960, 32, seed=1), SyntheticTokens(960, 32, seed=1)
    assert np.array_equal(a.sample(7), b.sample(7))
    assert not np.array_equal(a.sample(7), a.sample(8))
    assert not np.array_equal(a.sample(7), SyntheticTokens(960, 32, seed=2).sample(7))
    s = a.sample(3)
    assert s.shape == (33,) and s.min() >= 0 and s.max() < 960
    assert set(np.diff(s) % 960) <= {1, 2, 3}  # the learnable random walk


def test_pipelines_take_consecutive_sample_ranges_in_plan_order():
    plan = Plan.from_json(PLANS["hetero-5-3"])
    assert [pipeline_samples(plan, p) for p in range(2)] == [(0, 5), (5, 3)]


def test_bin_file_is_cut_into_windows(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    (tmp_path / "t.bin").write_bytes(tokens.tobytes())
    source = TokenFile(str(tmp_path / "t.bin"), vocab_size=960, seq_len=9)
    assert source.windows == 11
    assert source.sample(2).tolist() == list(range(18, 28))
    assert source.sample(13).tolist() == source.sample(2).tolist()  # wraps around


def test_text_file_is_tokenised_by_bytes(tmp_path):
    (tmp_path / "t.txt").write_text("héllo wörld " * 10)
    source = TokenFile(str(tmp_path / "t.txt"), vocab_size=960, seq_len=8)
    assert bytes(source.sample(0).astype(np.uint8).tolist()) == "héllo wörld ".encode()[:9]


@pytest.mark.parametrize(
    ("name", "content", "vocab", "sentence"),
    [
        ("bad.txt", b"\xff\xfe\x00abc" * 10, 960, "neither a .npy or .bin token file nor UTF-8 text"),
        ("short.txt", b"abc", 960, "fewer tokens than seq_len + 1 = 9"),
        ("small.txt", b"abcdefghijkl" * 10, 128, "tokenised by bytes (256 tokens)"),
    ],
)
def test_bad_data_files_are_one_sentence(tmp_path, name, content, vocab, sentence):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ElastorError, match=r"\.$") as e:
        TokenFile(str(tmp_path / name), vocab_size=vocab, seq_len=8)
    assert sentence in str(e.value)


def test_a_token_outside_the_vocabulary_is_refused(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.full(50, 999, dtype=np.uint16).tobytes())
    with pytest.raises(ElastorError, match="outside the model's vocabulary of 960"):
        TokenFile(str(tmp_path / "t.bin"), vocab_size=960, seq_len=8).sample(0)


def test_prefetcher_serves_steps_in_order_and_restarts_at_a_new_cursor():
    source = SyntheticTokens(960, 16, seed=0)
    prefetcher = Prefetcher(source, offset=2, count=3, stride=8)
    try:
        for cursor in (0, 8, 16, 40, 48):
            assert torch.equal(prefetcher.get(cursor), fetch(source, cursor + 2, 3))
    finally:
        prefetcher.close()


# ---- optimiser ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runtimes_adamw_updates_as_torchs_fused_adamw_bit_for_bit(dtype):
    """runtime.optim.AdamW calls the kernel of torch.optim.AdamW(fused=True) without the class: the
    same weights and moments after steps with decay and without, a changed learning rate, and a
    parameter without a gradient left alone."""
    config = OptimConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (5,), (3, 4), (4,)]
    ours = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    mine = build_optimizer(ours, config)
    groups = decay_groups(theirs, config)
    torchs = torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=True
    )
    for step in range(4):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        for a, b, g in zip(ours, theirs, grads, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        ours[3].grad = theirs[3].grad = None  # no gradient this step: neither moves it
        set_lr(mine, config.lr / (step + 1))
        set_lr(torchs, config.lr / (step + 1))
        mine.step()
        torchs.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in torchs.state[b]:
                assert torch.equal(mine.state[a][key], torchs.state[b][key]), key
    assert torch.equal(mine.state[ours[3]]["exp_avg"], torch.zeros(shapes[3], dtype=dtype))
    assert [g["weight_decay"] for g in mine.param_groups] == [0.1, 0.0]
    mine.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in ours)


def test_learning_rate_warms_up_then_decays_by_a_cosine():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [optim.lr_at(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert optim.lr_at(4) == pytest.approx(1.0)
    assert optim.lr_at(9) == pytest.approx(0.55)
    assert optim.lr_at(14) == pytest.approx(0.1) and optim.lr_at(100) == pytest.approx(0.1)
    assert optim.clip_coefficient(0.5) == 1.0 and optim.clip_coefficient(4.0) == pytest.approx(0.25)


# ---- ownership and contributions ----------------------------------------------------------------------
@pytest.mark.parametrize("sharding", ["none", "zero1"])
@pytest.mark.parametrize("name", list(PLANS))
def test_every_gradient_element_is_counted_once_for_the_norm_and_kept_once_sharded(name, sharding):
    plan = replace(Plan.from_json(PLANS[name]), optimizer=OptimizerLayout(sharding, bucket_bytes=4096))
    norm: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for bucket in buckets(plan):
        for device in bucket.holders:
            regions = [(norm, [bucket.region_of(device)] if bucket.counts_norm(device) else [])]
            regions.append((kept, bucket.kept(device)))
            for counts, indices in regions:
                for rows in (r for i in indices for r in bucket.regions[i]):
                    count = counts.setdefault(rows.name, torch.zeros(rows.spec.shape, dtype=torch.int32))
                    count[box_slices(rows.box)].add_(1)
    assert all(bool((c == 1).all()) for c in norm.values())
    holders = {spec.name: 0 for d in plan.devices for spec, _ in device_pieces(plan, d)}
    assert set(norm) == set(kept) == set(holders)
    if sharding == "zero1" and len(plan.pipelines) > 1:  # every element is reduced: one keeper each
        assert all(bool((c == 1).all()) for c in kept.values())
    elif sharding == "none":  # every holder keeps what it holds
        for name, count in kept.items():
            full = torch.zeros_like(count)
            for d in plan.devices:
                for spec, box in device_pieces(plan, d):
                    if spec.name == name:
                        full[box_slices(box)] += 1
            assert torch.equal(count, full), name


def test_the_squared_norm_is_as_exact_for_one_long_bucket_as_for_many_short_ones():
    """The clipping coefficient must not depend on how the plan cuts the gradients into buckets."""
    grads = torch.randn(2_436_480, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = grads.double().pow(2).sum().item()
    whole = square_sum([grads], "cpu").item()
    pieces = square_sum(list(grads.split(5_000)), "cpu").item()
    assert abs(whole - exact) / exact < 1e-6 and abs(pieces - exact) / exact < 1e-6, (whole, pieces, exact)


@pytest.mark.parametrize("name", list(PLANS))
def test_each_stage_contributes_once_to_each_segment(name):
    plan = Plan.from_json(PLANS[name])
    for holders in sync_buckets(plan):
        stages = [plan.placement(d) for d in holders if contributes(plan, d, holders)]
        assert len(stages) == len(set(stages)) == len({plan.placement(d) for d in holders}) >= 2


# ---- the stage module and the training state (one process, no torchrun) -------------------------------
def test_a_whole_model_stage_is_the_reference_model():
    plan = Plan.from_json(plan_json(TINY, [(1, [((0, 6), ["n0:0"])])]))
    stage, model = StageModule(plan, "n0:0", None, seed=3), build_model(plan.model, seed=3)
    assert {n: p.shape for n, p in stage.named_parameters()} == {
        n: p.shape for n, p in model.named_parameters()
    }
    tokens = torch.randint(0, 960, (2, 16))
    assert torch.equal(stage(tokens), model(tokens))


@pytest.fixture
def single_process():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_training_state_round_trip_continues_identically(single_process):
    torch.set_num_threads(1)
    plan = Plan.from_json(plan_json(TINY, [(2, [((0, 6), ["n0:0"])])], micro_batch_size=2, seq_len=16))
    ctx = init_distributed(plan)
    optim = OptimConfig(lr=1e-3, warmup_steps=2, decay_steps=6)
    first = Trainer(plan, ctx, optim=optim, seed=0)
    for _ in range(3):
        first.train_step()
    pieces, meta = training_state(first)
    meta = json.loads(json.dumps(meta))  # JSON-able, and what a checkpoint gives back
    saved = {(p.name, p.offsets): p.tensor.clone() for p in pieces}
    assert {p.name for p in pieces} >= {
        "embed.weight",
        "optim.exp_avg.embed.weight",
        "optim.exp_avg_sq.head.norm.weight",
    }
    assert meta["step"] == 3 and meta["data"]["cursor"] == 12 and meta["model"]["name"] == "gpt-tiny"

    second = Trainer(plan, ctx, optim=OptimConfig(), seed=99)  # other weights and schedule, all replaced
    restore_training_state(second, saved, meta)
    assert (second.step, second.cursor, second.optim) == (3, 12, optim)
    for _ in range(3):
        a, b = first.train_step(), second.train_step()
        assert a.loss == b.loss and a.lr == b.lr
    for a, b in zip(first.main.pieces, second.main.pieces, strict=True):
        assert torch.equal(a.param, b.param), a.rows
    first.close()
    second.close()

    other = json.loads(json.dumps(meta))
    other["model"] = ModelConfig(
        **{**PRESETS["gpt-tiny"].__dict__, "name": "gpt-other", "num_blocks": 2}
    ).to_json()
    with pytest.raises(ElastorError, match="holds model 'gpt-other'"):
        restore_training_state(second, saved, other)


class _MovedIntoMain(TorchDispatchMode):
    """Bytes of every in-place add into one of `storages` (read what is added, read and write the
    fp32 target), counted where the kernels are dispatched."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.bytes, self.adds = storages, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and args[0].untyped_storage().data_ptr() in self.storages:
            target, added = args[0], args[1]
            self.bytes += added.numel() * added.element_size() + 2 * target.numel() * target.element_size()
            self.adds += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gradient_accumulation_moves_the_bytes_the_analytic_backward_prices(single_process, dtype):
    """The runtime's hooks add each micro-batch's gradients into the fp32 main gradients: exactly
    `main_gradient_bytes` per layer and micro-batch, which the analytic backward prices."""
    torch.set_num_threads(1)
    config, micro_batches = PRESETS["gpt-tiny"], 3
    data = plan_json(TINY, [(micro_batches, [((0, config.num_layers), ["n0:0"])])], seq_len=16)
    plan = Plan.from_json({**data, "dtype": dtype})
    trainer = Trainer(plan, init_distributed(plan), optim=OptimConfig(), seed=0)
    moved = _MovedIntoMain({held.grads.untyped_storage().data_ptr() for held in trainer.main.held})
    with moved:
        trainer.train_step()
    per_micro_batch = sum(
        main_gradient_bytes(config, config.layer_kind(i), 1, dtype) for i in range(config.num_layers)
    )
    assert moved.adds == micro_batches * len(list(trainer.model.parameters()))
    assert moved.bytes == micro_batches * per_micro_batch

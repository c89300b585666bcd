"""Pricing a configuration: model FLOPs and MFU, pinned Megatron-style grids, `elastor estimate`."""

import dataclasses
import json
import random

import pytest
from checkpoint_support import random_plan
from helpers import EXAMPLES, run_elastor
from synthetic import synthetic_profile

import solver
from costmodel import PRESETS, ClusterSpec, ElastorError, ModelConfig, Plan
from costmodel import flops as model_flops
from costmodel.estimate import CostModel
from costmodel.jsonio import write_json
from costmodel.sharding import MAIN_GRAD_BYTES, buckets, state_bytes
from elastor.cli import main
from profiler.analytic import analytic_profile
from solver.baselines import Grid, virtual_split


def gpt_shaped(hidden: int, heads: int, layers: int, vocab: int = 51200) -> ModelConfig:
    return ModelConfig(
        name="gpt",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=8 * hidden // 3,
        num_blocks=layers,
        num_heads=heads,
        num_kv_heads=heads,
        tie_embeddings=True,
    )


# ---- model FLOPs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("hidden", "heads", "layers"), [(2304, 24, 24), (12288, 96, 80), (25344, 132, 128)])
def test_model_flops_are_narayanans_formula_for_a_gpt_shape(hidden, heads, layers):
    """72·B·s·l·h²·(1 + s/6h) + 6·B·s·h·V per step without recomputation, Narayanan's 96·B·s·l·h²·
    (1 + s/6h + V/16lh) with full recomputation (exact when 3 divides 8h, approximately otherwise)."""
    config, s, V = gpt_shaped(hidden, heads, layers), 2048, 51200
    h, n = hidden, layers
    ratio = 3 * config.intermediate_size / (8 * h)  # 1 when the SwiGLU width is exactly 8h/3
    blocks = 72 * s * n * h**2 * ((2 + ratio * 2) / 4 + s / (6 * h))
    assert model_flops.model_flops_per_token(config, s) * s == pytest.approx(
        blocks + 6 * s * h * V, rel=1e-12
    )
    published = 96 * s * n * h**2 * (1 + s / (6 * h) + V / (16 * n * h))
    assert model_flops.hardware_flops_per_token(config, s, "full") * s == pytest.approx(published, rel=1e-4)


def test_mfu_in_the_prediction_is_model_flops_over_peak():
    profile = analytic_profile(
        PRESETS["llama2-7b"],
        device_kind="H100-80GB",
        micro_batch_sizes=[1],
        tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )
    cluster = ClusterSpec.parse("8", "H100-80GB")
    plan = solver.solve(profile, cluster, 16)
    p = plan.predicted
    tokens_per_s = p["samples_per_s"] * 4096
    expected = (
        model_flops.model_flops_per_token(profile.model, 4096) * tokens_per_s / (plan.world_size * 989e12)
    )
    assert p["mfu"] == pytest.approx(expected, rel=1e-12) and 0.1 < p["mfu"] < 1.0
    assert p["model_tflops_per_gpu"] == pytest.approx(p["mfu"] * 989, rel=1e-12)
    cpu = solver.solve(synthetic_profile(), ClusterSpec.parse("2", "cpu"), 8)
    assert cpu.predicted["mfu"] is None  # the cpu kind's peak is a placeholder


# ---- the exact optimizer-state count -------------------------------------------------------------
def test_state_bytes_counts_what_the_buckets_allocate():
    """The fast count (from each bucket's cuts) equals the definition over the built buckets."""
    rng = random.Random(11)
    for _ in range(60):
        plan = random_plan(rng)
        want = {d: [0, 0, 0, 0] for d in plan.devices}
        for b in buckets(plan):
            for device in b.holders:
                kept = sum(hi - lo for lo, hi in map(b.span, b.kept(device)))
                runs = sum(len(b.regions[i]) for i in b.kept(device))
                for k, v in enumerate((kept, b.numel, 2 * kept, runs)):
                    want[device][k] += v * MAIN_GRAD_BYTES
        got = state_bytes(plan, 2)
        assert {d: [s.masters, s.grads, s.moments, s.steps] for d, s in got.items()} == want


# ---- pinned grids --------------------------------------------------------------------------------
def test_virtual_split_is_megatrons_assignment():
    assert virtual_split(8, 2, 2) == [((0, 3), (5, 7)), ((3, 5), (7, 10))]
    assert virtual_split(6, 4, 1) == [((0, 3),), ((3, 5),), ((5, 6),), ((6, 8),)]
    assert virtual_split(3, 2, 2) is None and virtual_split(8, 1, 2) is None


@pytest.fixture(scope="module")
def p70():
    return analytic_profile(
        PRESETS["llama2-70b"], device_kind="H100-80GB", micro_batch_sizes=[1, 2], tp_degrees=[1, 2, 4, 8],
        seq_len=4096,
    )  # fmt: skip


def test_every_pin_changes_the_plan_it_names(p70):
    cluster = ClusterSpec.parse(",".join(["8"] * 8), "H100-80GB")
    free = solver.solve(p70, cluster, 64, "uniform")
    pinned = solver.solve(
        p70,
        cluster,
        64,
        "uniform",
        grid=Grid(tp=4, pp=8, chunks=2),
        recompute="selective",
        sharding=("zero1",),
    )
    stages = [st for pipe in pinned.pipelines for st in pipe.stages]
    assert {st.tp_degree for st in stages} == {4} and {len(p.stages) for p in pinned.pipelines} == {8}
    assert {p.num_chunks for p in pinned.pipelines} == {2} and {st.recompute for st in stages} == {
        "selective"
    }
    assert pinned.optimizer.sharding == "zero1" and len(pinned.pipelines) == 2
    assert (free.pipelines[0].stages[0].tp_degree, len(free.pipelines[0].stages)) != (4, 8)
    # the prediction is the cost model's of the plan as written, and each pin moves it
    assert pinned.predicted["step_time_s"] == CostModel(p70, cluster).estimate(pinned).step_time_s
    assert pinned.predicted["step_time_s"] != free.predicted["step_time_s"]
    one_chunk = solver.solve(
        p70, cluster, 64, "uniform", grid=Grid(tp=4, pp=8), recompute="selective", sharding=("zero1",)
    )
    assert {p.num_chunks for p in one_chunk.pipelines} == {1}
    assert one_chunk.predicted["step_time_s"] > pinned.predicted["step_time_s"]  # interleaving: less bubble
    with pytest.raises(ElastorError, match="does not fit"):  # without ZeRO-1 the same grid is out of memory
        solver.solve(p70, cluster, 64, "uniform", grid=Grid(tp=4, pp=8, chunks=2), recompute="selective")


def test_a_pinned_grid_that_does_not_fit_names_the_device_and_its_memory(p70):
    cluster = ClusterSpec.parse(",".join(["8"] * 8), "H100-80GB")
    with pytest.raises(ElastorError) as err:
        solver.solve(p70, cluster, 64, "uniform", grid=Grid(tp=2, pp=2))
    message = str(err.value)
    assert message.count(".") >= 1 and "\n" not in message
    assert "TP2 x PP2 grid of llama2-70b" in message and "GiB of the 73.6 GiB usable per H100-80GB" in message
    assert "n0:0" in message or "n0:2" in message


@pytest.mark.parametrize(
    ("method", "grid", "words"),
    [
        ("elastor", Grid(tp=8), "add --method uniform"),
        ("uniform", Grid(tp=3), "--tp 3 is not available"),
        ("uniform", Grid(pp=81), "--pp 81 must be between 1"),
        ("uniform", Grid(pp=1, chunks=2), "more than one chunk needs --pp of 2"),
        ("uniform", Grid(pp=41, chunks=2), "82 virtual stages"),
    ],
)
def test_pins_that_cannot_apply_are_one_sentence(p70, method, grid, words):
    cluster = ClusterSpec.parse("8,8", "H100-80GB")
    with pytest.raises(ElastorError, match=words):
        solver.solve(p70, cluster, 64, method, grid=grid)


# ---- elastor estimate ----------------------------------------------------------------------------
def test_estimate_prints_what_plan_wrote(tmp_path, capsys):
    profile = tmp_path / "tiny.json"
    write_json(profile, synthetic_profile().to_json())
    out = tmp_path / "plan.json"
    common = ["--profile", str(profile), "--cluster", "3,2"]
    assert main(["plan", *common, "--global-batch-size", "8", "--out", str(out)]) == 0
    planned = capsys.readouterr().out
    assert main(["estimate", str(out), *common]) == 0
    estimated = capsys.readouterr().out
    table = planned.split("\npipeline times")[0].split("\n", 1)[1]
    assert table in estimated  # the same per-stage table
    assert "equal to the prediction the plan file records" in estimated and "MFU n/a" in estimated


def test_estimate_prices_the_examples_and_a_hand_written_plan(tmp_path):
    bf16 = tmp_path / "tiny-h100.json"
    config = PRESETS["gpt-tiny"]
    profile = analytic_profile(
        config, device_kind="H100-80GB", micro_batch_sizes=[2], tp_degrees=[1, 2], seq_len=64
    )
    write_json(bf16, profile.to_json())
    for plan, prof, mfu in (
        ("plan-hetero.json", "profiles/gpt-tiny-cpu.json", "MFU n/a"),
        ("plan-interleaved.json", str(bf16), "MFU 0."),
    ):
        result = run_elastor("estimate", str(EXAMPLES / plan), "--profile", prof, "--cluster", "4,3")
        assert result.returncode == 0, result.stderr
        assert "model TFLOP/s per GPU" in result.stdout and "records no prediction" in result.stdout
        assert mfu in result.stdout
    hand = json.loads((EXAMPLES / "plan-hetero.json").read_text())
    hand["predicted"] = {"step_time_s": 1.0}
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(hand))
    result = run_elastor("estimate", str(path), "--profile", "profiles/gpt-tiny-cpu.json", "--cluster", "4,3")
    assert result.returncode == 0 and "the plan file records 1000.0 ms per step" in result.stdout


def test_estimate_of_a_plan_that_does_not_fit_is_one_sentence_and_exit_2(tmp_path, p70):
    cluster = ClusterSpec.parse(",".join(["8"] * 8), "H100-80GB")
    plan = solver.solve(p70, cluster, 64, "uniform", grid=Grid(tp=8, pp=4))
    tight = dataclasses.replace(cluster.device, memory_bytes=40 << 30)
    small = dataclasses.replace(cluster, device=tight)
    paths = {}
    for name, data in (("plan", plan.to_json()), ("profile", p70.to_json()), ("cluster", small.to_json())):
        paths[name] = tmp_path / f"{name}.json"
        write_json(paths[name], data)
    result = run_elastor(
        "estimate", str(paths["plan"]), "--profile", str(paths["profile"]), "--cluster", str(paths["cluster"])
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert "The plan does not fit:" in line and "GiB of the 36.8 GiB usable per H100-80GB" in line
    assert Plan.from_json(json.loads(paths["plan"].read_text())).validate(small)

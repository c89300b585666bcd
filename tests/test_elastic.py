"""`elastor run` on a simulated cluster: failures, recovery, and the mathematics of an uninterrupted run.

Each test starts one supervisor per simulated node (CPU processes play the GPUs, on loopback) and
compares with a single-process run of the same global batch: the losses of every step and the final
weights and optimizer state within 1e-5 (runtime.elastic.demo.compare_runs).
"""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from dist_helpers import elastor_run, launch

from costmodel import ClusterSpec, ElastorError, ModelProfile, Plan
from costmodel.jsonio import read_json, write_json
from goodput.costs import RecoveryCosts
from runtime.checkpoint import checkpoint_meta
from runtime.compare import compare_runs, full_state
from runtime.elastic.report import read_metrics, recoveries
from solver import solve

GLOBAL_BATCH, CKPT_EVERY = 8, 4
RUN_TIMEOUT_S = 400


def _profile(path: Path, dtype: str = "float32") -> Path:
    done = launch(
        [
            sys.executable,
            "-m",
            "elastor",
            "profile",
            "--model=gpt-tiny",
            "--device=cpu",
            "--seq-len=32",
            "--micro-batch-size=1,2",
            "--tp-degrees=1,2",
            f"--dtype={dtype}",
            f"--out={path}",
            "--quiet",
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return path


# Measured once per session: tests/test_inprocess.py imports the fixture, and its module scope
# alone would measure it again there.
_PROFILES: dict[str, Path] = {}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    if "float32" not in _PROFILES:
        _PROFILES["float32"] = _profile(tmp_path_factory.mktemp("profile") / "profile.json")
    return _PROFILES["float32"]


def run_command(tmp: Path, profile: Path, cluster: str, steps: int, *flags: str) -> list[str]:
    """`elastor run` of these tests: the global batch and checkpoint interval above."""
    return elastor_run(
        tmp,
        f"--ckpt-every={CKPT_EVERY}",
        *flags,
        cluster=cluster,
        steps=steps,
        profile=profile,
        global_batch_size=GLOBAL_BATCH,
    )


def _run(tmp: Path, profile: Path, cluster: str, steps: int, *flags: str, env=None):
    return launch(run_command(tmp, profile, cluster, steps, *flags), timeout=RUN_TIMEOUT_S, env=env)


# The uninterrupted runs made so far in this session, by reference plan and steps: tests whose runs
# share both compare against one (each is a few seconds of the time budget of make test).
_REFERENCES: dict[tuple[str, int], Path] = {}


def _reference(tmp: Path, records, steps: int) -> Path:
    """The same training in one process, without failures; returns its checkpoint directory (its
    metrics beside it, with the suffix .jsonl)."""
    first = Plan.from_json(next(r["plan"] for r in records if r.get("event") == "replanned"))
    whole = {"layers": [0, first.model.num_layers], "devices": ["n0:0"]}
    pipeline = {"num_microbatches": GLOBAL_BATCH // first.micro_batch_size, "stages": [whole]}
    reference_plan = {**first.to_json(), "pipelines": [pipeline]}
    key = (json.dumps(reference_plan, sort_keys=True), steps)
    if key in _REFERENCES:
        return _REFERENCES[key]
    write_json(tmp / "reference-plan.json", reference_plan)
    done = launch(
        [
            sys.executable,
            "-m",
            "elastor",
            "train",
            f"--plan={tmp / 'reference-plan.json'}",
            f"--steps={steps}",
            f"--ckpt-dir={tmp / 'reference'}",
            f"--metrics={tmp / 'reference.jsonl'}",
            "--device=cpu",
        ],
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    _REFERENCES[key] = tmp / "reference"
    return tmp / "reference"


def _events(records) -> list[str]:
    """The recovery story's events (checkpoints and each round's memory measurement left out)."""
    return [r["event"] for r in records if r.get("event") not in (None, "checkpoint_saved", "memory")]


def _assert_matches_reference(tmp: Path, records, steps: int) -> None:
    reference_dir = _reference(tmp, records, steps)
    reference = read_metrics(reference_dir.with_suffix(".jsonl"))
    check = compare_runs(records, reference, tmp / "ckpt", reference_dir)
    assert check["steps_match"], "a step of the elastic run has no loss"
    assert check["loss_max_rel_diff"] <= 1e-5, check
    assert check["param_max_abs_diff"] <= 1e-5, check
    assert check["equal"]


def test_failure_and_recovery_match_an_uninterrupted_run(tmp_path, profile_path):
    steps = 16
    scratch = tmp_path / "tmp"  # the run's temp directory: it leaves nothing there
    scratch.mkdir()
    # The restart path (the in-process one: tests/test_inprocess.py).
    done = _run(
        tmp_path, profile_path, "2,2", steps,
        "--recovery=restart", "--inject-failure=n1:1@6", "--inject-recovery=n1:1@10",
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stragglers
    # three rounds of torchrun on two nodes, and the launcher's token: nothing is left but torch's
    # compile cache (torchinductor_<user>, which every run shares)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert _events(records) == [
        "replanned",
        "start",
        "failure_injected",
        "failure_detected",
        "replanned",
        "restored",
        "start",
        "resumed",
        "done",
        "replanned",
        "restored",
        "start",
        "resumed",
        "done",
    ]
    plans = [r for r in records if r.get("event") == "replanned"]
    assert [p["healthy"] for p in plans] == [4, 3, 4]
    assert "n1:1" not in Plan.from_json(plans[1]["plan"]).devices
    restored = [r["step"] for r in records if r.get("event") == "restored"]
    assert restored == [4, 12]  # the newest checkpoint before step 6; the boundary after step 10
    # No step lost; none redone beyond the checkpoint interval.
    done_steps = [r["step"] for r in records if "loss" in r]
    assert sorted(set(done_steps)) == list(range(1, steps + 1))
    assert len(done_steps) - steps <= CKPT_EVERY
    found = recoveries(records)
    assert [r.kind for r in found] == ["failure", "scale-up"]
    assert found[0].phases_s["plan"] <= 1.0  # re-planning takes at most a second of the recovery
    assert "failure" in done.stdout and "scale-up" in done.stdout  # the breakdown table is printed
    # The measured costs, in the file `elastor simulate --costs` reads.
    costs = read_json(tmp_path / "metrics-costs.json", "costs")
    assert costs["detect_s"] == pytest.approx(found[0].phases_s["detect"])
    assert costs["reshard_load_s"] == pytest.approx(found[0].phases_s["load"])
    assert RecoveryCosts().updated(costs, "measured").ckpt_background_s == costs["ckpt_background_s"] > 0
    _assert_matches_reference(tmp_path, records, steps)


@pytest.mark.slow  # -m slow: make test's time budget
def test_a_second_failure_during_recovery_and_a_node_losing_every_gpu(tmp_path, profile_path):
    """n1:0 is node n1's only GPU; then n0:1 dies as soon as the survivors have restored."""
    steps = 12
    profile = ModelProfile.from_json(read_json(profile_path, "profile"))
    # Inter-node links as fast as intra-node ones, so that the measured timings cannot make the
    # planner leave n1:0 idle (a slow inter-node gradient sync against one more GPU's compute).
    cluster = ClusterSpec.parse("2,1", profile.device_kind)
    links = dataclasses.replace(cluster.links, inter_node_gbps=cluster.links.intra_node_gbps)
    cluster = dataclasses.replace(cluster, links=links)
    write_json(tmp_path / "cluster.json", cluster.to_json())
    assert "n1:0" in solve(profile, cluster, GLOBAL_BATCH).devices  # so the first failure fires
    survivors = solve(profile, ClusterSpec.parse("2,0", profile.device_kind), GLOBAL_BATCH)
    assert "n0:1" in survivors.devices  # so the second failure does fire during the recovery
    done = _run(
        tmp_path, profile_path, str(tmp_path / "cluster.json"), steps,
        "--recovery=restart", "--inject-failure=n1:0@6", "--inject-failure=n0:1@4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    injected = [(r["device"], r["step"]) for r in records if r.get("event") == "failure_injected"]
    assert injected == [("n1:0", 6), ("n0:1", 4)]
    # The second failure strikes after the survivors restored the checkpoint, before their first step.
    second = [i for i, r in enumerate(records) if r.get("event") == "failure_injected"][1]
    restored = max(i for i, r in enumerate(records[:second]) if r.get("event") == "restored")
    assert records[restored]["step"] == 4
    assert not any("loss" in r for r in records[restored:second])
    plans = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"]
    assert [p.devices for p in plans[1:]] == [survivors.devices, ["n0:0"]]
    _assert_matches_reference(tmp_path, records, steps)


@pytest.mark.slow  # -m slow: make test's time budget
def test_too_little_memory_left_stops_with_one_sentence_and_keeps_the_checkpoint(tmp_path, profile_path):
    profile = ModelProfile.from_json(read_json(profile_path, "profile"))
    memory = _memory_for_four_gpus_but_not_three(profile)
    cluster = ClusterSpec.parse("2,2", profile.device_kind)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory))
    write_json(tmp_path / "cluster.json", cluster.to_json())
    done = _run(tmp_path, profile_path, str(tmp_path / "cluster.json"), 12, "--inject-failure=n1:1@6")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastor: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr.split("elastor: error:")[-1]
    assert "the last checkpoint (step 4) is intact" in errors[0]
    verify = launch([sys.executable, "-m", "elastor", "ckpt", "verify", str(tmp_path / "ckpt")], timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert checkpoint_meta(tmp_path / "ckpt")[2] == 4


def _memory_for_four_gpus_but_not_three(profile: ModelProfile) -> int:
    """The smallest device memory (to 1%) on which the 2,2 cluster has a plan; 2,1 then must not."""

    def feasible(memory: int, counts: str) -> bool:
        cluster = ClusterSpec.parse(counts, profile.device_kind)
        cluster = dataclasses.replace(
            cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory)
        )
        try:
            solve(profile, cluster, GLOBAL_BATCH)
        except ElastorError:
            return False
        return True

    low, high = 1 << 20, 1 << 30
    while high > low * 1.01:
        mid = (low + high) // 2
        low, high = (low, mid) if feasible(mid, "2,2") else (mid, high)
    if feasible(high, "2,1"):
        pytest.skip("with this profile, three GPUs fit wherever four do")
    return high


@pytest.mark.slow
def test_bf16_failure_reshard_and_scale_up_match_an_uninterrupted_bf16_run(tmp_path):
    """The demo's story in bf16: a bf16 profile makes bf16 plans; the failure's re-plan and the
    scale-up reshard the fp32 masters; the losses and final masters stay within the bf16 tolerance of
    tests/test_runtime_precision.py (three times the spread of the single-process bf16 run under
    reordered roundings) of an uninterrupted single-process bf16 run."""
    from test_runtime_precision import bf16_reference

    from runtime.optim import OptimConfig

    steps = 16
    profile = _profile(tmp_path / "profile.json", "bfloat16")
    done = _run(
        tmp_path,
        profile,
        "2,2",
        steps,
        "--recovery=restart",
        "--inject-failure=n1:1@6",
        "--inject-recovery=n1:1@10",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    plans = [Plan.from_json(r["plan"]) for r in records if r.get("event") == "replanned"]
    # the re-plan avoids the failed GPU (how many of the other three it uses is the cost model's choice)
    assert len(plans) == 3 and "n1:1" not in plans[1].devices and len(plans[2].devices) == 4
    assert {p.dtype for p in plans} == {"bfloat16"}
    assert [r.kind for r in recoveries(records)] == ["failure", "scale-up"]
    optim = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=10, decay_steps=steps, weight_decay=0.1)
    ref_losses, ref_params, loss_rtol, param_atol = bf16_reference(
        json.dumps(plans[0].model.to_json()), GLOBAL_BATCH, plans[0].seq_len, steps, optim
    )
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, steps + 1))
    for step, want in enumerate(ref_losses, start=1):
        assert abs(losses[step] - want) <= loss_rtol * want, (step, losses[step], want, loss_rtol)
    state = full_state(tmp_path / "ckpt")
    for name, want in ref_params.items():
        assert (state[name] - want).abs().max().item() <= param_atol, name

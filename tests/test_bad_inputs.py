"""Nothing gets in: every subcommand refuses a bad flag or file with one sentence and exit 2.

Each case is an argv run in-process through `elastor.cli.main`; `{name}` in it is a file that the
`files` fixture wrote (a mutated copy of a good profile, plan, cluster or model config, a binary or
deeply nested file, a directory, a FIFO). A case passes when the command exits 2 and stderr holds
exactly one error: one `elastor: error:` line, or argparse's usage lines and its one error line.
An uncaught exception fails the case with its traceback. For `run` and `ckpt` the cases are the
ones refused before any process starts or any checkpoint is read.
"""

import copy
import json
import os
import re

import pytest
from helpers import CLUSTER_8_7, PLAN_HETERO, REPO

from costmodel import PRESETS
from elastor.cli import main

PROFILE = REPO / "profiles" / "gpt-tiny-cpu.json"
DELETE = object()  # a mutation's value that removes the field

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def mutated(base: dict, path: str, value) -> dict:
    """A deep copy of `base` with the field at dotted `path` ("nodes.0.gpus") set to `value`."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def _json(name: str) -> dict:
    return json.loads((REPO / name).read_text()) if isinstance(name, str) else json.loads(name.read_text())


PROFILE_JSON, PLAN_JSON, CLUSTER_JSON = _json(PROFILE), _json(PLAN_HETERO), _json(CLUSTER_8_7)
MODEL_JSON = PRESETS["gpt-tiny"].to_json()
FAILURES_JSON = {"gpu_per_gpu_hour": 1e-5, "node_per_node_hour": 1e-5, "job_per_gpu_hour": 1e-5}

# name -> content: a dict is written as JSON (NaN and Infinity as JavaScript literals), bytes as they are
FILES = {
    # Hugging Face model configs
    "hf_heads0": mutated(HF_CONFIG, "num_attention_heads", 0),
    "hf_heads_negative": mutated(HF_CONFIG, "num_attention_heads", -4),
    "hf_heads_too_many": mutated(HF_CONFIG, "num_attention_heads", 128),
    "hf_hidden_string": mutated(HF_CONFIG, "hidden_size", "64"),
    "hf_hidden_float": mutated(HF_CONFIG, "hidden_size", 64.0),
    "hf_hidden_bool": mutated(HF_CONFIG, "hidden_size", True),
    "hf_hidden_missing": mutated(HF_CONFIG, "hidden_size", DELETE),
    "hf_vocab_null": mutated(HF_CONFIG, "vocab_size", None),
    "hf_layers_huge": mutated(HF_CONFIG, "num_hidden_layers", 10**9),
    "hf_mlp_huge": mutated(HF_CONFIG, "intermediate_size", 10**12),
    "hf_tie_no": mutated(HF_CONFIG, "tie_word_embeddings", "no"),
    "hf_tie_int": mutated(HF_CONFIG, "tie_word_embeddings", 1),
    "hf_theta_string": mutated(HF_CONFIG, "rope_theta", "abc"),
    "hf_theta_negative": mutated(HF_CONFIG, "rope_theta", -1.0),
    "hf_theta_inf": mutated(HF_CONFIG, "rope_theta", float("inf")),
    "hf_theta_400_digits": mutated(HF_CONFIG, "rope_theta", 10**400),
    "hf_eps_zero": mutated(HF_CONFIG, "rms_norm_eps", 0.0),
    "hf_eps_string": mutated(HF_CONFIG, "rms_norm_eps", "1e-5"),
    "hf_eps_nan": mutated(HF_CONFIG, "rms_norm_eps", float("nan")),
    "hf_positions_zero": mutated(HF_CONFIG, "max_position_embeddings", 0),
    "hf_positions_float": mutated(HF_CONFIG, "max_position_embeddings", 1e9),
    "hf_kv_heads_3": mutated(HF_CONFIG, "num_key_value_heads", 3),
    "hf_kv_heads_0": mutated(HF_CONFIG, "num_key_value_heads", 0),
    "hf_head_dim_odd": mutated(HF_CONFIG, "head_dim", 7),
    "hf_attention_bias": mutated(HF_CONFIG, "attention_bias", True),
    "hf_rope_scaling": mutated(HF_CONFIG, "rope_scaling", {"type": "linear", "factor": 2.0}),
    # Elastor model blocks
    "model_tie_no": mutated(MODEL_JSON, "tie_embeddings", "no"),
    "model_tie_null": mutated(MODEL_JSON, "tie_embeddings", None),
    "model_name_int": mutated(MODEL_JSON, "name", 7),
    "model_name_empty": mutated(MODEL_JSON, "name", ""),
    "model_blocks_zero": mutated(MODEL_JSON, "num_blocks", 0),
    "model_blocks_huge": mutated(MODEL_JSON, "num_blocks", 10**9),
    "model_eps_string": mutated(MODEL_JSON, "norm_eps", "x"),
    "model_eps_big": mutated(MODEL_JSON, "norm_eps", 2.0),
    "model_layers_mismatch": mutated(MODEL_JSON, "num_layers", 99),
    "model_vocab_missing": mutated(MODEL_JSON, "vocab_size", DELETE),
    "model_vocab_list": mutated(MODEL_JSON, "vocab_size", [1]),
    "model_list": b"[1, 2]",
    # clusters
    "cluster_memory_string": mutated(CLUSTER_JSON, "device.memory_bytes", "abc"),
    "cluster_memory_fraction": mutated(CLUSTER_JSON, "device.memory_bytes", 8.5e10 + 0.5),
    "cluster_memory_bool": mutated(CLUSTER_JSON, "device.memory_bytes", True),
    "cluster_memory_negative": mutated(CLUSTER_JSON, "device.memory_bytes", -1),
    "cluster_flops_string": mutated(CLUSTER_JSON, "device.peak_flops", "fast"),
    "cluster_flops_nan": mutated(CLUSTER_JSON, "device.peak_flops", float("nan")),
    "cluster_flops_inf": mutated(CLUSTER_JSON, "device.peak_flops", float("inf")),
    "cluster_flops_400_digits": mutated(CLUSTER_JSON, "device.peak_flops", 10**400),
    "cluster_memory_400_digits": mutated(CLUSTER_JSON, "device.memory_bytes", 10**400),
    "cluster_intra_huge": mutated(CLUSTER_JSON, "links.intra_node_gbps", 1e300),
    "cluster_kind_int": mutated(CLUSTER_JSON, "device.kind", 5),
    "cluster_intra_string": mutated(CLUSTER_JSON, "links.intra_node_gbps", "x"),
    "cluster_inter_zero": mutated(CLUSTER_JSON, "links.inter_node_gbps", 0),
    "cluster_inter_minus_inf": mutated(CLUSTER_JSON, "links.inter_node_gbps", float("-inf")),
    "cluster_collectives_list": mutated(CLUSTER_JSON, "links.collectives", []),
    "cluster_gpu_string": mutated(CLUSTER_JSON, "nodes.0.gpus", ["0"]),
    "cluster_gpu_id_huge": mutated(CLUSTER_JSON, "nodes.0.gpus", [100]),
    "cluster_gpu_float": mutated(CLUSTER_JSON, "nodes.0.gpus", [0.0]),
    "cluster_node_100_gpus": mutated(CLUSTER_JSON, "nodes.0.gpus", list(range(100))),
    "cluster_node_name_int": mutated(CLUSTER_JSON, "nodes.0.name", 5),
    "cluster_node_name_colon": mutated(CLUSTER_JSON, "nodes.0.name", "a:b"),
    "cluster_too_many_nodes": mutated(
        CLUSTER_JSON, "nodes", [{"name": f"n{i}", "gpus": []} for i in range(131_073)]
    ),
    "cluster_schema_2": mutated(CLUSTER_JSON, "schema_version", 2),
    "cluster_links_missing": mutated(CLUSTER_JSON, "links", DELETE),
    "cluster_device_string": mutated(CLUSTER_JSON, "device", "H100-80GB"),
    # plans
    "plan_gbs_string": mutated(PLAN_JSON, "global_batch_size", "16"),
    "plan_gbs_huge": mutated(PLAN_JSON, "global_batch_size", 10**9),
    "plan_gbs_bool": mutated(PLAN_JSON, "global_batch_size", True),
    "plan_gbs_400_digits": mutated(PLAN_JSON, "global_batch_size", 10**400),
    "plan_mbs_float": mutated(PLAN_JSON, "micro_batch_size", 2.0),
    "plan_seq_null": mutated(PLAN_JSON, "seq_len", None),
    "plan_pipelines_object": mutated(PLAN_JSON, "pipelines", {}),
    "plan_microbatches_string": mutated(PLAN_JSON, "pipelines.0.num_microbatches", "5"),
    "plan_microbatches_huge": mutated(PLAN_JSON, "pipelines.0.num_microbatches", 10**9),
    "plan_layers_string": mutated(PLAN_JSON, "pipelines.0.stages.0.layers", "0-3"),
    "plan_devices_ints": mutated(PLAN_JSON, "pipelines.0.stages.0.devices", [1]),
    "plan_sp_string": mutated(PLAN_JSON, "pipelines.0.stages.0.sequence_parallel", "yes"),
    "plan_recompute_unknown": mutated(PLAN_JSON, "pipelines.0.stages.0.recompute", "some"),
    "plan_optimizer_string": mutated(PLAN_JSON, "optimizer", "zero1"),
    "plan_predicted_string": mutated(PLAN_JSON, "predicted", "fast"),
    "plan_predicted_step_string": mutated(PLAN_JSON, "predicted", {"step_time_s": "x"}),
    "plan_predicted_step_nan": mutated(PLAN_JSON, "predicted", {"step_time_s": float("nan")}),
    "plan_model_tie_no": mutated(PLAN_JSON, "model.tie_embeddings", "no"),
    "plan_model_heads_zero": mutated(PLAN_JSON, "model.num_heads", 0),
    "plan_list": b"[]",
    # profiles
    "profile_fwd_string": mutated(PROFILE_JSON, "layers.1.costs.0.fwd_s", "abc"),
    "profile_fwd_nan": mutated(PROFILE_JSON, "layers.1.costs.0.fwd_s", float("nan")),
    "profile_fwd_inf": mutated(PROFILE_JSON, "layers.1.costs.0.fwd_s", float("inf")),
    "profile_fwd_400_digits": mutated(PROFILE_JSON, "layers.1.costs.0.fwd_s", 10**400),
    "profile_activation_400_digits": mutated(PROFILE_JSON, "layers.1.costs.0.activation_bytes", 10**400),
    "profile_activation_float": mutated(PROFILE_JSON, "layers.1.costs.0.activation_bytes", 1.5),
    "profile_mbs_zero": mutated(PROFILE_JSON, "layers.1.costs.0.micro_batch_size", 0),
    "profile_tp_string": mutated(PROFILE_JSON, "layers.1.costs.0.tp_degree", "1"),
    "profile_costs_object": mutated(PROFILE_JSON, "layers.1.costs", {}),
    "profile_seq_string": mutated(PROFILE_JSON, "seq_len", "128"),
    "profile_seq_huge": mutated(PROFILE_JSON, "seq_len", 10**9),
    "profile_layers_object": mutated(PROFILE_JSON, "layers", {}),
    "profile_kind_int": mutated(PROFILE_JSON, "device_kind", 5),
    "profile_dtype_list": mutated(PROFILE_JSON, "dtype", ["x"]),
    "profile_params_string": mutated(PROFILE_JSON, "layers.0.param_count", "x"),
    "profile_model_tie_no": mutated(PROFILE_JSON, "model.tie_embeddings", "no"),
    "profile_model_heads_float": mutated(PROFILE_JSON, "model.num_heads", 6.0),
    # failure models and costs for simulate
    "failures_rate_string": mutated(FAILURES_JSON, "gpu_per_gpu_hour", "x"),
    "failures_rate_nan": mutated(FAILURES_JSON, "gpu_per_gpu_hour", float("nan")),
    "failures_shape_tiny": {**FAILURES_JSON, "distribution": "weibull", "weibull_shape": 1e-9},
    "costs_load_string": {"load_s": "x"},
    "costs_detect_negative": {"detect_s": -1.0},
    "plan_cache_garbage": {"schema_version": 1, "plans": 5},
    # files that are not JSON objects at all
    "binary": bytes(range(256)) * 4,
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
    "long_number": b'{"schema_version": ' + b"9" * 5000 + b"}",
    # token files
    "tokens_empty.bin": b"",
    "tokens_odd.bin": b"\x01\x00\x02",
    "tokens_empty.txt": b"",
    "tokens_binary.txt": b"\xff\xfe\xfd" * 100,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-inputs")
    paths = {"profile": str(PROFILE), "plan": str(PLAN_HETERO), "cluster": str(CLUSTER_8_7)}
    for name, content in FILES.items():
        path = root / (name if "." in name else f"{name}.json")
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        path.write_bytes(data)
        paths[name.replace(".", "_")] = str(path)
    (root / "dir.json").mkdir()
    os.mkfifo(root / "fifo.json")
    (root / "existing.txt").write_text("a file, not a directory\n")
    paths.update(
        dir=str(root / "dir.json"),
        fifo=str(root / "fifo.json"),
        file=str(root / "existing.txt"),
        out=str(root / "out" / "result.json"),
        missing=str(root / "absent.json"),
        readonly=_read_only_dir(root),
    )
    yield paths
    os.chmod(root / "read-only", 0o755)


def _read_only_dir(root) -> str:
    """A directory this process cannot create files in: a chmod-ed one, or /sys for root, which
    ignores permissions but cannot create files in sysfs."""
    path = root / "read-only"
    path.mkdir()
    os.chmod(path, 0o555)
    return "/sys" if os.geteuid() == 0 else str(path)


def case(id_: str, *argv: str):
    return pytest.param(list(argv), id=id_)


def cases_for(prefix: str, base: tuple[str, ...], variants: dict[str, tuple[str, ...]]):
    return [case(f"{prefix}-{name}", *base, *extra) for name, extra in variants.items()]


PROFILE_BASE = ("profile", "--analytic", "--device-kind", "H100-80GB", "--out", "{out}")
PROFILE_MODELS = [
    case(f"profile-{name}", *PROFILE_BASE, "--model", "{" + name + "}")
    for name in FILES
    if name.startswith(("hf_", "model_"))
] + [
    case(f"profile-model-{name}", *PROFILE_BASE, "--model", "{" + name + "}")
    for name in ("binary", "deep", "empty", "long_number", "missing", "dir")
]
PROFILE_FLAGS = cases_for(
    "profile",
    ("profile", "--model", "gpt-tiny", "--out", "{out}"),
    {
        "unknown-model": ("--model", "gpt-huge"),
        "seq-len-0": ("--seq-len", "0"),
        "seq-len-abc": ("--seq-len", "abc"),
        "seq-len-over-model": ("--seq-len", "4096"),
        "mbs-0": ("--micro-batch-size", "0"),
        "mbs-x": ("--micro-batch-size", "1,x"),
        "mbs-huge": ("--micro-batch-size", "1000000000"),
        "mbs-digits": ("--micro-batch-size", "9" * 5000),
        "tp-4": ("--tp-degrees", "4"),
        "tp-huge": ("--tp-degrees", "99999999999999"),
        "repeats-0": ("--repeats", "0"),
        "repeats-huge": ("--repeats", "100000"),
        "warmup-negative": ("--warmup", "-1"),
        "threads-0": ("--threads", "0"),
        "threads-huge": ("--threads", "5000"),
        "threads-float": ("--threads", "2.5"),
        "comm-ranks-0": ("--comm", "--cluster-out", "{missing}", "--comm-ranks", "0"),
        "comm-bytes-small": ("--comm", "--cluster-out", "{missing}", "--comm-max-bytes", "4096"),
        "dtype": ("--dtype", "int8"),
        "device": ("--device", "tpu"),
        "out-dev-null": ("--out", "/dev/null"),
        "out-dir": ("--out", "{dir}"),
        "out-fifo": ("--out", "{fifo}"),
        "cluster-out-dev-null": ("--comm", "--cluster-out", "/dev/null"),
        "analytic-no-kind": ("--analytic",),
        "unknown-kind": ("--analytic", "--device-kind", "B200"),
    },
)
VALIDATE_CLUSTERS = cases_for(
    "validate",
    ("validate", "{plan}"),
    {
        "cluster-billion": ("--cluster", "1000000000"),
        "cluster-node-73": ("--cluster", "73"),
        "cluster-total": ("--cluster", ",".join(["72"] * 1821)),
        "cluster-digits": ("--cluster", "9" * 30),
        "cluster-word": ("--cluster", "abc"),
        "cluster-no-gpu": ("--cluster", "0,0"),
        "cluster-missing": ("--cluster", "{missing}"),
        "device-kind": ("--cluster", "4,3", "--device-kind", "B300"),
        "no-cluster": (),
    }
    | {
        name.removeprefix("cluster_"): ("--cluster", "{" + name + "}")
        for name in FILES
        if name.startswith("cluster_")
    }
    | {f"cluster-{name}": ("--cluster", "{" + name + "}") for name in ("binary", "deep", "empty", "dir")},
)
VALIDATE_PLANS = [
    case(f"validate-{name}", "validate", "{" + name + "}", "--cluster", "4,3")
    for name in [n for n in FILES if n.startswith("plan_") and n != "plan_cache_garbage"]
    + ["binary", "deep", "empty", "long_number", "missing", "dir"]
]
PLAN_FLAGS = cases_for(
    "plan",
    ("plan", "--profile", "{profile}", "--cluster", "4,3", "--global-batch-size", "16", "--out", "{out}"),
    {
        "gbs-billion": ("--global-batch-size", "1000000000"),
        "gbs-0": ("--global-batch-size", "0"),
        "gbs-negative": ("--global-batch-size", "-5"),
        "gbs-abc": ("--global-batch-size", "abc"),
        "gbs-exponent": ("--global-batch-size", "1e3"),
        "tp-0": ("--method", "uniform", "--tp", "0"),
        "tp-1000": ("--method", "uniform", "--tp", "1000"),
        "pp-0": ("--method", "uniform", "--pp", "0"),
        "chunks-0": ("--chunks", "0"),
        "chunks-huge": ("--chunks", "100000"),
        "chunks-x": ("--chunks", "x"),
        "time-limit-inf": ("--time-limit", "inf"),
        "time-limit-nan": ("--time-limit", "nan"),
        "time-limit-0": ("--time-limit", "0"),
        "time-limit-negative": ("--time-limit", "-1"),
        "time-limit-huge": ("--time-limit", "1e9"),
        "mbs-0": ("--micro-batch-sizes", "0"),
        "mbs-negative": ("--micro-batch-sizes", "-1"),
        "mbs-huge": ("--micro-batch-sizes", "1000000000"),
        "mbs-words": ("--micro-batch-sizes", "a,b"),
        "method": ("--method", "magic"),
        "sharding": ("--sharding", "half"),
        "recompute": ("--recompute", "some"),
        "out-dev-null": ("--out", "/dev/null"),
        "out-dir": ("--out", "{dir}"),
        "out-fifo": ("--out", "{fifo}"),
        "out-read-only": ("--out", "{readonly}/plan.json"),
        "cluster-billion": ("--cluster", "1000000000"),
        "profile-missing": ("--profile", "{missing}"),
    }
    | {
        name.removeprefix("profile_"): ("--profile", "{" + name + "}")
        for name in FILES
        if name.startswith("profile_")
    }
    | {
        f"profile-{name}": ("--profile", "{" + name + "}")
        for name in ("binary", "deep", "empty", "long_number")
    },
)
ESTIMATE = cases_for(
    "estimate",
    ("estimate", "--profile", "{profile}", "--cluster", "4,3"),
    {
        "plan-gbs-huge": ("{plan_gbs_huge}",),
        "plan-step-nan": ("{plan_predicted_step_nan}",),
        "plan-binary": ("{binary}",),
        "plan-missing": ("{missing}",),
        "no-plan": (),
        "profile-missing": ("{plan}", "--profile", "{missing}"),
        "profile-deep": ("{plan}", "--profile", "{deep}"),
        "cluster-billion": ("{plan}", "--cluster", "1000000000"),
        "cluster-memory-string": ("{plan}", "--cluster", "{cluster_memory_string}"),
        "no-profile": ("{plan}", "--profile"),
    },
)
WHATIF = cases_for(
    "whatif",
    ("whatif", "--profile", "{profile}", "--cluster", "4,3", "--global-batch-size", "16", "--quiet"),
    {
        "fail-billion": ("--fail", "0..1000000000"),
        "fail-negative": ("--fail=-1..3",),
        "fail-reversed": ("--fail", "5..3"),
        "fail-words": ("--fail", "a..b"),
        "fail-too-many": ("--fail", "0..99999"),
        "fail-all-gpus": ("--fail", "100"),
        "fail-digits": ("--fail", "9" * 5000),
        "seed-negative": ("--seed", "-1"),
        "seed-huge": ("--seed", str(2**32)),
        "seed-x": ("--seed", "x"),
        "time-limit-inf": ("--time-limit", "inf"),
        "gbs-0": ("--global-batch-size", "0"),
        "csv-dev-null": ("--csv", "/dev/null"),
        "csv-dir": ("--csv", "{dir}"),
        "plot-dev-null": ("--plot", "/dev/null"),
        "plot-suffix": ("--plot", "{missing}.foo"),
        "methods": ("--methods", "magic"),
        "placement": ("--placement", "everywhere"),
    },
)
TRAIN = cases_for(
    "train",
    ("train", "--plan", "{plan}", "--steps", "1", "--metrics", "{out}"),
    {
        "lr-inf": ("--lr", "inf"),
        "lr-nan": ("--lr", "nan"),
        "lr-0": ("--lr", "0"),
        "lr-negative": ("--lr", "-1"),
        "lr-huge": ("--lr", "100"),
        "min-lr-negative": ("--min-lr", "-1"),
        "min-lr-inf": ("--min-lr", "inf"),
        "min-lr-over-lr": ("--lr", "0.01", "--min-lr", "0.1"),
        "weight-decay-nan": ("--weight-decay", "nan"),
        "weight-decay-negative": ("--weight-decay", "-0.1"),
        "weight-decay-inf": ("--weight-decay", "inf"),
        "grad-clip-negative": ("--grad-clip", "-1"),
        "grad-clip-inf": ("--grad-clip", "inf"),
        "timeout-0": ("--timeout-s", "0"),
        "timeout-inf": ("--timeout-s", "inf"),
        "steps-negative": ("--steps", "-1"),
        "steps-huge": ("--steps", str(10**10)),
        "steps-abc": ("--steps", "abc"),
        "warmup-negative": ("--warmup-steps", "-1"),
        "ckpt-every-negative": ("--ckpt-every", "-1"),
        "keep-0": ("--keep", "0"),
        "seed-negative": ("--seed", "-1"),
        "stop-at-negative": ("--stop-at", "-1"),
        "ckpt-every-without-dir": ("--ckpt-every", "5"),
        "metrics-dir": ("--metrics", "{dir}"),
        "plan-binary": ("--plan", "{binary}"),
        "plan-tie-no": ("--plan", "{plan_model_tie_no}"),
        "data-empty-bin": ("--data", "{tokens_empty_bin}"),
        "data-odd-bin": ("--data", "{tokens_odd_bin}"),
        "data-empty-text": ("--data", "{tokens_empty_txt}"),
        "data-binary-text": ("--data", "{tokens_binary_txt}"),
        "data-missing": ("--data", "{missing}"),
    },
)
RUN = cases_for(
    "run",
    ("run", "--cluster", "2,2", "--profile", "{profile}", "--global-batch-size", "16", "--steps", "4"),
    {
        "steps-0": ("--ckpt-dir", "{missing}", "--steps", "0"),
        "gbs-0": ("--ckpt-dir", "{missing}", "--global-batch-size", "0"),
        "ckpt-every-0": ("--ckpt-dir", "{missing}", "--ckpt-every", "0"),
        "steps-abc": ("--ckpt-dir", "{missing}", "--steps", "abc"),
        "lr-abc": ("--ckpt-dir", "{missing}", "--lr", "abc"),
        "no-ckpt-dir": (),
        "device": ("--ckpt-dir", "{missing}", "--device", "tpu"),
        "profile-missing": ("--ckpt-dir", "{missing}", "--profile", "{missing}"),
        "profile-binary": ("--ckpt-dir", "{missing}", "--profile", "{binary}"),
        "profile-deep": ("--ckpt-dir", "{missing}", "--profile", "{deep}"),
        "cluster-billion": ("--ckpt-dir", "{missing}", "--cluster", "1000000000"),
        "cluster-memory-string": ("--ckpt-dir", "{missing}", "--cluster", "{cluster_memory_string}"),
    },
)
CKPT = [
    case("ckpt-action", "ckpt", "explode", "{missing}"),
    case("ckpt-format", "ckpt", "export", "{missing}", "--format", "onnx"),
    case("ckpt-out-dev-null", "ckpt", "export", "{missing}", "--out", "/dev/null"),
    case("ckpt-out-dir", "ckpt", "export", "{missing}", "--out", "{dir}"),
    case("ckpt-out-fifo", "ckpt", "export", "{missing}", "--out", "{fifo}"),
    case("ckpt-no-dir", "ckpt", "verify"),
]
SIMULATE = cases_for(
    "simulate",
    ("simulate", "--profile", "{profile}", "--cluster", "2x4", "--global-batch-size", "8", "--quiet"),
    {
        "days-inf": ("--days", "inf"),
        "days-nan": ("--days", "nan"),
        "days-0": ("--days", "0"),
        "days-1000": ("--days", "1000"),
        "runs-0": ("--runs", "0"),
        "runs-huge": ("--runs", "100000"),
        "seed-negative": ("--seed", "-1"),
        "ckpt-interval-0": ("--ckpt-interval", "0"),
        "ckpt-interval-inf": ("--ckpt-interval", "inf"),
        "timeline-days-inf": ("--timeline-days", "inf"),
        "gbs-billion": ("--global-batch-size", "1000000000"),
        "cluster-billion-nodes": ("--cluster", "1000000000x8"),
        "cluster-wide-nodes": ("--cluster", "4x1000"),
        "cluster-digits": ("--cluster", "99999999999x8"),
        "rate-factors-inf": ("--rate-factors", "inf"),
        "rate-factors-0": ("--rate-factors", "0"),
        "rate-factors-huge": ("--rate-factors", "1e9"),
        "sweep-nan": ("--sweep-intervals", "nan"),
        "sweep-huge": ("--sweep-intervals", "1e300"),
        "weibull-shape-0": ("--distribution", "weibull", "--weibull-shape", "0"),
        "weibull-shape-nan": ("--weibull-shape", "nan"),
        "repair-sigma-10": ("--repair-sigma", "10"),
        "gpu-repair-inf": ("--gpu-repair-h", "inf"),
        "solver-time-limit-inf": ("--solver-time-limit", "inf"),
        "slices-0": ("--slices", "0"),
        "too-many-failures": ("--cluster", "2048x8", "--days", "365", "--rate-factors", "1000"),
        "out-dir-file": ("--out-dir", "{file}"),
        "out-dir-dev-null": ("--out-dir", "/dev/null"),
        "plan-cache-dir": ("--plan-cache", "{dir}"),
        "plan-cache-dev-null": ("--plan-cache", "/dev/null"),
        "plan-cache-garbage": ("--plan-cache", "{plan_cache_garbage}"),
        "failures-rate-string": ("--failures", "{failures_rate_string}"),
        "failures-rate-nan": ("--failures", "{failures_rate_nan}"),
        "failures-shape-tiny": ("--failures", "{failures_shape_tiny}"),
        "failures-binary": ("--failures", "{binary}"),
        "costs-load-string": ("--costs", "{costs_load_string}"),
        "costs-detect-negative": ("--costs", "{costs_detect_negative}"),
        "profile-deep": ("--profile", "{deep}"),
    },
)
DEMO = [
    case("demo-out-file", "demo", "--out", "{file}"),
    case("demo-out-dev-null", "demo", "--out", "/dev/null"),
    case("demo-out-fifo", "demo", "--out", "{fifo}"),
    case("demo-flag", "demo", "--fast"),
]
CASES = [
    *PROFILE_MODELS,
    *PROFILE_FLAGS,
    *VALIDATE_CLUSTERS,
    *VALIDATE_PLANS,
    *PLAN_FLAGS,
    *ESTIMATE,
    *WHATIF,
    *TRAIN,
    *RUN,
    *CKPT,
    *SIMULATE,
    *DEMO,
]
USAGE_ERROR = re.compile(r"^elastor( \w+)?: error: ")


def test_every_subcommand_has_bad_inputs():
    covered = {param.values[0][0] for param in CASES}
    assert covered == {
        "profile",
        "validate",
        "plan",
        "estimate",
        "whatif",
        "train",
        "run",
        "ckpt",
        "simulate",
        "demo",
    }
    assert len(CASES) >= 150


@pytest.mark.parametrize("argv", CASES)
def test_a_bad_input_is_one_sentence_and_exit_2(argv, files, capsys):
    argv = [arg.format(**files) for arg in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage, then one error line
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    if lines[0].startswith("usage: elastor"):
        assert USAGE_ERROR.match(errors[0]), err
    else:
        assert lines == errors and errors[0].startswith("elastor: error: "), err  # one line, nothing else
    assert "Traceback" not in out + err
    assert not os.path.exists(files["out"]), "a refused command wrote its output"


@pytest.mark.parametrize("out", ["/dev/null", "{dir}", "{fifo}"])
def test_ckpt_export_refuses_a_bad_out_before_it_reads_the_checkpoint(out, files, capsys):
    """The checkpoint named is missing too: the refusal must be the output's, which comes first."""
    code = main(["ckpt", "export", files["missing"], "--out", out.format(**files)])
    err = capsys.readouterr().err
    assert code == 2 and "not a regular file; name a file to write" in err, err

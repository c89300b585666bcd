"""The command line: help texts, `elastor validate`, and user errors that exit 2 without a traceback.

Subcommands are discovered from the parser, so these tests keep holding as subcommands are added.
"""

import argparse
import json

import pytest
from helpers import CLUSTER_8_7, PLAN_HETERO, REPO, example_plan_json, run_elastor

from costmodel import ClusterSpec, Plan
from elastor.cli import build_parser, main


def subcommands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return list(actions[0].choices)


def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def assert_user_error(result, *sentences: str) -> None:
    """Exit 2; stderr is one `elastor:` line per problem, naming each; no traceback anywhere."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == len(sentences), lines
    for line, sentence in zip(lines, sentences, strict=True):
        assert line.startswith("elastor:"), line
        assert sentence in line, (sentence, line)


# ---- help ---------------------------------------------------------------------------------------


def test_help_lists_validate():
    result = run_elastor("--help")
    assert result.returncode == 0, result.stderr
    assert "validate" in result.stdout
    assert "example:" in result.stdout
    for name in subcommands():
        assert name in result.stdout


@pytest.mark.parametrize("name", subcommands())
def test_every_subcommand_help_ends_with_an_example(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out
    example = out.split("example:")[-1]
    assert f"elastor {name}" in example, example  # a real invocation of this subcommand


def test_no_subcommand_is_a_usage_error():
    result = run_elastor()
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "usage: elastor" in result.stderr


# ---- validate: success --------------------------------------------------------------------------


def test_validate_prints_the_stage_summary():
    result = run_elastor("validate", str(PLAN_HETERO), "--cluster", "4,3")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    plan = Plan.from_json(example_plan_json())
    assert plan.summary() in out
    for row in ("[0,3)", "[3,6)", "[0,2)", "[2,6)", "n0:0,n0:1", "n1:0,n1:1,n1:2", "embed..blocks.1"):
        assert row in out, row
    assert out.strip().splitlines()[-1] == "valid on cluster 4,3"


def test_validate_names_idle_devices(capsys):
    assert main(["validate", str(PLAN_HETERO), "--cluster", str(CLUSTER_8_7)]) == 0
    out = capsys.readouterr().out
    idle = sorted(
        set(ClusterSpec.parse(str(CLUSTER_8_7)).devices) - set(Plan.from_json(example_plan_json()).devices)
    )
    assert out.strip().splitlines()[-1] == f"valid on cluster 8,7; idle: {', '.join(idle)}"
    assert "n1:3" not in idle and "n0:7" in idle


# ---- validate: user errors ----------------------------------------------------------------------


def test_malformed_json(tmp_path):
    plan = write(tmp_path, "plan.json", '{"schema_version": 1, "model": ')
    assert_user_error(run_elastor("validate", plan, "--cluster", "4,3"), "is not valid JSON (line 1")


def test_missing_file(tmp_path):
    result = run_elastor("validate", str(tmp_path / "absent.json"), "--cluster", "4,3")
    assert_user_error(result, "absent.json does not exist.")


def test_unknown_schema_version(tmp_path):
    data = example_plan_json()
    data["schema_version"] = 7
    plan = write(tmp_path, "plan.json", data)
    result = run_elastor("validate", plan, "--cluster", "4,3")
    assert_user_error(result, "The plan has schema_version 7; this Elastor reads version 1.")


def test_invalid_plan_prints_one_line_per_problem(tmp_path):
    data = example_plan_json()
    data["global_batch_size"] = 18
    data["pipelines"][0]["stages"][1]["layers"] = [4, 6]
    data["pipelines"][1]["stages"][1]["devices"] = ["n1:3"]
    problems = Plan.from_json(data).violations(ClusterSpec.parse("4,3"))
    assert len(problems) == 3
    result = run_elastor("validate", write(tmp_path, "plan.json", data), "--cluster", "4,3")
    assert_user_error(result, *problems)
    assert result.stdout == ""


@pytest.mark.parametrize("cluster", ["4,x", "four", "absent-cluster.json"])
def test_bad_cluster(cluster):
    result = run_elastor("validate", str(PLAN_HETERO), "--cluster", cluster)
    sentence = "does not exist" if cluster.endswith(".json") else "is neither healthy GPUs per node"
    assert_user_error(result, sentence)


@pytest.mark.parametrize(
    ("cluster", "sentence"),
    [
        ({"schema_version": 1, "nodes": [8, 7]}, "The cluster lacks the required field(s) device, links."),
        (
            {**json.loads(CLUSTER_8_7.read_text()), "nodes": [8, 7]},
            "The cluster node must be a JSON object, not int.",
        ),
        (
            {**json.loads(CLUSTER_8_7.read_text()), "nodes": [{"name": "n0", "gpus": 8}]},
            "Cluster node n0's gpus must be a list of GPU ids",
        ),
    ],
)
def test_bad_cluster_file(tmp_path, capsys, cluster, sentence):
    path = write(tmp_path, "cluster.json", cluster)
    assert main(["validate", str(PLAN_HETERO), "--cluster", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastor:") and sentence in err and len(err.splitlines()) == 1


def test_unknown_device_kind():
    result = run_elastor("validate", str(PLAN_HETERO), "--cluster", "4,3", "--device-kind", "B300")
    assert_user_error(result, "Unknown device kind 'B300'")


def test_missing_cluster_flag_is_a_usage_error():
    result = run_elastor("validate", str(PLAN_HETERO))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--cluster" in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--global-batch-size", "8", "--out", "never.json"],
        ["estimate", str(PLAN_HETERO)],
        ["whatif", "--global-batch-size", "8", "--quiet"],
        ["simulate", "--global-batch-size", "8", "--quiet"],
        ["run", "--steps", "2", "--global-batch-size", "8", "--ckpt-dir", "ckpt"],
    ],
    ids=lambda c: c[0],
)
def test_a_profile_of_another_device_kind_than_the_cluster_is_refused(command, tmp_path):
    """A CPU profile cannot price the H100 devices of a cluster file: one sentence naming both."""
    profile = REPO / "profiles" / "gpt-tiny-cpu.json"
    result = run_elastor(*command, "--profile", str(profile), "--cluster", str(CLUSTER_8_7), cwd=tmp_path)
    assert_user_error(result, "The profile is for cpu devices but cluster")
    assert "has H100-80GB devices" in result.stderr and result.stderr.rstrip().endswith(".")
    assert not any(tmp_path.iterdir())

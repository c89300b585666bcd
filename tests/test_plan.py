"""Plan: JSON round trips, rank order, the summary, and every invariant `violations` checks."""

import json

import pytest
from helpers import CLUSTER_8_7, PLAN_HETERO, example_plan_json

from costmodel import ClusterSpec, ElastorError, ModelConfig, Pipeline, Plan, PlanInvalid, Stage
from costmodel.jsonio import read_json, write_json

CLUSTER_4_3 = ClusterSpec.parse("4,3")


def plan_with(edit=None, *, cluster: ClusterSpec | None = CLUSTER_4_3) -> list[str]:
    """The violations of the example plan after `edit(data)` changes its JSON."""
    data = example_plan_json()
    if edit is not None:
        edit(data)
    return Plan.from_json(data).violations(cluster)


def stages(data: dict, pipeline: int) -> list[dict]:
    return data["pipelines"][pipeline]["stages"]


# ---- the example plan and round trips -----------------------------------------------------------


def test_example_plan_is_valid():
    plan = Plan.from_json(read_json(PLAN_HETERO, "plan"))
    assert plan.violations(CLUSTER_4_3) == []
    assert plan.violations(ClusterSpec.parse(str(CLUSTER_8_7))) == []
    assert plan.violations() == []
    assert plan.validate(CLUSTER_4_3) is plan


def test_plan_json_round_trip(tmp_path):
    original = example_plan_json()
    plan = Plan.from_json(original)
    data = plan.to_json()
    for key in ("schema_version", "global_batch_size", "micro_batch_size", "seq_len", "pipelines"):
        assert data[key] == original[key], key
    assert ModelConfig.from_json(data["model"]) == ModelConfig.from_json(original["model"])
    path = tmp_path / "plan.json"
    write_json(path, data)
    assert Plan.from_json(read_json(path, "plan")) == plan


def test_predicted_and_solver_blocks_survive_the_round_trip():
    data = example_plan_json()
    data["predicted"] = {"step_time_s": 0.42, "samples_per_s": 38.1, "peak_memory_bytes": {"n0:0": 123}}
    data["solver"] = {"method": "elastor", "status": "OPTIMAL", "wall_s": 0.03}
    plan = Plan.from_json(json.loads(json.dumps(data)))
    assert plan.predicted == data["predicted"] and plan.solver == data["solver"]
    again = plan.to_json()
    assert again["predicted"] == data["predicted"] and again["solver"] == data["solver"]
    assert "predicted" not in Plan.from_json(example_plan_json()).to_json()


def test_split_backward_round_trips_and_older_plans_read_as_unsplit():
    data = example_plan_json()
    assert "split_backward" not in json.dumps(data)
    plan = Plan.from_json(data)
    assert not any(p.split_backward for p in plan.pipelines)
    assert "split_backward" not in json.dumps(plan.to_json())  # unsplit plans are written as before
    data["pipelines"][0]["split_backward"] = True
    again = Plan.from_json(Plan.from_json(data).to_json())
    assert [p.split_backward for p in again.pipelines] == [True] + [False] * (len(again.pipelines) - 1)


def test_split_backward_needs_two_stages():
    data = example_plan_json()
    pipe = data["pipelines"][0]
    pipe["stages"] = [
        {"layers": [0, 6], "devices": pipe["stages"][0]["devices"] + pipe["stages"][1]["devices"]}
    ]
    pipe["split_backward"] = True
    assert any("splitting its backward would change nothing" in v for v in Plan.from_json(data).violations())


def test_shape_queries():
    plan = Plan.from_json(example_plan_json())
    assert plan.world_size == 7
    assert plan.devices == ["n0:0", "n0:1", "n0:2", "n0:3", "n1:0", "n1:1", "n1:2"]
    assert plan.nodes() == ["n0", "n1"]
    assert plan.placement("n0:3") == (1, 1)
    assert plan.placement("n1:2") == (1, 0)
    with pytest.raises(KeyError):
        plan.placement("n0:7")
    stage = plan.pipelines[1].stages[1]
    assert stage == Stage(chunks=((2, 6),), devices=("n0:3",))
    assert (stage.tp_degree, stage.num_layers) == (1, 4)


def test_rank_order_is_natural_by_node_then_gpu():
    def edit(d):
        stages(d, 0)[0]["devices"] = ["n10:1", "n10:0"]
        stages(d, 0)[1]["devices"] = ["n2:5"]
        stages(d, 1)[0]["devices"] = ["n9:2", "n9:0", "n9:1"]
        stages(d, 1)[1]["devices"] = ["n2:1"]

    data = example_plan_json()
    edit(data)
    plan = Plan.from_json(data)
    assert plan.devices == ["n2:1", "n2:5", "n9:0", "n9:1", "n9:2", "n10:0", "n10:1"]
    assert plan.nodes() == ["n2", "n9", "n10"]


def test_summary_has_one_row_per_stage():
    plan = Plan.from_json(example_plan_json())
    lines = plan.summary().splitlines()
    assert lines[0].startswith("gpt-tiny: 2 pipeline(s) on 7 device(s), global batch 16 = micro-batch 2 x 8")
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["0", "0", "[0,3)", "embed..blocks.1", "2", "5", "n0:0,n0:1"],
        ["0", "1", "[3,6)", "blocks.2..head", "1", "n0:2"],
        ["1", "0", "[0,2)", "embed..blocks.0", "3", "3", "n1:0,n1:1,n1:2"],
        ["1", "1", "[2,6)", "blocks.1..head", "1", "n0:3"],
    ]


def test_summary_survives_an_invalid_range():
    data = example_plan_json()
    stages(data, 0)[1]["layers"] = [3, 9]
    assert "?" in Plan.from_json(data).summary()


# ---- every violation ----------------------------------------------------------------------------


def test_coverage_gap():
    problems = plan_with(lambda d: stages(d, 0)[1].update(layers=[4, 6]))
    assert problems == [
        "Pipeline 0 stage 1 starts at layer 4 but the previous stage ends at 3, so it leaves a gap."
    ]


def test_coverage_overlap():
    problems = plan_with(lambda d: stages(d, 1)[1].update(layers=[1, 6]))
    assert problems == [
        "Pipeline 1 stage 1 starts at layer 1 but the previous stage ends at 2, "
        "so it overlaps the previous stage."
    ]


def test_first_stage_must_start_at_embed():
    problems = plan_with(lambda d: stages(d, 1)[0].update(layers=[1, 2]))
    assert problems == [
        "Pipeline 1 stage 0 starts at layer 1 but the previous stage ends at 0, so it leaves a gap."
    ]


@pytest.mark.parametrize("end", [5, 7])
def test_wrong_end(end):
    problems = plan_with(lambda d: stages(d, 0)[1].update(layers=[3, end]))
    assert problems == [f"Pipeline 0 ends at layer {end} but model 'gpt-tiny' has 6 layers."]


def test_empty_stage():
    def edit(d):
        stages(d, 0).insert(1, {"layers": [3, 3], "devices": ["n0:3"]})
        d["pipelines"].pop(1)
        d["pipelines"][0]["num_microbatches"] = 8

    assert plan_with(edit) == ["Pipeline 0 stage 1 has the empty or reversed layer range [3, 3)."]


def test_reversed_stage():
    def edit(d):
        stages(d, 0)[:] = [
            {"layers": [0, 4], "devices": ["n0:0"]},
            {"layers": [4, 2], "devices": ["n0:1"]},
            {"layers": [2, 6], "devices": ["n0:2"]},
        ]

    problems = plan_with(edit)
    assert "Pipeline 0 stage 1 has the empty or reversed layer range [4, 2)." in problems
    assert (
        "Pipeline 0 stage 2 starts at layer 2 but the previous stage ends at 4, "
        "so it overlaps the previous stage." in problems
    )


def test_pipeline_without_stages():
    problems = plan_with(lambda d: d["pipelines"][1].update(stages=[]))
    assert problems == ["Pipeline 1 has no stage."]


def test_stage_without_devices():
    problems = plan_with(lambda d: stages(d, 0)[1].update(devices=[]))
    assert problems == ["Pipeline 0 stage 1 has no device."]


def test_plan_without_pipelines():
    problems = plan_with(lambda d: d.update(pipelines=[]))
    assert "The plan has no pipeline." in problems


def test_pipeline_without_microbatches():
    def edit(d):
        d["pipelines"][1]["num_microbatches"] = 0
        d["global_batch_size"] = 10

    assert plan_with(edit) == ["Pipeline 1 has 0 micro-batches; it needs at least 1."]


def test_unhealthy_device():
    cluster = ClusterSpec.parse(str(CLUSTER_8_7))  # n1 lost GPU 3
    problems = plan_with(lambda d: stages(d, 1)[1].update(devices=["n1:3"]), cluster=cluster)
    assert problems == ["Pipeline 1 stage 1 uses n1:3, which is not a healthy device of the cluster."]


def test_device_on_a_node_the_cluster_lacks():
    problems = plan_with(lambda d: stages(d, 0)[1].update(devices=["n2:0"]))
    assert problems == ["Pipeline 0 stage 1 uses n2:0, which is not a healthy device of the cluster."]


def test_health_is_only_checked_against_a_cluster():
    assert plan_with(lambda d: stages(d, 0)[1].update(devices=["n2:0"]), cluster=None) == []


def test_device_used_twice_across_pipelines():
    problems = plan_with(lambda d: stages(d, 1)[1].update(devices=["n0:2"]))
    assert problems == ["Pipeline 1 stage 1 uses n0:2, which pipeline 0 stage 1 already uses."]


def test_device_used_twice_in_one_stage():
    def edit(d):
        stages(d, 1)[0]["devices"] = ["n1:0", "n1:0"]

    problems = plan_with(edit)
    assert problems == ["Pipeline 1 stage 0 uses n1:0, which pipeline 1 stage 0 already uses."]


def test_tp_group_spanning_nodes():
    problems = plan_with(lambda d: stages(d, 0)[0].update(devices=["n0:0", "n1:5"]), cluster=None)
    assert problems == [
        "Pipeline 0 stage 0 spans nodes n0, n1; a tensor-parallel group must sit on one node."
    ]


def test_tp_degree_must_divide_heads():
    problems = plan_with(lambda d: stages(d, 1)[0].update(devices=["n1:0", "n1:1", "n1:2", "n1:3"]))
    assert "Pipeline 1 stage 0 uses n1:3, which is not a healthy device of the cluster." in problems
    assert (
        "Pipeline 1 stage 0 has TP degree 4, which does not divide the model's 6 attention heads "
        "and 6 key/value heads."
    ) in problems
    assert len(problems) == 2


def test_tp_degree_must_divide_kv_heads():
    # 8 query heads share 2 key/value heads: TP 4 divides the former but not the latter.
    def edit(d):
        d["model"].update(name="gqa", num_heads=8, num_kv_heads=2)
        stages(d, 0)[0]["devices"] = ["n0:0", "n0:1", "n0:2", "n0:3"]
        stages(d, 0)[1]["devices"] = ["n1:0", "n1:1"]
        d["pipelines"].pop(1)
        d["pipelines"][0]["num_microbatches"] = 8

    assert plan_with(edit) == [
        "Pipeline 0 stage 0 has TP degree 4, which does not divide the model's 8 attention heads "
        "and 2 key/value heads."
    ]


def test_batch_arithmetic():
    problems = plan_with(lambda d: d.update(global_batch_size=17))
    assert problems == [
        "The pipelines' micro-batches (8) times micro_batch_size (2) make 16 samples, "
        "not global_batch_size 17."
    ]


def test_micro_batch_size_at_least_one():
    def edit(d):
        d["micro_batch_size"] = 0
        d["global_batch_size"] = 0

    assert plan_with(edit) == ["micro_batch_size must be at least 1, not 0."]


@pytest.mark.parametrize("seq_len", [0, 257])
def test_seq_len_out_of_range(seq_len):
    problems = plan_with(lambda d: d.update(seq_len=seq_len))
    assert problems == [f"seq_len {seq_len} is outside 1..256, the model's maximum."]


def test_seq_len_at_the_model_maximum_is_valid():
    assert plan_with(lambda d: d.update(seq_len=256)) == []


@pytest.mark.parametrize("device", ["n0-3", "n0:", ":3", "n0:x", "n0:1:2"])
def test_malformed_device_name(device):
    problems = plan_with(lambda d: stages(d, 0)[1].update(devices=[device]))
    assert f"Pipeline 0 stage 1: Device {device!r} is not of the form <node>:<gpu>, like n1:3." in problems


def test_every_problem_is_reported_at_once():
    def edit(d):
        d["global_batch_size"] = 18
        d["seq_len"] = 1000
        stages(d, 0)[1]["layers"] = [4, 6]
        stages(d, 1)[1]["devices"] = ["n0:2"]

    problems = plan_with(edit)
    assert len(problems) == 4
    assert all(p.endswith(".") and "\n" not in p for p in problems)


def test_validate_raises_with_one_problem_per_line():
    data = example_plan_json()
    data["global_batch_size"] = 18
    stages(data, 0)[1]["layers"] = [4, 6]
    plan = Plan.from_json(data)
    with pytest.raises(PlanInvalid) as e:
        plan.validate(CLUSTER_4_3)
    assert isinstance(e.value, ElastorError)
    assert e.value.problems == plan.violations(CLUSTER_4_3)
    assert str(e.value).splitlines() == e.value.problems
    assert len(e.value.problems) == 2


def test_hand_built_plan_without_json():
    config = ModelConfig(
        name="m",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_blocks=2,
        num_heads=4,
        num_kv_heads=4,
    )
    plan = Plan(
        model=config,
        global_batch_size=6,
        micro_batch_size=3,
        seq_len=32,
        pipelines=(
            Pipeline(num_microbatches=1, stages=(Stage(chunks=((0, 4),), devices=("n0:0", "n0:1")),)),
            Pipeline(
                num_microbatches=1,
                stages=(
                    Stage(chunks=((0, 1),), devices=("n1:0",)),
                    Stage(chunks=((1, 4),), devices=("n1:1",)),
                ),
            ),
        ),
    )
    assert plan.violations(ClusterSpec.parse("2,2")) == []
    assert plan.violations(ClusterSpec.parse("2,1")) == [
        "Pipeline 1 stage 1 uses n1:1, which is not a healthy device of the cluster."
    ]


# ---- malformed plan files -----------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, None, "1"])
def test_unknown_schema_version(version):
    data = example_plan_json()
    data["schema_version"] = version
    with pytest.raises(ElastorError) as e:
        Plan.from_json(data)
    assert str(e.value) == f"The plan has schema_version {version!r}; this Elastor reads version 1."


@pytest.mark.parametrize(
    ("edit", "sentence"),
    [
        (
            lambda d: (d.pop("seq_len"), d.pop("pipelines")),
            "The plan lacks the required field(s) seq_len, pipelines.",
        ),
        (lambda d: d.update(seq_len="64"), "The plan's seq_len must be an integer, not '64'."),
        (
            lambda d: d.update(global_batch_size=16.0),
            "The plan's global_batch_size must be an integer, not 16.0.",
        ),
        (lambda d: d.update(pipelines={}), "The plan's pipelines must be a list."),
        (lambda d: d["pipelines"][0].pop("num_microbatches"), "The pipeline lacks the required field(s) "),
        (
            lambda d: d["pipelines"][0].update(num_microbatches="5"),
            "A pipeline needs an integer num_microbatches",
        ),
        (lambda d: stages(d, 0)[0].pop("devices"), "The stage lacks the required field(s) devices."),
        (
            lambda d: stages(d, 0)[0].update(layers=[0, 3, 6]),
            "A stage's layers must be [start, end) integers",
        ),
        (lambda d: stages(d, 0)[0].update(layers=[0, 3.0]), "A stage's layers must be [start, end) integers"),
        (lambda d: stages(d, 0)[0].update(devices="n0:0"), "A stage's devices must be a list of names like"),
        (lambda d: stages(d, 0)[0].update(devices=[0, 1]), "A stage's devices must be a list of names like"),
        (lambda d: d["model"].pop("num_heads"), "The model block lacks the required field(s) num_heads."),
        (lambda d: d["model"].update(num_layers=7), "Model 'gpt-tiny' says num_layers=7 but has 4 blocks"),
        (lambda d: d.update(pipelines=[5]), "The pipeline must be a JSON object, not int."),
        (lambda d: stages(d, 0).append("n0:4"), "The stage must be a JSON object, not str."),
        (
            lambda d: d["pipelines"][0].update(split_backward="yes"),
            "A pipeline's split_backward is true or false",
        ),
    ],
)
def test_malformed_plan_json(edit, sentence):
    data = example_plan_json()
    edit(data)
    with pytest.raises(ElastorError) as e:
        Plan.from_json(data)
    assert str(e.value).startswith(sentence)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("data", [[], None, "plan"])
def test_a_plan_that_is_not_an_object_is_one_sentence(data):
    with pytest.raises(ElastorError, match="The plan must be a JSON object"):
        Plan.from_json(data)

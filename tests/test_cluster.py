"""ClusterSpec: the short form, the JSON form, device names and every construction error."""

import json

import pytest
from helpers import CLUSTER_8_7

from costmodel import ClusterSpec, DeviceSpec, ElastorError, LinkSpec, NodeSpec
from costmodel.cluster import parse_device
from costmodel.hardware import DEVICE_KINDS
from costmodel.jsonio import write_json


def cluster_json() -> dict:
    return json.loads(CLUSTER_8_7.read_text())


# ---- the short form -----------------------------------------------------------------------------


def test_short_form():
    cluster = ClusterSpec.parse("8,8,7")
    assert [n.name for n in cluster.nodes] == ["n0", "n1", "n2"]
    assert cluster.node("n2").gpus == tuple(range(7))
    assert cluster.world_size == 23
    assert cluster.devices[:2] == ["n0:0", "n0:1"]
    assert cluster.devices[-1] == "n2:6"
    assert "n2:7" not in cluster.devices
    assert cluster.short_form() == "8,8,7"


def test_short_form_takes_the_device_kind_it_is_given():
    h100 = ClusterSpec.parse("2")
    assert h100.device.kind == "H100-80GB"
    a100 = ClusterSpec.parse(" 4 , 2 ", kind="A100-80GB")
    assert a100.short_form() == "4,2"
    hw = DEVICE_KINDS["A100-80GB"]
    assert a100.device == DeviceSpec(kind="A100-80GB", memory_bytes=hw.memory_bytes, peak_flops=hw.peak_flops)
    assert a100.links.inter_node_gbps == hw.inter_node_gbps
    assert a100.links.intra_node_gbps == hw.intra_node_gbps


def test_short_form_refuses_an_unknown_device_kind():
    with pytest.raises(ElastorError, match=r"^Unknown device kind 'B300'; known kinds are A100-40GB, "):
        ClusterSpec.parse("8", kind="B300")


@pytest.mark.parametrize("text", ["8,x,7", "8;8", "", "-1,2", "eight"])
def test_unparseable_cluster_strings(text):
    with pytest.raises(ElastorError) as e:
        ClusterSpec.parse(text)
    assert str(e.value) == (
        f"Cluster {text!r} is neither healthy GPUs per node like 8,8,7 nor a cluster JSON file."
    )


def test_short_form_with_an_empty_node_keeps_the_node():
    cluster = ClusterSpec.parse("2,0,1")
    assert [len(n.gpus) for n in cluster.nodes] == [2, 0, 1]
    assert cluster.devices == ["n0:0", "n0:1", "n2:0"]


# ---- the JSON form ------------------------------------------------------------------------------


def test_example_cluster_file():
    cluster = ClusterSpec.parse(str(CLUSTER_8_7))
    assert cluster.world_size == 15
    assert cluster.short_form() == "8,7"
    assert cluster.node("n1").gpus == (0, 1, 2, 4, 5, 6, 7)
    assert "n1:3" not in cluster.devices and "n1:7" in cluster.devices
    assert cluster.device.memory_bytes == 85899345920
    assert cluster.links.inter_node_gbps == 50


def test_a_hand_written_whole_memory_size_in_float_notation_still_loads(tmp_path):
    data = cluster_json()
    data["device"]["memory_bytes"] = 8e10
    write_json(tmp_path / "cluster.json", data)
    memory = ClusterSpec.parse(str(tmp_path / "cluster.json")).device.memory_bytes
    assert memory == 80_000_000_000 and type(memory) is int


def test_cluster_json_round_trip(tmp_path):
    cluster = ClusterSpec.parse(str(CLUSTER_8_7))
    assert cluster.to_json() == cluster_json()
    path = tmp_path / "cluster.json"
    write_json(path, cluster.to_json())
    assert ClusterSpec.parse(str(path)) == cluster


def test_short_form_json_round_trip():
    cluster = ClusterSpec.parse("8,8,7", kind="H200-141GB")
    assert ClusterSpec.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def test_measured_collectives_survive_the_round_trip():
    data = cluster_json()
    data["links"]["collectives"] = {"all_reduce": {"intra": {"latency_s": 1e-5, "gbps": 300.0}}}
    data["comment"] = "extra fields are allowed"
    cluster = ClusterSpec.from_json(data)
    assert cluster.links.collectives["all_reduce"]["intra"]["gbps"] == 300.0
    assert ClusterSpec.from_json(cluster.to_json()) == cluster


def test_gpus_are_sorted_and_a_node_may_skip_any():
    data = cluster_json()
    data["nodes"][1]["gpus"] = [7, 0, 5]
    cluster = ClusterSpec.from_json(data)
    assert cluster.devices[-3:] == ["n1:0", "n1:5", "n1:7"]


def test_without_marks_devices_unhealthy():
    cluster = ClusterSpec.parse("4,4")
    smaller = cluster.without({"n1:3", "n0:0"})
    assert smaller.short_form() == "3,3"
    assert "n1:3" not in smaller.devices and "n0:0" not in smaller.devices
    assert smaller.device == cluster.device and smaller.links == cluster.links
    assert cluster.world_size == 8  # the original is unchanged


def test_a_node_is_whole_by_its_nominal_count_not_by_the_largest_node_now():
    assert ClusterSpec.parse("8,8,7").gpus_per_node == 8
    assert ClusterSpec.parse("7,7").whole_nodes().short_form() == "7,7"  # the short form: largest count
    assert ClusterSpec.parse("7,7", gpus_per_node=8).whole_nodes() is None
    worn = ClusterSpec.parse("8,8").without({"n0:7", "n1:2"})  # every node lost one
    assert worn.gpus_per_node == 8 and worn.whole_nodes() is None
    data = cluster_json()
    data["nodes"] = [{"name": "a", "gpus": [0, 1, 2, 3]}, {"name": "b", "gpus": [0, 1, 3]}]
    assert ClusterSpec.from_json(data).gpus_per_node == 4  # a file without it: the highest id listed, + 1
    assert [n.name for n in ClusterSpec.from_json(data).whole_nodes().nodes] == ["a"]
    data["gpus_per_node"] = 8
    cluster = ClusterSpec.from_json(data)
    assert cluster.whole_nodes() is None and ClusterSpec.from_json(cluster.to_json()) == cluster
    data["gpus_per_node"] = 3
    with pytest.raises(ElastorError, match=r"gpus_per_node must be .*the highest is 3"):
        ClusterSpec.from_json(data)


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, None, "1"])
def test_unknown_schema_version(version):
    data = cluster_json()
    data["schema_version"] = version
    with pytest.raises(ElastorError) as e:
        ClusterSpec.from_json(data)
    assert str(e.value) == f"The cluster has schema_version {version!r}; this Elastor reads version 1."


@pytest.mark.parametrize(
    ("edit", "sentence"),
    [
        (lambda d: d.pop("links"), "The cluster lacks the required field(s) links."),
        (lambda d: d["device"].pop("peak_flops"), "The cluster's device block lacks the required field(s) "),
        (
            lambda d: d["links"].pop("inter_node_gbps"),
            "The cluster's links block lacks the required field(s) ",
        ),
        (lambda d: d["nodes"][0].pop("gpus"), "The cluster node lacks the required field(s) gpus."),
        (
            lambda d: d.update(nodes={"n0": [0]}),
            "The cluster's nodes must be a list of {name, gpus} objects.",
        ),
        (lambda d: d["nodes"][1].update(name="n0"), "The cluster names a node twice."),
        (lambda d: d["nodes"][1].update(gpus=[1, 1]), "Node n1 lists a GPU twice."),
        (lambda d: d["nodes"][1].update(gpus=[0, -1]), "Node n1 lists GPU ids that are not non-negative"),
        (lambda d: d["nodes"][1].update(gpus=["0"]), "Node n1 lists GPU ids that are not non-negative"),
        (lambda d: d["nodes"][1].update(name="n:1"), "Node name 'n:1' must be non-empty and contain no ':'."),
        (lambda d: d["nodes"][1].update(name=""), "Node name '' must be non-empty and contain no ':'."),
        (lambda d: d["device"].update(memory_bytes=0), "Device kind 'H100-80GB' needs positive memory_bytes"),
        (lambda d: d["links"].update(intra_node_gbps=0), "Cluster links need positive intra_node_gbps and"),
        (lambda d: d.update(nodes=[{"name": "n0", "gpus": []}]), "The cluster has no healthy GPU."),
        (lambda d: d["nodes"][0].update(gpus=8), "Cluster node n0's gpus must be a list of GPU ids"),
        (lambda d: d.update(nodes=[8, 7]), "The cluster node must be a JSON object, not int."),
        (
            lambda d: d.update(device="H100-80GB"),
            "The cluster's device block must be a JSON object, not str.",
        ),
    ],
)
def test_cluster_json_errors(edit, sentence):
    data = cluster_json()
    edit(data)
    with pytest.raises(ElastorError) as e:
        ClusterSpec.from_json(data)
    assert str(e.value).startswith(sentence)
    assert "\n" not in str(e.value)


def test_all_zero_short_form_has_no_healthy_gpu():
    with pytest.raises(ElastorError, match=r"^The cluster has no healthy GPU.$"):
        ClusterSpec.parse("0,0")


def test_cluster_file_errors(tmp_path):
    with pytest.raises(ElastorError, match=r"^The cluster file .*absent.json does not exist.$"):
        ClusterSpec.parse(str(tmp_path / "absent.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema_version": 1,')
    with pytest.raises(ElastorError, match=r"^The cluster file .*broken.json is not valid JSON \(line 1, "):
        ClusterSpec.parse(str(broken))
    listed = tmp_path / "listed.json"
    listed.write_text("[8, 8, 7]")
    with pytest.raises(ElastorError, match=r"must hold a JSON object, not list.$"):
        ClusterSpec.parse(str(listed))


def test_constructors_validate_directly():
    with pytest.raises(ElastorError):
        NodeSpec(name="n0", gpus=(0, 0))
    with pytest.raises(ElastorError):
        LinkSpec(intra_node_gbps=1.0, inter_node_gbps=-1.0)
    with pytest.raises(ElastorError):
        DeviceSpec(kind="x", memory_bytes=1, peak_flops=0.0)
    assert NodeSpec(name="n0", gpus=(3, 1)).devices == ["n0:1", "n0:3"]


# ---- device names -------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "parsed"), [("n1:3", ("n1", 3)), ("gpu-host.7:12", ("gpu-host.7", 12))])
def test_parse_device(device, parsed):
    assert parse_device(device) == parsed


@pytest.mark.parametrize("device", ["n1", "n1:", ":3", "n1:x", "n1:-1", "n1:1:2", "n1:²", "n1:٣", "n1: 3"])
def test_parse_device_refuses_malformed_names(device):
    with pytest.raises(ElastorError) as e:
        parse_device(device)
    assert str(e.value) == f"Device {device!r} is not of the form <node>:<gpu>, like n1:3."

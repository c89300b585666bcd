"""Collectives: the alpha-beta fit, a real gloo measurement, and the cluster file it writes.

The gloo runs spawn 2-3 local processes that talk over loopback; `measure_collectives` joins or
terminates them in a `finally`, and each test checks that none is left behind.
"""

import json
import multiprocessing

import pytest

from costmodel import ClusterSpec, ElastorError
from costmodel.comm import all_reduce_s, link
from elastor.cli import main
from profiler.comm import COLLECTIVES, collectives_block, fit_alpha_beta, measure_collectives, model_terms


def synthetic(collective: str, latency_s: float, bandwidth_gbps: float, noise=lambda i: 1.0) -> list[dict]:
    samples = []
    for n in (2, 3, 4):
        for i, size in enumerate(4 * 8**k for k in range(9)):
            steps, bus = model_terms(collective, n, size)
            seconds = (steps * latency_s + bus / (bandwidth_gbps * 1e9)) * noise(i + n)
            samples.append({"collective": collective, "group_size": n, "bytes": size, "time_s": seconds})
    return samples


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_the_fit_recovers_latency_and_bandwidth(collective):
    fit = fit_alpha_beta(synthetic(collective, 20e-6, 3.0))
    assert fit["latency_s"] == pytest.approx(20e-6, rel=1e-6)
    assert fit["bandwidth_gbps"] == pytest.approx(3.0, rel=1e-6)
    assert fit["max_rel_error"] < 1e-6


def test_the_fit_tolerates_noise_and_never_goes_negative():
    wobble = synthetic("all_reduce", 50e-6, 1.0, noise=lambda i: 1.1 if i % 2 else 0.9)
    fit = fit_alpha_beta(wobble)
    assert fit["latency_s"] == pytest.approx(50e-6, rel=0.15)
    assert fit["bandwidth_gbps"] == pytest.approx(1.0, rel=0.15)
    pure_bandwidth = synthetic("p2p", 0.0, 2.0, noise=lambda i: 1.05 if i % 3 else 0.97)
    assert fit_alpha_beta(pure_bandwidth)["latency_s"] >= 0.0


def test_latency_bound_samples_leave_the_bandwidth_to_the_hardware_table():
    # Messages of at most 256 B: time is all latency (plus noise), the fitted slope is not positive.
    noisy = synthetic("all_gather", 300e-6, 1e6, noise=lambda i: 1.2 if i % 2 else 1.0)
    tiny = [s for s in noisy if s["bytes"] < 300]
    fit = fit_alpha_beta(tiny)
    assert fit["bandwidth_gbps"] is None
    assert fit["latency_s"] == pytest.approx(300e-6, rel=0.2)
    block = collectives_block(tiny, "gloo", fallback_gbps=2.0)
    assert block["all_gather"]["intra_node"]["bandwidth_gbps"] == 2.0
    assert "too small" in block["all_gather"]["intra_node"]["bandwidth_from"]


def test_profile_comm_measures_gloo_and_writes_a_cluster_file(tmp_path, capsys):
    # One end-to-end run: 3 spawned gloo processes, groups of 2 and 3, messages of 4 B to 1 MiB.
    profile, cluster = tmp_path / "p.json", tmp_path / "c.json"
    argv = [
        "profile",
        "--model",
        "gpt-tiny",
        "--micro-batch-size",
        "1",
        "--tp-degrees",
        "1",
        "--seq-len",
        "8",
    ]
    argv += ["--repeats", "1", "--warmup", "0", "--quiet", "--out", str(profile)]
    argv += ["--comm", "--comm-ranks", "3", "--comm-max-bytes", str(1 << 20), "--cluster-out", str(cluster)]
    assert main(argv) == 0
    assert not multiprocessing.active_children()
    printed = capsys.readouterr().out
    assert "reduce_scatter" in printed and "inter-node is a copy" in printed

    again = ClusterSpec.from_json(json.loads(cluster.read_text()))
    assert again.world_size == 3 and again.device.kind == "cpu"
    block = again.links.collectives
    samples = block["measurement"]["samples"]
    assert {(s["collective"], s["group_size"]) for s in samples} == {
        (c, n) for c in COLLECTIVES for n in (2, 3)
    }
    # 4 B ... 1 MiB by factors of 8, each rounded to whole float32 elements per rank (4 B -> 8 B).
    assert sorted({s["bytes"] for s in samples if s["group_size"] == 2}) == [
        8,
        32,
        256,
        2048,
        16384,
        131072,
        1048576,
    ]
    assert all(s["time_s"] > 0 for s in samples)
    assert block["measurement"]["scopes_measured"] == ["intra_node"]
    assert again.links.intra_node_gbps == block["all_reduce"]["intra_node"]["bandwidth_gbps"]
    assert block["all_reduce"]["inter_node"]["copied_from"] == "intra_node"
    assert set(block["p2p"]["intra_node"]["by_group_size"]) == {"2", "3"}
    # The cost model reads the fit: ring all-reduce time from the measured latency and bandwidth.
    fitted = link(again.links, "all_reduce", inter_node=False)
    assert fitted.latency_s == block["all_reduce"]["intra_node"]["latency_s"]
    assert all_reduce_s(1 << 20, 3, fitted) > 0


def test_a_group_of_one_is_a_user_error():
    with pytest.raises(ElastorError, match="at least 2 processes"):
        measure_collectives(1)

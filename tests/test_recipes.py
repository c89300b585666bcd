"""The cluster recipes under examples/ are valid as written: the Slurm batch script parses in bash,
the Kubernetes manifest is a headless Service and an Indexed Job that agree with each other, and
the `elastor run` command line each one runs parses with Elastor's own parser."""

import json
import re
import shlex
import shutil
import subprocess

import pytest
from helpers import EXAMPLES

from elastor.cli import build_parser

SBATCH = EXAMPLES / "slurm-elastor-run.sbatch"
K8S = EXAMPLES / "k8s-elastor-run.json"


def parsed_run(command: str, values: dict[str, str]):
    """The `elastor run ...` command with its shell variables set to `values`, parsed."""
    for name, value in values.items():
        command = re.sub(rf"\$\{{?{name}\}}?", value, command)
    command = re.sub(r"\$\(hostname -s\)", "host-a", command)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:2] == ["elastor", "run"], words
    assert "$" not in " ".join(words), words
    return build_parser().parse_args(words[1:])


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_slurm_script_parses_and_runs_a_valid_elastor_run():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n") and "--ntasks-per-node=1" in text
    assert "--kill-on-bad-exit=0" in text  # a failed task must not end the survivors' step
    command = re.search(r"exec (elastor run .*?)\n'", text, re.S)[1]
    values = {"nodes": "host-a,host-b", "leader": "host-a", "PORT": "29400"}
    values |= {
        "CLUSTER": "cluster.json",
        "PROFILE": "p.json",
        "CKPT_DIR": "ckpt",
        "TOKEN": "/shared/elastor/token",
    }
    args = parsed_run(command, values)
    assert args.node == "host-a" and args.nodes == "host-a,host-b" and args.rdzv_endpoint == "host-a:29400"
    assert args.token_file == "/shared/elastor/token" and "umask 077" in text  # made private
    assert args.device == "cuda"


def test_the_kubernetes_manifest_is_an_indexed_job_behind_a_headless_service():
    manifest = json.loads(K8S.read_text())
    kinds = {item["kind"]: item for item in manifest["items"]}
    service, job = kinds["Service"], kinds["Job"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    [container] = pod["containers"]
    [command] = container["args"]
    args = parsed_run(command.removeprefix("exec "), {"JOB_COMPLETION_INDEX": "1"})
    names = args.nodes.split(",")
    assert len(names) == spec["completions"] and args.node == names[1]
    leader = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert args.rdzv_endpoint == f"{leader}:{service['spec']['ports'][0]['port']}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    # The job's token comes from a Secret, mounted readable by its owner only.
    mount = next(m for m in container["volumeMounts"] if args.token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] == 0o400

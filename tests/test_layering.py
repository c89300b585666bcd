"""The dependency rule of docs/DESIGN.md: planning (costmodel, solver) never imports torch.

Each check runs in a fresh interpreter, since this test process has torch loaded already.
"""

import json
import subprocess
import sys

from helpers import REPO

# Imports the given packages and every module below them, then reports what it imported and
# whether torch came along. Submodules are discovered, so a module added later is checked too.
CHECK = """
import importlib, json, pkgutil, sys
imported = []
for package in sys.argv[1:]:
    module = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=package + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({"imported": imported, "torch": "torch" in sys.modules}))
"""


def imports_torch(*packages: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHECK, *packages], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_acceptance_one_liner():
    code = "import solver, costmodel, sys; assert 'torch' not in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_costmodel_and_solver_never_import_torch():
    report = imports_torch("costmodel", "solver")
    foundation = {"config", "cluster", "profile", "plan", "jsonio", "errors", "hardware", "table"}
    assert {f"costmodel.{m}" for m in foundation} <= set(report["imported"])
    assert "solver" in report["imported"]
    assert not report["torch"], "costmodel or solver imports torch: " + ", ".join(report["imported"])


def test_the_check_sees_torch_where_it_is_imported():
    # The same check on the runtime, which does import torch, must report it.
    assert imports_torch("runtime")["torch"]

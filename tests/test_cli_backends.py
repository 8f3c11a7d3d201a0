"""`deepinfer backends` and `deepinfer conformance` as a user runs them (fresh interpreters)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

Run = Callable[..., subprocess.CompletedProcess[str]]


def rows(stdout: str) -> dict[str, list[str]]:
    """name -> [version, priority, available, reason...] from the backends table."""
    table = stdout.split("\n\n")[0].splitlines()
    assert table[0].split()[:4] == ["name", "version", "priority", "available"]
    return {line.split()[0]: line.split()[1:] for line in table[1:]}


def test_backends_lists_reference_cuda_ascend(run_deepinfer: Run) -> None:
    out = run_deepinfer("backends", env={"DEEPINFER_BACKEND": ""})
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table["reference"][2] == "yes"
    assert {"reference", "cuda", "ascend"} <= set(table), (
        "deepinfer-cuda and deepinfer-ascend must be installed"
    )
    if not torch.cuda.is_available():
        assert table["cuda"][2] == "no" and len(table["cuda"]) > 3, "an unavailable backend says why"
    if importlib.util.find_spec("torch_npu") is None:
        assert table["ascend"][2] == "no" and "torch_npu" in " ".join(table["ascend"][3:])
    if not torch.cuda.is_available() and importlib.util.find_spec("torch_npu") is None:
        assert "selected: reference" in out.stdout


def test_backends_unknown_name_lists_known(run_deepinfer: Run) -> None:
    out = run_deepinfer("backends", "--backend", "nosuch")
    assert out.returncode == 1
    assert "unknown backend 'nosuch'" in out.stdout and "reference" in out.stdout


def test_backends_unavailable_choice_says_why(run_deepinfer: Run) -> None:
    if torch.cuda.is_available():
        return  # nothing unavailable to ask for on a GPU machine
    out = run_deepinfer("backends", env={"DEEPINFER_BACKEND": "cuda"})
    assert out.returncode == 1
    assert "backend 'cuda' is not available:" in out.stdout


def test_backends_lists_a_plugin_that_fails_to_load(run_deepinfer: Run, tmp_path: Path) -> None:
    """A broken third-party package (found through its installed metadata) is listed with its
    error and the other backends still load."""
    dist = tmp_path / "broken_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[deepinfer.backends]\nbroken = broken_backend_mod\n")
    (tmp_path / "broken_backend_mod.py").write_text("raise RuntimeError('vendor runtime 9.9 not found')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    out = run_deepinfer("backends", env={"PYTHONPATH": path, "DEEPINFER_BACKEND": ""})
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table["broken"][2] == "no"
    assert "plugin failed to load: RuntimeError: vendor runtime 9.9 not found" in out.stdout
    assert table["reference"][2] == "yes"


def test_help_lists_commands(run_deepinfer: Run) -> None:
    out = run_deepinfer("--help")
    assert out.returncode == 0
    for command in ("backends", "conformance", "generate", "bench"):
        assert command in out.stdout


def test_conformance_unknown_backend_fails_clearly(run_deepinfer: Run) -> None:
    for extra in (("-q", "-x", "-k", "test_device_basics"), ()):
        out = run_deepinfer("conformance", "--backend", "nosuch", *extra)
        assert out.returncode == 2
        # one line naming the backend and the known ones, before pytest collects a case
        assert (
            out.stderr.startswith("error: unknown backend 'nosuch'; known backends: ")
            and "reference" in out.stderr
        )
        assert out.stdout == "" and "ERROR" not in out.stderr


def test_conformance_without_pytest_says_how_to_install() -> None:
    code = (
        "import sys\nsys.modules['pytest'] = None  # as if pytest were not installed\n"
        "from deepinfer.entrypoints.cli import main\nmain(['conformance', '--backend', 'reference'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    assert "deepinfer conformance needs pytest" in out.stderr and "pip install" in out.stderr

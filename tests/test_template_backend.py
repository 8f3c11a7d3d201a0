"""docs/template-backend, the package a porter starts from, installs as it is generated, is found
through its entry point, is chosen only when named (explicit_only), and passes the whole
conformance suite (verdict GREEN)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]
TEMPLATE = Path(__file__).resolve().parents[1] / "docs" / "template-backend"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip-install a fresh copy of the template into a throwaway target directory."""
    root = tmp_path_factory.mktemp("template")
    src = root / "src"
    shutil.copytree(TEMPLATE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    target = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    out = subprocess.run(
        [*cmd, "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(target.glob("deepinfer_template-0.1.0.dist-info/entry_points.txt"))
    return target


def env_for(site: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "DEEPINFER_BACKEND": ""}


def test_listed_and_chosen_only_when_named(site: Path, run_deepinfer: Run) -> None:
    out = run_deepinfer("backends", env=env_for(site))
    assert out.returncode == 0, out.stdout + out.stderr
    table = {line.split()[0]: line.split() for line in out.stdout.split("\n\n")[0].splitlines()[1:]}
    assert table["template"][1:5] == ["0.1.0", "50", "yes", "explicit"]
    assert table["reference"][4] == "fallback", "the selection column"
    assert "selected: template" not in out.stdout, "explicit_only: never chosen automatically"
    named = run_deepinfer("backends", "--backend", "template", env=env_for(site))
    assert named.returncode == 0 and "selected: template" in named.stdout, named.stdout + named.stderr
    code = (
        "from deepinfer.backend.registry import BackendRegistry\n"
        "r = BackendRegistry.discover()\nprint(r.info('template').selection)"
    )
    env = {**os.environ, **env_for(site)}
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert made.stdout.strip() == "explicit", made.stderr


def test_template_passes_conformance_as_generated(site: Path, run_deepinfer: Run) -> None:
    workers = ["-n", "2"] if importlib_util_has("xdist") else []
    out = run_deepinfer(
        "conformance", "--backend", "template", "-q", "-W", "ignore::FutureWarning", *workers,
        env=env_for(site), timeout=2400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "GREEN: " in out.stdout and "NOT GREEN" not in out.stdout, out.stdout[-3000:]
    # the verdict docs/porting.md shows as what green looks like is this run's, counts included
    doc = (TEMPLATE.parents[0] / "porting.md").read_text()
    shown = next(line for line in doc.splitlines() if line.startswith("GREEN: "))
    assert shown in out.stdout, f"docs/porting.md shows {shown!r}; the template's run:\n{out.stdout[-1500:]}"


def importlib_util_has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None

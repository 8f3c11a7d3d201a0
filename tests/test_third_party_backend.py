"""A third-party backend package, built and installed into a temporary directory, is found through
its entry point, selected by name and held to the conformance suite, which it passes; a broken
variant from the same package fails it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

Run = Callable[..., subprocess.CompletedProcess[str]]

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "deepinfer-toy"
version = "0.3.1"
requires-python = ">=3.11"
dependencies = []

[project.entry-points."deepinfer.backends"]
toy = "deepinfer_toy.plugin"

[tool.setuptools]
packages = ["deepinfer_toy"]
"""

# A port written only against the public contract: its own device part and required ops (which
# happen to call plain PyTorch), everything optional left to the contract's defaults.
PLUGIN = '''
"""deepinfer backends "toy" (correct) and "toy-broken" (two subtle bugs)."""

import dataclasses

import torch

from deepinfer.backend import (
    NO_MODIFIERS, AttentionOps, Availability, Backend, BackendInfo, BackendOptions, Capabilities,
    CollectiveOps, DeviceOps, GemmOps, KVCacheOps, MoeOps, SmallOps, hookimpl,
)
from deepinfer.reference import attention as ref_attention


class ToyDevice(DeviceOps):
    def device(self):
        return torch.device("cpu")

    def synchronize(self):
        pass

    def memory_info(self):
        return (1 << 30, 2 << 30)


class ToyAttention(AttentionOps):  # decode: the contract's default (check, then prefill)
    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):
        return ref_attention.paged_attention(q, cache, meta, scale, v_dim, modifiers)


class ToyGemm(GemmOps):
    def linear(self, x, weight, bias=None):
        y = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
        return y if bias is None else y + bias


class ToyCollectives(CollectiveOps):
    @property
    def dist_backend(self):
        return "gloo"


class BrokenAttention(ToyAttention):
    def decode(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):
        forgot = dataclasses.replace(modifiers, sinks=None)  # forgets the sinks
        return super().decode(q, cache, meta, scale=scale, v_dim=v_dim, modifiers=forgot)


class BrokenGemm(ToyGemm):
    def linear(self, x, weight, bias=None):
        return super().linear(x, weight, None)  # forgets the bias


def _create(options, broken=False):
    return Backend(
        name="toy-broken" if broken else "toy",
        options=options,
        capabilities=Capabilities(dtypes=(torch.float32, torch.bfloat16)),
        device=ToyDevice(options),
        kv_cache=KVCacheOps(options),
        attention=(BrokenAttention if broken else ToyAttention)(options),
        gemm=(BrokenGemm if broken else ToyGemm)(options),
        moe=MoeOps(options),
        collectives=ToyCollectives(options),
        small=SmallOps(options),
    )


@hookimpl
def deepinfer_backends():
    probe = lambda: Availability(True, "toy device present")  # noqa: E731
    return [
        BackendInfo("toy", "0.3.1", 1, True, probe, _create, "a third-party test backend"),
        BackendInfo("toy-broken", "0.3.1", 0, False, probe, lambda o: _create(o, True)),
    ]
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the package with pip and install it into a throwaway target directory."""
    root = tmp_path_factory.mktemp("toy")
    src = root / "src"
    (src / "deepinfer_toy").mkdir(parents=True)
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / "deepinfer_toy" / "__init__.py").write_text('"""A toy deepinfer backend."""\n')
    (src / "deepinfer_toy" / "plugin.py").write_text(PLUGIN)
    target = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    out = subprocess.run(
        [*cmd, "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / "deepinfer_toy" / "plugin.py").exists()
    assert list(target.glob("deepinfer_toy-0.3.1.dist-info/entry_points.txt"))
    return target


def env_for(site: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "DEEPINFER_BACKEND": ""}


def test_found_through_entry_point_and_selected(site: Path, run_deepinfer: Run) -> None:
    out = run_deepinfer("backends", "--backend", "toy", env=env_for(site))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.split("\n\n")[0].splitlines()[1:]}
    assert lines["toy"][1:4] == ["0.3.1", "1", "yes"]
    assert "selected: toy" in out.stdout
    if not torch.cuda.is_available():  # nothing with a higher priority is available here
        auto = run_deepinfer("backends", env=env_for(site))
        assert "selected: toy" in auto.stdout
    code = "from deepinfer.backend import get_backend\nb = get_backend('toy')\n"
    code += "print(b.name, type(b.gemm).__module__)"
    made = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env_for(site)}
    )
    assert made.stdout.split() == ["toy", "deepinfer_toy.plugin"], made.stderr


def test_toy_passes_conformance(site: Path, run_deepinfer: Run) -> None:
    out = run_deepinfer(
        "conformance", "--backend", "toy", "-q", "-rs", "-W", "ignore::FutureWarning", env=env_for(site)
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    # what it does not claim is skipped, with the reason
    assert "does not claim FP8" in out.stdout and "does not claim batch invariance" in out.stdout
    assert "does not claim torch.float16" in out.stdout


def test_broken_backend_fails_conformance(site: Path, run_deepinfer: Run) -> None:
    out = run_deepinfer(
        "conformance", "--backend", "toy-broken", "-q", "-k", "test_linear or test_decode", env=env_for(site)
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    assert any("test_linear[" in line and "-bias-" in line for line in failed), failed
    assert not any("test_linear[" in line and "-nobias-" in line for line in failed), failed
    assert any("test_decode[" in line and "sinks" in line for line in failed), failed
    assert not any("test_decode[" in line and "block_boundaries" in line for line in failed), failed

"""The CUDA backend's registration and availability probe (no GPU and no Triton kernels needed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from deepinfer.backend.registry import BackendRegistry, BackendUnavailableError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepinfer_cuda") is None, reason="deepinfer-cuda is not installed"
)

plugin = pytest.importorskip("deepinfer_cuda.plugin")


def test_registration_is_cheap() -> None:
    """Discovery imports neither Triton nor the kernels, and initialises no CUDA context."""
    code = (
        "import sys, torch\n"
        "from deepinfer.backend.registry import BackendRegistry\n"
        "r = BackendRegistry.discover()\n"
        "assert 'cuda' in r.names, r.load_errors\n"
        "r.availability('cuda')\n"
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('deepinfer_cuda.kernels')]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]


def test_probe_without_gpu_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(plugin, "_query_nvml", lambda: None)
    monkeypatch.setattr(plugin, "_query_smi", lambda: (None, "no NVIDIA driver (nvidia-smi not found)"))
    avail = plugin.probe()
    assert not avail.available and "no NVIDIA driver" in avail.reason


def test_probe_uses_interpreter_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(plugin, "_query_nvml", lambda: None)
    monkeypatch.setattr(plugin, "_query_smi", lambda: ([], ""))
    avail = plugin.probe()
    assert avail.available and avail.reason == plugin.INTERPRETER_REASON


def test_probe_rejects_old_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_query_nvml", lambda: [("NVIDIA A100-SXM4-80GB", (8, 0))])
    avail = plugin.probe()
    assert not avail.available and "8.0" in avail.reason and ">= 9.0" in avail.reason


def test_probe_accepts_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_query_nvml", lambda: [("NVIDIA H200", (9, 0))])
    avail = plugin.probe()
    assert avail.available and "H200" in avail.reason


def test_probe_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    avail = plugin.probe()
    assert not avail.available and avail.reason == "triton is not installed"


def test_smi_output_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Done:
        returncode = 0
        stdout = "NVIDIA H200, 9.0\nNVIDIA H200, 9.0\n"
        stderr = ""

    monkeypatch.setattr(plugin.shutil, "which", lambda _: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(plugin.subprocess, "run", lambda *a, **k: Done())
    gpus, why = plugin._query_smi()
    assert gpus == [("NVIDIA H200", (9, 0)), ("NVIDIA H200", (9, 0))] and why == ""


def test_selecting_cuda_without_gpu_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if plugin.probe().available:
        pytest.skip("a GPU (or the interpreter) is available here")
    registry = BackendRegistry.discover()
    with pytest.raises(BackendUnavailableError, match="cuda"):
        registry.select("cuda")
    assert registry.select().name != "cuda"

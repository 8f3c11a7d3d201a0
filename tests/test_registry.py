"""Backend discovery and selection (DESIGN section 3), with fake plugins registered directly or
through fake entry points."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from deepinfer.backend import registry as registry_module
from deepinfer.backend.hookspecs import BackendInfo, hookimpl
from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import (
    AmbiguousBackendError,
    BackendRegistry,
    BackendUnavailableError,
    UnknownBackendError,
    get_backend,
)
from deepinfer.backend.types import Availability, BackendOptions
from deepinfer.reference.backend import create_reference_backend


def info(
    name: str, priority: int = 10, available: bool = True, reason: str = "", accelerator: bool = True
) -> BackendInfo:
    def probe() -> Availability:
        return Availability(available, reason or ("found" if available else "not found"))

    def factory(options: BackendOptions) -> Backend:
        backend = create_reference_backend(options)
        backend.name = name
        return backend

    return BackendInfo(name, "1.0", priority, accelerator, probe, factory)


class FakePlugin:
    def __init__(self, *infos: BackendInfo) -> None:
        self.infos = list(infos)

    @hookimpl
    def deepinfer_backends(self) -> list[BackendInfo]:
        return self.infos


def make_registry(*infos: BackendInfo) -> BackendRegistry:
    reg = BackendRegistry()
    reg.register_plugin(FakePlugin(info("reference", priority=0, accelerator=False)), "ref")
    for i in infos:
        reg.register_plugin(FakePlugin(i), f"plugin-{i.name}")
    return reg


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_BACKEND", raising=False)


def test_auto_picks_highest_priority_available_accelerator() -> None:
    reg = make_registry(info("fast", 20), info("slow", 10), info("best", 30, available=False))
    assert reg.select().name == "fast"
    assert reg.select("auto").name == "fast"


def test_reference_is_the_last_resort() -> None:
    reg = make_registry(info("gpu", 50, available=False, reason="no driver"))
    assert reg.select().name == "reference"


def test_env_and_explicit_argument_override(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = make_registry(info("fast", 20), info("slow", 10))
    monkeypatch.setenv("DEEPINFER_BACKEND", "slow")
    assert reg.select().name == "slow"
    assert reg.select("auto").name == "slow"
    assert reg.select("reference").name == "reference"  # the argument beats the variable
    assert reg.create("reference").name == "reference"
    monkeypatch.setenv("DEEPINFER_BACKEND", "nope")
    with pytest.raises(UnknownBackendError):
        reg.select()


def test_unknown_name_lists_known_names() -> None:
    reg = make_registry(info("fast"), info("slow"))
    with pytest.raises(UnknownBackendError) as exc:
        reg.select("fsat")
    msg = str(exc.value)
    assert "'fsat'" in msg and "fast" in msg and "slow" in msg and "reference" in msg


def test_unavailable_backend_gives_reason() -> None:
    reg = make_registry(info("gpu", available=False, reason="no NVIDIA driver found"))
    with pytest.raises(BackendUnavailableError, match="'gpu' is not available: no NVIDIA driver found"):
        reg.select("gpu")
    with pytest.raises(BackendUnavailableError):
        reg.create("gpu")


def test_probe_exception_is_the_reason_and_probe_runs_once() -> None:
    calls = []

    def probe() -> Availability:
        calls.append(1)
        raise OSError("driver library libfoo.so missing")

    bad = BackendInfo("bad", "1", 5, True, probe, create_reference_backend)
    reg = make_registry(bad)
    with pytest.raises(
        BackendUnavailableError, match=re.escape("probe failed: OSError: driver library libfoo.so missing")
    ):
        reg.select("bad")
    assert reg.select().name == "reference"
    assert [e.availability.available for e in reg.entries() if e.info.name == "bad"] == [False]
    assert len(calls) == 1


def test_equal_priority_accelerators_are_an_error_naming_both() -> None:
    reg = make_registry(info("cuda-like", 100), info("npu-like", 100), info("other", 5))
    with pytest.raises(AmbiguousBackendError) as exc:
        reg.select()
    assert "'cuda-like'" in str(exc.value) and "'npu-like'" in str(exc.value)
    assert reg.select("npu-like").name == "npu-like"  # an explicit choice resolves it


def test_equal_priority_is_fine_when_one_is_unavailable() -> None:
    reg = make_registry(info("a", 100), info("b", 100, available=False))
    assert reg.select().name == "a"


def test_create_passes_options() -> None:
    reg = make_registry(info("fast"))
    backend = reg.create("fast", BackendOptions(batch_invariant=True))
    assert backend.name == "fast" and backend.options.batch_invariant
    assert all(part.batch_invariant for part in backend.parts())


@pytest.mark.parametrize(
    "plugin,error",
    [
        (object(), "implements no deepinfer_backends hook"),
        (FakePlugin(info("UPPER")), "invalid backend name"),
        (FakePlugin(info("twice"), info("twice")), "one backend name twice"),
        (FakePlugin(info("reference")), "already registered"),
    ],
)
def test_invalid_plugins_are_rejected(plugin: Any, error: str) -> None:
    reg = make_registry()
    with pytest.raises((TypeError, ValueError), match=error):
        reg.register_plugin(plugin, "bad-plugin")
    assert reg.names == ["reference"]
    reg.register_plugin(FakePlugin(info("good")), "bad-plugin")  # the failed one was unregistered
    assert reg.names == ["good", "reference"]


def test_plugin_returning_wrong_type() -> None:
    class Wrong:
        @hookimpl
        def deepinfer_backends(self) -> list[Any]:
            return [{"name": "dict"}]

    with pytest.raises(TypeError, match="not BackendInfo"):
        make_registry().register_plugin(Wrong(), "wrong")


def test_failing_plugins_are_listed_and_do_not_stop_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "broken_backend_plugin.py").write_text(
        "raise ImportError('libvendor.so: cannot open shared object')\n"
    )
    (tmp_path / "nohook_backend_plugin.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = "deepinfer.backends"
    fake = [
        EntryPoint("broken", "broken_backend_plugin", group),
        EntryPoint("missing", "no_such_module_for_deepinfer_tests", group),
        EntryPoint("nohook", "nohook_backend_plugin", group),
        EntryPoint("reference", "deepinfer.reference.plugin", group),
    ]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: fake)
    reg = BackendRegistry.discover()
    assert reg.names == ["reference"]
    assert set(reg.load_errors) == {"broken", "missing", "nohook"}
    assert "libvendor.so" in reg.load_errors["broken"]
    assert "ModuleNotFoundError" in reg.load_errors["missing"]
    assert "no deepinfer_backends hook" in reg.load_errors["nohook"]
    assert reg.select().name == "reference"
    with pytest.raises(UnknownBackendError, match="broken failed to load: ImportError"):
        reg.select("broken")


def test_installed_entry_points_include_reference() -> None:
    reg = BackendRegistry.discover()
    assert "reference" in reg.names
    ref = reg.info("reference")
    assert not ref.is_accelerator and reg.availability("reference").available
    backend = get_backend("reference")
    assert backend.name == "reference" and backend.device.device().type == "cpu"


def test_discovery_imports_no_vendor_library_and_probes_touch_no_device() -> None:
    """Registration must stay cheap: no triton / torch_npu / vendor kernels at import, and probing
    every installed backend never initialises a device context."""
    code = textwrap.dedent(
        """
        import json, sys
        from deepinfer.backend.registry import BackendRegistry
        reg = BackendRegistry.discover()
        after_import = sorted(m for m in ("triton", "torch_npu", "flash_mla", "deep_gemm", "deep_ep")
                              if m in sys.modules)
        entries = reg.entries()
        import torch
        print(json.dumps({"names": reg.names, "errors": reg.load_errors, "vendor": after_import,
                          "cuda_initialized": torch.cuda.is_initialized()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}, result["errors"]
    assert result["vendor"] == [], f"plugin registration imported {result['vendor']}"
    assert result["cuda_initialized"] is False

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
    name: str,
    priority: int = 10,
    available: bool = True,
    reason: str = "",
    accelerator: bool = True,
    explicit_only: bool = False,
) -> BackendInfo:
    def probe() -> Availability:
        return Availability(available, reason or ("found" if available else "not found"))

    def factory(options: BackendOptions) -> Backend:
        backend = create_reference_backend(options)
        backend.name = name
        return backend

    return BackendInfo(name, "1.0", priority, accelerator, probe, factory, explicit_only=explicit_only)


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


def test_any_available_candidate_beats_the_reference_whatever_its_priority() -> None:
    """Priority only orders the candidates of automatic selection: priority 0 still wins over
    the fallback."""
    reg = make_registry(info("low", priority=0))
    assert reg.select().name == "low"


def test_explicit_only_backends_are_chosen_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = make_registry(info("dev", priority=500, explicit_only=True))
    assert reg.select().name == "reference"  # never automatically, whatever its priority
    assert reg.select("dev").name == "dev"
    monkeypatch.setenv("DEEPINFER_BACKEND", "dev")
    assert reg.select().name == "dev"
    monkeypatch.delenv("DEEPINFER_BACKEND")
    # nor does it take part in ties, nor hide a lower-priority candidate
    reg = make_registry(info("a", 100), info("b", 100, explicit_only=True), info("c", 5))
    assert reg.select().name == "a"
    assert [i.name for i in reg.candidates()] == ["a", "c"]
    # named but unavailable: an error with the probe's reason, never a fallback
    reg = make_registry(info("dev", explicit_only=True, available=False, reason="driver too old"))
    with pytest.raises(BackendUnavailableError, match="driver too old"):
        reg.select("dev")


@pytest.mark.parametrize(
    "accelerator,explicit_only,name,selection",
    [
        (True, False, "gpu", "auto"),
        (True, True, "gpu", "explicit"),
        (False, False, "toy", "explicit"),
        (False, True, "toy", "explicit"),
        (False, False, "reference", "fallback"),
    ],
)
def test_selection_table(accelerator: bool, explicit_only: bool, name: str, selection: str) -> None:
    """The table of hookspecs.BackendInfo and the registry's module docstring."""
    i = info(name, accelerator=accelerator, explicit_only=explicit_only)
    assert i.selection == selection
    reg = BackendRegistry()
    reg.register_plugin(FakePlugin(i), "p")
    if name != "reference":
        reg.register_plugin(FakePlugin(info("reference", priority=0, accelerator=False)), "ref")
    assert (reg.select().name == name) == (selection in ("auto", "fallback"))
    assert reg.select(name).name == name


def test_describe_shows_the_selection_column() -> None:
    reg = make_registry(info("fast", 20), info("dev", 50, explicit_only=True), info("gone", available=False))
    reg.load_errors["broken"] = "ImportError: libfoo.so"
    table = reg.describe().splitlines()
    assert table[0].split() == ["name", "version", "priority", "available", "selection", "reason"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows["fast"][1:5] == ["1.0", "20", "yes", "auto"]
    assert rows["dev"][1:5] == ["1.0", "50", "yes", "explicit"]
    assert rows["gone"][3:5] == ["no", "auto"]
    assert rows["reference"][3:5] == ["yes", "fallback"]
    assert rows["broken"][1:5] == ["?", "-", "no", "-"] and "libfoo.so" in table[-1]


def test_equal_priority_is_fine_when_one_is_unavailable() -> None:
    reg = make_registry(info("a", 100), info("b", 100, available=False))
    assert reg.select().name == "a"


def test_create_passes_options() -> None:
    reg = make_registry(info("fast"))
    backend = reg.create("fast", BackendOptions(batch_invariant=True, max_model_len=4096))
    assert backend.name == "fast" and backend.options.batch_invariant
    assert backend.options.max_model_len == 4096
    assert all(part.batch_invariant for part in backend.parts())


@pytest.mark.parametrize("bad", [0, -5, True])
def test_options_refuse_a_max_model_len_that_is_not_a_length(bad: int) -> None:
    with pytest.raises(ValueError, match="max_model_len must be a positive int"):
        BackendOptions(max_model_len=bad)


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

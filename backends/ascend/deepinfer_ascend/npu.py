"""The one place that imports torch_npu, plus the facts the backend needs about the device.

torch_npu registers the "npu" device (PrivateUse1) and `torch.npu`; `import torch_npu` fails
with ImportError or OSError (e.g. libhccl.so not found) when the CANN toolkit is not sourced.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

from deepinfer.backend.types import Availability

# SoC versions reported by torch_npu.npu.get_soc_version(): 220-225 Atlas A2, 250-255 Atlas A3,
# 260 Ascend 950 (the first with FP8 e4m3 / MXFP8 matmuls).
SOC_A2 = range(220, 226)
SOC_A3 = range(250, 256)
SOC_950 = 260

# A torch_npu stand-in (the CPU simulation used by the tests) may set this attribute to run the
# backend on another torch device type; the real torch_npu does not have it.
DEVICE_TYPE_ATTR = "_deepinfer_device_type"


class TorchNpuUnavailable(RuntimeError):
    """torch_npu is missing or cannot be imported; the message says why."""


def load() -> ModuleType:
    """Import torch_npu (which also creates `torch.npu`) or raise TorchNpuUnavailable."""
    if importlib.util.find_spec("torch_npu") is None:
        raise TorchNpuUnavailable("torch_npu is not installed (pip install torch-npu matching your CANN)")
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError) as exc:
        hint = (
            ""
            if os.environ.get("ASCEND_HOME_PATH")
            else " (ASCEND_HOME_PATH is unset: source CANN's set_env.sh)"
        )
        raise TorchNpuUnavailable(f"import torch_npu failed: {type(exc).__name__}: {exc}{hint}") from exc


def torch_npu_ns() -> Any:
    """`torch.npu`, the device module torch_npu installs on import."""
    load()
    return torch.npu  # type: ignore[attr-defined]


def probe() -> Availability:
    """Availability without selecting a device: torch_npu importable and an NPU visible."""
    try:
        tnpu = load()
    except TorchNpuUnavailable as exc:
        return Availability(False, str(exc))
    ns = torch.npu  # type: ignore[attr-defined]
    if not ns.is_available():
        return Availability(
            False, "torch_npu imported but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES)"
        )
    # The SoC version is read in the factory: querying it here might initialise the runtime.
    version = getattr(tnpu, "__version__", "?")
    return Availability(True, f"{ns.device_count()} NPU(s), torch_npu {version}")


def soc_version() -> int:
    """torch_npu.npu.get_soc_version() as an int (see SOC_* above)."""
    return int(load().npu.get_soc_version())


def supports_fp8(soc: int) -> bool:
    """FP8 e4m3 matmuls exist from the Ascend 950 on."""
    return soc >= SOC_950


def device_type() -> str:
    """ "npu", or what a torch_npu stand-in declares."""
    return str(getattr(load(), DEVICE_TYPE_ATTR, "npu"))

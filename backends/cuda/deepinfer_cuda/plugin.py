"""Registers the `cuda` backend. Importing this module loads neither Triton nor the CUDA runtime.

The probe decides availability without creating a CUDA context in the calling process: it
looks for Triton with importlib, then asks NVML (pynvml, if installed) or `nvidia-smi` for the
GPUs and their compute capability. Under TRITON_INTERPRET=1 with no GPU the backend runs its
Triton kernels in the interpreter on CPU tensors, which is how CI checks them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from deepinfer.backend.hookspecs import BackendInfo, hookimpl
from deepinfer.backend.types import Availability, BackendOptions
from deepinfer_cuda import __version__

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend

# Compute capabilities the Triton kernels are written and tested for (Hopper; Blackwell untested).
MIN_CAPABILITY = (9, 0)
INTERPRETER_REASON = "Triton interpreter on cpu (TRITON_INTERPRET=1)"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _query_nvml() -> list[tuple[str, tuple[int, int]]] | None:
    """[(name, capability)] per GPU through NVML, or None when pynvml is missing or fails."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else str(name)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                gpus.append((name, (int(major), int(minor))))
            return gpus
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _query_smi() -> tuple[list[tuple[str, tuple[int, int]]] | None, str]:
    """GPUs through `nvidia-smi` (a subprocess: no context here), or (None, why not)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no NVIDIA driver (nvidia-smi not found, NVML unavailable)"
    try:
        res = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi failed: {exc}"
    if res.returncode != 0:
        return None, f"nvidia-smi failed: {(res.stderr or res.stdout).strip()[:200]}"
    gpus = []
    for line in res.stdout.strip().splitlines():
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        gpus.append((name.strip(), (int(major), int(minor or 0))))
    return gpus, ""


def probe() -> Availability:
    """Available when Triton is installed and a GPU of capability >= 9.0 is visible."""
    if importlib.util.find_spec("triton") is None:
        return Availability(False, "triton is not installed")
    gpus = _query_nvml()
    why = ""
    if gpus is None:
        gpus, why = _query_smi()
    if not gpus:
        if interpreting():
            return Availability(True, INTERPRETER_REASON)
        return Availability(False, why or "no NVIDIA GPU visible")
    name, cap = gpus[0]
    if cap < MIN_CAPABILITY:
        return Availability(
            False, f"{name} has compute capability {cap[0]}.{cap[1]}; the Triton kernels need >= 9.0"
        )
    return Availability(True, f"{len(gpus)} x {name} (compute capability {cap[0]}.{cap[1]})")


def _create(options: BackendOptions) -> Backend:
    from deepinfer_cuda.backend import create_cuda_backend

    return create_cuda_backend(options)


@hookimpl
def deepinfer_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name="cuda",
            version=__version__,
            priority=100,
            is_accelerator=True,
            probe=probe,
            factory=_create,
            description="NVIDIA GPUs (SM90/SM100): Triton kernels; FlashMLA / DeepGEMM when installed",
        )
    ]

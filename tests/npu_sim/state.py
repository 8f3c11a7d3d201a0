"""Installing the simulation and its global state (SoC version, device count)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer import envs


class SimError(RuntimeError):
    """A call the torch_npu documentation forbids (an NPU would reject it or misbehave)."""


def fail(op: str, constraint: str, detail: str = "") -> None:
    """Raise SimError naming the op and the documented constraint it breaks."""
    raise SimError(f"{op}: {constraint}" + (f" [{detail}]" if detail else ""))


def check(cond: bool, op: str, constraint: str, detail: str = "") -> None:
    if not cond:
        fail(op, constraint, detail)


@dataclass
class SimState:
    soc_version: int = envs.SIMULATED_SOC.default
    device_count: int = 1
    current_device: int = 0


STATE = SimState()
_saved: dict[str, object] = {}


def installed() -> bool:
    return "torch_npu" in sys.modules and getattr(sys.modules["torch_npu"], "IS_SIMULATION", False)


def install(soc_version: int | None = None, device_count: int = 1) -> ModuleType:
    """Install the fake torch_npu / torch.npu (idempotent); returns the torch_npu module."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    from . import mc2, runtime, torch_npu_sim

    STATE.soc_version = soc_version if soc_version is not None else envs.read().simulated_soc
    STATE.device_count = device_count
    if not installed():
        _saved["torch_npu"] = sys.modules.get("torch_npu")
        _saved["torch.npu"] = getattr(torch, "npu", None)
        sys.modules["torch_npu"] = torch_npu_sim
        torch.npu = runtime  # type: ignore[attr-defined]
        # gloo plays HCCL: the MC2 ops name their group by get_hccl_comm_name (tests/npu_sim/mc2.py)
        ProcessGroupGloo.get_hccl_comm_name = mc2.get_hccl_comm_name  # type: ignore[attr-defined]
    return torch_npu_sim


def uninstall() -> None:
    if not installed():
        return
    from torch._C._distributed_c10d import ProcessGroupGloo

    del ProcessGroupGloo.get_hccl_comm_name  # type: ignore[attr-defined]
    prev = _saved.pop("torch_npu", None)
    if prev is None:
        sys.modules.pop("torch_npu", None)
    else:
        sys.modules["torch_npu"] = prev  # type: ignore[assignment]
    prev_ns = _saved.pop("torch.npu", None)
    if prev_ns is None:
        if hasattr(torch, "npu"):
            delattr(torch, "npu")
    else:
        torch.npu = prev_ns  # type: ignore[attr-defined]

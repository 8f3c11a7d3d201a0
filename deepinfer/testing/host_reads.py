"""A check that code meant for graph capture reads no device tensor on the host.

A captured graph freezes every host value computed at capture: a `.item()`, `.tolist()`,
`bool(t)`, `nonzero` or boolean-mask index in the model or the engine's graph path breaks CUDA
capture (or, on a device that re-runs the function, silently reads values a real graph would
not). On the CPU, RerunGraph re-runs the captured function, so these reads pass unnoticed;
`no_host_reads` makes them visible: inside it, each such read whose nearest caller in the
deepinfer package lies outside the backend ops (deepinfer/backend, deepinfer/reference: the
reference ops are not graph-safe, and each accelerator backend overrides what its graphs
capture, checked by the conformance suite) is recorded as "file:line: what", and the block
raises HostReadError naming them on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = Path(__file__).resolve().parents[1]  # deepinfer/
_ALLOWED = (_PACKAGE / "backend", _PACKAGE / "reference")
_THIS = Path(__file__).resolve()

# ops whose result the host reads, or whose output shape depends on tensor values
_SYNCING = {
    torch.ops.aten._local_scalar_dense.default: "a scalar read (.item(), bool(), int())",
    torch.ops.aten.nonzero.default: "nonzero",
    torch.ops.aten.masked_select.default: "masked_select",
    torch.ops.aten.repeat_interleave.Tensor: "repeat_interleave by a tensor",
    torch.ops.aten._unique2.default: "unique",
}


class HostReadError(AssertionError):
    """Code on a graph path read a device tensor on the host."""


def _caller() -> str | None:
    """ "file:line" of the nearest frame in the deepinfer package (this file excluded), or None
    where that frame is a backend op's (or no deepinfer frame called)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != _THIS and path.is_relative_to(_PACKAGE):
            if any(path.is_relative_to(a) for a in _ALLOWED):
                return None
            return f"{path.relative_to(_PACKAGE.parent)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, found: list[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.found = found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        what = _SYNCING.get(func)
        masks = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        if what is None and masks:
            what = "a boolean-mask index"
        if what is not None and (where := _caller()) is not None:
            self.found.append(f"{where}: {what}")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[list[str]]:
    """Record the host reads of device tensors made inside the block outside the backend ops
    (module docstring); HostReadError on exit if there are any. Yields the list of them."""
    found: list[str] = []
    originals: dict[str, Callable[..., Any]] = {
        name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")
    }

    def watched(name: str) -> Callable[..., Any]:
        real = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (where := _caller()) is not None:
                found.append(f"{where}: .{name}()")
            return real(self, *args, **kwargs)

        return read

    for name in originals:
        setattr(torch.Tensor, name, watched(name))
    try:
        with _Watch(found):
            yield found
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)
    if found:
        raise HostReadError("host reads of device tensors on a graph path:\n  " + "\n  ".join(found))

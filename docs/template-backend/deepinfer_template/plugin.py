"""Registration: what `deepinfer backends` lists. Keep this module cheap to import: no vendor
library, no kernel compilation, no device initialisation (every installed plugin is imported
whenever deepinfer looks for backends, and a broken driver must not break the others)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from deepinfer.backend import Availability, BackendInfo, BackendOptions, hookimpl
from deepinfer_template import __version__

if TYPE_CHECKING:
    from deepinfer.backend import Backend

NAME = "template"  # REPLACE: your backend's name, [a-z][a-z0-9_-]*: what users select it by


def probe() -> Availability:
    """Whether the backend can run here, and why not, WITHOUT creating a device context in this
    process (ask the driver through a file, NVML-like library or a subprocess; import the runtime
    only when find_spec says it is installed). Exceptions become the reason it is unavailable."""
    # REPLACE: e.g. `if importlib.util.find_spec("mydev_runtime") is None: return Availability(
    # False, "mydev_runtime is not installed (pip install ...)")`, then count the devices.
    if importlib.util.find_spec("torch") is None:
        return Availability(False, "torch is not installed")
    return Availability(True, "template: plain PyTorch on the CPU")


def _create(options: BackendOptions) -> Backend:
    from deepinfer_template.backend import create_backend  # heavy imports happen here, not above

    return create_backend(options)


@hookimpl
def deepinfer_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name=NAME,
            version=__version__,
            # Among available backends chosen automatically, the highest priority wins (the
            # shipped cuda and ascend backends use 100; two equal top priorities are an error).
            priority=50,
            is_accelerator=True,
            probe=probe,
            factory=_create,
            description="template backend: plain PyTorch, replace op by op",
            # Chosen ONLY when named (backend="template" / DEEPINFER_BACKEND=template), never by
            # automatic selection: right while the port is in development or slower than the
            # reference. Set False once it is the backend users of this device should get.
            explicit_only=True,
        )
    ]

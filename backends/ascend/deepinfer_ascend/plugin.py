"""Registers the `ascend` backend through the `deepinfer.backends` entry point.

Cheap by design: nothing here imports torch_npu. The probe imports it (guarded) only when
`find_spec` says it is installed, and never selects or initialises a device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.backend.hookspecs import BackendInfo, hookimpl
from deepinfer.backend.types import Availability, BackendOptions
from deepinfer_ascend import __version__

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend


def _probe() -> Availability:
    from deepinfer_ascend.npu import probe

    return probe()


def _create(options: BackendOptions) -> Backend:
    from deepinfer_ascend.backend import create_ascend_backend

    return create_ascend_backend(options)


@hookimpl
def deepinfer_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name="ascend",
            version=__version__,
            priority=100,
            is_accelerator=True,
            probe=_probe,
            factory=_create,
            description="Huawei Ascend NPUs (Atlas A2/A3, Ascend 950) through torch_npu and CANN",
        )
    ]

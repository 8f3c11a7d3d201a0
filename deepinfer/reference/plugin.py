"""Registers the reference backend through the `deepinfer.backends` entry point, like any plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer import __version__, envs
from deepinfer.backend.hookspecs import BackendInfo, hookimpl
from deepinfer.backend.types import Availability, BackendOptions

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend


def _probe() -> Availability:
    device = envs.read().reference_device
    return Availability(True, f"plain PyTorch on {device}")


def _create(options: BackendOptions) -> Backend:
    from deepinfer.reference.backend import create_reference_backend

    return create_reference_backend(options)


@hookimpl
def deepinfer_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name="reference",
            version=__version__,
            priority=0,
            is_accelerator=False,
            probe=_probe,
            factory=_create,
            description="plain PyTorch on any torch device; defines each op's meaning",
        )
    ]

"""pluggy hook specifications for backend plugins.

A backend package exposes a module (or object) through the entry-point group
`deepinfer.backends`; deepinfer imports it, registers it with pluggy and calls the hooks below.
Importing that module must be cheap: no torch_npu, triton or vendor kernel imports, and no
device initialisation. Heavy imports belong inside `BackendInfo.factory` (and, guarded, in
`probe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from deepinfer.backend.types import Availability, BackendOptions

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend

PROJECT = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """What a plugin says about one backend it provides.

    name:           unique id users select with (`backend="cuda"`, DEEPINFER_BACKEND=cuda).
    version:        the providing distribution's version.
    priority:       among available accelerators, the highest priority is chosen automatically.
    is_accelerator: False only for backends that are a last resort (the reference backend).
    probe:          () -> Availability. Must not create a device context in the calling process;
                    exceptions it raises are reported as the reason the backend is unavailable.
    factory:        (BackendOptions) -> Backend; may import vendor libraries.
    """

    name: str
    version: str
    priority: int
    is_accelerator: bool
    probe: Callable[[], Availability]
    factory: Callable[[BackendOptions], Backend]
    description: str = ""


class BackendHookSpecs:
    """The hooks a backend plugin implements."""

    @hookspec
    def deepinfer_backends(self) -> list[BackendInfo]:  # type: ignore[empty-body]
        """Return the backends this plugin provides.

        Called once per discovery (BackendRegistry.discover), right after the plugin module is
        imported and registered; the results of all plugins are collected into the registry.
        """

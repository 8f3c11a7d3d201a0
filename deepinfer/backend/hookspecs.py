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
FALLBACK = "reference"  # the backend chosen when no candidate of automatic selection is available

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """What a plugin says about one backend it provides.

    name:           unique id users select with (`backend="cuda"`, DEEPINFER_BACKEND=cuda).
    version:        the providing distribution's version.
    priority:       among the candidates of automatic selection, the highest priority wins.
    is_accelerator: False for backends that are never picked automatically because they are not
                    a device port (the reference backend, test doubles); True for device ports.
    probe:          () -> Availability. Must not create a device context in the calling process;
                    exceptions it raises are reported as the reason the backend is unavailable.
    factory:        (BackendOptions) -> Backend; may import vendor libraries.
    description:    one line for `deepinfer backends`.
    explicit_only:  True: chosen ONLY when named (argument or DEEPINFER_BACKEND), never by
                    automatic selection, whatever its priority. For a port under development, a
                    backend that runs on the same device as another (a second CUDA backend), or
                    one that is correct but slow.

    The selection table (deepinfer.backend.registry applies it):

      is_accelerator  explicit_only  chosen when named  chosen automatically
      True            False          yes                if available, by highest priority
      True            True           yes                never
      False           any            yes                never (the reference: as the last resort)
    """

    name: str
    version: str
    priority: int
    is_accelerator: bool
    probe: Callable[[], Availability]
    factory: Callable[[BackendOptions], Backend]
    description: str = ""
    explicit_only: bool = False

    @property
    def selection(self) -> str:
        """How the registry may choose it: "auto" (a candidate of automatic selection),
        "explicit" (only when named) or "fallback" (the last resort when nothing else is
        available, the reference backend) -- the column `deepinfer backends` shows."""
        if self.is_accelerator and not self.explicit_only:
            return "auto"
        return "fallback" if self.name == FALLBACK else "explicit"


class BackendHookSpecs:
    """The hooks a backend plugin implements."""

    @hookspec
    def deepinfer_backends(self) -> list[BackendInfo]:  # type: ignore[empty-body]
        """Return the backends this plugin provides.

        Called once per discovery (BackendRegistry.discover), right after the plugin module is
        imported and registered; the results of all plugins are collected into the registry.
        """

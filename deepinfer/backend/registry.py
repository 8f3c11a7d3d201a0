"""Backend discovery (entry points + pluggy) and selection.

Selection rule (DESIGN section 3):
  1. an explicit name (argument, else DEEPINFER_BACKEND) wins, whatever the backend's flags;
     unknown names and unavailable backends are errors that list the known names or give the
     probe's reason (never a silent fallback);
  2. otherwise, among the CANDIDATES (is_accelerator=True and explicit_only=False) that are
     available, the highest priority; two available candidates of equal top priority is an
     error naming both;
  3. otherwise the reference backend, the last resort.

So, per backend (BackendInfo.selection, the `selection` column of `deepinfer backends`):

  is_accelerator  explicit_only  selection   chosen when named  chosen automatically
  True            False          auto        yes                if available and of highest priority
  True            True           explicit    yes                never
  False           any            explicit    yes                never
  False (reference)              fallback    yes                when no candidate is available

Priority only orders the candidates: an available candidate of priority 1 beats the reference,
and a backend that must not be picked by itself says explicit_only=True.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, cast

import pluggy

from deepinfer import envs
from deepinfer.backend.hookspecs import ENTRY_POINT_GROUP, FALLBACK, PROJECT, BackendHookSpecs, BackendInfo
from deepinfer.backend.types import Availability, BackendOptions

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend

ENV_VAR = envs.BACKEND.name
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


class BackendError(RuntimeError):
    """Base class of the backend-selection errors a user can cause."""


class UnknownBackendError(BackendError):
    pass


class BackendUnavailableError(BackendError):
    pass


class AmbiguousBackendError(BackendError):
    pass


@dataclass(frozen=True)
class BackendEntry:
    """One row of `deepinfer backends`: a discovered backend and its probe result."""

    info: BackendInfo
    availability: Availability


class BackendRegistry:
    """Backends found through the `deepinfer.backends` entry points (or registered directly)."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(BackendHookSpecs)
        self._infos: dict[str, BackendInfo] = {}
        self._availability: dict[str, Availability] = {}
        self.load_errors: dict[str, str] = {}  # plugin name -> why it failed to load

    @classmethod
    def discover(cls, group: str = ENTRY_POINT_GROUP) -> BackendRegistry:
        """Import every plugin of the entry-point group. A plugin that fails to import or to
        register is recorded in `load_errors` and never stops the others."""
        registry = cls()
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            try:
                registry.register_plugin(ep.load(), ep.name)
            except Exception as exc:
                registry.load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
        return registry

    def register_plugin(self, plugin: object, name: str) -> None:
        """Register a plugin object (module or instance) and collect the backends it provides."""
        self._pm.register(plugin, name=name)
        try:
            impls = [i for i in self._pm.hook.deepinfer_backends.get_hookimpls() if i.plugin is plugin]
            if not impls:
                raise TypeError(f"plugin {name!r} implements no deepinfer_backends hook")
            infos: list[BackendInfo] = []
            for impl in impls:
                infos.extend(cast("list[BackendInfo]", impl.function()))
            for info in infos:
                self._validate(info, name)
            if len({i.name for i in infos}) != len(infos):
                raise ValueError(f"plugin {name!r} returned one backend name twice")
        except Exception:
            self._pm.unregister(plugin)
            raise
        for info in infos:
            self._infos[info.name] = info

    def _validate(self, info: BackendInfo, plugin: str) -> None:
        if not isinstance(info, BackendInfo):
            raise TypeError(f"plugin {plugin!r} returned {type(info).__name__}, not BackendInfo")
        if not _NAME.match(info.name):
            raise ValueError(f"plugin {plugin!r}: invalid backend name {info.name!r}")
        if info.name in self._infos:
            raise ValueError(f"plugin {plugin!r}: backend {info.name!r} is already registered")
        if not callable(info.probe) or not callable(info.factory):
            raise TypeError(f"plugin {plugin!r}: backend {info.name!r} needs callable probe and factory")
        if not isinstance(info.priority, int) or isinstance(info.priority, bool):
            raise TypeError(f"plugin {plugin!r}: backend {info.name!r} priority must be an int")

    @property
    def names(self) -> list[str]:
        return sorted(self._infos)

    def info(self, name: str) -> BackendInfo:
        if name not in self._infos:
            known = ", ".join(self.names) or "none"
            failed = "".join(f"\n  {n} failed to load: {e}" for n, e in sorted(self.load_errors.items()))
            raise UnknownBackendError(f"unknown backend {name!r}; known backends: {known}{failed}")
        return self._infos[name]

    def availability(self, name: str) -> Availability:
        """The backend's probe result, computed once. A probe that raises means unavailable."""
        if name not in self._availability:
            info = self.info(name)
            try:
                result = info.probe()
            except Exception as exc:
                result = Availability(False, f"probe failed: {type(exc).__name__}: {exc}")
            self._availability[name] = result
        return self._availability[name]

    def entries(self) -> list[BackendEntry]:
        return [BackendEntry(self._infos[n], self.availability(n)) for n in self.names]

    def candidates(self) -> list[BackendInfo]:
        """The available candidates of automatic selection (see the module docstring), highest
        priority first."""
        found = [
            self._infos[n]
            for n in self.names
            if self._infos[n].selection == "auto" and self.availability(n).available
        ]
        return sorted(found, key=lambda i: -i.priority)

    def describe(self) -> str:
        """The table `deepinfer backends` prints: name, version, priority, available, selection
        (auto / explicit / fallback, see the module docstring) and the probe's reason; plugins
        that failed to load are listed with their error."""
        rows = [("name", "version", "priority", "available", "selection", "reason")]
        for entry in self.entries():
            info, avail = entry.info, entry.availability
            rows.append(
                (
                    info.name, info.version, str(info.priority), "yes" if avail.available else "no",
                    info.selection, avail.reason,
                )
            )  # fmt: skip
        for plugin, error in sorted(self.load_errors.items()):
            rows.append((plugin, "?", "-", "no", "-", f"plugin failed to load: {error}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)

    def select(self, name: str | None = None) -> BackendInfo:
        """Apply the selection rule; `name` None or "auto" defers to DEEPINFER_BACKEND, then auto."""
        if name in (None, "auto"):
            name = envs.read().backend or "auto"
        if name != "auto":
            info = self.info(name)
            avail = self.availability(name)
            if not avail.available:
                raise BackendUnavailableError(f"backend {name!r} is not available: {avail.reason}")
            return info
        candidates = self.candidates()
        if candidates:
            top = candidates[0].priority
            best = [i for i in candidates if i.priority == top]
            if len(best) > 1:
                both = " and ".join(repr(i.name) for i in best)
                raise AmbiguousBackendError(
                    f"backends {both} are both available with priority {top}; choose one with "
                    f"backend=NAME or {ENV_VAR}=NAME"
                )
            return best[0]
        return self.select(FALLBACK)

    def create(self, name: str | None = None, options: BackendOptions | None = None) -> Backend:
        """Select a backend and build it."""
        return self.select(name).factory(options or BackendOptions())


def get_backend(name: str | None = None, options: BackendOptions | None = None) -> Backend:
    """Discover the installed backends and create the selected one (see module docstring)."""
    return BackendRegistry.discover().create(name, options)

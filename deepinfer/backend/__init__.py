"""The backend contract: types, op interfaces, plugin hooks and the registry."""

from deepinfer.backend.hookspecs import BackendInfo, hookimpl
from deepinfer.backend.ops import (
    AttentionOps,
    Backend,
    CollectiveOps,
    DeviceOps,
    GemmOps,
    GraphRunner,
    MoeOps,
    SmallOps,
)
from deepinfer.backend.registry import (
    BackendError,
    BackendRegistry,
    BackendUnavailableError,
    UnknownBackendError,
    get_backend,
)
from deepinfer.backend.types import (
    AttentionMetadata,
    Availability,
    BackendOptions,
    Capabilities,
    KVCacheSpec,
    PagedKVCache,
    RouterConfig,
)

__all__ = [
    "AttentionMetadata",
    "AttentionOps",
    "Availability",
    "Backend",
    "BackendError",
    "BackendInfo",
    "BackendOptions",
    "BackendRegistry",
    "BackendUnavailableError",
    "Capabilities",
    "CollectiveOps",
    "DeviceOps",
    "GemmOps",
    "GraphRunner",
    "KVCacheSpec",
    "MoeOps",
    "PagedKVCache",
    "RouterConfig",
    "SmallOps",
    "UnknownBackendError",
    "get_backend",
    "hookimpl",
]

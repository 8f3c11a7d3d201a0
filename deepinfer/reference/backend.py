"""The reference backend's parts: the contract's defaults plus its required ops, in plain PyTorch.

Runs on the CPU by default; DEEPINFER_REFERENCE_DEVICE=cuda:0 (any torch device string) runs the
same code elsewhere, e.g. as the baseline in GPU benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer import envs
from deepinfer.backend.host import host_memory_info
from deepinfer.backend.ops import (
    AttentionOps,
    Backend,
    CollectiveOps,
    DeviceOps,
    GemmOps,
    GraphRunner,
    KVCacheOps,
    MoeOps,
    RerunGraph,
    SmallOps,
)
from deepinfer.backend.types import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    Capabilities,
    PagedKVCache,
)
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import gemm as ref_gemm

DEVICE_ENV = envs.REFERENCE_DEVICE.name


class ReferenceDevice(DeviceOps):
    graph_lengths_on_device = True  # a replay reruns the function, lengths and all

    def __init__(self, options: BackendOptions, device: torch.device) -> None:
        super().__init__(options)
        self._device = device

    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).synchronize()

    def memory_info(self) -> tuple[int, int]:
        if self._device.type == "cpu":
            return host_memory_info()
        free, total = torch.get_device_module(self._device).mem_get_info(self._device)
        return int(free), int(total)

    def capture_graph(
        self, fn: Callable[[], object], share_with: GraphRunner | None = None
    ) -> GraphRunner | None:
        """Emulated graphs: replay runs `fn` again (see RerunGraph)."""
        return RerunGraph(fn)


class ReferenceAttention(AttentionOps):
    def prefill(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
    ) -> torch.Tensor:
        return ref_attention.paged_attention(q, cache, meta, scale, v_dim, modifiers)


class ReferenceGemm(GemmOps):
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return ref_gemm.linear(x, weight, bias, self.batch_invariant)


class ReferenceCollectives(CollectiveOps):
    def __init__(self, options: BackendOptions, device: torch.device) -> None:
        super().__init__(options)
        self._dist_backend = "gloo" if device.type == "cpu" else "nccl" if device.type == "cuda" else "gloo"

    @property
    def dist_backend(self) -> str:
        return self._dist_backend


CAPABILITIES = Capabilities(
    dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
    supports_fp8=True,  # emulated: FP8 weights are dequantised to float32 inside each op
    supports_batch_invariant=True,
    supports_graphs=True,  # emulated (RerunGraph): a replay runs the captured function again
    supports_fp8_kv_cache=True,  # FP8 latent rows dequantised to float32 before the attention
)


def reference_device(options: BackendOptions) -> torch.device:
    device = torch.device(envs.read().reference_device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, options.device_index)
    return device


def create_reference_backend(options: BackendOptions | None = None) -> Backend:
    options = options or BackendOptions()
    device = reference_device(options)
    return Backend(
        name="reference",
        options=options,
        # on the CPU, host memory is the device's: Engram tables there are read in place
        capabilities=dataclasses.replace(CAPABILITIES, reads_host_tables=device.type == "cpu"),
        device=ReferenceDevice(options, device),
        kv_cache=KVCacheOps(options),
        attention=ReferenceAttention(options),
        gemm=ReferenceGemm(options),
        moe=MoeOps(options),
        collectives=ReferenceCollectives(options, device),
        small=SmallOps(options),
    )

"""The collectives part: torch.distributed over NCCL (gloo under the interpreter); the MoE
exchange through DeepEP where it applies (deepinfer_cuda.deepep)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.backend.ops import CollectiveOps
from deepinfer.backend.types import BackendOptions


class CudaCollectives(CollectiveOps):
    def __init__(self, options: BackendOptions, device: torch.device) -> None:
        super().__init__(options)
        self._dist_backend = "nccl" if device.type == "cuda" else "gloo"

    @property
    def dist_backend(self) -> str:
        return self._dist_backend

    def expert_exchange(
        self, num_experts: int, x: torch.Tensor, top_k: int
    ) -> Callable[..., torch.Tensor] | None:
        """DeepEP's normal kernels when they apply (deepinfer_cuda.deepep), else None."""
        from deepinfer_cuda.deepep import deepep_exchange

        return deepep_exchange(num_experts, x)

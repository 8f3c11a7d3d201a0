"""The collectives part: torch.distributed over NCCL (gloo under the interpreter); the MoE
exchange through DeepEP's EPBuffer when DEEPINFER_CUDA_EXPERT_EXCHANGE=deepep
(deepinfer_cuda.deepep)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer import envs
from deepinfer.backend.ops import CollectiveOps
from deepinfer.backend.types import BackendOptions


class CudaCollectives(CollectiveOps):
    def __init__(self, options: BackendOptions, device: torch.device, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self._dist_backend = "nccl" if device.type == "cuda" else "gloo"
        self._deepep = None
        if env.cuda_expert_exchange == "DEEPEP":  # asked for: an error here if DeepEP is missing
            from deepinfer_cuda.deepep import DeepEPExchanges, load_deep_ep

            self._deepep = DeepEPExchanges(load_deep_ep(), env.cuda_deepep_tokens, options.batch_invariant)

    @property
    def dist_backend(self) -> str:
        return self._dist_backend

    def expert_exchange(
        self, num_experts: int, x: torch.Tensor, top_k: int
    ) -> Callable[..., torch.Tensor] | None:
        """DeepEP's EPBuffer when selected (ValueError where it cannot serve the layer), else None."""
        return None if self._deepep is None else self._deepep.get(num_experts, x, top_k)

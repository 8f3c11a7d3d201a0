"""Norms, rotary embedding and SwiGLU on torch_npu fused ops.

rms_norm        npu_rms_norm(x, gamma, epsilon) -> (y, rstd)
add_rms_norm    npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)
rope            npu_rotary_mul(x (T, H, R) "TND", r1 = cos (T, 1, R), r2 = sin (T, 1, R),
                rotary_mode "half" | "interleave"); R < 896 and even
silu_and_mul    npu_swiglu(x, dim=-1)
clamped_silu_and_mul  npu_clipped_swiglu(x, dim=-1, alpha=1.0, limit, bias=0.0, interleaved=False):
                min(A, limit) * sigmoid(1.0 * min(A, limit)) * (clamp(B, -limit, limit) + 0.0),
                DeepSeek-V4's clamped SwiGLU exactly (the defaults are GPT-OSS's: pass all four)
DeepSeek-V4's gated_pool and hc_pre / hc_post / hc_head keep the contract's reference
definitions (torch_npu has no such op; see docs/ascend.md), as do DeepSeek-V4.1's
engram_lookup and engram_gate.
Token bitmask and sampling keep the contract's torch implementations (aten ops on the NPU).
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend.ops import SmallOps
from deepinfer.backend.types import BackendOptions

MAX_ROPE_DIM = 896  # npu_rotary_mul: D < 896


class AscendSmall(SmallOps):
    def __init__(self, options: BackendOptions, tnpu: Any) -> None:
        super().__init__(options)
        self._tnpu = tnpu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y: torch.Tensor
        y, _ = self._tnpu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y: torch.Tensor
        h: torch.Tensor
        y, _, h = self._tnpu.npu_add_rms_norm(x, residual.to(x.dtype), weight.to(x.dtype), epsilon=eps)
        return y, h

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        t, _, r = x.shape
        if r % 2 or r >= MAX_ROPE_DIM:
            raise NotImplementedError(f"npu_rotary_mul needs an even rotary dim < {MAX_ROPE_DIM}, got {r}")
        if t == 0:
            return x.clone()
        half = r // 2
        cs = cos_sin_cache.index_select(0, positions.long())  # (T, R) = [cos | sin]
        cos, sin = cs[:, :half], cs[:, half:]
        if interleaved:  # pairs (2i, 2i+1) rotate by f_i
            r1, r2 = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:  # pairs (i, i + R/2)
            r1, r2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        r1 = r1.to(x.dtype).unsqueeze(1)  # (T, 1, R), the "T1D" layout
        r2 = r2.to(x.dtype).unsqueeze(1)
        mode = "interleave" if interleaved else "half"
        y: torch.Tensor = self._tnpu.npu_rotary_mul(x.contiguous(), r1, r2, rotary_mode=mode)
        return y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
        if x.numel() == 0:
            return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
        y: torch.Tensor = self._tnpu.npu_swiglu(x, dim=-1)
        return y

    def clamped_silu_and_mul(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"clamped_silu_and_mul needs an even last dim, got {x.shape[-1]}")
        if x.numel() == 0:  # the op takes no empty tensor
            return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
        y: torch.Tensor = self._tnpu.npu_clipped_swiglu(
            x.contiguous(), dim=-1, alpha=1.0, limit=float(limit), bias=0.0, interleaved=False
        )
        return y

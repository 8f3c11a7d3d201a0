"""Optional vendor kernels (FlashMLA, DeepGEMM), used through the same contract when installed.

Each adapter returns None when its library is missing or the GPU or the call does not fit; the
caller then runs the Triton kernel, which computes the same op. With DEEPINFER_CUDA_VENDOR=0 (read
when the backend is created) the backend's parts never call them.
None of these libraries was installed on the GPUs this backend was measured on, so this code
has not run: it follows the libraries' documented APIs and the conformance suite is what must
vouch for it on a machine that has them. DeepEP serves collectives.expert_exchange
(deepinfer_cuda.deepep).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType
from typing import Any

import torch

from deepinfer.backend.types import AttentionMetadata

_broken: set[str] = set()


@functools.cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def _disable(name: str, exc: Exception) -> None:
    _broken.add(name)
    warnings.warn(f"{name} call failed ({type(exc).__name__}: {exc}); using the Triton kernel", stacklevel=3)


def flash_mla_available() -> bool:
    """Whether flash_mla_decode may serve a call (FlashMLA installed, not broken)."""
    return _module("flash_mla") is not None and "flash_mla" not in _broken


def flash_mla_decode(
    q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, *, scale: float, v_dim: int
) -> torch.Tensor | None:
    """FlashMLA dense decode: bf16/fp16, block size 64, D = 576, Dv = 512; no window/sinks/top-k."""
    mod = _module("flash_mla")
    fits = q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype and kv.shape[1] == 64
    if (
        mod is None
        or "flash_mla" in _broken
        or not fits
        or q.shape[-1] != 576
        or v_dim != 512
        or not _sm90(q)
    ):
        return None
    try:
        md, splits = mod.get_mla_metadata(meta.seq_lens, q.shape[1], 1)
        out, _ = mod.flash_mla_with_kvcache(
            q.unsqueeze(1), kv.unsqueeze(2), meta.block_tables, meta.seq_lens, v_dim, md, splits,
            softmax_scale=scale, causal=True,
        )  # fmt: skip
    except (TypeError, RuntimeError) as exc:
        _disable("flash_mla", exc)
        return None
    result: torch.Tensor = out.squeeze(1)
    return result


def deep_gemm_fp8(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """DeepGEMM FP8 GEMM (1x128 / 128x128 scales, bf16 output) on SM90."""
    mod: Any = _module("deep_gemm")
    m, k = xq.shape
    n = weight.shape[0]
    fits = out_dtype == torch.bfloat16 and m > 0 and k % 128 == 0 and n % 128 == 0
    if mod is None or "deep_gemm" in _broken or not fits or not _sm90(xq):
        return None
    out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    try:
        if hasattr(mod, "fp8_gemm_nt"):
            mod.fp8_gemm_nt((xq, x_scale), (weight, ws), out)
        else:
            xs = mod.get_col_major_tma_aligned_tensor(x_scale)
            mod.gemm_fp8_fp8_bf16_nt((xq, xs), (weight, ws), out)
    except (TypeError, RuntimeError, AttributeError) as exc:
        _disable("deep_gemm", exc)
        return None
    return out

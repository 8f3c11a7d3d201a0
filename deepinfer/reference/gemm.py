"""Reference GEMMs: float matmuls, FP8 e4m3 block-scaled products and MXFP4 expert products
(dequantise, then float32)."""

from __future__ import annotations

import torch

# The format (constants, weight quantisation, dequantisation) lives in the contract; re-exported
# here because the reference functions below are written in its terms.
from deepinfer.backend import fp4
from deepinfer.backend.fp8 import (
    AMAX_EPS,
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_act,
    dequantize_weight,
    expand_block_scale,
    quantize_weight,
)

__all__ = [
    "AMAX_EPS",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "batched_linear",
    "check_fp8_operands",
    "dequantize_act",
    "dequantize_weight",
    "expand_block_scale",
    "fp8_gemm",
    "group_bounds",
    "grouped_gemm",
    "grouped_gemm_fp4",
    "grouped_gemm_fp8",
    "linear",
    "mm",
    "quantize_fp8",
    "quantize_weight",
]


def mm(x: torch.Tensor, w_t: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """x (M, K) @ w_t (K, N). Batch-invariant mode computes row by row, so a row's bits never
    depend on M (a GEMM library may pick a different kernel, and reduction order, per M)."""
    if not batch_invariant or x.shape[0] <= 1:
        return x @ w_t
    return torch.cat([x[i : i + 1] @ w_t for i in range(x.shape[0])]) if x.shape[0] else x @ w_t


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool
) -> torch.Tensor:
    y = mm(x, weight.t(), batch_invariant)
    return y if bias is None else y + bias


def batched_linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    if not batch_invariant:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.stack([mm(x[g], weight[g].t(), True) for g in range(x.shape[0])])


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    pad = -k % block
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, (k + pad) // block, block)
    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_EPS)
    scale = amax / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, k + pad)[:, :k]
    return q.to(FP8_DTYPE), scale


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    batch_invariant: bool = False,
    block: int = FP8_BLOCK,
) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T with `block` x `block` weight scales and 1 x
    `block` activation scales (the shapes are checked: a scale tensor of another block size would
    otherwise be read as a wrong one)."""
    check_fp8_operands(xq, x_scale, weight, weight_scale, block)
    x = dequantize_act(xq, x_scale, block)
    w = dequantize_weight(weight, weight_scale, block)
    return mm(x, w.t(), batch_invariant).to(out_dtype)


def check_fp8_operands(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int
) -> None:
    """ValueError unless x_scale is (M, ceil(K/block)) and weight_scale (..., ceil(N/block),
    ceil(K/block)) for xq (M, K) and weight (..., N, K)."""
    m, k = xq.shape
    n = weight.shape[-2]
    if weight.shape[-1] != k:
        raise ValueError(f"fp8_gemm: activations have K={k} but the weight has K={weight.shape[-1]}")
    kb = -(-k // block)
    if tuple(x_scale.shape) != (m, kb):
        raise ValueError(
            f"fp8_gemm: x_scale must be (M, ceil(K/{block})) = {(m, kb)}, got {tuple(x_scale.shape)}"
        )
    want = (*weight.shape[:-2], -(-n // block), kb)
    if tuple(weight_scale.shape) != want:
        raise ValueError(
            f"fp8_gemm: weight_scale of {block} x {block} blocks must be {want}, "
            f"got {tuple(weight_scale.shape)}"
        )


def group_bounds(group_sizes: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(group, start, end)] for the non-empty groups of rows sorted by group."""
    bounds, start = [], 0
    for g, n in enumerate(group_sizes.tolist()):
        if n:
            bounds.append((g, start, start + n))
        start += n
    return bounds


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, batch_invariant: bool = False
) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    for g, s, e in group_bounds(group_sizes):
        out[s:e] = mm(x[s:e], weight[g].t(), batch_invariant)
    return out


def grouped_gemm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    batch_invariant: bool = False,
    block: int = FP8_BLOCK,
) -> torch.Tensor:
    xq, xs = quantize_fp8(x, block)
    xd = dequantize_act(xq, xs, block)
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    for g, s, e in group_bounds(group_sizes):
        w = dequantize_weight(weight[g], weight_scale[g], block)
        out[s:e] = mm(xd[s:e], w.t(), batch_invariant).to(x.dtype)
    return out


def grouped_gemm_fp4(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """MXFP4 experts: each non-empty group's weights dequantised to float32, x in float32 (not
    quantised), a float32 product, the result in x's dtype."""
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    for g, s, e in group_bounds(group_sizes):
        w = fp4.dequantize_weight(weight[g], weight_scale[g])
        out[s:e] = mm(x[s:e].float(), w.t(), batch_invariant).to(x.dtype)
    return out

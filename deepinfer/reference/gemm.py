"""Reference GEMMs: float matmuls and FP8 e4m3 block-scaled products (dequantise, then float32)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
_AMAX_EPS = 1e-10  # keeps all-zero blocks finite: scale = eps / 448, values 0


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


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """(..., ceil(rows/b), ceil(cols/b)) block scales -> (..., rows, cols) elementwise scales."""
    s = scale.repeat_interleave(block, dim=-2)[..., :rows, :]
    return s.repeat_interleave(block, dim=-1)[..., :cols]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., N, K) e4m3 with (..., ceil(N/128), ceil(K/128)) scales -> float32."""
    return weight.float() * expand_block_scale(scale.float(), weight.shape[-2], weight.shape[-1])


def quantize_weight(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (e4m3 (N, K), float32 scale (ceil(N/b), ceil(K/b))), DeepSeek's format."""
    n, k = weight.shape
    pn, pk = -n % block, -k % block
    w = torch.nn.functional.pad(weight.float(), (0, pk, 0, pn))
    blocks = w.view(w.shape[0] // block, block, w.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=_AMAX_EPS)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(w)[:n, :k]
    return q.to(FP8_DTYPE), scale


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    pad = -k % block
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, (k + pad) // block, block)
    amax = xf.abs().amax(dim=-1).clamp(min=_AMAX_EPS)
    scale = amax / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, k + pad)[:, :k]
    return q.to(FP8_DTYPE), scale


def dequantize_act(xq: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    k = xq.shape[-1]
    return xq.float() * scale.float().repeat_interleave(block, dim=-1)[..., :k]


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    batch_invariant: bool = False,
) -> torch.Tensor:
    x = dequantize_act(xq, x_scale)
    w = dequantize_weight(weight, weight_scale)
    return mm(x, w.t(), batch_invariant).to(out_dtype)


def _group_bounds(group_sizes: torch.Tensor) -> list[tuple[int, int, int]]:
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
    for g, s, e in _group_bounds(group_sizes):
        out[s:e] = mm(x[s:e], weight[g].t(), batch_invariant)
    return out


def grouped_gemm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    xq, xs = quantize_fp8(x)
    xd = dequantize_act(xq, xs)
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    for g, s, e in _group_bounds(group_sizes):
        w = dequantize_weight(weight[g], weight_scale[g])
        out[s:e] = mm(xd[s:e], w.t(), batch_invariant).to(x.dtype)
    return out

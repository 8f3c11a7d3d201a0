# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""Bidirectional varlen attention (attention.varlen_attention: a vision tower's images).

A program owns BLOCK_M query rows of one segment and one head (grid: row blocks of the longest
segment, segments, heads) and walks that segment's keys in BLOCK_N tiles with the online
softmax (float32 running max, sum and output):

    S = Q @ K^T * scale         (BLOCK_M, BLOCK_N), keys past the segment's end masked
    O = O * exp(m - m') + exp(S - m') @ V

No causal mask and no split over keys: a segment is one image (at most a few thousand
patches), and every row sees every key of its segment. Row blocks past a segment's end exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.kernels.common import mma, next_pow2, to_dtype

BLOCK_M, BLOCK_N = 64, 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["sq_t", "sk_t", "sv_t"])
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
    scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, seg, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seg).to(tl.int64)
    n = tl.load(cu_ptr + seg + 1).to(tl.int64) - start
    if pid_m * BLOCK_M >= n:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (start + rows)[:, None] * sq_t + h * sq_h + d[None, :],
        mask=rmask[:, None] & (d < D)[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for kb in range(0, n, BLOCK_N):
        cols = kb + tl.arange(0, BLOCK_N)
        cmask = cols < n
        k = tl.load(
            k_ptr + (start + cols)[None, :] * sk_t + h * sk_h + d[:, None],
            mask=(d < D)[:, None] & cmask[None, :],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        s = mma(q, k, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE) * scale
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + (start + cols)[:, None] * sv_t + h * sv_h + dv[None, :],
            mask=cmask[:, None] & (dv < DV)[None, :],
            other=0.0,
        )
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (start + rows)[:, None] * so_t + h * so_h + dv[None, :],
        to_dtype(out, o_ptr.dtype.element_ty),
        mask=rmask[:, None] & (dv < DV)[None, :],
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """The contract's varlen_attention: q, k (T, H, D), v (T, H, Dv) with stride(-1) == 1,
    cu_seqlens (S + 1,) int32 -> (T, H, Dv) in q's dtype."""
    t, h, d = q.shape
    dv = v.shape[-1]
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"varlen_attention: q, k, v of one dtype in {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape != (t, h, d) or v.shape[:2] != (t, h):
        raise ValueError(
            f"varlen_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("varlen_attention: q, k and v need stride(-1) == 1")
    out = torch.empty((t, h, dv), dtype=q.dtype, device=q.device)
    segments = cu_seqlens.numel() - 1
    if t == 0 or max_seqlen <= 0 or segments <= 0:
        return out.zero_()
    cu = cu_seqlens.to(torch.int32)
    grid = (triton.cdiv(max_seqlen, BLOCK_M), segments, h)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale,
        D=d, DV=dv, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out

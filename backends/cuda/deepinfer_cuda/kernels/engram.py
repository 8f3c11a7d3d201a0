# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""DeepSeek-V4.1's Engram kernels: the hashed n-gram lookup (hash and row gather in one launch)
and the gate into the residual streams. Meanings: deepinfer.backend.ops SmallOps.engram_lookup,
engram_gate (reference: deepinfer.reference.engram).

Symbols: T tokens, G max n-gram size, C table heads ((G - 1) * Hg), Dh a row's width, N
streams, Dm hidden. Each program owns one (token, head) row or one (token, stream) row: no
reduction crosses rows (batch-invariant by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.reference.engram import check_fp8_rows, engram_offsets
from deepinfer_cuda.kernels.common import INTERPRET, next_pow2, to_dtype


@triton.jit
def _lookup_kernel(
    ids_ptr, mult_ptr, size_ptr, offset_ptr, table_ptr, scale_ptr, out_ptr, DH, stride_ids, stride_table,
    stride_scale, stride_out, HEADS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """FP8: e4m3 rows times 2^(byte - 127) per 32 values, written in the output's dtype."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = c // HEADS + 2  # the head's n-gram size: tokens p .. p - n + 1
    mix = tl.load(ids_ptr + t * stride_ids) * tl.load(mult_ptr)
    for r in tl.static_range(1, G):
        term = tl.load(ids_ptr + t * stride_ids + r) * tl.load(mult_ptr + r)
        mix = tl.where(r < n, mix ^ term, mix)
    size = tl.load(size_ptr + c)
    rem = mix % size
    rem = tl.where(rem < 0, rem + size, rem)  # a non-negative remainder (torch.remainder's)
    row = rem + tl.load(offset_ptr + c)
    cols = tl.arange(0, BLOCK)
    vals = tl.load(table_ptr + row * stride_table + cols, mask=cols < DH)
    if FP8:
        byte = tl.load(scale_ptr + row * stride_scale + cols // 32, mask=cols < DH, other=127)
        # 2^(byte - 127) written as float32 bits (byte 0: 2^-127, a subnormal)
        scale = tl.where(byte == 0, 2.0**-127, (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True))
        vals = to_dtype(vals.to(tl.float32) * scale, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + c * DH + cols, vals, mask=cols < DH)


def engram_lookup(
    ngram_ids: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(T, G) int64 ids -> (T, C * Dh) rows in table's dtype on the ids' device; one program per
    (token, head). The table may be in pinned host memory: the kernel reads the rows it needs
    through their mapped address (a zero-copy gather over the bus, no host sync: graph-safe).
    FP8 rows (e4m3 table, (R, Dh / 32) UE8M0 scales, both where the table is): dequantised in
    the kernel into `dtype` (default float32), one byte a value over the bus."""
    t, g = ngram_ids.shape
    c = sizes.numel()
    if g < 2 or c % (g - 1) or multipliers.shape != (g,):
        raise ValueError(
            f"engram_lookup: ids {tuple(ngram_ids.shape)}, multipliers {tuple(multipliers.shape)}, "
            f"{c} heads: need G >= 2 multipliers and a multiple of G - 1 heads"
        )
    dh = table.shape[1]
    ids = ngram_ids.to(torch.int64).contiguous()
    sizes64 = sizes.to(torch.int64).contiguous()
    offsets = engram_offsets(sizes64)
    if table.stride(-1) != 1:
        raise ValueError("engram_lookup needs a table with contiguous rows (it may be host memory: no copy)")
    for what, x in (("table", table), ("scales", scales)):
        if x is not None and x.device != ids.device and not (INTERPRET or x.is_pinned()):
            raise ValueError(
                f"engram_lookup: a {what} on {x.device} must be pinned host memory or on {ids.device}"
            )
    if scales is not None:
        check_fp8_rows(table, scales, "engram_lookup")
        if scales.stride(-1) != 1:
            raise ValueError("engram_lookup needs scales with contiguous rows (they may be host memory)")
    out_dtype = table.dtype if scales is None else dtype or torch.float32
    out = torch.empty((t, c * dh), dtype=out_dtype, device=ids.device)
    if t and c and dh:
        _lookup_kernel[(t, c)](
            ids, multipliers.to(torch.int64).contiguous(), sizes64, offsets, table,
            table if scales is None else scales, out, dh, ids.stride(0), table.stride(0),
            0 if scales is None else scales.stride(0), out.stride(0), HEADS=c // (g - 1), G=g,
            BLOCK=next_pow2(dh), FP8=scales is not None, num_warps=1,
        )  # fmt: skip
    return out


@triton.jit
def _gate_kernel(
    x_ptr, kv_ptr, w_ptr, out_ptr, D, N, eps, clamp, stride_xt, stride_xn, stride_kt, stride_kn, stride_w,
    stride_ot, stride_on, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + t * stride_xt + n * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(kv_ptr + t * stride_kt + n * stride_kn + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(kv_ptr + t * stride_kt + N * stride_kn + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + n * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    rx = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    rk = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) / D + eps)
    a = tl.sum(x * rx * w * (k * rk), axis=0) / tl.sqrt(D.to(tl.float32))
    root = tl.sqrt(tl.maximum(tl.abs(a), clamp))
    s = tl.where(a > 0, root, tl.where(a < 0, -root, 0.0))
    g = 1.0 / (1.0 + tl.exp(-s))
    out = to_dtype(x + g * v, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + n * stride_on + cols, out, mask=mask)


def engram_gate(
    streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float, clamp: float = 1e-6
) -> torch.Tensor:
    """streams (T, N, Dm), kv (T, N + 1, Dm), weight (N, Dm) -> streams + g * v; one program per
    (token, stream), its row in registers (float32)."""
    t, n, d = streams.shape
    if kv.shape != (t, n + 1, d) or weight.shape != (n, d):
        raise ValueError(
            f"engram_gate: streams {tuple(streams.shape)} need kv ({t}, {n + 1}, {d}) and weight ({n}, {d}), "
            f"got {tuple(kv.shape)} and {tuple(weight.shape)}"
        )
    if streams.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"engram_gate: streams of {streams.dtype}; the kernel casts float32 / bfloat16 / float16"
        )
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    weight = weight.float().contiguous()
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t and n and d:
        _gate_kernel[(t, n)](
            streams, kv, weight, out, d, n, eps, clamp, streams.stride(0), streams.stride(1), kv.stride(0),
            kv.stride(1), weight.stride(0), out.stride(0), out.stride(1), BLOCK=next_pow2(d), num_warps=4,
        )  # fmt: skip
    return out

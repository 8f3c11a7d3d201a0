# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""Row-wise kernels: rms_norm (+ fused residual add), rotary embedding, silu_and_mul, token
bitmask, the KV-cache row store, MLA's fused cache write (norm + rope + store), the MoE
weighted combine, and the counter-based exponential noise of sampling.

Each program owns whole rows and reduces a row in one pass with a fixed block, so a row's
result never depends on the other rows (batch-invariant by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.kernels.common import (
    INTERPRET,
    Semaphores,
    launch_dependents,
    log,
    next_pow2,
    pdl_enabled,
    to_dtype,
    wait_for_previous,
)

# Float dtypes the kernels cast between exactly as torch does (to_dtype: round to nearest even).
CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (R, D) view (a copy only when the last dim is strided)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, eps, stride_x, stride_r, stride_y, stride_h,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # a decode step's next GEMM (kernels/gemm.skinny_matmul) loads its weights
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    wait_for_previous(PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (h * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = norm(x [+ residual]) * weight; returns (y, x + residual or None), both in x's dtype.
    pdl: launch with PDL where the device has it (common.pdl_enabled)."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must be ({d},), got {tuple(weight.shape)}")
    x2 = _rows(x)
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else None
    r2 = _rows(residual) if residual is not None else None
    if x2.shape[0] and d:
        pdl = pdl_enabled(x.device, pdl)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight, y, h if h is not None else y, d, eps,
            x2.stride(0), r2.stride(0) if r2 is not None else 0,
            y.stride(0), h.stride(0) if h is not None else 0,
            HAS_RES=residual is not None, BLOCK=next_pow2(d), PDL=pdl, num_warps=4 if d <= 4096 else 8,
            launch_pdl=pdl,
        )  # fmt: skip
    return y.view(x.shape), (h.view(x.shape) if h is not None else None)


@triton.jit
def rope_rows(x_ptrs, y_ptrs, mask, cos, sin, HALF, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rotary embedding of a block of M rows (a helper of the kernels, inlined): x_ptrs, y_ptrs
    (M, 1) pointers to each row's first rotary element, mask (M, 1) the rows to do; cos, sin
    float32 (M or 1, BLOCK_R): the row's cos / sin of f_i for i < HALF. Pairs (2i, 2i+1)
    (INTERLEAVED) or (i, i + HALF) rotate by f_i in float32; y is stored in its own dtype."""
    i = tl.arange(0, BLOCK_R)[None, :]
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + HALF
    m = mask & (i < HALF)
    x1 = tl.load(x_ptrs + c1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + c2, mask=m, other=0.0).to(tl.float32)
    ty = y_ptrs.dtype.element_ty
    tl.store(y_ptrs + c1, (x1 * cos - x2 * sin).to(ty), mask=m)
    tl.store(y_ptrs + c2, (x2 * cos + x1 * sin).to(ty), mask=m)


@triton.jit
def _rope_kernel(
    x_ptr, y_ptr, pos_ptr, cs_ptr, H, HALF, stride_xt, stride_xh, stride_yt, stride_yh, stride_cs,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One token, BLOCK_H heads: rotate pairs (2i, 2i+1) or (i, i + R/2) by cos/sin of f_i."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    rope_rows(
        x_ptr + t * stride_xt + hs[:, None] * stride_xh, y_ptr + t * stride_yt + hs[:, None] * stride_yh,
        hs[:, None] < H, cos[None, :], sin[None, :], HALF, INTERLEAVED, BLOCK_R,
    )  # fmt: skip


def _rope_operands(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What the rope launchers pass for x (T, H, .): x and cos_sin_cache with unit last strides,
    the positions contiguous (the kernel reads position t at offset t), and BLOCK_H."""
    xs = x if x.stride(-1) == 1 else x.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return xs, cs, positions.contiguous(), min(16, next_pow2(x.shape[1], 1))


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x (T, H, R) -> rotated copy in x's dtype; cos_sin_cache (P, R) = [cos | sin] rows."""
    if x.dim() != 3:
        raise ValueError(f"rope takes x of shape (T, H, R), got {tuple(x.shape)}")
    t, h, r = x.shape
    if r % 2:
        raise ValueError(f"rope needs an even rotary width, got {r}")
    if cos_sin_cache.shape[-1] != r:
        raise ValueError(f"rope: cos_sin_cache width {cos_sin_cache.shape[-1]} != rotary width {r}")
    y = torch.empty((t, h, r), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0 or r == 0:
        return y
    xs, cs, positions, block_h = _rope_operands(x, positions, cos_sin_cache)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        xs, y, positions, cs, h, r // 2, xs.stride(0), xs.stride(1), y.stride(0), y.stride(1), cs.stride(0),
        INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_R=next_pow2(r // 2, 1), num_warps=4,
    )  # fmt: skip
    return y


@triton.jit
def _rope_tail_kernel(
    x_ptr, y_ptr, pos_ptr, cs_ptr, H, HEAD, HALF, stride_xt, stride_xh, stride_yt, stride_yh, stride_cs,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One token, BLOCK_H heads: the first HEAD channels copied in BLOCK_D chunks, the rotary
    tail's interleaved pairs rotated by f_i (INVERSE: by -f_i, sin negated)."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = hs[:, None] < H
    x_row = x_ptr + t * stride_xt + hs[:, None] * stride_xh
    y_row = y_ptr + t * stride_yt + hs[:, None] * stride_yh
    for d0 in range(0, HEAD, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        m = rows & (d < HEAD)
        tl.store(y_row + d, tl.load(x_row + d, mask=m), mask=m)
    i = tl.arange(0, BLOCK_R)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    rope_rows(x_row + HEAD, y_row + HEAD, rows, cos[None, :], sin[None, :], HALF, True, BLOCK_R)


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool
) -> torch.Tensor:
    """x (T, H, D) -> a copy in x's dtype whose last R channels (R = cos_sin_cache.shape[1]) are
    rotated, interleaved pairs (by -angle where inverse), in one launch."""
    if x.dim() != 3:
        raise ValueError(f"rope_tail takes x of shape (T, H, D), got {tuple(x.shape)}")
    t, h, d = x.shape
    r = cos_sin_cache.shape[-1]
    if r % 2 or r > d:
        raise ValueError(f"rope_tail: rotary width {r} must be even and at most the row width {d}")
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0 or d == 0:
        return y
    xs, cs, positions, block_h = _rope_operands(x, positions, cos_sin_cache)
    _rope_tail_kernel[(t, triton.cdiv(h, block_h))](
        xs, y, positions, cs, h, d - r, r // 2, xs.stride(0), xs.stride(1), y.stride(0), y.stride(1),
        cs.stride(0), INVERSE=inverse, BLOCK_H=block_h, BLOCK_D=min(128, next_pow2(max(d - r, 1), 1)),
        BLOCK_R=next_pow2(r // 2, 1), num_warps=4,
    )  # fmt: skip
    return y


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, y_ptr, I, stride_x, stride_y, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # DeepSeek-V4: gate clamped above, up clamped on both sides
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _swiglu(x: torch.Tensor, limit: float | None, name: str) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"{name} needs an even last dim, got {x.shape[-1]}")
    x2 = _rows(x)
    inner = x.shape[-1] // 2
    y = torch.empty((x2.shape[0], inner), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inner:
        block = min(1024, next_pow2(inner))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](
            x2, y, inner, x2.stride(0), y.stride(0), float(limit or 0.0), CLAMP=limit is not None,
            BLOCK=block, num_warps=4,
        )  # fmt: skip
    return y.view(*x.shape[:-1], inner)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (M, 2I) = [gate | up] -> silu(gate) * up (M, I), computed in float32."""
    return _swiglu(x, None, "silu_and_mul")


def clamped_silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: x (M, 2I) -> silu(min(gate, limit)) * clamp(up, -limit, limit) (M, I)."""
    return _swiglu(x, limit, "clamped_silu_and_mul")


@triton.jit
def _gated_pool_kernel(
    kv_ptr, gate_ptr, out_ptr, bias_ptr, present_ptr, S, D, stride_kw, stride_ks, stride_gw, stride_gs,
    stride_ow, stride_bs, stride_pw, BIASED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (window, channel block): the softmax over the S slots per channel, BLOCK_S
    slots per step as one (BLOCK_S, BLOCK_D) tile (V4-Flash's 8 and 128 slots: one step), merged
    online across steps. A slot per step, as before, made HCA's 128 slots a chain of 128
    dependent loads: 20 us a call at decode. BIASED: the logits are gate + bias[s] (float32),
    -inf where present[w, s] is 0."""
    w = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    m = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_D,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        mask = (slots[:, None] < S) & cmask[None, :]
        g = tl.load(
            gate_ptr + w * stride_gw + slots[:, None] * stride_gs + cols[None, :],
            mask=mask,
            other=float("-inf"),
        ).to(tl.float32)
        if BIASED:
            g += tl.load(bias_ptr + slots[:, None] * stride_bs + cols[None, :], mask=mask, other=0.0)
            live = tl.load(present_ptr + w * stride_pw + slots, mask=slots < S, other=0)
            g = tl.where(live[:, None] != 0, g, float("-inf"))
        v = tl.load(
            kv_ptr + w * stride_kw + slots[:, None] * stride_ks + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        m_new = tl.maximum(m, tl.max(g, axis=0))
        # a finite reference while no slot is present yet: exp(-inf - 0) = 0, never -inf - -inf
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - ref)
        p = tl.exp(g - ref[None, :])
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * v, axis=0)
        m = m_new
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + w * stride_ow + cols, out.to(out_ptr.dtype.element_ty), mask=cmask)


# Elements of one (slots, channels) tile of gated_pool: 4096 in 4 warps (32 per thread and tensor).
GATED_POOL_TILE = 4096
GATED_POOL_MAX_SLOTS = 128


def gated_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V4's compressor pooling: kv (W, S, D), gate (W, S, D) logits (-inf: absent) ->
    (W, D) in kv's dtype, the softmax over S per channel in float32 (all absent: zeros). With bias
    (S, D) float32 and present (W, S) bool: the logits gate + bias, -inf where not present."""
    if kv.shape != gate.shape or kv.dim() != 3:
        shapes = f"{tuple(kv.shape)} and {tuple(gate.shape)}"
        raise ValueError(f"gated_pool needs kv and gate of one (W, S, D) shape, got {shapes}")
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    w, s, d = kv.shape
    out = torch.empty((w, d), dtype=kv.dtype, device=kv.device)
    if w and d:
        block_s = min(next_pow2(s, 1), GATED_POOL_MAX_SLOTS)
        block = max(16, min(next_pow2(d), GATED_POOL_TILE // block_s))
        biased = bias is not None and present is not None
        bias_arg, present_arg = gate, gate  # unread without BIASED
        if bias is not None and present is not None:
            if bias.shape != (s, d) or present.shape != (w, s):
                raise ValueError(f"gated_pool: bias {tuple(bias.shape)} / present {tuple(present.shape)} "
                                 f"do not match ({w}, {s}, {d})")  # fmt: skip
            bias_arg, present_arg = bias.float().contiguous(), present.contiguous().view(torch.uint8)
        _gated_pool_kernel[(w, triton.cdiv(d, block))](
            kv, gate, out, bias_arg, present_arg, s, d, kv.stride(0), kv.stride(1), gate.stride(0),
            gate.stride(1), out.stride(0), bias_arg.stride(0), present_arg.stride(0), BIASED=biased,
            BLOCK_S=block_s, BLOCK_D=block, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(mask_ptr + row * stride_m + cols // 32, mask=cols < V, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=(cols < V) & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: bit (v % 32) of word v // 32 clear -> logits[:, v] = -inf."""
    b, v = logits.shape
    if bitmask.shape != (b, triton.cdiv(v, 32)):
        raise ValueError(f"bitmask must be ({b}, {triton.cdiv(v, 32)}) int32, got {tuple(bitmask.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("apply_token_bitmask needs logits with a contiguous last dim (it works in place)")
    if b and v:
        mask = bitmask.to(torch.int32)
        block = 1024
        _bitmask_kernel[(b, triton.cdiv(v, block))](
            logits, mask, v, logits.stride(0), mask.stride(0), BLOCK=block, num_warps=4
        )


@triton.jit
def _write_kv_kernel(
    kv_ptr, cache_ptr, slot_ptr, D, stride_kv, stride_slot, stride_c, CAST: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(kv_ptr + t * stride_kv + cols, mask=cols < D, other=0.0)
        if CAST:  # exact into float32, then one round-to-nearest-even cast, as torch's .to()
            row = to_dtype(row.to(tl.float32), cache_ptr.dtype.element_ty)
        tl.store(cache_ptr + slot * stride_c + cols, row, mask=cols < D)


def write_kv(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (NB, BS, D) contiguous; kv (T, D) (a strided view is fine); slot_mapping (T,)
    (-1 skips a row). One launch, no host sync: casts between float32 / bfloat16 / float16 happen
    in the kernel; other dtype pairs (FP8 caches, float64 rows) are cast in torch first."""
    t, d = kv.shape
    if cache.shape[-1] != d:
        raise ValueError(f"write_kv: rows of width {d} into a cache of width {cache.shape[-1]}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"write_kv: slot_mapping must be ({t},), got {tuple(slot_mapping.shape)}")
    if t == 0 or d == 0:
        return
    if kv.dtype != cache.dtype and (kv.dtype not in CAST_DTYPES or cache.dtype not in CAST_DTYPES):
        kv = kv.to(cache.dtype)
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    block = min(1024, next_pow2(d))
    _write_kv_kernel[(t, triton.cdiv(d, block))](
        kv, cache, slot_mapping, d, kv.stride(0), slot_mapping.stride(0), d,
        CAST=kv.dtype != cache.dtype, BLOCK=block, num_warps=4,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    y_ptr, idx_ptr, w_ptr, out_ptr, K: tl.constexpr, D, stride_y, stride_o, BLOCK: tl.constexpr
):
    """out[t] = sum_k w[t, k] * y[idx[t*K + k]], summed in float32 in k order. The loop is
    unrolled (K constexpr): the K row indices, then the K rows, are loaded together rather than
    two memory round trips after another per k."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(K):
        src = tl.load(idx_ptr + t * K + k).to(tl.int64)
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += w * tl.load(y_ptr + src * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_combine(y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y_sorted[src_to_dst[t*K + k]] -> (T, Dm) in y's dtype."""
    t, k = weights.shape
    d = y_sorted.shape[-1]
    if src_to_dst.shape != (t * k,):
        raise ValueError(f"unpermute: src_to_dst must be ({t * k},), got {tuple(src_to_dst.shape)}")
    out = torch.empty((t, d), dtype=y_sorted.dtype, device=y_sorted.device)
    if t == 0 or d == 0:
        return out
    if k == 0:
        return out.zero_()
    y = y_sorted if y_sorted.stride(-1) == 1 else y_sorted.contiguous()
    w = weights.float().contiguous()
    block = min(1024, next_pow2(d))
    _combine_kernel[(t, triton.cdiv(d, block))](
        y, src_to_dst.contiguous(), w, out, k, d, y.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def write_mla_kv_row(
    kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, t, C, HALF, eps,
    stride_kv, stride_pos, stride_cs, stride_slot, D,
    INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Token t (a helper of the kernels, inlined): cache[slot[t]] = [rms_norm(kv[t, :C]) * w |
    rope(kv[t, C:])], nothing for slot -1. Each half is rounded to kv's dtype first (what the two
    small ops return), then to the cache's (what write_kv does)."""
    slot, w, cos, sin = mla_kv_row_inputs(
        w_ptr, pos_ptr, cs_ptr, slot_ptr, t, C, HALF, stride_pos, stride_cs, stride_slot,
        BLOCK_C, BLOCK_R, ROPE,
    )  # fmt: skip
    write_mla_kv_row_from(
        kv_ptr, cache_ptr, t, C, HALF, eps, stride_kv, D, slot, w, cos, sin,
        INTERLEAVED, BLOCK_C, BLOCK_R, ROPE,
    )  # fmt: skip


@triton.jit
def mla_kv_row_inputs(
    w_ptr, pos_ptr, cs_ptr, slot_ptr, t, C, HALF, stride_pos, stride_cs, stride_slot,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """What write_mla_kv_row reads besides kv: token t's slot, the norm weight (float32, BLOCK_C)
    and the cos / sin of its position (float32, BLOCK_R). None of it is written by the forward (step
    inputs, weights), so a kernel may load it before waiting for the previous kernel."""
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    i = tl.arange(0, BLOCK_R)
    rmask = i < HALF
    cos = tl.zeros([BLOCK_R], tl.float32)
    sin = tl.zeros([BLOCK_R], tl.float32)
    if ROPE:
        pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + i, mask=rmask, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=rmask, other=0.0).to(tl.float32)
    return slot, w, cos, sin


@triton.jit
def write_mla_kv_row_from(
    kv_ptr, cache_ptr, t, C, HALF, eps, stride_kv, D, slot, w, cos, sin,
    INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """write_mla_kv_row given mla_kv_row_inputs' values."""
    if slot >= 0:
        src = kv_ptr + t * stride_kv
        dst = cache_ptr + slot * D
        kv_ty = kv_ptr.dtype.element_ty
        cache_ty = cache_ptr.dtype.element_ty
        # latent: rms_norm in float32, as _rms_norm_kernel computes it
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        h = tl.load(src + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / C + eps)
        y = to_dtype(h * rstd * w, kv_ty).to(tl.float32)
        tl.store(dst + cols, to_dtype(y, cache_ty), mask=cmask)
        if ROPE:  # rope of the last R = 2 * HALF columns, as _rope_kernel computes it
            i = tl.arange(0, BLOCK_R)
            rmask = i < HALF
            if INTERLEAVED:
                c1 = C + 2 * i
                c2 = C + 2 * i + 1
            else:
                c1 = C + i
                c2 = C + HALF + i
            x1 = tl.load(src + c1, mask=rmask, other=0.0).to(tl.float32)
            x2 = tl.load(src + c2, mask=rmask, other=0.0).to(tl.float32)
            y1 = to_dtype(x1 * cos - x2 * sin, kv_ty).to(tl.float32)
            y2 = to_dtype(x2 * cos + x1 * sin, kv_ty).to(tl.float32)
            tl.store(dst + c1, to_dtype(y1, cache_ty), mask=rmask)
            tl.store(dst + c2, to_dtype(y2, cache_ty), mask=rmask)


@triton.jit
def _write_mla_kv_kernel(
    kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, C, HALF, eps,
    stride_kv, stride_pos, stride_cs, stride_slot, D,
    INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program per token (write_mla_kv_row)."""
    launch_dependents(PDL)  # MLA's query kernel loads its W_UK tiles
    wait_for_previous(PDL)
    write_mla_kv_row(
        kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, tl.program_id(0).to(tl.int64), C, HALF, eps,
        stride_kv, stride_pos, stride_cs, stride_slot, D, INTERLEAVED, BLOCK_C, BLOCK_R, ROPE,
    )  # fmt: skip


def check_mla_kv_write(
    cache: torch.Tensor,
    kv: torch.Tensor,
    latent_dim: int,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """write_mla_kv's argument checks (also those of mla.mla_query's fused write)."""
    t, d = kv.shape
    c, r = latent_dim, d - latent_dim
    if cache.shape[-1] != d or not cache.is_contiguous():
        raise ValueError(
            f"write_mla_kv: rows of width {d} into a contiguous cache of width {cache.shape[-1]}"
        )
    if c <= 0 or r < 0 or r % 2 or (r and cos_sin_cache.shape[-1] != r):
        raise ValueError(
            f"write_mla_kv: latent {c} + an even rotary width {r} (= the cos_sin_cache width "
            f"{cos_sin_cache.shape[-1]}) must make the row width {d}"
        )
    if norm_weight.shape != (c,):
        raise ValueError(f"write_mla_kv: norm_weight must be ({c},), got {tuple(norm_weight.shape)}")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"write_mla_kv: positions and slot_mapping must be ({t},)")
    if kv.dtype not in CAST_DTYPES or cache.dtype not in CAST_DTYPES:
        raise ValueError(f"write_mla_kv: dtypes {kv.dtype} -> {cache.dtype}; supported: {CAST_DTYPES}")


def write_mla_kv(
    cache: torch.Tensor,
    kv: torch.Tensor,
    latent_dim: int,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
    slot_mapping: torch.Tensor,
    pdl: bool = True,
) -> None:
    """MLA's cache write in one launch, one program per token (graph-safe: no host sync).
    cache (NB, BS, C + R) contiguous; kv (T, C + R), the raw kv_a output (a strided view is fine);
    C = latent_dim; norm_weight (C,); positions, slot_mapping (T,) int (slot -1: skip the row);
    cos_sin_cache (P, R) float rows [cos | sin] (unused when R = 0). pdl: as rms_norm's."""
    check_mla_kv_write(cache, kv, latent_dim, norm_weight, positions, cos_sin_cache, slot_mapping)
    t, d = kv.shape
    c, r = latent_dim, d - latent_dim
    if t == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    pdl = pdl_enabled(kv.device, pdl)
    _write_mla_kv_kernel[(t,)](
        kv, norm_weight.contiguous(), positions, cs, slot_mapping, cache, c, r // 2, eps,
        kv.stride(0), positions.stride(0), cs.stride(0), slot_mapping.stride(0), d,
        INTERLEAVED=interleaved, BLOCK_C=next_pow2(c), BLOCK_R=next_pow2(r // 2, 1), ROPE=r > 0,
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip


@triton.jit
def mix32(x):
    """deepinfer.reference.small.mix32 on uint32 x: the multiplies wrap modulo 2**32, which is
    what the reference's `& 0xFFFFFFFF` emulates in int64."""
    x = ((x >> 16) ^ x) * 0x045D9F3B
    x = ((x >> 16) ^ x) * 0x045D9F3B
    return (x >> 16) ^ x


@triton.jit
def _exp_noise_kernel(seed_ptr, off_ptr, out_ptr, V, stride_s, stride_o, stride_out, BLOCK: tl.constexpr):
    """BLOCK tokens of row b: -log(u), u from the reference's hash of (seed, offset, token)."""
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + b * stride_s).to(tl.int64)  # in [0, 2**63): >> 32 is the high half
    off = tl.load(off_ptr + b * stride_o).to(tl.int64)
    # int64 -> uint32 keeps the low 32 bits
    key = mix32(mix32(seed.to(tl.uint32) ^ mix32((seed >> 32).to(tl.uint32))) ^ off.to(tl.uint32))
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bits = mix32(key ^ mix32(v.to(tl.uint32)))
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # exact: 24 bits + 1/2
    tl.store(out_ptr + b * stride_out + v, -log(u), mask=v < V)


def exponential_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) int64 seeds and offsets -> (B, V) float32 Exp(1) noise, one launch, no state."""
    b = seeds.shape[0]
    if seeds.shape != (b,) or offsets.shape != (b,):
        raise ValueError(f"exponential_noise: seeds and offsets must be (B,), got {tuple(seeds.shape)}, "
                         f"{tuple(offsets.shape)}")  # fmt: skip
    out = torch.empty((b, vocab_size), dtype=torch.float32, device=seeds.device)
    if b == 0 or vocab_size == 0:
        return out
    block = 1024
    _exp_noise_kernel[(b, triton.cdiv(vocab_size, block))](
        seeds,
        offsets,
        out,
        vocab_size,
        seeds.stride(0),
        offsets.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out


@triton.jit
def _argmax_kernel(
    x_ptr, val_ptr, idx_ptr, tickets_ptr, out_ptr, V, stride_x,
    BLOCK: tl.constexpr, PARTS: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Row r, columns [p * BLOCK, (p + 1) * BLOCK): the block's maximum and the first column
    holding it, stored as the row's part p; the row's last program (a per-row ticket, taken
    acq_rel, reset by it) picks the first part holding the row's maximum: the first maximum."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
    best, at = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * PARTS + p, best)
    tl.store(idx_ptr + row * PARTS + p, p.to(tl.int64) * BLOCK + at)
    tl.debug_barrier()  # the part is stored before the program counts itself in
    arrived = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel")
    if arrived < PARTS - 1:
        return
    tl.store(tickets_ptr + row, 0)  # the row's last program: ready for the next launch
    ps = tl.arange(0, BLOCK_P)
    # written by other programs: volatile, no stale L1 lines
    vals = tl.load(val_ptr + row * PARTS + ps, mask=ps < PARTS, other=float("-inf"), volatile=True)
    first = tl.min(tl.where(vals == tl.max(vals, 0), ps, BLOCK_P), 0)  # the first part holding it
    first = tl.minimum(first, PARTS - 1)  # a NaN maximum matches no part: stay inside the row
    idx = tl.load(idx_ptr + row * PARTS + first, volatile=True)
    tl.store(out_ptr + row, idx)


# One int32 ticket per row of an argmax launch.
_ARGMAX_TICKETS = Semaphores()
ARGMAX_BLOCK = 4096  # columns a program: V2-Lite's 102400-token vocabulary is 25 programs a row


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SmallOps.argmax in one launch: logits (S, V) float32 -> (S,) int64, the first maximum of
    each row, into `out` when given. Grid (S, ceil(V / ARGMAX_BLOCK)): each program reduces a
    block of a row, the row's last one the blocks' maxima (torch's two reductions and the index
    arithmetic after them took four launches)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"argmax: logits must be (S, V) float32, got {tuple(logits.shape)} {logits.dtype}")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if out.shape != (rows,) or out.dtype != torch.int64:
        raise ValueError(f"argmax: out must be ({rows},) int64, got {tuple(out.shape)} {out.dtype}")
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax: a row of no columns has no maximum")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    parts = triton.cdiv(vocab, ARGMAX_BLOCK)
    vals = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, parts), dtype=torch.int64, device=x.device)
    _argmax_kernel[(rows, parts)](
        x, vals, idx, _ARGMAX_TICKETS.get(x.device, rows), out, vocab, x.stride(0),
        BLOCK=ARGMAX_BLOCK, PARTS=parts, BLOCK_P=next_pow2(parts, 1), num_warps=8,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- small host copies

COPY_MAX_BYTES = 1 << 16  # larger copies go to the copy engine
COPY_BLOCK = 1024  # 32-bit words a program


@triton.jit
def _copy_words_kernel(src_ptr, dst_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < N), mask=offs < N)


def copy_words(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst <- src in one Triton launch, queued on the current stream, where both are contiguous
    and of the same dtype and shape, the bytes a multiple of 4 and at most COPY_MAX_BYTES, and a
    host tensor among them is pinned (a GPU kernel reaches pinned memory through its mapped
    address; under the interpreter both are host tensors). Returns False, copying nothing,
    otherwise. The engine's step inputs and sampled tokens: a kernel starts about 1 us after the
    kernel before it, where a copy-engine transfer waited about 6 us on an H200."""
    nbytes = src.numel() * src.element_size()
    fits = src.shape == dst.shape and src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
    if not fits or nbytes % 4 or not 0 < nbytes <= COPY_MAX_BYTES:
        return False
    if not INTERPRET and not all(t.is_cuda or t.is_pinned() for t in (src, dst)):
        return False
    n = nbytes // 4
    _copy_words_kernel[(triton.cdiv(n, COPY_BLOCK),)](
        src.view(torch.int32), dst.view(torch.int32), n, BLOCK=COPY_BLOCK, num_warps=4
    )
    return True

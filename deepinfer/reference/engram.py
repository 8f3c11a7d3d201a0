"""Reference definitions of DeepSeek-V4.1's Engram ops: the hashed n-gram lookup and the gate
into the residual streams. Semantics on deepinfer.backend.ops (SmallOps.engram_lookup,
engram_gate). Plain PyTorch, any device.

Symbols: T tokens, G = max n-gram size (columns of the n-gram ids: tokens p, p-1, ..., p-G+1),
Hg heads per n-gram size, C = (G - 1) * Hg table heads (head c = (n - 2) * Hg + k for n-gram
size n = 2..G and head k), Dh a table row's width, N hc_mult streams, Dm hidden.
"""

from __future__ import annotations

import torch

from deepinfer.backend.fp4 import e8m0_to_float


def engram_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """(C,) head sizes -> (C,) int64 first row of each head in the stacked table."""
    sizes = sizes.to(torch.int64)
    return torch.cumsum(sizes, 0) - sizes


def engram_hash(ngram_ids: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """ngram_ids (T, G) int64 >= 0, multipliers (G,) int64, sizes (C,) int64 -> rows (T, C) int64:
    head c of n-gram size n = c // Hg + 2 reads row (XOR_{r < n} ids[:, r] * m[r]) mod sizes[c]
    + offsets[c]. The products wrap in int64 (they do not for ids below the vocabulary the
    multipliers are bounded by); the modulo takes a non-negative remainder."""
    g = ngram_ids.shape[1]
    c = sizes.numel()
    if g < 2 or c % (g - 1):
        raise ValueError(f"engram_hash: {c} table heads do not divide over n-gram sizes 2..{g}")
    heads = c // (g - 1)
    prod = ngram_ids.to(torch.int64) * multipliers.to(torch.int64)[None, :]
    mixes = [prod[:, 0]]
    for r in range(1, g):
        mixes.append(mixes[-1] ^ prod[:, r])
    mix = torch.stack(mixes[1:], dim=1).repeat_interleave(heads, dim=1)  # (T, C): n = 2..G
    sizes = sizes.to(torch.int64)
    return torch.remainder(mix, sizes[None, :]) + engram_offsets(sizes)[None, :]


def engram_lookup(
    ngram_ids: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The heads' rows of each token, side by side: (T, G) ids -> (T, C * Dh) in table's dtype;
    table (R, Dh), R >= sum(sizes). FP8 rows: table e4m3 with scales (R, Dh / 32) UE8M0 bytes,
    the gathered rows dequantised into `dtype` (default float32)."""
    rows = engram_hash(ngram_ids, multipliers, sizes).reshape(-1)
    t, c, dh = ngram_ids.shape[0], sizes.numel(), table.shape[1]
    if scales is None:
        return table[rows.to(table.device)].to(ngram_ids.device).view(t, c * dh)
    check_fp8_rows(table, scales, "engram_lookup")
    picked = table[rows.to(table.device)].to(ngram_ids.device).float()  # (T * C, Dh)
    scale = e8m0_to_float(scales[rows.to(scales.device)].to(ngram_ids.device))  # (T * C, Dh / 32)
    out = picked * scale.repeat_interleave(FP8_ROW_GROUP, dim=1)
    return out.to(dtype or torch.float32).view(t, c * dh)


FP8_ROW_GROUP = 32  # values of an FP8 Engram row under one UE8M0 scale


def check_fp8_rows(table: torch.Tensor, scales: torch.Tensor, op: str) -> None:
    """FP8 rows' layout: an e4m3 (R, Dh) table with (R, Dh / 32) uint8 scales, else ValueError."""
    r, dh = table.shape
    if table.dtype != torch.float8_e4m3fn or dh % FP8_ROW_GROUP:
        raise ValueError(
            f"{op}: FP8 rows are float8_e4m3fn (R, Dh), Dh % 32 == 0; got {table.dtype} {tuple(table.shape)}"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (r, dh // FP8_ROW_GROUP):
        raise ValueError(
            f"{op}: scales of FP8 rows (R, Dh) = {(r, dh)} are uint8 ({r}, {dh // FP8_ROW_GROUP}); got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )


def engram_gate(
    streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float, clamp: float = 1e-6
) -> torch.Tensor:
    """streams (T, N, Dm), kv (T, N + 1, Dm) (keys of the N streams, then one value), weight
    (N, Dm) -> streams + g * v (T, N, Dm) in streams' dtype, in float32:
    a = <rms(x_n) * w_n, rms(k_n)> / sqrt(Dm) (unweighted rms, eps), g = sigmoid(sign(a) *
    sqrt(max(|a|, clamp)))."""
    x, k = streams.float(), kv[:, :-1].float()
    v = kv[:, -1:].float()
    xn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    kn = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps)
    a = (xn * weight.float() * kn).sum(-1) / streams.shape[-1] ** 0.5  # (T, N)
    g = torch.sigmoid(torch.sign(a) * torch.sqrt(a.abs().clamp(min=clamp)))
    return (x + g[..., None] * v).to(streams.dtype)

"""The MXFP4 format of the contract (DeepSeek-V4's routed experts), and UE8M0 scale bytes.

    weights  (N, K) e2m1 values packed two per byte: (N, K/2) uint8 (K even); element 2j is the
             LOW nibble of byte j, element 2j+1 the high nibble
    scales   one UE8M0 per 32 consecutive values along K: (N, ceil(K/32)) uint8 exponent bytes,
             scale = 2^(byte - 127); byte 0xFF is NaN (the loader refuses it)
    value = e2m1 * scale          (no activation quantisation: activations stay in their dtype)

e2m1 code: sign bit 3, exponent bits 2-1, mantissa bit 0 -> magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Every value times a power of two is exact in bfloat16 (at most 2 significant bits), so a
dequantised weight loses nothing in the activation dtype.

DeepSeek's checkpoints store the packed weights as int8 (also seen: uint8, float4_e2m1fn_x2) and
the scales as float8_e8m0fnu (also seen: uint8): the same bytes, which the loader views as uint8.
The same UE8M0 bytes are DeepSeek-V4's FP8 block scales (e8m0_to_float turns them into the
float32 scales of deepinfer.backend.fp8).
"""

from __future__ import annotations

import torch

FP4_BLOCK = 32  # values per UE8M0 scale, along K
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_MAX = 6.0
# value of each 4-bit code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """The (N, ceil(K/32)) scale shape of an (N, K) weight."""
    return n, -(-k // FP4_BLOCK)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8, or float8_e8m0fnu) -> float32 2^(s - 127), exactly: the exponent is
    written into the float32 bits (byte 0 is the subnormal 2^-127)."""
    b = s.view(torch.uint8).to(torch.int32)
    out = (b << 23).view(torch.float32)
    return torch.where(b == 0, torch.full_like(out, 2.0**-127), out)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two (float32, 2^-126 .. 2^127) -> their UE8M0 bytes (uint8)."""
    f = scale.float()
    bits = f.view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any()) or bool((f <= 0).any()):
        raise ValueError("UE8M0 scales must be positive normal powers of two")
    return (bits >> 23).to(torch.uint8)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0, float32)."""
    p = torch.exp2(torch.ceil(torch.log2(x)))
    return torch.where(p < x, 2 * p, p)  # log2 may round down just above a power of two


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., K/2) packed bytes (uint8 / int8 / float4_e2m1fn_x2) -> (..., K) values in dtype."""
    b = packed.view(torch.uint8).long()
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    pairs = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1)  # (..., K/2, 2): low nibble first
    return pairs.flatten(-2)


def dequantize_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(..., N, K/2) packed e2m1 with (..., N, ceil(K/32)) UE8M0 scales -> (..., N, K) in dtype
    (exact in float32 and bfloat16, barring scales outside the dtype's range)."""
    w = unpack_e2m1(packed, dtype)
    s = e8m0_to_float(scale).to(dtype).repeat_interleave(FP4_BLOCK, dim=-1)[..., : w.shape[-1]]
    return w * s


# Rounding to the nearest e2m1 magnitude, ties to the even code: the midpoints between
# neighbouring magnitudes, and whether a value exactly on one rounds up.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) float (K even) -> (packed uint8 (..., N, K/2), UE8M0 bytes (..., N, ceil(K/32))).
    Each 32-block's scale is the smallest power of two that maps its amax within +-6 (nothing
    clips); values round to the nearest e2m1, ties to even. Tests and random checkpoints use it."""
    *lead, n, k = weight.shape
    if k % 2:
        raise ValueError(f"MXFP4 packs two values per byte: K must be even, got {k}")
    pad = -k % FP4_BLOCK
    w = torch.nn.functional.pad(weight.float(), (0, pad)).reshape(*lead, n, -1, FP4_BLOCK)
    amax = w.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126 * E2M1_MAX)
    scale = pow2_ceil(amax / E2M1_MAX)  # (..., N, Kb, 1)
    packed = pack_e2m1(e2m1_codes((w / scale).flatten(-2)[..., :k]))
    return packed, float_to_e8m0(scale[..., 0])


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale (|y| <= 6) -> 4-bit codes (int64): the nearest
    e2m1 magnitude, ties to the even code, sign in bit 3 (never on zero)."""
    a = y.abs().contiguous()
    mids = torch.tensor(_MIDPOINTS, device=y.device)  # on y's device: quantising on a GPU
    code = torch.bucketize(a, mids, right=True)  # ties round up here ...
    on_tie = (a[..., None] == mids).any(-1)
    down = on_tie & ~torch.tensor(_TIE_UP, device=y.device)[(code - 1).clamp(min=0)]
    code = code - down.long()  # ... and down again where the even code is below
    return code | ((y < 0) & (code > 0)).long() << 3


def pack_e2m1(code: torch.Tensor) -> torch.Tensor:
    """(..., K) 4-bit codes (K even) -> (..., K/2) uint8, element 2j in the low nibble of byte j."""
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)

"""The FP8 format of the contract, in one place: DeepSeek's block-scaled float8 e4m3.

    value = fp8 * scale                          scales MULTIPLY (checkpoints call them weight_scale_inv)
    weights      (N, K) e4m3, one float32 scale per b x b block: (ceil(N/b), ceil(K/b))
    activations  (M, K) e4m3, one float32 scale per token per b channels: (M, ceil(K/b)),
                 scale = amax / 448 (FP8_MAX), symmetric, round to nearest even

The block b is 128 in DeepSeek-V3 / V4 (FP8_BLOCK) and 32 in DeepSeek-V4.1 (MXFP8_BLOCK: e4m3
with UE8M0 scales per 32, "MXFP8-32"); weights and activations always share one b.

Backends, the model loader and the tests import these names from here; the reference backend's
quantize_fp8 / fp8_gemm (deepinfer.reference.gemm) define what the GemmOps compute with them.
"""

from __future__ import annotations

import torch

from deepinfer.backend.fp4 import pow2_ceil

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_BLOCK = 128  # weights: 128 x 128 blocks; activations: 1 x 128
MXFP8_BLOCK = 32  # DeepSeek-V4.1: 32 x 32 weight blocks, 1 x 32 activations
FP8_BLOCKS = (FP8_BLOCK, MXFP8_BLOCK)  # the block sizes a checkpoint may use
AMAX_EPS = 1e-10  # keeps all-zero blocks finite: scale = eps / 448, values 0


def num_blocks(n: int, block: int = FP8_BLOCK) -> int:
    """ceil(n / block): scale entries along a dimension of n values."""
    return -(-n // block)


def weight_scale_shape(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """The (ceil(N/b), ceil(K/b)) scale shape of an (N, K) weight."""
    return num_blocks(n, block), num_blocks(k, block)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """(..., ceil(rows/b), ceil(cols/b)) block scales -> (..., rows, cols) elementwise scales."""
    s = scale.repeat_interleave(block, dim=-2)[..., :rows, :]
    return s.repeat_interleave(block, dim=-1)[..., :cols]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """(..., N, K) e4m3 with (..., ceil(N/b), ceil(K/b)) scales -> float32."""
    return weight.float() * expand_block_scale(scale.float(), weight.shape[-2], weight.shape[-1], block)


def quantize_weight(
    weight: torch.Tensor, block: int = FP8_BLOCK, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (e4m3 (N, K), float32 scale (ceil(N/b), ceil(K/b))), DeepSeek's format.
    ue8m0: each scale rounded up to a power of two (DeepSeek-V3.1 / V4 checkpoints), so that it
    fits a UE8M0 byte (deepinfer.backend.fp4.float_to_e8m0); nothing saturates either way."""
    n, k = weight.shape
    pn, pk = -n % block, -k % block
    w = torch.nn.functional.pad(weight.float(), (0, pk, 0, pn))
    blocks = w.view(w.shape[0] // block, block, w.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_EPS)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(w)[:n, :k]
    return q.to(FP8_DTYPE), scale


def dequantize_act(xq: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """(..., K) e4m3 activations with (..., ceil(K/block)) scales -> float32."""
    k = xq.shape[-1]
    return xq.float() * scale.float().repeat_interleave(block, dim=-1)[..., :k]

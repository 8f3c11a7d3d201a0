"""Dense and grouped GEMMs.

linear          aten matmul on the NPU (torch.nn.functional.linear)
grouped_gemm    npu_grouped_matmul([x], [W^T (E, K, N)], group_list=counts, group_list_type=1,
                group_type=0, split_item=2) -> [y (M, N)]
FP8 (Ascend 950, SoC 260 only; Capabilities.supports_fp8 says so):
quantize_fp8    npu_dynamic_block_quant(x, dst_type=float8_e4m3fn, row_block_size=1,
                col_block_size=128) -> (xq, scale (M, ceil(K/128)))
fp8_gemm        npu_quant_matmul(xq, W^T, W_scale^T, pertoken_scale=x_scale,
                group_sizes=[1, 128, 128], output_dtype=...) (DeepSeek's 128x128 block scales)
grouped FP8     one npu_quant_matmul per non-empty expert (host-side split: one sync)
FP8 with 32 x 32 blocks (DeepSeek-V4.1's MXFP8-32 linears): the two ops above are modelled
(simulated in CI) for 128-blocks only, so 32-blocks take the documented fallback, the contract's
reference math in aten ops on the NPU: activations quantised per 32 channels, both operands
dequantised to float32, one float32 matmul (correct; slow and memory-hungry). Whether
npu_quant_matmul's group_sizes [1, 32, 32] or its MX mode (per-32 UE8M0 scales along K, which
a 32 x 32 weight block expands to exactly) serves it has not been checked on an NPU.
MXFP4 experts (DeepSeek-V4): torch_npu has no MXFP4 grouped matmul on the CANN releases this
backend targets, as far as known (npu_grouped_matmul takes float, int8 and on the 950 FP8 /
MXFP8 weights; npu_quant_matmul's MX modes are dense). The documented fallback: dequantise the
experts that have rows to the activation dtype (exact) and run the bf16 grouped matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend import fp4
from deepinfer.backend.fp8 import FP8_BLOCK as BLOCK
from deepinfer.backend.fp8 import FP8_DTYPE as FP8
from deepinfer.backend.fp8 import MXFP8_BLOCK
from deepinfer.backend.ops import GemmOps
from deepinfer.backend.types import BackendOptions

BLOCK_GROUPS = [1, BLOCK, BLOCK]  # per-token x 128 channels (x), 128 x 128 blocks (weight)
# Experts dequantised for one npu_grouped_matmul in the MXFP4 fallback: bounds the transient
# weights (V4-Flash's w13: 16 x 4096 x 4096 bf16 = 512 MiB)
FP4_EXPERTS_PER_CALL = 16


class AscendGemm(GemmOps):
    def __init__(self, options: BackendOptions, tnpu: Any, fp8: bool) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._fp8 = fp8

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    def grouped_gemm(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        return grouped_matmul(self._tnpu, x, weight, group_sizes)

    def grouped_gemm_fp4(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        """MXFP4 experts by the fallback (module docstring): the experts with rows dequantised to
        x's dtype with aten ops on the NPU, FP4_EXPERTS_PER_CALL at a time, each batch of them
        through npu_grouped_matmul on its rows (sorted by expert: one contiguous range). One
        host sync reads the group sizes."""
        out = x.new_empty((x.shape[0], weight.shape[1]))
        sizes = group_sizes.tolist()
        starts = [sum(sizes[:e]) for e in range(len(sizes))]
        used = [e for e, n in enumerate(sizes) if n]
        for i in range(0, len(used), FP4_EXPERTS_PER_CALL):
            chunk = used[i : i + FP4_EXPERTS_PER_CALL]
            rows = slice(starts[chunk[0]], starts[chunk[-1]] + sizes[chunk[-1]])  # experts between: none
            ids = torch.tensor(chunk, device=weight.device)
            w = fp4.dequantize_weight(weight[ids], weight_scale[ids], x.dtype)  # (C, N, K)
            counts = torch.tensor([sizes[e] for e in chunk], dtype=torch.int64, device=x.device)
            out[rows] = grouped_matmul(self._tnpu, x[rows], w, counts)
        return out

    # ------------------------------------------------------------------ FP8 (950)

    def _need_fp8(self) -> None:
        if not self._fp8:
            raise NotImplementedError("FP8 matmuls need an Ascend 950 (SoC 260); this NPU runs bf16")

    def quantize_fp8(self, x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        self._need_fp8()
        if block == MXFP8_BLOCK:  # the documented fallback (module docstring)
            return super().quantize_fp8(x, block)
        if block != BLOCK:
            raise NotImplementedError(
                f"ascend FP8 quantises per {BLOCK} or {MXFP8_BLOCK} channels, not {block}"
            )
        if x.shape[0] == 0:
            k = x.shape[1]
            return x.new_empty((0, k), dtype=FP8), x.new_empty((0, -(-k // BLOCK)), dtype=torch.float32)
        if x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)  # npu_dynamic_block_quant takes fp16/bf16
        xq, scale = self._tnpu.npu_dynamic_block_quant(
            x, dst_type=FP8, row_block_size=1, col_block_size=BLOCK
        )
        return xq, scale

    def fp8_gemm(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
        block: int = BLOCK,
    ) -> torch.Tensor:
        self._need_fp8()
        if block == MXFP8_BLOCK:  # the documented fallback (module docstring)
            return super().fp8_gemm(xq, x_scale, weight, weight_scale, out_dtype, block=block)
        if block != BLOCK:
            raise NotImplementedError(f"ascend FP8 GEMMs take {BLOCK} or {MXFP8_BLOCK} blocks, not {block}")
        if xq.shape[0] == 0:
            return torch.empty((0, weight.shape[0]), dtype=out_dtype, device=xq.device)
        out: torch.Tensor = self._tnpu.npu_quant_matmul(
            xq.contiguous(),
            # (K, N) transposed views of contiguous (N, K) / (N/128, K/128) tensors, as the op
            # expects for block scales (callers may hand over other strides)
            weight.contiguous().t(),
            weight_scale.float().contiguous().t(),
            pertoken_scale=x_scale.float().contiguous(),
            output_dtype=out_dtype,
            group_sizes=BLOCK_GROUPS,
        )
        return out

    def grouped_gemm_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
        block: int = BLOCK,
    ) -> torch.Tensor:
        self._need_fp8()
        out = x.new_empty((x.shape[0], weight.shape[1]))
        start = 0
        for e, n in enumerate(group_sizes.tolist()):
            if n:
                xq, xs = self.quantize_fp8(x[start : start + n], block)
                out[start : start + n] = self.fp8_gemm(
                    xq, xs, weight[e], weight_scale[e], x.dtype, block=block
                )
            start += n
        return out


def grouped_matmul(
    tnpu: Any, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor
) -> torch.Tensor:
    """Rows of x sorted by group times weight[e]^T: x (M, K), weight (E, N, K), sizes (E,) -> (M, N)."""
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[1]))
    ys: list[torch.Tensor] = tnpu.npu_grouped_matmul(
        [x],
        [weight.transpose(1, 2)],  # (E, K, N) view
        group_list=group_sizes.to(torch.int64),
        split_item=2,
        group_type=0,
        group_list_type=1,  # counts, not cumsum
    )
    return ys[0]

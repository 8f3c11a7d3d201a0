"""The GEMM part: dense, skinny (decode sizes), batch-invariant, FP8 and grouped GEMMs."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend.fp8 import FP8_BLOCK, FP8_DTYPE
from deepinfer.backend.ops import GemmOps
from deepinfer.backend.types import BackendOptions
from deepinfer_cuda import vendor
from deepinfer_cuda.kernels import gemm as gemm_k
from deepinfer_cuda.kernels import moe as moe_k
from deepinfer_cuda.kernels.common import INTERPRET


class CudaGemm(GemmOps):
    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        # decode-sized float linears on kernels/gemm.skinny_matmul (outside batch-invariant mode)
        self.skinny = self.fused and env.cuda_skinny and not self.batch_invariant
        # ... and FP8 ones on its FP8 flag (skinny_fp8_matmul); the MXFP4 grouped GEMM's pair decode
        self.v4_decode = env.cuda_v4_decode
        self.skinny_fp8 = self.skinny and self.v4_decode
        # the MXFP4 grouped GEMM on Triton's microscaled product (bf16 x, not batch-invariant) from
        # gemm_k.MX_MIN_ROWS_PER_GROUP copies an expert (DEEPINFER_CUDA_MX_FP4=0: never)
        self.mx_fp4 = self.v4_decode and env.cuda_mx_fp4 and not self.batch_invariant and not INTERPRET
        self.pdl = env.cuda_pdl
        self.vendor = env.cuda_vendor  # DeepGEMM where installed (deepinfer_cuda.vendor)
        # the batch-invariant matmul's tiles, where a benchmark pins them (else by M)
        self.invariant_tile = gemm_k.invariant_setting(env.cuda_invariant_tile)

    def _tiles(self, group_sizes: torch.Tensor, rows: int, fp8: bool) -> gemm_k.TileTable | None:
        """The tile table in one launch (None, unfused: grouped_gemm computes it in torch)."""
        if not self.fused:
            return None
        cfg = gemm_k.grouped_config(rows, fp8, self.batch_invariant, group_sizes.device)
        return moe_k.tile_table(group_sizes, rows, cfg.block_m)

    # ----- DeepSeek-V4's published format at decode sizes (DEEPINFER_CUDA_V4_DECODE)

    def linear_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """Up to gemm.SKINNY_FP8_MAX_M rows and SKINNY_FP8_MAX_WEIGHT_BYTES of 128-block weights:
        ONE launch, the skinny kernel's FP8 flag (x quantised in the kernel, the e4m3 slab loaded
        before the wait); else (32-blocks too) the contract's quantize_fp8 + fp8_gemm."""
        fits = bias is None and x.dim() == 2 and gemm_k.skinny_fp8_pays(x, weight, weight_scale)
        if self.skinny_fp8 and fits and block == FP8_BLOCK:
            return gemm_k.skinny_fp8_matmul(x, weight, weight_scale, pdl=self.pdl)
        return super().linear_fp8(x, weight, weight_scale, bias, block=block)

    def batched_linear_fp8(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = FP8_BLOCK
    ) -> torch.Tensor:
        """Decode sizes, 128-blocks: one skinny FP8 launch over the G groups, read from x's strided
        view and written as a (G, M, N) view of an (M, G, N) tensor (V4 flattens (M, G * N)
        without a copy); other 128-block sizes: the contract's grouped_gemm_fp8 (one grouped launch).
        Other blocks (V4.1's 32): linear_fp8 per group, G launches that read no length on the host
        (the contract's grouped path reads the group sizes there, which a CUDA graph cannot)."""
        if self.skinny_fp8 and block == FP8_BLOCK and gemm_k.skinny_fp8_pays(x, weight, weight_scale):
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            return gemm_k.skinny_fp8_matmul(x, weight, weight_scale, out.transpose(0, 1), pdl=self.pdl)
        if block != FP8_BLOCK:
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            for g in range(x.shape[0]):
                out[:, g] = self.linear_fp8(x[g], weight[g], weight_scale[g], block=block)
            return out.transpose(0, 1)
        return super().batched_linear_fp8(x, weight, weight_scale, block=block)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Up to SKINNY_MAX_M rows and SKINNY_MAX_WEIGHT_BYTES of weight: the skinny Triton GEMM
        (its weight loads overlap the previous kernel); else cuBLAS through torch. Batch-invariant
        mode uses the fixed-tile Triton matmul instead (cuBLAS may change kernel, and reduction
        order, with M)."""
        if self.batch_invariant:
            return gemm_k.matmul(x, weight, bias, self.invariant_tile)
        if self.skinny and bias is None and x.dim() == 2 and gemm_k.skinny_pays(x, weight):
            return gemm_k.skinny_matmul(x, weight, pdl=self.pdl)
        return torch.nn.functional.linear(x, weight, bias)

    def batched_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """cuBLAS bmm, or the skinny GEMM at decode sizes, its (G, M, N) result a view of an (M, G, N)
        tensor (MLA transposes it back to (T, H, Vh) and flattens the heads without a copy);
        batch-invariant mode: the fixed-tile Triton matmul over every group in one launch (each
        row's result independent of M)."""
        if self.batch_invariant:
            return gemm_k.batched_matmul(x, weight, self.invariant_tile)
        if self.skinny and gemm_k.skinny_pays(x, weight):
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            return gemm_k.skinny_matmul(x, weight, out.transpose(0, 1), pdl=self.pdl)
        return torch.bmm(x, weight.transpose(1, 2))

    def quantize_fp8(self, x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        return gemm_k.quantize_fp8(x, block)

    def fp8_gemm(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """DeepGEMM where installed (128-blocks: its SM90 recipe), else the Triton block-scaled
        GEMM (128- or 32-blocks)."""
        if self.vendor and not self.batch_invariant and block == FP8_BLOCK:
            out = vendor.deep_gemm_fp8(xq, x_scale, weight, weight_scale, out_dtype)
            if out is not None:
                return out
        return gemm_k.fp8_gemm(
            xq, x_scale, weight, weight_scale, out_dtype, batch_invariant=self.batch_invariant, block=block
        )

    def grouped_gemm(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        return gemm_k.grouped_gemm(
            x, weight, group_sizes, out_dtype=x.dtype, batch_invariant=self.batch_invariant,
            tiles=self._tiles(group_sizes, x.shape[0], False),
        )  # fmt: skip

    def grouped_gemm_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """128-blocks: one grouped Triton launch. 32-blocks (no FP8 routed experts in V4.1; its
        grouped wo_a): the contract's default, this part's quantiser and one fp8_gemm launch per
        non-empty group (the group sizes read on the host)."""
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"grouped_gemm_fp8 takes float8_e4m3fn weights, got {weight.dtype}")
        if block != FP8_BLOCK:
            return super().grouped_gemm_fp8(x, weight, weight_scale, group_sizes, block=block)
        xq, xs = gemm_k.quantize_fp8(x)
        return gemm_k.grouped_gemm(
            xq, weight, group_sizes, out_dtype=x.dtype, x_scale=xs, weight_scale=weight_scale.float(),
            batch_invariant=self.batch_invariant, tiles=self._tiles(group_sizes, x.shape[0], True),
        )  # fmt: skip

    def grouped_gemm_fp4(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        """MXFP4 experts in one Triton launch: e2m1 codes and UE8M0 scales decoded in the kernel,
        the product in x's dtype (SM90 has no FP4 tensor cores): bf16 x on Triton's microscaled
        product (_grouped_mx_kernel) from MX_MIN_ROWS_PER_GROUP rows an expert, else the
        nibble-pair kernel."""
        pairs = self.v4_decode
        rows, groups = x.shape[0], weight.shape[0]
        scaled = self.mx_fp4 and x.dtype == torch.bfloat16 and rows >= gemm_k.MX_MIN_ROWS_PER_GROUP * groups
        if scaled:
            cfg = gemm_k.grouped_mx_config(rows, groups)
        else:
            cfg = gemm_k.grouped_fp4_config(x.shape[0], self.batch_invariant, x.device, pairs)
        tiles = moe_k.tile_table(group_sizes, x.shape[0], cfg.block_m) if self.fused else None
        return gemm_k.grouped_gemm_fp4(
            x, weight, weight_scale, group_sizes, batch_invariant=self.batch_invariant, tiles=tiles,
            pairs=pairs, config=cfg, scaled=scaled,
        )  # fmt: skip

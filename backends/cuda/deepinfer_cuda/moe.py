"""The MoE part: the router, the expert alignment and the expert MLPs (the grouped path, or the
decode kernels for a few tokens), and the weighted combine."""

from __future__ import annotations

import weakref

import torch

from deepinfer import envs
from deepinfer.backend.ops import MoeOps
from deepinfer.backend.types import BackendOptions, RouterConfig
from deepinfer_cuda.kernels import gemm as gemm_k
from deepinfer_cuda.kernels import moe as moe_k
from deepinfer_cuda.kernels import small as small_k
from deepinfer_cuda.kernels.moe import sort_by_expert


class CudaMoe(MoeOps):
    """Fused: the router's scores at decode sizes and the router in one Triton kernel each, both
    in one launch at decode sizes (select_experts); the stable expert sort, src_to_dst, counts
    and the grouped GEMM's tile table in another (kernels/moe.py); expert MLPs by the Triton
    grouped GEMM; the weighted combine in Triton. Unfused (DEEPINFER_CUDA_UNFUSED=1): the reference's
    torch routing, the torch sort and a torch tile table per GEMM, as before the fusion."""

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.decode = self.fused and env.cuda_moe_decode  # kernels/moe.decode_moe for a few tokens
        # MXFP4 experts on decode_moe too; off (DEEPINFER_CUDA_V4_DECODE=0), DeepSeek-V4's MoE
        # (the calls with swiglu_limit) takes the contract's composition, as before V4 used fused_moe
        self.v4_decode = env.cuda_v4_decode
        self.fp4_decode = env.cuda_fp4_decode  # how decode_moe decodes MXFP4 weights (moe_k.FP4_DECODE)
        # its tiles where a benchmark pins them (else decode_config's by size), and its copy limit
        self.decode_tiles, self.max_copies = moe_k.decode_setting(env.cuda_moe_decode_tiles)
        self.early = env.cuda_moe_early
        self.pdl = env.cuda_pdl
        # The last one-launch routing: (x, ids) by weak reference, its shared experts S and E + S.
        # fused_moe on that very x and ids may start the shared copies early.
        self._routed: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int] | None = None

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Decode sizes (outside batch-invariant mode): one Triton launch on x as it is; else the
        contract's x.float() and a float32 linear."""
        if self._router_gemv(x, weight):
            return moe_k.router_logits(x, weight, pdl=self.pdl)
        return super().router_logits(x, weight)

    def route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fused:  # the contract's default: the reference router in torch ops
            return super().route(logits, config, correction_bias, hash_ids)
        tile = moe_k.router_tile(logits.shape[0], self.batch_invariant)  # its warps order a softmax sum
        return moe_k.route(logits, config, correction_bias, hash_ids, tile)

    def select_experts(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where router_logits takes its one-launch path, scores and routing in ONE launch (the
        same bits as router_logits + route); else those two."""
        self._routed = None
        if self._router_gemv(x, gate_weight):
            weights, ids = moe_k.select_experts(
                x, gate_weight, config, correction_bias, hash_ids, pdl=self.pdl
            )
            s = config.shared_experts
            self._routed = (weakref.ref(x), weakref.ref(ids), s, gate_weight.shape[0] + s)
            return weights, ids
        return super().select_experts(x, gate_weight, config, correction_bias, hash_ids)

    def _shared_early(self, x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor) -> int:
        """S where fused_moe's x and ids are the last one-launch routing's and w13 holds its E + S
        experts: the decode kernels then start the S shared experts' copies while the router runs
        (kernels/moe.decode_moe); else 0. The models call fused_moe right after select_experts, on
        the x they routed (inference tensors keep no version counter to check that x is unchanged)."""
        routed, self._routed = self._routed, None
        if routed is None or not self.early:
            return 0
        x_ref, ids_ref, shared, experts = routed
        same = x_ref() is x and ids_ref() is ids and w13.shape[0] == experts
        return shared if same else 0

    def _router_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Decode sizes, fused mode, outside batch-invariant mode: the router's one-launch kernels."""
        small = x.dim() == 2 and x.shape[0] <= moe_k.ROUTER_GEMV_MAX_TOKENS and weight.dtype == torch.float32
        return self.fused and small and not self.batch_invariant

    def _align(self, ids: torch.Tensor, num_experts: int, block_m: int | None) -> moe_k.Alignment:
        if self.fused:
            return moe_k.align(ids, num_experts, block_m)
        order, src_to_dst, counts = sort_by_expert(ids, num_experts)
        return moe_k.Alignment(order, order // ids.shape[1], src_to_dst, counts, None)

    def permute(
        self, x: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self._align(ids, num_experts, None)
        return x[a.token], a.src_to_dst, a.counts

    def unpermute(
        self, y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return small_k.weighted_combine(y_sorted, src_to_dst, weights)

    def experts(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        if w13.dtype == torch.uint8:  # MXFP4: the contract's composition over grouped_gemm_fp4
            return super().experts(x_sorted, counts, w13, w2, w13_scale, w2_scale, swiglu_limit)
        cfg = self._config(x_sorted.shape[0], w13_scale, x_sorted.device)
        tiles = moe_k.tile_table(counts, x_sorted.shape[0], cfg.block_m) if self.fused else None
        return self._mlp(x_sorted, counts, tiles, cfg, w13, w2, w13_scale, w2_scale, None, swiglu_limit)

    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        """Like the default composition, but the first GEMM reads token rows straight from x
        through the sorted ids (no permuted copy of x). Fused: route -> align (one launch: sort,
        counts and the tile table for both GEMMs) -> GEMM -> silu_and_mul -> GEMM -> combine.
        Up to max_copies token copies (moe_k.DECODE_MAX_COPIES unless pinned), outside
        batch-invariant mode (the two paths round alike but reduce in different tiles, so a row's
        bits would change with T at the limit), for unquantised experts: kernels/moe.decode_moe,
        two launches (up with silu_and_mul, down with the combine), no sort;
        DEEPINFER_CUDA_MOE_DECODE=0 turns it off.
        MXFP4 experts (DeepSeek-V4): decode_moe's GEMV kernels up to moe_k.FP4_DECODE_MAX_COPIES
        copies (pinned tiles: their copy limit), decoded as DEEPINFER_CUDA_FP4_DECODE says; above,
        the contract's composition over grouped_gemm_fp4. DEEPINFER_CUDA_V4_DECODE=0: every call
        with swiglu_limit (DeepSeek-V4) takes that composition, the path before."""
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"fused_moe: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be (T, K)"
            )
        small = ids.numel() <= self.max_copies
        shared = self._shared_early(x, ids, w13)
        limit = swiglu_limit
        if w13.dtype == torch.uint8 or (limit is not None and not self.v4_decode):  # MXFP4, or V4 off
            most = moe_k.FP4_DECODE_MAX_COPIES if self.decode_tiles is None else self.max_copies
            fits = self.fused and not self.batch_invariant and ids.numel() <= most
            if self.v4_decode and fits:
                return moe_k.decode_moe(
                    x, weights, ids, w13, w2, w13_scale, w2_scale, config=self.decode_tiles, pdl=self.pdl,
                    swiglu_limit=limit, fp4_decode=self.fp4_decode,
                )  # fmt: skip
            return super().fused_moe(x, weights, ids, w13, w2, w13_scale, w2_scale, limit)
        if self.decode and not self.batch_invariant and small and w13_scale is None and w2_scale is None:
            # bf16 / float32 experts (FP8: slower)
            return moe_k.decode_moe(
                x, weights, ids, w13, w2, config=self.decode_tiles, shared_experts=shared, pdl=self.pdl,
                swiglu_limit=limit,
            )  # fmt: skip
        cfg = self._config(ids.numel(), w13_scale, ids.device)
        a = self._align(ids, w13.shape[0], cfg.block_m)
        y = self._mlp(x, a.counts, a.tiles, cfg, w13, w2, w13_scale, w2_scale, a.token, limit)
        return small_k.weighted_combine(y, a.src_to_dst, weights)

    def _config(self, rows: int, w13_scale: torch.Tensor | None, device: torch.device) -> gemm_k.GemmConfig:
        """One tiling for both expert GEMMs (same rows, same FP8-ness), so one tile table serves."""
        return gemm_k.grouped_config(rows, w13_scale is not None, self.batch_invariant, device)

    def _mlp(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        tiles: gemm_k.TileTable | None,
        cfg: gemm_k.GemmConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None,
        gather: torch.Tensor | None,
        limit: float | None = None,
    ) -> torch.Tensor:
        def act(h: torch.Tensor) -> torch.Tensor:
            return small_k.silu_and_mul(h) if limit is None else small_k.clamped_silu_and_mul(h, limit)

        if (w13_scale is None) != (w2_scale is None):
            raise ValueError("FP8 experts need both w13_scale and w2_scale")
        rows = gather.shape[0] if gather is not None else x.shape[0]

        def gemm(
            a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
            gather: torch.Tensor | None = None,
        ) -> torch.Tensor:  # fmt: skip
            return gemm_k.grouped_gemm(
                a, w, counts, out_dtype=x.dtype, x_scale=a_scale, weight_scale=w_scale, gather=gather,
                num_rows=rows, config=cfg, tiles=tiles,
            )  # fmt: skip

        if w13_scale is None or w2_scale is None:
            return gemm(act(gemm(x, w13, None, None, gather)), w2, None, None)
        xq, xs = gemm_k.quantize_fp8(x)  # per-token quantisation commutes with the row gather
        aq, a_s = gemm_k.quantize_fp8(act(gemm(xq, w13, xs, w13_scale.float(), gather)))
        return gemm(aq, w2, a_s, w2_scale.float())

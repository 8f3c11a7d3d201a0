"""Builds the ascend Backend: torch_npu imported here (lazily, from the factory), never at
registration. Capabilities depend on the SoC: FP8 from the Ascend 950 (SoC 260) on.

DeepSeek-V4's ops (docs/ascend.md, "DeepSeek-V4 ops"):
  small.clamped_silu_and_mul    npu_clipped_swiglu (alpha 1, bias 0, halves)
  attention.indexer_topk        npu_lightning_indexer for bf16/fp16, D 128, block size % 16 == 0,
                                <= 64 heads; the reference definition for other shapes
  attention.indexer_candidate_blocks / indexer_topk_in_blocks  reference definition (DeepSeek-V4.1's
                                candidate blocks; npu_lightning_indexer has no block maxima and no
                                scoring inside listed blocks)
  attention.compressed_attention  reference definition (no torch_npu op: two key sets + sinks in
                                one softmax; vllm-ascend's custom npu_sparse_attn_sharedkv is not
                                torch_npu)
  small.hc_pre / hc_post        reference definition (no torch_npu op; custom npu_hc_pre /
                                npu_hc_post exist outside torch_npu)
  small.hc_head, gated_pool     reference definition (no torch_npu op)
  small.engram_lookup / engram_gate  reference definition (DeepSeek-V4.1's Engram; no torch_npu op)
  kv_cache.write_kv_rows / read_kv_rows, attention.quantized_attention / quantized_indexer_topk
                                (DeepSeek-V4.1's FP8 / FP4 / MXFP4 KV rows) the contract's
                                defaults: the torch quantiser on the NPU, the reference attention
                                and scoring over rows dequantised to float32, the FP4 indexer's
                                queries rounded to MXFP4 beside MXFP4 keys (eager steps only):
                                the fallback until a torch_npu op reading these byte layouts (e2m1
                                pairs with e4m3 or UE8M0 scales per 16 / 32 values) is wired
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.backend.ops import Backend, CollectiveOps
from deepinfer.backend.types import BackendOptions, Capabilities
from deepinfer_ascend import npu
from deepinfer_ascend.attention import DTYPES, AscendAttention
from deepinfer_ascend.device import AscendDevice, AscendKVCache
from deepinfer_ascend.ep import mc2_exchange
from deepinfer_ascend.gemm import AscendGemm
from deepinfer_ascend.moe import AscendMoe
from deepinfer_ascend.small import AscendSmall


class AscendCollectives(CollectiveOps):
    """torch.distributed over HCCL (process groups created with backend "hccl"); the MoE exchange
    through MC2 where the SoC's documented limits allow it (deepinfer_ascend.ep)."""

    def __init__(self, options: BackendOptions, tnpu: Any, soc: int) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._soc = soc
        self._mc2: dict[tuple[int, int, torch.dtype, int], Callable[..., torch.Tensor] | None] = {}

    @property
    def dist_backend(self) -> str:
        return "hccl"

    def expert_exchange(
        self, num_experts: int, x: torch.Tensor, top_k: int
    ) -> Callable[..., torch.Tensor] | None:
        key = (num_experts, x.shape[1], x.dtype, top_k)  # the same answer on every rank
        if key not in self._mc2:
            self._mc2[key] = mc2_exchange(self._tnpu, self._soc, num_experts, x, top_k)
        return self._mc2[key]


def capabilities(soc: int) -> Capabilities:
    return Capabilities(
        dtypes=DTYPES,  # FIA, the fused norms and MoE kernels run bf16 / fp16
        supports_fp8=npu.supports_fp8(soc),
        supports_batch_invariant=False,
        supports_graphs=True,
    )


def create_ascend_backend(options: BackendOptions | None = None) -> Backend:
    options = options or BackendOptions()
    tnpu = npu.load()
    ns = npu.torch_npu_ns()
    if not ns.is_available() or options.device_index >= ns.device_count():
        raise RuntimeError(
            f"NPU {options.device_index} is not available ({ns.device_count()} visible; "
            "check ASCEND_RT_VISIBLE_DEVICES)"
        )
    ns.set_device(options.device_index)
    kind = npu.device_type()
    device = torch.device(kind, options.device_index) if kind != "cpu" else torch.device("cpu")
    soc = npu.soc_version()
    gemm = AscendGemm(options, tnpu, fp8=npu.supports_fp8(soc))
    attention = AscendAttention(options, tnpu, device)
    return Backend(
        name="ascend",
        options=options,
        capabilities=capabilities(soc),
        device=AscendDevice(options, tnpu, ns, device, attention),
        kv_cache=AscendKVCache(options, tnpu, device),
        attention=attention,
        gemm=gemm,
        moe=AscendMoe(options, tnpu, gemm),
        collectives=AscendCollectives(options, tnpu, soc),
        small=AscendSmall(options, tnpu),
    )

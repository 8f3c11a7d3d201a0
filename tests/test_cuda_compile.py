"""The CUDA backend's kernels that the interpreter cannot vouch for compile for SM90 (Hopper) with
no GPU, at the shapes models use: DeepSeek-V4's (V4-Flash's shapes), MLA's query kernel with the
rope kernel whose helper it shares, and the router kernels. Triton lowers them to PTX and ptxas
assembles it (both ship in the Triton wheel). The interpreter (tests/test_cuda_interpret.py) runs
the kernels' arithmetic on the CPU but accepts programs the compiler rejects (mismatched types
across branches, layouts it cannot lower); this catches those. Runs without TRITON_INTERPRET (an
interpreted kernel cannot be compiled)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from deepinfer.backend.types import RouterConfig

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None or importlib.util.find_spec("deepinfer_cuda") is None,
        reason="needs triton and the deepinfer-cuda package",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="compiles: not under the interpreter"
    ),
]

PTR = {"bf16": "*bf16", "f32": "*fp32", "i32": "*i32", "i64": "*i64"}


class Ptx(str):
    """A kernel's PTX text, with the warps it was compiled for (bench/kernel_registers.py)."""

    num_warps: int = 4
    shared: int = 0  # bytes of shared memory the compiled kernel needs a program


# Shared memory a program may take on SM90 (227 KB: the H200's "Hardware limit" in a launch error).
SM90_SHARED = 232448


def compile_sm90(
    kernel: Any,
    types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    aligned: tuple[str, ...] = (),
    num_stages: int | None = None,
) -> Ptx:
    """Lower `kernel` to a cubin for sm_90 (arguments not in `types` or `constexprs` are i32);
    returns the PTX. aligned: arguments specialised as multiples of 16, as the launcher does at
    run time for pointers and integers that are (what lets masked loads vectorise, and pipeline
    through shared memory). num_stages: the launch's (None: Triton's default)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: types.get(a, "i32") for a in kernel.arg_names if a not in constexprs}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton build
        if "ptxas" in str(exc) or "backend" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise
    assert compiled.asm.get("cubin"), "no cubin"
    ptx = Ptx(compiled.asm["ptx"])
    ptx.num_warps = num_warps
    ptx.shared = compiled.metadata.shared
    return ptx


@pytest.mark.parametrize("head", [False, True], ids=["hc_pre", "hc_head"])
@pytest.mark.parametrize("block_t", [16, 32])
def test_hc_mix_kernel(head: bool, block_t: int) -> None:
    from deepinfer_cuda.kernels import v4 as v4_k

    n, dm = 4, 4096
    mix = n if head else (2 + n) * n
    splits, split_k = v4_k.hc_splits(n * dm)
    types = {"s_ptr": PTR["bf16"], "fn_ptr": PTR["f32"], "part_ptr": PTR["f32"], "ssq_ptr": PTR["f32"]}
    constexprs = dict(
        SPLITS=splits, SPLIT_K=split_k, MIX=mix, MIXP=32 if mix > 16 else 16, BLOCK_T=block_t,
        BLOCK_K=v4_k.HC_BLOCK_K,
    )  # fmt: skip
    compile_sm90(v4_k._hc_mix_kernel, types, constexprs, num_warps=4 if block_t == 16 else 8)


@pytest.mark.parametrize("head", [False, True], ids=["hc_pre", "hc_head"])
@pytest.mark.parametrize("block_d", [256, 2048])
def test_hc_finish_kernel(head: bool, block_d: int) -> None:
    from deepinfer_cuda.kernels import v4 as v4_k

    n, dm = 4, 4096
    mix = n if head else (2 + n) * n
    splits, _ = v4_k.hc_splits(n * dm)
    types = {f"{a}_ptr": PTR["f32"] for a in ("base", "scale", "part", "ssq", "post", "comb", "pre")}
    types |= {"s_ptr": PTR["bf16"], "out_ptr": PTR["bf16"], "norm_eps": "fp32", "hc_eps": "fp32"}
    constexprs = dict(
        N=n, HEAD=head, SPLITS=splits, SPLITSP=splits, NP=n, MIXP=32 if mix > 16 else 16, BLOCK_D=block_d
    )
    compile_sm90(v4_k._hc_finish_kernel, types, constexprs, num_warps=4)


def test_hc_mixes_finish_and_collapse_kernels() -> None:
    """DeepSeek-V4.1's hc_mixes (the finish storing pre, no collapse) and hc_collapse."""
    from deepinfer_cuda.kernels import v4 as v4_k

    n, dm = 4, 4096
    splits, _ = v4_k.hc_splits(n * dm)
    types = {f"{a}_ptr": PTR["f32"] for a in ("base", "scale", "part", "ssq", "post", "comb", "pre")}
    types |= {"s_ptr": PTR["bf16"], "out_ptr": PTR["f32"], "norm_eps": "fp32", "hc_eps": "fp32"}
    constexprs = dict(
        N=n, HEAD=False, SPLITS=splits, SPLITSP=splits, NP=n, MIXP=32, BLOCK_D=256, COLLAPSE=False
    )
    compile_sm90(v4_k._hc_finish_kernel, types, constexprs, num_warps=4)
    types = {"s_ptr": PTR["bf16"], "pre_ptr": PTR["f32"], "out_ptr": PTR["bf16"]}
    compile_sm90(v4_k._hc_collapse_kernel, types, dict(N=n, BLOCK_D=1024))


def test_hc_post_kernel() -> None:
    from deepinfer_cuda.kernels import v4 as v4_k

    types = {"y_ptr": PTR["bf16"], "s_ptr": PTR["bf16"], "out_ptr": PTR["bf16"]}
    types |= {"post_ptr": PTR["f32"], "comb_ptr": PTR["f32"]}
    compile_sm90(v4_k._hc_post_kernel, types, dict(N=4, NP=4, BLOCK_D=1024))


@pytest.mark.parametrize("ratio,overlap,keys", [(4, True, True), (128, False, False)])
def test_entries_kernel(ratio: int, overlap: bool, keys: bool) -> None:
    """The compressed entries of a step (kernels/v4.compressed_entries): CSA's overlapping windows
    with an indexer-key table, HCA's 128 slots."""
    from deepinfer_cuda.kernels import v4 as v4_k

    types = {"seq_ptr": PTR["i32"], "slot_ptr": PTR["i64"], "bt_ptr": PTR["i32"], "et_ptr": PTR["i32"]}
    types |= {"kt_ptr": PTR["i32"], "present_ptr": "*u8"}
    types |= {name: PTR["i64"] for name in ("state_ptr", "out_ptr", "pos_ptr", "key_ptr")}
    span = 2 * ratio if overlap else ratio
    compile_sm90(v4_k._entries_kernel, types, dict(OVERLAP=overlap, HAS_KEYS=keys, BLOCK_S=span), num_warps=1)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_varlen_attention_kernel(dtype: str) -> None:
    """The vision tower's bidirectional attention at V4.1's ViT shape (16 heads of 64)."""
    from deepinfer_cuda.kernels import vision as vision_k

    types = {f"{a}_ptr": PTR[dtype] for a in ("q", "k", "v", "o")} | {"cu_ptr": PTR["i32"], "scale": "fp32"}
    constexprs = dict(
        D=64,
        DV=64,
        BLOCK_D=64,
        BLOCK_DV=64,
        BLOCK_M=vision_k.BLOCK_M,
        BLOCK_N=vision_k.BLOCK_N,
        IEEE=dtype == "f32",
    )
    compile_sm90(vision_k._varlen_attention_kernel, types, constexprs, num_warps=4)


def test_indexer_kernels() -> None:
    from deepinfer_cuda.kernels import v4 as v4_k

    lengths = {"bt_ptr": PTR["i32"], "seq_lens_ptr": PTR["i32"], "qsl_ptr": PTR["i32"]}
    types = {
        "q_ptr": PTR["bf16"],
        "k_ptr": PTR["bf16"],
        "w_ptr": PTR["f32"],
        "score_ptr": PTR["f32"],
        "scale": "fp32",
    }
    compile_sm90(
        v4_k._indexer_scores_kernel, types | lengths, dict(BLOCK_H=64, BLOCK_D=128, BLOCK_N=64, IEEE=False)
    )
    types = {"score_ptr": PTR["f32"], "out_ptr": PTR["i32"]}
    compile_sm90(v4_k._indexer_select_kernel, types | lengths, dict(BLOCK=v4_k.SELECT_BLOCK))


def test_candidate_block_kernels() -> None:
    """DeepSeek-V4.1's candidate blocks: the block maxima, the scores over the candidate slots
    (V4.1-Flash's 32 x 128 indexer, blocks of 16; bf16 keys and the published MXFP4 key rows,
    dequantised in registers, the queries rounded to MXFP4 in registers beside them) and the
    select of both stages."""
    from deepinfer_cuda.kernels import v4 as v4_k

    lengths = {"bt_ptr": PTR["i32"], "seq_lens_ptr": PTR["i32"], "qsl_ptr": PTR["i32"]}
    types = {"score_ptr": PTR["f32"], "out_ptr": PTR["f32"]}
    compile_sm90(v4_k._block_max_kernel, types | lengths, dict(BLOCK_B=64, BS=16))
    for key_format in (None, "mxfp4"):
        types = {
            "q_ptr": PTR["bf16"],
            "k_ptr": PTR["bf16"] if key_format is None else "*u8",
            "w_ptr": PTR["f32"],
            "blocks_ptr": PTR["i32"],
            "score_ptr": PTR["f32"],
            "scale": "fp32",
        }
        constexprs = dict(
            BLOCK_H=32, BLOCK_D=128, BLOCK_N=64, IEEE=False, K_FMT=v4_k.row_format_code(key_format),
            Q_MXFP4=key_format == "mxfp4",
        )  # fmt: skip
        compile_sm90(v4_k._listed_scores_kernel, types | lengths, constexprs)
    types = {"score_ptr": PTR["f32"], "blocks_ptr": PTR["i32"], "out_ptr": PTR["i32"], "qsl_ptr": PTR["i32"]}
    for listed in (True, False):
        compile_sm90(v4_k._listed_select_kernel, types, dict(LISTED=listed, BLOCK=v4_k.SELECT_BLOCK))


@pytest.mark.parametrize("topk", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "splits"])
def test_compressed_attention_kernel(topk: bool, direct: bool) -> None:
    from deepinfer_cuda.kernels import v4 as v4_k

    types = {a: PTR["bf16"] for a in ("q_ptr", "kv_ptr", "ckv_ptr", "out_ptr")}
    types |= {a: PTR["i32"] for a in ("bt_ptr", "cbt_ptr", "seq_lens_ptr", "qsl_ptr", "topk_ptr")}
    types |= {"sinks_ptr": PTR["f32"], "part_ptr": PTR["f32"], "lse_ptr": PTR["f32"], "qk_scale": "fp32"}
    cfg = v4_k._compressed_config(64, torch.bfloat16)
    constexprs = dict(
        BLOCK_D=512, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=True, HAS_TOPK=topk, HAS_SINKS=True,
        DIRECT=direct, IEEE=False,
    )  # fmt: skip
    compile_sm90(v4_k._compressed_attention_kernel, types, constexprs, num_warps=cfg.num_warps)


@pytest.mark.parametrize("formats", [("fp8", "fp4"), ("fp8", "fp8")], ids=["fp8-fp4", "fp8-fp8"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "splits"])
def test_quantized_attention_kernel(formats: tuple[str, str], direct: bool) -> None:
    """DeepSeek-V4.1's rows: the compressed-attention kernel over uint8 FP8 window rows and FP4 /
    FP8 entry rows (V4.1-Flash: 64 heads, D 512), dequantised in registers."""
    from deepinfer_cuda.kernels import v4 as v4_k

    types = {a: PTR["bf16"] for a in ("q_ptr", "out_ptr")} | {"kv_ptr": "*u8", "ckv_ptr": "*u8"}
    types |= {a: PTR["i32"] for a in ("bt_ptr", "cbt_ptr", "seq_lens_ptr", "qsl_ptr", "topk_ptr")}
    types |= {"sinks_ptr": PTR["f32"], "part_ptr": PTR["f32"], "lse_ptr": PTR["f32"], "qk_scale": "fp32"}
    cfg = v4_k._compressed_config(64, torch.bfloat16)
    constexprs = dict(
        BLOCK_D=512, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=True, HAS_TOPK=True, HAS_SINKS=True,
        DIRECT=direct, IEEE=False, KV_FMT=v4_k.row_format_code(formats[0]),
        CKV_FMT=v4_k.row_format_code(formats[1]),
    )  # fmt: skip
    compile_sm90(v4_k._compressed_attention_kernel, types, constexprs, num_warps=cfg.num_warps)


def test_quantized_indexer_scores_kernel() -> None:
    """MXFP4 index keys (V4.1-Flash: 32 heads x 128), dequantised in registers, the queries
    rounded to MXFP4 in registers (the FP4 indexer)."""
    from deepinfer_cuda.kernels import v4 as v4_k

    lengths = {"bt_ptr": PTR["i32"], "seq_lens_ptr": PTR["i32"], "qsl_ptr": PTR["i32"]}
    types = {"q_ptr": PTR["bf16"], "k_ptr": "*u8", "w_ptr": PTR["f32"], "score_ptr": PTR["f32"]}
    types["scale"] = "fp32"
    constexprs = dict(
        BLOCK_H=32, BLOCK_D=128, BLOCK_N=64, IEEE=False, K_FMT=v4_k.row_format_code("mxfp4"), Q_MXFP4=True
    )
    compile_sm90(v4_k._indexer_scores_kernel, types | lengths, constexprs)


@pytest.mark.parametrize(("fmt", "width"), [("fp8", 512), ("fp4", 512), ("mxfp4", 128)])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_v41_row_store_kernels(fmt: str, width: int, dtype: str) -> None:
    """DeepSeek-V4.1's fused quantise + store of each row format at V4.1-Flash's widths (the
    window / main rows of 512 values, the index keys of 128), from bf16 and float32 rows."""
    from deepinfer_cuda.kernels import kv_v41

    kernel, group = kv_v41._KERNELS[fmt]  # type: ignore[index]
    types = {"x_ptr": PTR[dtype], "cache_ptr": "*u8", "slot_ptr": PTR["i64"]}
    ptx = compile_sm90(kernel, types, dict(BLOCK_G=width // group), num_warps=2)
    assert "div.rn.f32" in ptx  # the IEEE quotients of the reference's scales


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("tile", ["decode", "prefill"])
def test_mla_query_kernel(dtype: str, tile: str) -> None:
    from deepinfer_cuda.kernels import mla as mla_k

    cfg = mla_k.DECODE_TILE if tile == "decode" else mla_k.PREFILL_TILE
    types = {a: PTR[dtype] for a in ("qn_ptr", "qp_ptr", "w_ptr", "out_ptr", "kv_ptr", "kvw_ptr")}
    types["cache_ptr"] = PTR[dtype]
    types |= {"pos_ptr": PTR["i64"], "cs_ptr": PTR["f32"], "slot_ptr": PTR["i64"], "eps": "fp32"}
    tiles = dict(BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c, BLOCK_N=128, BLOCK_R=32, BLOCK_KC=512)
    decode = tile == "decode"
    constexprs = dict(INTERLEAVED=True, IEEE=dtype == "f32", PDL=dtype == "bf16", WRITE=decode, EARLY=decode)
    constexprs |= tiles
    compile_sm90(mla_k._mla_query_kernel, types, constexprs, num_warps=cfg.num_warps)


@pytest.mark.parametrize("e, m", [(64, 1024), (256, 808)])  # V2-Lite's prefill, V3's decode at batch 101
def test_align_kernel(e: int, m: int) -> None:
    """The expert sort: a program per block of rows, each reading every id (histograms of up to
    ALIGN_MAX_ROWS ids)."""
    from deepinfer_cuda.kernels import moe as moe_k

    types = {a: PTR["i64"] for a in ("order_ptr", "token_ptr", "s2d_ptr", "counts_ptr")}
    types |= {"ids_ptr": PTR["i32"], "group_ptr": PTR["i32"], "rows_ptr": PTR["i32"]}
    block_e = max(16, 1 << (e - 1).bit_length())
    constexprs = dict(TILES=True, BLOCK_M=16, BLOCK_R=moe_k._block_rows(block_e), BLOCK_E=block_e,
                      BLOCK_T=moe_k.SPARE_TILES_BLOCK, BLOCK_ALL=1 << (m - 1).bit_length())  # fmt: skip
    compile_sm90(moe_k._align_kernel, types, constexprs)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_kernel(interleaved: bool) -> None:
    from deepinfer_cuda.kernels import small as small_k

    types = {"x_ptr": PTR["bf16"], "y_ptr": PTR["bf16"], "pos_ptr": PTR["i64"], "cs_ptr": PTR["f32"]}
    compile_sm90(small_k._rope_kernel, types, dict(INTERLEAVED=interleaved, BLOCK_H=16, BLOCK_R=32))


@pytest.mark.parametrize("biased", [False, True])
def test_gated_pool_kernel(biased: bool) -> None:
    """The compressor's pooling at V4-Flash's HCA tile (128 slots), plain and with the position
    bias and absent slots (small.compressor_pool)."""
    from deepinfer_cuda.kernels import small as small_k

    types = {"kv_ptr": PTR["bf16"], "gate_ptr": PTR["bf16"], "out_ptr": PTR["bf16"]}
    types |= {"bias_ptr": PTR["f32"], "present_ptr": "*u8"}
    compile_sm90(small_k._gated_pool_kernel, types, dict(BIASED=biased, BLOCK_S=128, BLOCK_D=32))


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_kernel(inverse: bool) -> None:
    """V4's partial rope at its shapes: 512-wide heads, a 64-wide rotary tail."""
    from deepinfer_cuda.kernels import small as small_k

    types = {"x_ptr": PTR["bf16"], "y_ptr": PTR["bf16"], "pos_ptr": PTR["i64"], "cs_ptr": PTR["f32"]}
    compile_sm90(small_k._rope_tail_kernel, types, dict(INVERSE=inverse, BLOCK_H=16, BLOCK_D=128, BLOCK_R=32))


@pytest.mark.parametrize("router", ["v3", "v4_hash"])
def test_router_kernels(router: str) -> None:
    """route, router_logits and select_experts (both in one launch, its ticket atomics) for
    DeepSeek-V3's router (256 experts in 8 groups, bias, a shared expert) and V4's hash layers."""
    from deepinfer_cuda.kernels import moe as moe_k

    from deepinfer.backend.types import RouterConfig

    if router == "v3":
        config = RouterConfig(
            "sigmoid", top_k=8, num_groups=8, topk_groups=4, group_score="top2_sum", renormalize=True,
            routed_scaling_factor=2.5, shared_experts=1,
        )  # fmt: skip
        bias, hash_ids = torch.zeros(256), None
    else:
        config = RouterConfig("sqrtsoftplus", top_k=6, renormalize=True, routed_scaling_factor=1.5)
        bias, hash_ids = None, torch.zeros((1, 6), dtype=torch.int64)
    route = moe_k._route_args(1, 256, config, bias, hash_ids)
    types = {a: PTR["f32"] for a in ("logits_ptr", "bias_ptr", "w_ptr", "gate_ptr")}
    types |= {"ids_ptr": PTR["i32"], "tickets_ptr": PTR["i32"], "hash_ptr": "*i64", "scaling": "fp32"}
    types |= {"x_ptr": PTR["bf16"], "out_ptr": PTR["f32"]}
    for tile in (moe_k.ROUTER_TILE, moe_k.ROUTER_FEW_TILE):
        gemv = dict(BLOCK_E=tile.block_e, BLOCK_D=min(tile.block_d, 4096), PDL=router == "v3")
        compile_sm90(moe_k._route_kernel, types, route, num_warps=tile.num_warps)
        gemv_types = types | {"w_ptr": PTR["f32"]}
        compile_sm90(moe_k._router_logits_kernel, gemv_types, gemv, num_warps=tile.num_warps)
        compile_sm90(moe_k._select_experts_kernel, types, route | gemv, num_warps=tile.num_warps)


@pytest.mark.parametrize("rows, groups", [(1536, 256), (24576, 256)])
def test_grouped_mx_kernel(rows: int, groups: int) -> None:
    """The MXFP4 grouped GEMM on tl.dot_scaled (CudaGemm's for bf16 x; the interpreter lacks the
    op, so only the GPU runs it) lowers, at grouped_mx_config's tiles, to SM90's warpgroup MMA on
    bf16 with the upcast weights as its register operand (wgmma ... {registers}, descriptor) and
    the e2m1 decode as byte permutes (prmt), not to mma.sync or a float32 decode."""
    from deepinfer_cuda.kernels import gemm as gemm_k

    cfg = gemm_k.grouped_mx_config(rows, groups)
    types = {"a_ptr": PTR["bf16"], "w_ptr": "*u8", "s_ptr": "*u8", "c_ptr": PTR["bf16"],
             "tile_group_ptr": PTR["i32"], "tile_rows_ptr": PTR["i32"]}  # fmt: skip
    ints = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_cm")
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    ptx = compile_sm90(
        gemm_k._grouped_mx_kernel, types, constexprs, num_warps=cfg.num_warps, aligned=(*types, *ints)
    )
    mmas = [line for line in ptx.splitlines() if "mma_async" in line or "mma.sync" in line]
    assert mmas and all("wgmma" in m and ".f32.bf16.bf16" in m for m in mmas), sorted(
        {m.split()[0] for m in mmas}
    )
    assert all(m.split("}, {")[1].startswith("%r") for m in mmas), (
        "the weights are the MMA's register operand"
    )
    assert "prmt.b32" in ptx


@pytest.mark.parametrize(
    "block_m, block_n, slab, warps",
    [(16, 64, 256, 4), (16, 64, 512, 8), (64, 64, 256, 4), (64, 128, 512, 8), (32, 128, 256, 4)],
)
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_skinny_fp8_mma_kernel(block_m: int, block_n: int, slab: int, warps: int, pdl: bool) -> None:
    """The skinny FP8 variant that multiplies e4m3 by e4m3 (SkinnyConfig.fp8_mma) lowers to SM90's
    FP8 warpgroup MMA (wgmma ... .f32.e4m3.e4m3: no operand converted to bf16), k32 steps, four a
    128-wide block (block_n 32 would be mma.sync on float16: skinny_fp8_matmul refuses it); with
    the operands aligned as at run time (V4-Flash's K = 4096) the whole weight slab loads as
    16-byte vectors before the wait under PDL; without PDL no griddepcontrol."""
    from deepinfer_cuda.kernels import gemm as gemm_k

    types = {"x_ptr": PTR["bf16"], "w_ptr": "*fp8e4nv", "wscale_ptr": PTR["f32"], "out_ptr": PTR["bf16"],
             "ws_ptr": PTR["f32"], "tickets_ptr": PTR["i32"]}  # fmt: skip
    ints = ("N", "K", "stride_xg", "stride_xm", "stride_wg", "stride_wn", "stride_og", "stride_om")
    ints += ("stride_sg",)
    aligned = (*types, *ints)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SLAB=slab, SPLIT=True, SPLITS=4, PDL=pdl)
    ptx = compile_sm90(gemm_k._skinny_fp8_mma_kernel, types, constexprs, num_warps=warps, aligned=aligned)
    lines = ptx.splitlines()
    mmas = [line for line in lines if "mma_async" in line or "mma.sync" in line]
    kinds = sorted({m.split()[0] for m in mmas})
    assert mmas and all("wgmma" in m and ".f32.e4m3.e4m3" in m for m in mmas), kinds
    assert len(mmas) % (4 * slab // 128) == 0, f"{len(mmas)} MMA instructions for {slab // 128} blocks"
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    vector_loads = sum("ld.global.v4.b32" in line for line in lines[:wait])
    want = block_n * slab // (16 * 32 * warps)  # the slab's bytes in 16-byte loads per thread
    assert vector_loads == want, f"{vector_loads} 16-byte loads before the wait, want {want}"
    assert "griddepcontrol.launch_dependents" in "\n".join(lines[:wait])


def decode_step_kernels(pdl: bool) -> dict[str, Ptx]:
    """The PTX of every Triton kernel of a V2-Lite-sized bfloat16 decode step, each compiled with
    PDL as given (the constexpr that makes it wait for the previous kernel, common.pdl_enabled)."""
    from deepinfer_cuda.kernels import attention as att_k
    from deepinfer_cuda.kernels import gemm as gemm_k
    from deepinfer_cuda.kernels import mla as mla_k
    from deepinfer_cuda.kernels import moe as moe_k
    from deepinfer_cuda.kernels import small as small_k

    bf16, f32, i32, i64 = PTR["bf16"], PTR["f32"], PTR["i32"], PTR["i64"]
    ptx: dict[str, Ptx] = {}
    ptx["rms_norm"] = compile_sm90(
        small_k._rms_norm_kernel,
        {a: bf16 for a in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr")} | {"eps": "fp32"},
        dict(HAS_RES=True, BLOCK=2048, PDL=pdl),
    )  # fmt: skip
    ptx["write_mla_kv"] = compile_sm90(
        small_k._write_mla_kv_kernel,
        {"kv_ptr": bf16, "w_ptr": bf16, "pos_ptr": i64, "cs_ptr": f32, "slot_ptr": i64, "cache_ptr": bf16,
         "eps": "fp32"},
        dict(INTERLEAVED=True, BLOCK_C=512, BLOCK_R=32, ROPE=True, PDL=pdl),
    )  # fmt: skip
    ptx["mla_query_and_cache"] = compile_sm90(
        mla_k._mla_query_kernel,
        {a: bf16 for a in ("qn_ptr", "qp_ptr", "w_ptr", "out_ptr", "kv_ptr", "kvw_ptr", "cache_ptr")}
        | {"pos_ptr": i64, "cs_ptr": f32, "slot_ptr": i64, "eps": "fp32"},
        dict(INTERLEAVED=True, IEEE=False, BLOCK_T=16, BLOCK_C=64, BLOCK_N=128, BLOCK_R=32, WRITE=True,
             BLOCK_KC=512, EARLY=True, PDL=pdl),
    )  # fmt: skip
    attn_types = {a: bf16 for a in ("q_ptr", "kv_ptr", "out_ptr", "sinks_ptr", "allow_ptr")}
    attn_types |= {a: i32 for a in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")}
    attn_types |= {"part_ptr": f32, "lse_ptr": f32, "qk_scale": "fp32"}
    ptx["mla_attention"] = compile_sm90(
        att_k._mla_attention_kernel, attn_types,
        dict(k_desc=None, kr_desc=None, BLOCK_DL=512, BLOCK_DR=64, BLOCK_DV=512, HAS_ROPE=True, V_IS_LAT=True,
             BLOCK_M=16, BLOCK_N=16, HAS_WINDOW=False, HAS_SINKS=False, HAS_ALLOW=False, DIRECT=False,
             IEEE=False, TMA=False, EARLY=False, PDL=pdl, FP8_TILE=0, FP8_TILES=0, FP8_HALF=False),
    )  # fmt: skip
    ptx["mla_attention_early"] = compile_sm90(  # mla_decode_and_uv's: TMA tiles, the first before the wait
        att_k._mla_attention_kernel,
        attn_types | {"k_desc": "tensordesc<bf16[16, 512]>", "kr_desc": "tensordesc<bf16[16, 64]>"},
        dict(BLOCK_DL=512, BLOCK_DR=64, BLOCK_DV=512, HAS_ROPE=True, V_IS_LAT=True, BLOCK_M=16, BLOCK_N=16,
             HAS_WINDOW=False, HAS_SINKS=False, HAS_ALLOW=False, DIRECT=False, IEEE=False, TMA=True,
             EARLY=True, PDL=pdl, FP8_TILE=0, FP8_TILES=0, FP8_HALF=False),
    )  # fmt: skip
    ptx["mla_attention_fp8"] = compile_sm90(  # FP8 latent rows (uint8), dequantised in registers
        att_k._mla_attention_kernel, attn_types | {"kv_ptr": "*u8"},
        dict(k_desc=None, kr_desc=None, BLOCK_DL=512, BLOCK_DR=64, BLOCK_DV=512, HAS_ROPE=True, V_IS_LAT=True,
             BLOCK_M=16, BLOCK_N=16, HAS_WINDOW=False, HAS_SINKS=False, HAS_ALLOW=False, DIRECT=False,
             IEEE=False, TMA=False, EARLY=False, PDL=pdl, FP8_TILE=128, FP8_TILES=4, FP8_HALF=False),
    )  # fmt: skip
    ptx["combine"] = compile_sm90(
        att_k._combine_kernel, {"part_ptr": f32, "lse_ptr": f32, "sinks_ptr": f32, "out_ptr": bf16},
        dict(HAS_SINKS=False, BLOCK_DV=512, BLOCK_S=16, BLOCK_C=128, ROWS=1, PDL=pdl),
    )  # fmt: skip
    skinny = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=True, SLAB=512, BLOCK_S=16, PDL=pdl, FP8=False)
    ptx["skinny"] = compile_sm90(
        gemm_k._skinny_kernel,
        {"x_ptr": bf16, "w_ptr": bf16, "out_ptr": bf16, "ws_ptr": f32, "tickets_ptr": i32, "lse_ptr": bf16},
        skinny | dict(MERGE=False, SPLITS=4), num_warps=8,
    )  # fmt: skip
    ptx["skinny_merge"] = compile_sm90(  # W_UV reading the attention's split-KV partials
        gemm_k._skinny_kernel,
        {"x_ptr": f32, "w_ptr": bf16, "out_ptr": bf16, "ws_ptr": f32, "tickets_ptr": i32, "lse_ptr": f32},
        skinny | dict(MERGE=True, SPLIT=False, SPLITS=1), num_warps=8,
    )  # fmt: skip
    ptx["skinny_fp8"] = compile_sm90(  # DeepSeek-V4's FP8 linears: e4m3 weights, 128 x 128 block scales
        gemm_k._skinny_kernel,
        {"x_ptr": bf16, "w_ptr": "*fp8e4nv", "out_ptr": bf16, "ws_ptr": f32, "tickets_ptr": i32,
         "lse_ptr": bf16, "wscale_ptr": f32},
        skinny | dict(MERGE=False, SPLITS=4, FP8=True), num_warps=8,
    )  # fmt: skip
    ptx["select_experts"] = compile_sm90(
        moe_k._select_experts_kernel,
        {a: f32 for a in ("gate_ptr", "logits_ptr", "bias_ptr", "w_ptr")}
        | {"x_ptr": bf16, "tickets_ptr": i32, "ids_ptr": i32, "hash_ptr": i64, "scaling": "fp32"},
        moe_k._route_args(1, 64, RouterConfig("softmax", top_k=6, shared_experts=2), None, None)
        | dict(BLOCK_E=moe_k.ROUTER_FEW_TILE.block_e, BLOCK_D=moe_k.ROUTER_FEW_TILE.block_d, PDL=pdl),
    )  # fmt: skip
    tiles = dict(FP8=False, IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PDL=pdl, FP4=False, STAGES=3)
    up_types = {"x_ptr": bf16, "w_ptr": bf16, "ws_ptr": f32, "ids_ptr": i32, "act_ptr": bf16,
                "count_ptr": i32, "limit": "fp32"}  # fmt: skip
    down_types = {"a_ptr": bf16, "w_ptr": bf16, "ws_ptr": f32, "ids_ptr": i32, "wt_ptr": f32, "y_ptr": bf16,
                  "out_ptr": bf16, "count_ptr": i32}  # fmt: skip
    ptx["decode_up"] = compile_sm90(
        moe_k._decode_up_kernel, up_types, tiles | dict(ZERO_BLOCK=4, SHARED=2, CLAMP=False)
    )
    ptx["decode_down"] = compile_sm90(
        moe_k._decode_down_kernel, down_types, tiles | dict(COMBINE=True, SHARED=2, K_IDS=8)
    )
    # DeepSeek-V4's experts: MXFP4 weights (two values a byte), UE8M0 scale bytes, clamped SwiGLU
    fp4_types = {"w_ptr": "*u8", "ws_ptr": "*u8"}
    for suffix, fp4 in (("", moe_k.FP4_DECODE_CONFIG), ("_one_token", moe_k.FP4_ONE_TOKEN_CONFIG)):
        fp4_tiles = tiles | dict(FP4=True, BLOCK_K=fp4.up_k)
        ptx[f"decode_up_fp4{suffix}"] = compile_sm90(
            moe_k._decode_up_kernel, up_types | fp4_types,
            fp4_tiles | dict(BLOCK_N=fp4.up_n, STAGES=fp4.up_stages, ZERO_BLOCK=4, SHARED=0, CLAMP=True),
        )  # fmt: skip
        ptx[f"decode_down_fp4{suffix}"] = compile_sm90(
            moe_k._decode_down_kernel, down_types | fp4_types,
            fp4_tiles | dict(BLOCK_N=fp4.down_n, BLOCK_K=fp4.down_k, STAGES=fp4.down_stages, COMBINE=True,
                             SHARED=0, K_IDS=6),
        )  # fmt: skip
    return ptx


def _fp8_launches() -> list[tuple[str, Any, torch.dtype]]:
    """The distinct tiles mla_attention picks over FP8 rows (attention.launch_config) for the
    models' head counts (16, 32, 64, 128) in decode (batch 1 over a short span, batch 128 over
    32768 keys), chunked prefill (8 query tokens) and batch-invariant mode, bfloat16 and float32
    queries; each id names the tiles (block_m x block_n, warps, stages)."""
    from deepinfer_cuda.kernels import attention as att_k

    seen: dict[Any, tuple[str, Any, torch.dtype]] = {}
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        for heads in (16, 32, 64, 128):
            for q, batch, span, inv in ((1, 1, 160, False), (1, 128, 32768, False), (8, 4, 4096, False),
                                        (1, 32, 4096, True)):  # fmt: skip
                cfg, _ = att_k.launch_config(dtype, q * heads, q, batch, span, inv, True, cpu)
                name = f"{cfg.block_m}x{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}_{str(dtype)[6:]}"
                seen.setdefault((name, dtype), (name, cfg, dtype))  # TMA or not: the same kernel here
    return list(seen.values())


FP8_LAUNCHES = _fp8_launches()


# The reads of FP8 rows: the float16 read (bfloat16 / float16 queries only), by pointers or TMA,
# and the read in q's dtype with the scales per tile or per value.
FP8_READS = {"half": "float16_read", "half_tma": "float16_read_tma", "tiles": "scales_per_tile",
             "values": "scales_per_value"}  # fmt: skip


FP8_CASES = [
    (p, r) for p in FP8_LAUNCHES for r in FP8_READS if p[2] != torch.float32 or not r.startswith("half")
]


@pytest.mark.parametrize(
    ("cfg", "dtype", "read"),
    [(*p[1:], r) for p, r in FP8_CASES],
    ids=[f"{p[0]}-{FP8_READS[r]}" for p, r in FP8_CASES],
)
def test_fp8_cache_kernels(cfg: Any, dtype: torch.dtype, read: str) -> None:
    """FP8 latent caches (kernels/kv_fp8.py): the attention kernel reading uint8 rows (DeepSeek-V3's
    512 + 64) at every tiling mla_attention picks for them, compiled as the launcher specialises it
    (pointers, strides and widths multiples of 16, the config's stages), fits SM90's shared memory:
    WIDE_CONFIG's 64 x 64 tiles with a scale per value needed 319488 bytes there on an H200. The
    float16 read (bfloat16 queries only) multiplies float16 operands: SM90's MMA on them, the
    e4m3 pairs converted straight to float16 (no bfloat16 conversion left in it); half_tma: its
    latent bytes by TMA (attention.FP8_TMA, a (rows, 2, 256) descriptor)."""
    from deepinfer_cuda.kernels import attention as att_k

    half = read.startswith("half")
    tiles = 0 if read == "values" else 4
    dt = "bf16" if dtype == torch.bfloat16 else "f32"
    types = {a: PTR[dt] for a in ("q_ptr", "out_ptr", "sinks_ptr", "allow_ptr")} | {"kv_ptr": "*u8"}
    types |= {a: PTR["i32"] for a in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")}
    types |= {"part_ptr": PTR["f32"], "lse_ptr": PTR["f32"], "qk_scale": "fp32"}
    types |= {"qh_ptr": "*fp16", "qs_ptr": PTR["f32"]}  # the float16 read's queries
    tma = read == "half_tma"
    descs = {"k_desc": f"tensordesc<u8[{cfg.block_n}, 2, 256]>"} if tma else {}
    aligned = ("q_ptr", "kv_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "out_ptr", "part_ptr", "lse_ptr",
               "stride_qt", "stride_qh", "stride_kvb", "stride_kvt", "stride_bt", "stride_ot", "stride_oh",
               "D_LAT", "D_ROPE", "DV", "qh_ptr", "qs_ptr")  # fmt: skip
    ptx = compile_sm90(
        att_k._mla_attention_kernel, types | descs,
        ({} if tma else dict(k_desc=None)) | dict(kr_desc=None, BLOCK_DL=512, BLOCK_DR=64, BLOCK_DV=512,
             HAS_ROPE=True, V_IS_LAT=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=False,
             HAS_SINKS=False, HAS_ALLOW=False, DIRECT=False, IEEE=dtype == torch.float32, TMA=tma,
             EARLY=False, PDL=True, FP8_TILE=128, FP8_TILES=tiles, FP8_HALF=half),
        num_warps=cfg.num_warps, aligned=aligned, num_stages=cfg.num_stages,
    )  # fmt: skip
    assert "e4m3" in ptx, "the FP8 rows are not converted in registers"
    assert ptx.shared <= SM90_SHARED, f"{ptx.shared} bytes of shared memory, SM90 has {SM90_SHARED}"
    if tma:
        assert "cp.async.bulk.tensor.3d" in ptx, "the latent bytes not by TMA"
    if half:
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx, "not the float16 read"
        assert ".f16.f16" in ptx, "no float16 MMA"


def test_fp8_store_and_v_prefix_kernels() -> None:
    """The quantising store, the float16 read's queries, and the direct (one split) kernel with V a
    prefix of the latent."""
    from deepinfer_cuda.kernels import attention as att_k
    from deepinfer_cuda.kernels import kv_fp8

    compile_sm90(
        kv_fp8._write_fp8_rows_kernel, {"kv_ptr": PTR["bf16"], "cache_ptr": "*u8", "slot_ptr": PTR["i64"]},
        dict(TILE=128, BLOCK_T=128, BLOCK_R=64), num_warps=1,
    )  # fmt: skip
    half = compile_sm90(
        kv_fp8._half_queries_kernel, {"q_ptr": PTR["bf16"], "out_ptr": "*fp16", "inv_ptr": PTR["f32"]},
        dict(BLOCK_R=16, BLOCK_C=512, PDL=True),
    )  # fmt: skip
    assert "griddepcontrol.wait" in half
    types = {a: PTR["bf16"] for a in ("q_ptr", "out_ptr", "sinks_ptr", "allow_ptr")} | {"kv_ptr": "*u8"}
    types |= {a: PTR["i32"] for a in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")}
    types |= {"part_ptr": PTR["f32"], "lse_ptr": PTR["f32"], "qk_scale": "fp32"}
    ptx = compile_sm90(
        att_k._mla_attention_kernel, types,
        dict(k_desc=None, kr_desc=None, BLOCK_DL=512, BLOCK_DR=64, BLOCK_DV=256, HAS_ROPE=True,
             V_IS_LAT=False, BLOCK_M=16, BLOCK_N=32, HAS_WINDOW=False, HAS_SINKS=False, HAS_ALLOW=False,
             DIRECT=True, IEEE=False, TMA=False, EARLY=False, PDL=True, FP8_TILE=128, FP8_TILES=4,
             FP8_HALF=False),
        num_stages=2,
    )  # fmt: skip
    assert "e4m3" in ptx, "the FP8 rows are not converted in registers"
    assert ptx.shared <= SM90_SHARED


@pytest.mark.parametrize("decode", ["GROUP", "MMA", "ASM", "SCALED"])
def test_fp4_decode_variant_kernels(decode: str) -> None:
    """decode_moe's MXFP4 kernels under each FP4_DECODE variant (PAIR: decode_step_kernels) at
    both of its decode tiles (fp4_decode_config) lower for SM90 without spills: MMA, ASM and
    SCALED multiply on the tensor cores in bf16 (SCALED on its 64 rows by wgmma), ASM decodes by
    its inline PTX (prmt, bf16x2 multiplies), GROUP with no float32 scale multiply per value
    (PAIR has two a value: 2^126 and the scale)."""
    from deepinfer_cuda.kernels import moe as moe_k

    bf16, f32, i32 = PTR["bf16"], PTR["f32"], PTR["i32"]
    tiles = dict(FP8=False, IEEE=False, BLOCK_M=16, PDL=True, FP4=True)
    up_types = {"x_ptr": bf16, "w_ptr": "*u8", "ws_ptr": "*u8", "ids_ptr": i32, "act_ptr": bf16,
                "count_ptr": i32, "limit": "fp32"}  # fmt: skip
    down_types = {"a_ptr": bf16, "w_ptr": "*u8", "ws_ptr": "*u8", "ids_ptr": i32, "wt_ptr": f32,
                  "y_ptr": bf16, "out_ptr": bf16, "count_ptr": i32}  # fmt: skip
    for cfg in (moe_k.fp4_decode_config(1, decode), moe_k.fp4_decode_config(64, decode)):
        for name, kernel, types, extra in (
            ("up", moe_k._decode_up_kernel, up_types, dict(ZERO_BLOCK=4, SHARED=0, CLAMP=True)),
            ("down", moe_k._decode_down_kernel, down_types, dict(COMBINE=True, SHARED=0, K_IDS=6)),
        ):
            n, k, st = (cfg.up_n, cfg.up_k, cfg.up_stages) if name == "up" else (cfg.down_n, cfg.down_k,
                                                                                cfg.down_stages)  # fmt: skip
            consts = tiles | extra | dict(BLOCK_N=n, BLOCK_K=k, STAGES=st)
            ptxs = {d: compile_sm90(kernel, types, consts | dict(DECODE=moe_k.FP4_DECODE[d]), num_stages=st)
                    for d in ("PAIR", decode)}  # fmt: skip
            ptx, what = ptxs[decode], f"{decode} {name} {k}"
            assert ".local" not in ptx, f"{what}: registers spill to local memory"
            mmas = [line for line in ptx.splitlines() if "mma.sync" in line or "mma_async" in line]
            if decode == "GROUP":
                assert not mmas, what
                assert ptx.count("mul.f32") < 0.6 * ptxs["PAIR"].count("mul.f32"), what
            else:
                assert mmas and all(".bf16.bf16" in m for m in mmas), what
            if decode == "SCALED":  # 64 rows: the warpgroup MMA
                assert all("wgmma" in m for m in mmas), what
            if decode == "ASM":
                assert "mul.rn.bf16x2" in ptx and "prmt.b32" in ptx, what


def test_decode_step_kernels_wait_for_the_previous_kernel_under_pdl() -> None:
    """Every kernel of the decode step compiles with programmatic dependent launch, and waits for
    its predecessor (griddepcontrol.wait) exactly when launched that way: a kernel launched with
    PDL that never waited could read its inputs before they are written."""
    with_pdl = decode_step_kernels(True)
    without = decode_step_kernels(False)
    for name, ptx in with_pdl.items():
        assert "griddepcontrol.wait" in ptx, f"{name}: launched with PDL but never waits"
        assert "griddepcontrol.launch_dependents" in ptx, f"{name}: never lets the next kernel launch early"
    for name, ptx in without.items():
        assert "griddepcontrol" not in ptx, f"{name}: PDL instructions without PDL"


def test_split_reductions_load_their_parts_together() -> None:
    """The last program of a split reduction (the skinny GEMM's K splits, the decode down
    kernel's fused combine of a token's K copies, the grouped path's combine) adds the parts in a
    loop unrolled at compile time, one load instruction per part, so the loads need not wait on
    one another: a runtime loop (one load instruction in PTX) made one L2 round trip after
    another at the end of those kernels."""
    from deepinfer_cuda.kernels import small as small_k

    step = decode_step_kernels(True)  # the skinny GEMM with 4 splits, the down kernel with 8 copies
    combine = compile_sm90(
        small_k._combine_kernel,
        {"y_ptr": PTR["bf16"], "idx_ptr": PTR["i64"], "w_ptr": PTR["f32"], "out_ptr": PTR["bf16"]},
        dict(K=8, BLOCK=1024),
    )
    for name, ptx, parts, load in (
        ("skinny", step["skinny"], 4, "ld.volatile.global"),
        ("decode_down", step["decode_down"], 8, "ld.volatile.global"),
        ("combine", combine, 8, "ld.global.b64"),  # the K row indices, before the rows
    ):
        lines = ptx.splitlines()
        start = next((i for i, line in enumerate(lines) if "atom." in line), 0)
        tail = lines[start:]
        loads = sum(load in line for line in tail)
        assert loads >= parts, f"{name}: {loads} {load} after the ticket, expected one per part"


@pytest.mark.parametrize("fp8", [False, True], ids=["float-rows", "fp8-rows"])
def test_engram_kernels(fp8: bool) -> None:
    """DeepSeek-V4.1's Engram lookup (float rows, or e4m3 rows with UE8M0 scales dequantised into
    bf16) at V4.1-Flash-like rows of 512, and the gate at a 4096-wide hidden."""
    from deepinfer_cuda.kernels import engram as engram_k

    types = {
        "ids_ptr": PTR["i64"],
        "mult_ptr": PTR["i64"],
        "size_ptr": PTR["i64"],
        "offset_ptr": PTR["i64"],
        "table_ptr": "*fp8e4nv" if fp8 else PTR["bf16"],
        "scale_ptr": "*u8" if fp8 else PTR["bf16"],
        "out_ptr": PTR["bf16"],
    }
    compile_sm90(engram_k._lookup_kernel, types, dict(HEADS=8, G=3, BLOCK=512, FP8=fp8), num_warps=1)
    types = {"x_ptr": PTR["bf16"], "kv_ptr": PTR["bf16"], "w_ptr": PTR["f32"], "out_ptr": PTR["bf16"]}
    types |= {"eps": "fp32", "clamp": "fp32"}
    compile_sm90(engram_k._gate_kernel, types, dict(BLOCK=4096))

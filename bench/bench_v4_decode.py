"""DeepSeek-V4-Flash's published format at decode sizes on one GPU: the kernels that read FP8
linears and MXFP4 experts directly, against the paths they replace and the copy rate.

Measured side by side in this one run (CUDA-graph replays of back-to-back calls, each call on
its own weight copy or routing, so that the bytes exceed the L2 as a decode step's layers do;
median of triton.testing.do_bench):
  * copy: a device-to-device copy, GB/s = bytes read + written over time (the ceiling);
  * FP8 linears at V4-Flash shapes (wq_a, wq_b, wkv, wo_b, the shared expert's gate_up and down,
    the grouped wo_a: 8 groups), M = 1, 8, 64 rows: `new` CudaGemm.linear_fp8 / batched_linear_fp8
    (the skinny kernel's FP8 flag), `old` the same backend with DEEPINFER_CUDA_V4_DECODE=0
    (quantize_fp8 + the block-scaled Triton GEMM / grouped_gemm_fp8), `bf16` the same shape in
    bfloat16 through CudaGemm.linear (skinny or cuBLAS); GB/s = weight + scale bytes over time;
    at M = 1 and 64 a sweep of the FP8 skinny tiles; at every shape and M the e4m3 x e4m3
    tensor-core variant (`mma BNxSLAB wW`: SkinnyConfig.fp8_mma, not the default dispatch);
  * the routed-expert layer (256 MXFP4 experts, hidden 4096, intermediate 2048, top-6, the clamped
    SwiGLU) at 1, 8, 64, 256 tokens: `new` CudaMoe.fused_moe (decode_moe's MXFP4 GEMV kernels up
    to FP4_DECODE_MAX_COPIES copies, else the grouped path), `grouped` the contract's composition
    over grouped_gemm_fp4 as dispatched (the nibble-pair kernel), `grouped mx` the same with
    DEEPINFER_CUDA_MX_FP4=1 (tl.dot_scaled), `old` DEEPINFER_CUDA_V4_DECODE=0, `bf16` the
    same layer with bfloat16 experts (diffs: against `old`, same MXFP4 weights); GB/s = bytes of
    the distinct experts touched over time; at 1 and 8 tokens a sweep of the MXFP4 decode tiles
    (up and down kernels' tiles apart: `sweep up nN kK down nN kK wW sS`; the defaults unchanged),
    at 64 tokens its BLOCK_K 256 rows against the grouped path;
  * the grouped MXFP4 GEMM over 64 to 4096 tokens' copies (gate_up): the default (nibble pairs),
    `mx` (DEEPINFER_CUDA_MX_FP4=1's dispatch) and the path before, tile sweeps of the nibble-pair
    and the microscaled (`mx ...`) kernels, in TFLOP/s and GB/s of the distinct experts' bytes.

    python bench/bench_v4_decode.py --out DIR          # writes v4_decode.json and v4_decode.md
    python bench/bench_v4_decode.py --only moe --fp4-variants --out DIR
        # the routed-expert layer at 1, 8, 64 tokens with each MXFP4 decode of decode_moe
        # (kernels/moe.FP4_DECODE; FP4_VARIANTS below) in place of the tile sweep
    TRITON_INTERPRET=1 python bench/bench_v4_decode.py --smoke   # tiny shapes on the CPU
"""

# ruff: noqa: B023 - every closure below is timed inside the iteration that defines it
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.backend.fp8 import quantize_weight as fp8_quantize
from deepinfer.backend.ops import MoeOps
from deepinfer.backend.types import BackendOptions

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES
# V4-Flash (model/deepseek-v4-flash/config.json): name, groups (0: a plain linear), N, K
FP8_SHAPES = [
    ("wq_a", 0, 1024, 4096), ("wq_b", 0, 32768, 1024), ("wkv", 0, 512, 4096), ("wo_b", 0, 4096, 8192),
    ("shared_gate_up", 0, 4096, 4096), ("shared_down", 0, 4096, 2048), ("wo_a", 8, 1024, 4096),
]  # fmt: skip
SMOKE_FP8_SHAPES = [("small", 0, 256, 512), ("grouped", 2, 128, 256)]
# The e4m3 x e4m3 skinny variant's tiles (block_n, slab, warps) timed at every FP8 shape and M
MMA_TILES = [(64, 256, 4), (64, 512, 8), (128, 256, 4), (128, 512, 8), (64, 128, 4)]
LIMIT = 10.0  # V4-Flash's swiglu_limit


def log(msg: str) -> None:
    print(msg, flush=True)


class Timer:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median ms of fn (a host clock around one call in --smoke mode)."""
        if self.smoke:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=100, return_mode="median"))

    def graph(self, step: Callable[[], object]) -> float:
        """Median ms of one replay of a CUDA graph of `step` (the call itself in --smoke mode)."""
        if self.smoke:
            return self(step)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return self(g.replay)


def backends(smoke: bool) -> tuple[Any, Any, Any]:
    """(new, old, mx): the cuda backend as built, built again with DEEPINFER_CUDA_V4_DECODE=0,
    and with DEEPINFER_CUDA_MX_FP4=1 (the MXFP4 grouped GEMM on tl.dot_scaled; compiled only)."""
    from deepinfer_cuda import backend as cb

    env = envs.read()
    new = cb.create_cuda_backend(BackendOptions(), env)
    old = cb.create_cuda_backend(BackendOptions(), dataclasses.replace(env, cuda_v4_decode=False))
    mx = cb.create_cuda_backend(BackendOptions(), dataclasses.replace(env, cuda_mx_fp4=not smoke))
    return new, old, mx


def copy_rate(dev: torch.device, timer: Timer, smoke: bool) -> float:
    n = (1 << 16) if smoke else (1 << 30)
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    gbs = 2 * a.numel() * 2 / ms / 1e6
    log(f"copy: {gbs:.0f} GB/s")
    return gbs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def fp8_weight(shape: tuple[int, ...], dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(e4m3 weight, float32 UE8M0 block scales, the bf16 weight they come from), made on `dev`."""
    n, k = shape[-2:]
    w = torch.randn(shape, device=dev) * k**-0.5
    parts = [fp8_quantize(p, ue8m0=True) for p in w.reshape(-1, n, k)]
    q = torch.stack([p[0].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn).view(shape)
    s = torch.stack([p[1] for p in parts]).view(*shape[:-2], *parts[0][1].shape)
    return q, s, w.to(torch.bfloat16)


def bench_fp8(new: Any, old: Any, dev: torch.device, timer: Timer, copy: float, smoke: bool) -> list[dict]:
    from deepinfer_cuda.kernels import gemm as gemm_k

    gen = torch.Generator().manual_seed(0)
    sweep = [
        gemm_k.SkinnyConfig(block_n=bn, block_k=128, num_warps=w, slab=slab, pdl=True)
        for bn, slab, w in (
            (64, 512, 8),
            (64, 1024, 8),
            (128, 512, 8),
            (32, 512, 4),
            (64, 256, 4),
            (64, 256, 8),
        )
    ]
    mma = [
        gemm_k.SkinnyConfig(block_n=bn, block_k=128, num_warps=w, slab=slab, pdl=True, fp8_mma=True)
        for bn, slab, w in (MMA_TILES[:2] if smoke else MMA_TILES)
    ]
    rows: list[dict] = []
    for name, g, n, k in SMOKE_FP8_SHAPES if smoke else FP8_SHAPES:
        shape = (g, n, k) if g else (n, k)
        nbytes = math.prod(shape) * (1 + 4 / 128**2)
        sets = 1 if smoke else max(1, min(16, math.ceil(ROTATE_BYTES / nbytes)))
        ws = [fp8_weight(shape, dev) for _ in range(sets)]
        for m in (1, 8, 64) if not smoke else (1, 5):
            x = torch.randn((g, m, k) if g else (m, k), generator=gen).to(dev, torch.bfloat16)

            def fp8(b: Any, cfg: Any = None) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
                if cfg is not None:
                    return lambda w: gemm_k.skinny_fp8_matmul(x, w[0], w[1], config=cfg)
                if g:
                    return lambda w: b.gemm.batched_linear_fp8(x, w[0], w[1])
                return lambda w: b.gemm.linear_fp8(x, w[0], w[1])

            def bf16(w: tuple[torch.Tensor, ...]) -> torch.Tensor:
                return new.gemm.batched_linear(x, w[2]) if g else new.gemm.linear(x, w[2])

            ways: list[tuple[str, Callable[..., torch.Tensor], float]] = [
                ("new", fp8(new), nbytes),
                ("old", fp8(old), nbytes),
                ("bf16", bf16, math.prod(shape) * 2),
            ]
            if m in (1, 64) and not g:
                ways += [(f"sweep {c.block_n}x{c.slab} w{c.num_warps}", fp8(new, c), nbytes) for c in sweep]
            ways += [(f"mma {c.block_n}x{c.slab} w{c.num_warps}", fp8(new, c), nbytes) for c in mma]
            ref = bf16(ws[0]).float()
            row: dict[str, Any] = {"shape": name, "groups": g, "n": n, "k": k, "m": m}
            for way, fn, size in ways:

                def run(fn: Callable[..., torch.Tensor] = fn) -> None:
                    for w in ws:
                        fn(w)

                try:
                    diff = rel(fn(ws[0]), ref)
                    us = timer.graph(run) / sets * 1e3
                except Exception as exc:  # a tile that does not compile: report, go on
                    log(f"fp8 {name} M={m} {way}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                gbs = size / us / 1e3
                row[way] = {"us": us, "gbs": gbs, "of_copy": gbs / copy, "rel_diff_to_bf16": diff}
                log(f"fp8 {name} M={m} {way}: {us:.2f} us {gbs:.0f} GB/s ({gbs / copy:.2f} of copy)")
            rows.append(row)
    return rows


def mxfp4_experts(e: int, h: int, inter: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 experts made on `dev`: uniform e2m1 codes, scale bytes near 2^-8 (the values
    do not change the time)."""
    p13 = torch.randint(0, 256, (e, 2 * inter, h // 2), device=dev, dtype=torch.uint8)
    p2 = torch.randint(0, 256, (e, h, inter // 2), device=dev, dtype=torch.uint8)
    s13 = torch.randint(117, 121, (e, 2 * inter, h // 32), device=dev, dtype=torch.uint8)
    s2 = torch.randint(117, 121, (e, h, inter // 32), device=dev, dtype=torch.uint8)
    return p13, p2, s13, s2


# FP4_DECODE variants timed side by side with --fp4-variants (decode_moe called directly, so at
# 64 tokens too): (variant, tiles (n, k, warps) of both kernels, or None for fp4_decode_config's;
# SCALED's own: 64 x 512 up to 8 copies, 64 x 256 above)
FP4_VARIANTS: list[tuple[str, tuple[int, int, int] | None]] = [
    ("PAIR", None), ("GROUP", None), ("MMA", None), ("ASM", None), ("SCALED", None),
    ("SCALED", (32, 256, 4)), ("SCALED", (64, 512, 4)), ("SCALED", (128, 256, 8)),
]  # fmt: skip


def bench_moe(
    new: Any, old: Any, mx: Any, dev: torch.device, timer: Timer, copy: float, smoke: bool,
    variants: bool = False,
) -> list[dict]:  # fmt: skip
    from deepinfer_cuda.kernels import moe as moe_k

    gen = torch.Generator().manual_seed(1)
    e, h, inter, top = (8, 256, 128, 6) if smoke else (256, 4096, 2048, 6)
    torch.manual_seed(1)
    w = mxfp4_experts(e, h, inter, dev)
    # bf16 experts of the same shapes (random: only their time is compared)
    bf = [
        torch.randn((e, 2 * inter, h), device=dev).to(torch.bfloat16),
        torch.randn((e, h, inter), device=dev),
    ]
    bf[1] = bf[1].to(torch.bfloat16)
    expert_bytes = (w[0][0].numel() + w[1][0].numel() + w[2][0].numel() + w[3][0].numel(), 3 * h * inter * 2)
    rows: list[dict] = []
    sweep = [
        moe_k.DecodeConfig(
            up_n=un, up_k=uk, up_warps=wp, up_stages=st, down_n=dn, down_k=dk, down_warps=wp, down_stages=st
        )
        for un, uk, dn, dk, wp, st in (
            (32, 128, 32, 128, 4, 3),  # the tiles before fp4_decode_config
            (32, 256, 32, 256, 4, 3),  # FP4_DECODE_CONFIG (9 to 64 copies)
            (32, 256, 32, 128, 4, 3),  # which kernel the longer step helps
            (32, 128, 32, 256, 4, 3),
            (32, 512, 32, 512, 4, 3),  # FP4_ONE_TOKEN_CONFIG (up to 8 copies)
            (32, 1024, 32, 512, 4, 3),
            (32, 512, 32, 512, 4, 4),
            (32, 256, 32, 256, 4, 2),
            (16, 256, 16, 256, 4, 3),
            (64, 256, 32, 256, 4, 3),
            (32, 256, 32, 256, 8, 3),
            (64, 128, 64, 128, 4, 3),
            (32, 128, 32, 128, 8, 3),
        )
    ]
    wide = [c for c in sweep if c.up_k == c.down_k == 256 and c.up_n == 32 and c.up_warps == 4]
    for t in ((1, 8, 64) if variants else (1, 8, 64, 256)) if not smoke else (1, 3):
        sets = 1 if smoke else 8 if t <= 64 else 2
        inputs = []
        for _ in range(sets):
            x = torch.randn((t, h), generator=gen).to(dev, torch.bfloat16)
            ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)]).int().to(dev)
            inputs.append((x, torch.rand((t, top), generator=gen).to(dev), ids))
        distinct = sum(len(set(i[2].flatten().tolist())) for i in inputs) / sets

        def layer(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for x, wt, ids in inputs:
                    fn(x, wt, ids)

            return run

        ways: list[tuple[str, Callable[..., torch.Tensor], int]] = [
            (
                "new",
                lambda x, wt, ids: new.moe.fused_moe(x, wt, ids, *w, swiglu_limit=LIMIT),
                expert_bytes[0],
            ),
            (
                "grouped",
                lambda x, wt, ids: MoeOps.fused_moe(new.moe, x, wt, ids, *w, swiglu_limit=LIMIT),
                expert_bytes[0],
            ),
            (
                "grouped mx",
                lambda x, wt, ids: MoeOps.fused_moe(mx.moe, x, wt, ids, *w, swiglu_limit=LIMIT),
                expert_bytes[0],
            ),
            (
                "old",
                lambda x, wt, ids: old.moe.fused_moe(x, wt, ids, *w, swiglu_limit=LIMIT),
                expert_bytes[0],
            ),
            (
                "bf16",
                lambda x, wt, ids: new.moe.fused_moe(x, wt, ids, *bf, swiglu_limit=LIMIT),
                expert_bytes[1],
            ),
        ]
        # 64 tokens: the k256 rows only; 256 tokens (past the decode kernels' copies): none
        tiles = (sweep[:3] if smoke else sweep) if t <= 8 else wide if t <= 64 else []
        if variants:  # the decode variants instead of the tile sweep and the grouped paths
            tiles = []
            ways = [wy for wy in ways if not wy[0].startswith("grouped")]
            for v, vt in FP4_VARIANTS:
                c = None
                if vt is not None:
                    n, k, wp = vt
                    c = moe_k.DecodeConfig(up_n=n, up_k=k, up_warps=wp, down_n=n, down_k=k, down_warps=wp)
                name = f"fp4 {v}" + (f" n{vt[0]} k{vt[1]} w{vt[2]}" if vt else "")
                ways.append((
                    name,
                    lambda x, wt, ids, c=c, v=v: moe_k.decode_moe(
                        x, wt, ids, *w, swiglu_limit=LIMIT, config=c, fp4_decode=v
                    ),
                    expert_bytes[0],
                ))  # fmt: skip
        for c in tiles:
            ways.append((
                f"sweep up n{c.up_n} k{c.up_k} down n{c.down_n} k{c.down_k} w{c.up_warps} s{c.up_stages}",
                lambda x, wt, ids, c=c: moe_k.decode_moe(x, wt, ids, *w, swiglu_limit=LIMIT, config=c),
                expert_bytes[0],
            ))  # fmt: skip
        ref = dict((n, f) for n, f, _ in ways)["old"](*inputs[0]).float()  # the old path, same weights
        row: dict[str, Any] = {"tokens": t, "copies": t * top, "distinct_experts": distinct}
        for way, fn, per_expert in ways:
            try:
                diff = rel(fn(*inputs[0]), ref)
                us = timer.graph(layer(fn)) / sets * 1e3
            except Exception as exc:
                log(f"moe T={t} {way}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            gbs = distinct * per_expert / us / 1e3
            row[way] = {"us": us, "gbs": gbs, "of_copy": gbs / copy, "rel_diff_to_old": diff}
            log(f"moe T={t} {way}: {us:.1f} us {gbs:.0f} GB/s ({gbs / copy:.2f} of copy) vs old {diff:.3f}")
        rows.append(row)
    return rows


def bench_prefill(mx: Any, dev: torch.device, timer: Timer, smoke: bool) -> list[dict]:
    """grouped_gemm_fp4 (gate_up of 256 experts) over prefill-sized sorted rows: tiles."""
    from deepinfer_cuda.kernels import gemm as gemm_k
    from deepinfer_cuda.kernels import moe as moe_k

    gen = torch.Generator().manual_seed(2)
    e, h, inter = (8, 256, 128) if smoke else (256, 4096, 2048)
    p13 = torch.randint(0, 256, (e, 2 * inter, h // 2), generator=gen, dtype=torch.uint8).to(dev)
    s13 = torch.randint(118, 122, (e, 2 * inter, h // 32), generator=gen, dtype=torch.uint8).to(dev)
    cfg = gemm_k.GemmConfig
    sweep = [
        cfg(64, 128, 128, 8, 8, 3),
        cfg(64, 128, 128, 8, 4, 3),
        cfg(128, 128, 128, 8, 8, 3),
        cfg(64, 256, 128, 8, 8, 3),
        cfg(64, 128, 64, 8, 4, 4),
        cfg(128, 128, 64, 8, 8, 4),
        cfg(128, 64, 128, 8, 4, 3),
    ]
    # the microscaled kernel's tiles (block_m token rows x block_n weight rows x block_k)
    mx_sweep = [
        cfg(16, 128, 128, 8, 4, 3),
        cfg(16, 64, 128, 8, 4, 3),
        cfg(16, 128, 256, 8, 4, 3),
        cfg(16, 128, 128, 8, 4, 4),
        cfg(16, 128, 128, 8, 8, 3),
        cfg(16, 256, 128, 8, 8, 3),
        cfg(32, 128, 128, 8, 4, 3),
        cfg(64, 128, 128, 8, 4, 3),
        cfg(64, 128, 128, 8, 8, 3),
        cfg(64, 256, 128, 8, 8, 3),
        cfg(128, 128, 128, 8, 8, 3),
        cfg(64, 128, 256, 8, 8, 3),
    ]
    expert_bytes = p13[0].numel() + s13[0].numel()
    rows: list[dict] = []
    for tokens in (64, 256, 512, 4096) if not smoke else (16,):
        m = tokens * 6
        ids = torch.randint(0, e, (m,), generator=gen)
        counts = torch.bincount(ids, minlength=e).to(dev)
        distinct = int((counts > 0).sum())
        x = torch.randn((m, h), generator=gen).to(dev, torch.bfloat16)
        flops = 2 * m * 2 * inter * h
        row: dict[str, Any] = {"tokens": tokens, "rows": m, "distinct_experts": distinct}
        # (name, config, pairs, scaled): default = the dispatch as built
        ways: list[tuple[str, Any, bool, bool | None]] = [
            ("default", None, True, False), ("mx", None, True, None), ("old", None, False, False)
        ]  # fmt: skip
        ways += [(f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps}", c, True, False) for c in sweep]
        ways += [
            (f"mx {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}", c, True, True)
            for c in (mx_sweep[:2] if smoke else mx_sweep)
        ]
        ref = None
        for way, c, pairs, scaled in ways:
            if scaled and smoke:  # the microscaled product is not in the interpreter
                continue
            if scaled is None:  # the dispatch of a backend built with DEEPINFER_CUDA_MX_FP4=1

                def run(**_: Any) -> torch.Tensor:
                    return mx.gemm.grouped_gemm_fp4(x, p13, s13, counts)
            else:
                bm = (c or gemm_k.grouped_fp4_config(m, False, dev, pairs)).block_m
                tiles = moe_k.tile_table(counts, m, bm)

                def run(
                    c: Any = c, pairs: bool = pairs, tiles: Any = tiles, scaled: bool = scaled
                ) -> torch.Tensor:
                    return gemm_k.grouped_gemm_fp4(
                        x, p13, s13, counts, tiles=tiles, pairs=pairs, config=c, scaled=scaled
                    )

            try:
                out = run().float()
                ref = out if ref is None else ref
                diff = rel(out, ref)
                ms = timer.graph(run)
            except Exception as exc:
                log(f"prefill fp4 T={tokens} {way}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            gbs = distinct * expert_bytes / ms / 1e6
            row[way] = {"ms": ms, "tflops": flops / ms / 1e9, "gbs": gbs, "rel_diff_to_default": diff}
            log(f"prefill fp4 gate_up T={tokens} {way}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                f"{gbs:.0f} GB/s vs default {diff:.2e}")  # fmt: skip
        rows.append(row)
    return rows


def markdown(res: dict[str, Any]) -> str:
    out = [f"# V4-Flash published format at decode sizes\n\ncopy {res['copy_gbs']:.0f} GB/s\n"]
    out.append("## FP8 linears (us, of copy)\n")
    out.append(
        "| shape | M | new | old | bf16 | new vs old | best sweep | best mma (e4m3 x e4m3) | mma vs old |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res["fp8"]:
        cells = [
            f"{r[w]['us']:.1f} ({r[w]['of_copy']:.2f})" if w in r else "-" for w in ("new", "old", "bf16")
        ]
        sp = f"{r['old']['us'] / r['new']['us']:.2f}x" if "new" in r and "old" in r else "-"
        sw = [(v["us"], k) for k, v in r.items() if k.startswith("sweep")]
        best = f"{min(sw)[1][6:]} {min(sw)[0]:.1f}" if sw else ""
        mm = [(v["us"], k, v["of_copy"]) for k, v in r.items() if k.startswith("mma")]
        best_mma = f"{min(mm)[1][4:]} {min(mm)[0]:.1f} ({min(mm)[2]:.2f})" if mm else ""
        mma_sp = f"{r['old']['us'] / min(mm)[0]:.2f}x" if mm and "old" in r else "-"
        out.append(
            f"| {r['shape']} | {r['m']} | {' | '.join(cells)} | {sp} | {best} | {best_mma} | {mma_sp} |"
        )
    out.append("\n## MXFP4 expert layer (us, of copy of the touched experts)\n")
    out.append("| tokens | experts | new | grouped | old | bf16 | new vs old | best sweep |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res["moe"]:
        ways = ("new", "grouped", "old", "bf16")
        cells = [f"{r[w]['us']:.1f} ({r[w]['of_copy']:.2f})" if w in r else "-" for w in ways]
        sp = f"{r['old']['us'] / r['new']['us']:.2f}x" if "new" in r and "old" in r else "-"
        sw = [(v["us"], k) for k, v in r.items() if k.startswith("sweep")]
        best = f"{min(sw)[1][6:]} {min(sw)[0]:.1f}" if sw else ""
        out.append(f"| {r['tokens']} | {r['distinct_experts']:.0f} | {' | '.join(cells)} | {sp} | {best} |")
    fp4 = sorted({k for r in res["moe"] for k in r if k.startswith("fp4 ")}, key=lambda k: k)
    if fp4:
        out.append("\n## MXFP4 decode variants (decode_moe; us, of copy, rel diff to old)\n")
        out.append("| variant | " + " | ".join(f"{r['tokens']} tok" for r in res["moe"]) + " |")
        out.append("| --- |" + " --- |" * len(res["moe"]))
        for k in fp4:
            cells = [
                f"{r[k]['us']:.1f} ({r[k]['of_copy']:.2f}, {r[k]['rel_diff_to_old']:.1e})" if k in r else "-"
                for r in res["moe"]
            ]
            out.append(f"| {k[4:]} | {' | '.join(cells)} |")
    out.append("\n## MXFP4 grouped GEMM, prefill (gate_up; ms, TFLOP/s)\n")
    for r in res["prefill"]:
        ways = sorted(((v["ms"], k) for k, v in r.items() if isinstance(v, dict)))
        out.append(
            f"- {r['tokens']} tokens: " + ", ".join(f"{k} {ms:.3f} ({r[k]['tflops']:.0f})" for ms, k in ways)
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--only", choices=["fp8", "moe", "prefill"], default=None)
    ap.add_argument(
        "--fp4-variants", action="store_true", help="moe: the MXFP4 decode variants (FP4_VARIANTS), no sweep"
    )
    args = ap.parse_args()
    smoke = args.smoke
    dev = torch.device("cpu") if smoke and not torch.cuda.is_available() else torch.device("cuda")
    timer = Timer(smoke)
    new, old, mx = backends(smoke)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    res["copy_gbs"] = copy_rate(dev, timer, smoke)
    res["fp8"] = bench_fp8(new, old, dev, timer, res["copy_gbs"], smoke) if args.only in (None, "fp8") else []
    res["moe"] = (
        bench_moe(new, old, mx, dev, timer, res["copy_gbs"], smoke, args.fp4_variants)
        if args.only in (None, "moe")
        else []
    )
    res["prefill"] = bench_prefill(mx, dev, timer, smoke) if args.only in (None, "prefill") else []
    md = markdown(res)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "v4_decode.json").write_text(json.dumps(res, indent=1))
        (args.out / "v4_decode.md").write_text(md)


if __name__ == "__main__":
    main()

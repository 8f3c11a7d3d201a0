"""CUDA backend benchmarks on one GPU: MLA decode, FP8 block-scaled GEMM, fused MoE, DeepSeek-V4's ops,
MLA's query preparation.

Every ratio is measured side by side in this one run:
  * MLA decode: effective bandwidth (latent KV + block tables + q bytes read, over time) against
    a device-to-device copy (bytes read + written) timed in the same process; over the FP8
    latent cache (decode_fp8) also its speed against the bf16 cache in the same run;
  * FP8 GEMM: TFLOP/s against torch._scaled_mm with per-tensor scales (cuBLAS);
  * fused MoE (DeepSeek-V3 layer: hidden 7168, 256 experts, top-8, inter 2048): time and
    TFLOP/s against the reference backend running on the same GPU;
  * DeepSeek-V4 (V4-Flash shapes): the Triton mHC ops (hc_pre, hc_post, hc_head), lightning
    indexer and compressed attention (CSA with top-k, HCA) against the torch compositions they
    replace (the reference's mHC ops; batched torch gathers for decode attention and the indexer),
    both replayed from CUDA graphs, with the relative difference of their outputs;
  * MLA's query (attention.mla_query: rope + per-head W_UK product + concat) in one launch against
    the contract's composition on this backend (Triton rope, cuBLAS bmm, torch.cat), a step's
    worth of layers per CUDA graph.
Timing: triton.testing.do_bench, median; inputs rotate through sets larger than L2 where one
set would fit in it; random data everywhere.

    python bench/bench_cuda.py --out bench/results/DIR      # writes bench_cuda.json and .md
    python bench/bench_cuda.py --only v4 --out bench/results/DIR   # one section
    python bench/bench_cuda.py --only mla_query                     # the query kernel only
    python bench/bench_cuda.py --only decode_fp8                    # FP8 latent cache vs bf16
    TRITON_INTERPRET=1 python bench/bench_cuda.py --smoke   # tiny shapes on the CPU: checks the code
"""

# ruff: noqa: B023 - every closure below is timed inside the iteration that defines it
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.ops import AttentionOps, Backend
from deepinfer.backend.registry import BackendRegistry
from deepinfer.backend.types import AttentionMetadata, BackendOptions, RouterConfig
from deepinfer.reference import gemm as ref_gemm

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES


class Timer:
    """Median milliseconds: do_bench on a GPU, a host clock in --smoke mode."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def __call__(self, fn: Callable[[], object], rep_ms: int = 200) -> float:
        if self.smoke:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- copy bandwidth


def bench_copy(dev: torch.device, timer: Timer, smoke: bool) -> dict[str, float]:
    n = (1 << 16) if smoke else (1 << 30)  # 2 GiB of bf16 per buffer on the GPU
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    gbs = 2 * a.numel() * a.element_size() / ms / 1e6
    log(f"copy: {2 * a.numel() * 2 / 1e9:.2f} GB moved in {ms:.3f} ms = {gbs:.0f} GB/s")
    return {"bytes": 2 * a.numel() * a.element_size(), "ms": ms, "gbs": gbs}


def bench_matmul(dev: torch.device, timer: Timer, smoke: bool) -> dict[str, float]:
    """The dense bf16 tensor-core ceiling: cuBLAS on an 8192^3 matmul."""
    n = 128 if smoke else 8192
    a = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    b = torch.randn((n, n), device=dev, dtype=torch.bfloat16)
    ms = timer(lambda: a @ b)
    tflops = 2 * n**3 / ms / 1e9
    log(f"bf16 matmul {n}^3: {ms:.3f} ms = {tflops:.0f} TFLOP/s")
    return {"n": n, "ms": ms, "tflops": tflops}


# --------------------------------------------------------------------------- MLA decode


def decode_inputs(
    batch: int,
    kv_len: int,
    heads: int,
    dev: torch.device,
    gen: torch.Generator,
    block: int = 64,
    device_rng: bool = False,
) -> tuple[torch.Tensor, list[AttentionMetadata], torch.Tensor, int]:
    """A bf16 pool of (NB, 64, 576) latents and metadata sets over disjoint random blocks (enough
    sets that together they exceed the L2), plus q (B, H, 576). device_rng: the pool drawn by the
    device's generator (seconds less for the 128 x 32k pools; other values than the host's)."""
    per_req = math.ceil(kv_len / block)
    need = batch * per_req
    bytes_per_block = block * 576 * 2
    sets = max(1, min(8, math.ceil(ROTATE_BYTES / (need * bytes_per_block))))
    if device_rng:
        pool = torch.randn((need * sets, block, 576), device=dev, dtype=torch.bfloat16)
    else:
        pool = torch.randn((need * sets, block, 576), generator=gen, dtype=torch.float32).to(
            dev, torch.bfloat16
        )
    perm = torch.randperm(need * sets, generator=gen).to(torch.int32)
    metas = []
    for s in range(sets):
        table = perm[s * need : (s + 1) * need].view(batch, per_req).to(dev)
        metas.append(AttentionMetadata.build(table, [kv_len] * batch, [1] * batch))
    q = torch.randn((batch, heads, 576), generator=gen).to(dev, torch.bfloat16)
    return pool, metas, q, per_req


def decode_error(
    out: torch.Tensor,
    q: torch.Tensor,
    pool: torch.Tensor,
    meta: AttentionMetadata,
    requests: int | None = None,
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Relative error of decode output against float32 softmax attention over each request (the
    first `requests` of them); rows: the (blocks, 64, 576) float rows of gathered pool blocks
    (None: the pool's own values)."""
    errs = []
    for b, n in enumerate(meta.seq_lens_host[:requests]):
        blocks = pool[meta.block_tables[b].long()]
        k = (blocks if rows is None else rows(blocks)).reshape(-1, 576)[:n].float()  # (L, 576)
        p = torch.softmax(q[b].float() @ k.T * 192**-0.5, dim=-1)  # (H, L)
        ref = p @ k[:, :512]
        errs.append(float((out[b] - ref).norm() / ref.norm()))
    return max(errs)


def graph_replayer(step: Callable[[], None], n: int) -> Callable[[], None]:
    """Capture n consecutive calls of `step` (each takes the next input set) as n CUDA graphs and
    return a function that replays them in turn: GPU time without the host's launch overhead,
    which is how a decode step runs in an engine."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):  # warm up (compiles, allocations) outside capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for _ in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        graphs.append(g)
    turn = [0]

    def replay() -> None:
        turn[0] = (turn[0] + 1) % n
        graphs[turn[0]].replay()

    return replay


def bench_decode(
    be: Backend, dev: torch.device, timer: Timer, copy_gbs: float, matmul_tflops: float, smoke: bool
) -> list[dict[str, Any]]:
    from deepinfer_cuda.kernels import attention as attn_k

    from deepinfer.backend.types import KVCacheSpec, PagedKVCache

    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    batches = [1, 2] if smoke else [1, 8, 32, 128]
    lens = [64, 128] if smoke else [512, 4096, 32768]
    heads_list = [16, 128] if not smoke else [16]
    free = be.device.memory_info()[0]
    for heads in heads_list:
        for batch in batches:
            for kv_len in lens:
                kv_bytes = batch * kv_len * 576 * 2
                if kv_bytes * 1.2 > free * 0.5:
                    rows.append({"heads": heads, "batch": batch, "kv_len": kv_len, "skipped": "memory"})
                    continue
                pool, metas, q, per_req = decode_inputs(batch, kv_len, heads, dev, gen)
                spec = KVCacheSpec(pool.shape[0], 64, 512, 64, torch.bfloat16)
                cache = PagedKVCache(spec, (pool,))
                it = [0]

                def run(
                    cache: PagedKVCache = cache, metas: list[AttentionMetadata] = metas, q: torch.Tensor = q
                ) -> None:
                    it[0] = (it[0] + 1) % len(metas)
                    be.attention.decode(q, cache, metas[it[0]], scale=192**-0.5, v_dim=512)

                eager_ms = timer(run)
                ms = eager_ms if smoke else timer(graph_replayer(run, len(metas)))
                read = kv_bytes + batch * per_req * 4 + q.numel() * 2
                gbs = read / ms / 1e6
                tflops = batch * heads * kv_len * 2 * (576 + 512) / ms / 1e9
                row = {
                    "heads": heads,
                    "batch": batch,
                    "kv_len": kv_len,
                    "ms": ms,
                    "eager_ms": eager_ms,
                    "gbs": gbs,
                    "ratio_to_copy": gbs / copy_gbs,
                    "tflops": tflops,
                    "ratio_to_matmul": tflops / matmul_tflops,
                    "sets": len(metas),
                }
                if batch <= 2:  # spot check (many KV splits at long lengths) against float32 torch
                    out = be.attention.decode(q, cache, metas[0], scale=192**-0.5, v_dim=512).float()
                    row["rel_err"] = decode_error(out, q, pool, metas[0])
                rows.append(row)
                log(
                    f"decode H={heads:3d} B={batch:3d} L={kv_len:5d}: {ms:.3f} ms {gbs:6.0f} GB/s "
                    f"err {row.get('rel_err', float('nan')):.1e} "
                    f"({gbs / copy_gbs:.2f} of copy) {tflops:5.0f} TFLOP/s"
                )
                del pool, metas, q, cache
    # tile-config sweeps (and batch-invariant mode) at batch 128 x 4096 with the kernel launcher
    cfg = attn_k.AttentionConfig
    sweeps = {
        128: [
            attn_k.WIDE_CONFIG,
            cfg(64, 64, 8, 2, tma=False),
            cfg(64, 64, 8, 1),
            cfg(64, 32, 8, 2),
            cfg(64, 32, 8, 3),
            cfg(64, 64, 8, 3),
            cfg(32, 64, 4, 2),
        ],
        16: [
            cfg(16, 32, 4, 2),
            cfg(16, 32, 4, 2, tma=False),
            cfg(16, 64, 4, 2),
            cfg(16, 32, 4, 3),
        ],
    }
    if smoke:
        sweeps = {16: [cfg(16, 16, 4, 1)]}
    batch, kv_len = (128, 4096) if not smoke else (2, 128)
    for heads, configs in sweeps.items():
        pool, metas, q, per_req = decode_inputs(batch, kv_len, heads, dev, gen)
        read = batch * kv_len * 576 * 2 + batch * per_req * 4 + q.numel() * 2
        for c in [*configs, None]:
            it = [0]

            def run_cfg(
                c: Any = c,
                metas: list[AttentionMetadata] = metas,
                pool: torch.Tensor = pool,
                q: torch.Tensor = q,
            ) -> None:
                it[0] = (it[0] + 1) % len(metas)
                attn_k.mla_attention(
                    q,
                    pool,
                    metas[it[0]],
                    scale=192**-0.5,
                    v_dim=512,
                    latent_dim=512,
                    config=c,
                    batch_invariant=c is None,
                )

            name = "batch_invariant (split 1024)" if c is None else str(c)
            try:
                ms = timer(run_cfg)
            except Exception as exc:
                log(f"decode sweep H={heads} {name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append({"sweep": name, "heads": heads, "error": type(exc).__name__})
                continue
            gbs = read / ms / 1e6
            rows.append(
                {
                    "sweep": name,
                    "heads": heads,
                    "batch": batch,
                    "kv_len": kv_len,
                    "ms": ms,
                    "gbs": gbs,
                    "ratio_to_copy": gbs / copy_gbs,
                }
            )
            log(f"decode sweep H={heads} {name}: {ms:.3f} ms {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
        del pool, metas, q
    return rows


# (heads, batch, keys) of the FP8-cache rows: issue 37's table (16 heads at 8 x 4096 and
# 128 x 32768, 128 heads at 32 x 4096 and 128 x 32768) and batch 1 at 32k keys, the largest first
# (a run cut by its time limit keeps the rows it logged)
FP8_DECODE_SHAPES = [(128, 128, 32768), (16, 128, 32768), (128, 32, 4096), (16, 8, 4096), (16, 1, 32768)]
# Requests of each row checked against float32 attention over the rows the FP8 cache holds.
FP8_CHECKED_REQUESTS = 2
# attention.FP8_WIDE_CONFIG (the tiles of >= 64 rows a request: 128 heads) against these, scales
# per tile: 64-key tiles in one stage (147456 bytes of shared memory) and two (189440 bytes;
# with a scale per value they need 319488, over SM90's 232448).
FP8_WIDE_SWEEP = {"64x64_s1": (64, 64, 8, 1), "64x64_s2": (64, 64, 8, 2)}
# attention.FP8_NARROW_CONFIG (fewer than 64 rows a request: 16 heads) against these: 64-key tiles,
# and the 16 heads padded to 64 rows (the warpgroup MMA).
FP8_NARROW_SWEEP = {"n16x64_s2": (16, 64, 4, 2), "n64x64_s2": (64, 64, 8, 2)}


def fp8_variants(heads: int, batch: int) -> dict[str, dict[str, Any]]:
    """The attention-module knobs decode_fp8 times beside the defaults, by name: the float16 read
    (FP8_HALF_READ) at the default tiles, with TMA (FP8_TMA), with 4 programs an SM at batch >= 8
    (FP8_PROGRAMS_PER_SM), and each read at the swept tiles (FP8_WIDE_SWEEP at >= 64 heads, else
    FP8_NARROW_SWEEP)."""
    from deepinfer_cuda.kernels import attention as attn_k

    half = {"FP8_HALF_READ": True}
    out = {"half": half, "half_tma": half | {"FP8_TMA": True}}
    if batch >= 8:
        out["half_per_sm_4"] = half | {"FP8_PROGRAMS_PER_SM": 4}
    tiles, knob = (
        (FP8_WIDE_SWEEP, "FP8_WIDE_CONFIG") if heads >= 64 else (FP8_NARROW_SWEEP, "FP8_NARROW_CONFIG")
    )
    for name, t in tiles.items():
        cfg = attn_k.AttentionConfig(*t, tma=False)
        out[f"half_{name}"] = half | {knob: cfg}
        out[f"bf16read_{name}"] = {"FP8_HALF_READ": False, knob: cfg}
    return out


def bench_decode_fp8(
    be: Backend, dev: torch.device, timer: Timer, copy_gbs: float, smoke: bool, sweep: bool = True
) -> list[dict[str, Any]]:
    """attention.decode over FP8 latent rows (kv_cache_dtype="fp8": 656 bytes a token) against the
    same call over the bf16 cache they were quantised from (1152 bytes), both replayed from CUDA
    graphs in this run: GB/s of the FP8 bytes read against the copy rate, speed against bf16, the
    times of fp8_variants (sweep: False for none; the float16 read is always timed), and the
    relative difference from float32 attention over the dequantised rows of the default's output
    and the float16 read's."""
    from deepinfer_cuda.kernels import attention as attn_k

    from deepinfer.backend.kv_formats_mla import dequantize_mla_rows
    from deepinfer.backend.types import KVCacheSpec, PagedKVCache

    gen = torch.Generator().manual_seed(1)
    rows: list[dict[str, Any]] = []
    shapes = [(16, 2, 128)] if smoke else FP8_DECODE_SHAPES
    free = be.device.memory_info()[0]
    for heads, batch, kv_len in shapes:
        if batch * kv_len * (1152 + 656) * 1.2 > free * 0.5:
            rows.append({"heads": heads, "batch": batch, "kv_len": kv_len, "skipped": "memory"})
            continue
        pool, metas, q, per_req = decode_inputs(batch, kv_len, heads, dev, gen, device_rng=True)
        nb = pool.shape[0]
        bf16 = PagedKVCache(KVCacheSpec(nb, 64, 512, 64, torch.bfloat16), (pool,))
        fp8 = be.kv_cache.allocate(KVCacheSpec(nb, 64, 512, 64, torch.bfloat16, "fp8"), 1)[0]
        be.kv_cache.write_kv(fp8, pool.view(-1, 576), torch.arange(nb * 64, device=dev))
        times = {}
        # (name, cache, attention-module knobs for the run: read at launch, the graph keeps them)
        variants = fp8_variants(heads, batch)
        if not sweep or smoke:
            variants = {"half": variants["half"]}
        runs: list[tuple[str, PagedKVCache, dict[str, Any]]] = [("bf16", bf16, {}), ("fp8", fp8, {})]
        runs += [(f"fp8_{k}", fp8, v) for k, v in variants.items()]
        knob_names = {k for v in variants.values() for k in v}
        defaults = {k: getattr(attn_k, k) for k in knob_names}
        for name, cache, knobs in runs:
            for k, v in (defaults | knobs).items():
                setattr(attn_k, k, v)
            swept = name[4:] in variants  # a variant that fails is logged, the rest still run
            it = [0]

            def run(
                cache: PagedKVCache = cache,
                it: list[int] = it,
                metas: list[AttentionMetadata] = metas,
                q: torch.Tensor = q,
            ) -> None:
                it[0] = (it[0] + 1) % len(metas)
                be.attention.decode(q, cache, metas[it[0]], scale=192**-0.5, v_dim=512)

            try:
                times[name] = timer(run) if smoke else timer(graph_replayer(run, len(metas)))
            except Exception as exc:
                if not swept:
                    raise
                log(f"decode fp8 H={heads} B={batch} {name}: failed {type(exc).__name__}: {str(exc)[:160]}")
        read = batch * kv_len * 656 + batch * per_req * 4 + q.numel() * 2
        gbs = read / times["fp8"] / 1e6
        row = {
            "heads": heads, "batch": batch, "kv_len": kv_len, "ms": times["fp8"], "bf16_ms": times["bf16"],
            "half_ms": times.get("fp8_half", math.nan),
            "half_speedup": times["bf16"] / times.get("fp8_half", math.nan),
            "gbs": gbs, "ratio_to_copy": gbs / copy_gbs, "speedup": times["bf16"] / times["fp8"],
            "tflops": batch * heads * kv_len * 2 * (576 + 512) / times["fp8"] / 1e9, "sets": len(metas),
        }  # fmt: skip
        swept_ms = {k[4:]: v for k, v in times.items() if k[4:] in variants and k != "fp8_half"}
        if swept_ms:
            row["sweep_ms"] = swept_ms
        # against float32 attention over the rows the FP8 cache holds, for the first requests (the
        # whole 128 x 32k cache in float32 would take 9.7 GB): the defaults, then the float16 read
        finite = True
        row["half_rel_err"] = math.nan
        for key, knobs in (("rel_err", {}), ("half_rel_err", variants["half"])):
            if key == "half_rel_err" and "fp8_half" not in times:
                continue  # the float16 read did not launch (logged above)
            for k, v in (defaults | knobs).items():
                setattr(attn_k, k, v)
            out = be.attention.decode(q, fp8, metas[0], scale=192**-0.5, v_dim=512).float()
            row[key] = decode_error(
                out,
                q,
                fp8.tensors[0],
                metas[0],
                FP8_CHECKED_REQUESTS,
                lambda r: dequantize_mla_rows(r, 512, 64),
            )
            finite = finite and bool(torch.isfinite(out).all())
        for k, v in defaults.items():
            setattr(attn_k, k, v)
        row["finite"] = finite
        rows.append(row)
        swept = "".join(f", {k} {v:.3f} ms" for k, v in swept_ms.items())
        log(
            f"decode fp8 H={heads:3d} B={batch:3d} L={kv_len:5d}: {times['fp8']:.3f} ms {gbs:6.0f} GB/s "
            f"({gbs / copy_gbs:.2f} of copy), bf16 cache {times['bf16']:.3f} ms: {row['speedup']:.2f}x, "
            f"float16 read {row['half_ms']:.3f} ms: {row['half_speedup']:.2f}x, err {row['rel_err']:.1e} "
            f"(float16 read {row['half_rel_err']:.1e}; first {FP8_CHECKED_REQUESTS} requests; all finite: "
            f"{row['finite']}){swept}"
        )
        del pool, metas, q, bf16, fp8
    return rows


def bench_decode_short(be: Backend, dev: torch.device, timer: Timer, smoke: bool) -> list[dict[str, Any]]:
    """A short context at batch 1, as in a batch-1 decode step of bench_e2e (16 heads, 160 keys,
    a graph captured with the host bound 192): the kernel's tile configs and KV split sizes, each
    in a CUDA graph of 27 back-to-back calls (a decode step's layers), per call."""
    from deepinfer_cuda.kernels import attention as attn_k

    gen = torch.Generator().manual_seed(0)
    heads, kv_len, bound, calls = (16, 160, 192, 27) if not smoke else (16, 40, 48, 2)
    pool, metas, q, _ = decode_inputs(1, bound, heads, dev, gen)
    meta = metas[0]
    meta = AttentionMetadata(  # the device length 160, the host's an upper bound (a graph's)
        meta.block_tables, torch.full_like(meta.seq_lens, kv_len), meta.query_start_loc,
        meta.seq_lens_host, meta.query_lens_host, meta.max_query_len, meta.max_seq_len,
    )  # fmt: skip
    cfg = attn_k.AttentionConfig
    configs = [None, cfg(16, 32, 4, 2), cfg(16, 64, 4, 2), cfg(16, 16, 4, 2), cfg(16, 32, 2, 2)]
    splits = [None, 16, 32, 64, 192] if not smoke else [None, 16]

    def attend(c: Any = None, split: Any = None) -> torch.Tensor:
        out: torch.Tensor = attn_k.mla_attention(
            q, pool, meta, scale=192**-0.5, v_dim=512, latent_dim=512, config=c, split_size=split
        )
        return out

    ref = attend().float()
    rows: list[dict[str, Any]] = []
    for c in configs:
        for split in splits:
            block_n = (c or cfg(16)).block_n
            if split is not None and split % block_n:
                continue

            def run(c: Any = c, split: Any = split) -> None:
                for _ in range(calls):
                    attend(c, split)

            name = f"{c or 'default'} split {split or 'adaptive'}"
            try:
                out = attend(c, split).float()
                ms = timer(run if smoke else graph_replayer(run, 1)) / calls
            except Exception as exc:
                log(f"decode short {name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append({"sweep": name, "error": type(exc).__name__})
                continue
            err = float((out - ref).norm() / ref.norm())
            rows.append({"sweep": name, "heads": heads, "kv_len": kv_len, "us": ms * 1e3, "rel_diff": err})
            log(f"decode short H={heads} L={kv_len} {name}: {ms * 1e3:.2f} us per call (diff {err:.1e})")
    return rows


# --------------------------------------------------------------------------- skinny GEMM

# V2-Lite's float linears at decode sizes: (name, G heads or 0, N, K)
SKINNY_SHAPES = [
    ("qkv_a", 0, 3648, 2048),
    ("o_proj", 0, 2048, 2048),
    ("w_uv (per head)", 16, 128, 512),
    ("dense gate_up", 0, 21888, 2048),
    ("dense down", 0, 2048, 10944),
    ("lm_head", 0, 102400, 2048),
]


def bench_skinny(dev: torch.device, timer: Timer, copy_gbs: float, smoke: bool) -> list[dict[str, Any]]:
    """kernels/gemm.skinny_matmul against cuBLAS (torch linear / bmm) for V2-Lite's float linears
    at M = 1, 2, 4, 8: per call, from a CUDA graph of back-to-back calls each on its own weight
    copy (the copies exceed the L2, as a decode step's layers do). `of copy`: the weight bytes
    over the time, against the copy bandwidth of this run. At M = 1 and 4 a tile sweep."""
    from deepinfer_cuda.kernels import gemm as gemm_k

    gen = torch.Generator().manual_seed(0)
    cfg = gemm_k.SkinnyConfig
    sweep = [
        cfg(64, 128, 2, 4, 4), cfg(64, 256, 2, 4, 3), cfg(64, 128, 4, 4, 4), cfg(64, 128, 1, 4, 4),
        cfg(128, 128, 2, 8, 4), cfg(128, 256, 1, 8, 3), cfg(32, 128, 4, 4, 4), cfg(64, 512, 2, 4, 2),
    ]  # fmt: skip
    shapes = SKINNY_SHAPES if not smoke else [("small", 0, 96, 64), ("heads", 4, 32, 64)]
    rows: list[dict[str, Any]] = []
    for name, g, n, k in shapes:
        wshape = (g, n, k) if g else (n, k)
        nbytes = math.prod(wshape) * 2
        sets = 1 if smoke else max(1, min(16, math.ceil(ROTATE_BYTES / nbytes)))
        ws = [torch.randn(wshape, generator=gen).to(dev, torch.bfloat16) * k**-0.5 for _ in range(sets)]
        for m in (1, 2, 4, 8) if not smoke else (1, 3):
            x = torch.randn((g, m, k) if g else (m, k), generator=gen).to(dev, torch.bfloat16)

            def cublas(w: torch.Tensor) -> torch.Tensor:
                return torch.bmm(x, w.transpose(1, 2)) if g else torch.nn.functional.linear(x, w)

            ref = cublas(ws[0]).float()
            ways: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [("cublas", cublas)]
            for c in [None, *sweep] if m in (1, 4) else [None]:
                ways.append((str(c or "default"), functools.partial(gemm_k.skinny_matmul, x, config=c)))
            row: dict[str, Any] = {"shape": name, "heads": g, "n": n, "k": k, "m": m, "mb": nbytes / 2**20}
            for way, fn in ways:

                def run(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> None:
                    for w in ws:
                        fn(w)

                try:
                    diff = rel(fn(ws[0]).float(), ref)
                    us = timer(run if smoke else graph_replayer(run, 1)) / sets * 1e3
                except Exception as exc:
                    log(f"skinny {name} M={m} {way}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                gbs = nbytes / us / 1e3
                key = "cublas" if way == "cublas" else "skinny" if way == "default" else f"sweep {way}"
                row[key] = {"us": us, "gbs": gbs, "of_copy": gbs / copy_gbs, "rel_diff": diff}
                log(f"skinny {name} M={m} {way}: {us:.2f} us, {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)")
            if "skinny" in row and "cublas" in row:
                row["speedup"] = row["cublas"]["us"] / row["skinny"]["us"]
            rows.append(row)
    rows += skinny_chain(dev, timer, copy_gbs, smoke, gen)
    return rows


def skinny_chain(
    dev: torch.device, timer: Timer, copy_gbs: float, smoke: bool, gen: torch.Generator
) -> list[dict[str, Any]]:
    """A dependent chain y <- y W_i^T of 16 square (2048, 2048) bf16 weights at M = 1 (o_proj's
    shape; each product reads the one before), in one CUDA graph: cuBLAS, the skinny kernel, and
    its slab variants, with and without programmatic dependent launch (PDL: a program loads its
    weight slab before waiting for the previous kernel). Per product."""
    from deepinfer_cuda.kernels import gemm as gemm_k

    d, links = (2048, 16) if not smoke else (64, 3)
    ws = [torch.randn((d, d), generator=gen).to(dev, torch.bfloat16) * d**-0.5 for _ in range(links)]
    x0 = torch.randn((1, d), generator=gen).to(dev, torch.bfloat16)
    cfg = gemm_k.SkinnyConfig
    slabs = [cfg(64, 128, slab=256), cfg(64, 128, slab=256, pdl=True), cfg(64, 128, slab=128, pdl=True),
             cfg(64, 128, slab=512, num_warps=8, pdl=True), cfg(32, 128, slab=256, pdl=True)]  # fmt: skip
    if smoke:
        slabs = [cfg(32, 32, slab=32), cfg(32, 32, slab=32, pdl=True)]
    ways: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        ("cublas", torch.nn.functional.linear),
        ("skinny", gemm_k.skinny_matmul),
    ]
    ways += [(str(c), functools.partial(gemm_k.skinny_matmul, config=c)) for c in slabs]

    def chain(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = x0
        for w in ws:
            y = fn(y, w)
        return y

    ref = chain(torch.nn.functional.linear).float()
    row: dict[str, Any] = {"shape": f"chain of {links} ({d}, {d})", "m": 1, "chain": True}
    for name, fn in ways:
        try:
            diff = rel(chain(fn).float(), ref)
            us = (
                timer(
                    (lambda fn=fn: chain(fn)) if smoke else graph_replayer(lambda fn=fn: void(chain(fn)), 1)
                )
                / links
                * 1e3
            )
        except Exception as exc:
            log(f"skinny chain {name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        gbs = d * d * 2 / us / 1e3
        row[name] = {"us": us, "gbs": gbs, "of_copy": gbs / copy_gbs, "rel_diff": diff}
        log(f"skinny chain {name}: {us:.2f} us per product, {gbs:.0f} GB/s, diff {diff:.1e}")
    return [row]


# --------------------------------------------------------------------------- FP8 GEMM

V3_SHAPES = [
    (24576, 1536),
    (32768, 512),
    (7168, 16384),
    (4096, 7168),
    (7168, 2048),
    (2112, 7168),
    (18432, 7168),
    (7168, 18432),
]


def bench_fp8(be: Backend, dev: torch.device, timer: Timer, smoke: bool) -> list[dict[str, Any]]:
    from deepinfer_cuda.kernels import gemm as gemm_k

    gen = torch.Generator().manual_seed(1)
    rows: list[dict[str, Any]] = []
    shapes = V3_SHAPES if not smoke else [(256, 256)]
    ms_list = [128, 4096] if not smoke else [16]
    for n, k in shapes:
        w = torch.randn((n, k), generator=gen).to(dev) * k**-0.5
        wq, ws = ref_gemm.quantize_weight(w)
        del w
        for m in ms_list:
            x = torch.randn((m, k), generator=gen).to(dev, torch.bfloat16)
            xq, xs = be.gemm.quantize_fp8(x)
            flops = 2 * m * n * k
            ms = timer(lambda: be.gemm.fp8_gemm(xq, xs, wq, ws, torch.bfloat16))
            row: dict[str, Any] = {"m": m, "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9}
            if not smoke:
                one = torch.ones((), device=dev)
                wt = wq.t()
                ms_c = timer(
                    lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                )
                row.update(cublas_ms=ms_c, cublas_tflops=flops / ms_c / 1e9, ratio=ms_c / ms)
                # the pointer-based kernel (the batch-invariant path and the non-TMA fallback)
                ms_p = timer(lambda: gemm_k.fp8_gemm(xq, xs, wq, ws, torch.bfloat16, tma=False))
                row.update(pointer_tflops=flops / ms_p / 1e9)
                # correctness at the benchmarked shape (against dequantised float32 on the GPU)
                y = be.gemm.fp8_gemm(xq, xs, wq, ws, torch.float32)
                ref = ref_gemm.dequantize_act(xq, xs) @ ref_gemm.dequantize_weight(wq, ws).t()
                row["rel_err"] = float((y - ref).norm() / ref.norm())
                ms_q = timer(lambda: be.gemm.quantize_fp8(x))
                row["quant_gbs"] = (m * k * 2 + m * k + m * k / 128 * 4) / ms_q / 1e6
            rows.append(row)
            log(
                f"fp8 M={m:5d} N={n:5d} K={k:5d}: {row['tflops']:6.0f} TFLOP/s"
                + (
                    f" cuBLAS {row['cublas_tflops']:6.0f} ratio {row['ratio']:.2f} err {row['rel_err']:.1e}"
                    if "ratio" in row
                    else ""
                )
            )
    if not smoke:  # tile sweeps of the TMA kernel (tma=True) and the pointer kernel
        tma_tiles = {
            128: [(64, 128, 4, 6), (128, 128, 8, 4)],
            4096: [(128, 128, 8, 4), (128, 128, 8, 5), (128, 128, 8, 6), (64, 128, 4, 6)],
        }
        for n, k in [(4096, 7168), (18432, 7168)]:
            w = torch.randn((n, k), generator=gen).to(dev) * k**-0.5
            wq, ws = ref_gemm.quantize_weight(w)
            for m, tiles in tma_tiles.items():
                x = torch.randn((m, k), generator=gen).to(dev, torch.bfloat16)
                xq, xs = be.gemm.quantize_fp8(x)
                for tma, (bm, bn, warps, stages) in [(True, t) for t in tiles] + [(False, (64, 64, 4, 5))]:
                    cfg = gemm_k.GemmConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                    name = f"{'tma' if tma else 'pointer'} {bm}x{bn} w{warps} s{stages}"
                    try:

                        def run_fp8(
                            cfg: gemm_k.GemmConfig = cfg,
                            xq: torch.Tensor = xq,
                            xs: torch.Tensor = xs,
                            tma: bool = tma,
                        ) -> None:
                            gemm_k.fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config=cfg, tma=tma)

                        ms = timer(run_fp8)
                    except Exception as exc:
                        log(f"fp8 sweep {name}: failed {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    tf = 2 * m * n * k / ms / 1e9
                    rows.append({"sweep": name, "m": m, "n": n, "k": k, "ms": ms, "tflops": tf})
                    log(f"fp8 sweep M={m} N={n} K={k} {name}: {tf:.0f} TFLOP/s")
    return rows


# --------------------------------------------------------------------------- fused MoE


def quantize_experts(w: torch.Tensor, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> e4m3 and (E, N/128, K/128) block scales (N, K multiples of 128),
    a few experts at a time to bound the float32 temporaries."""
    e, n, k = w.shape
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((e, n // 128, k // 128), dtype=torch.float32, device=w.device)
    for s in range(0, e, chunk):
        blocks = w[s : s + chunk].float().view(-1, n // 128, 128, k // 128, 128)
        sc = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 448.0
        q[s : s + chunk] = (blocks / sc[:, :, None, :, None]).clamp(-448, 448).view(-1, n, k).to(q.dtype)
        scale[s : s + chunk] = sc
    return q, scale


def bench_moe(
    be: Backend, ref: Backend, dev: torch.device, timer: Timer, smoke: bool
) -> list[dict[str, Any]]:
    gen = torch.Generator(device=dev).manual_seed(2)
    hidden, experts, top_k, inter = (7168, 256, 8, 2048) if not smoke else (256, 8, 2, 128)
    cfg = RouterConfig(
        "sigmoid",
        top_k,
        num_groups=8 if not smoke else 2,
        topk_groups=4 if not smoke else 1,
        group_score="top2_sum",
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    rows: list[dict[str, Any]] = []
    w13 = (
        torch.randn((experts, 2 * inter, hidden), device=dev, generator=gen, dtype=torch.bfloat16)
        * hidden**-0.5
    )
    w2 = torch.randn((experts, hidden, inter), device=dev, generator=gen, dtype=torch.bfloat16) * inter**-0.5
    bias = torch.randn((experts,), device=dev, generator=gen) * 0.1
    for fmt in ("bf16", "fp8"):
        if fmt == "fp8":
            w13q, w13s = quantize_experts(w13)
            w2q, w2s = quantize_experts(w2)
            del w13, w2
            weights_args: tuple[Any, ...] = (w13q, w2q, w13s, w2s)
        else:
            weights_args = (w13, w2, None, None)
        for tokens in [64, 4096] if not smoke else [4]:
            x = torch.randn((tokens, hidden), device=dev, generator=gen, dtype=torch.bfloat16)
            logits = torch.randn((tokens, experts), device=dev, generator=gen)
            weights, ids = be.moe.route(logits, cfg, bias)
            flops = tokens * top_k * 2 * hidden * 3 * inter

            def run(
                b: Backend, x: torch.Tensor = x, w: torch.Tensor = weights, i: torch.Tensor = ids
            ) -> None:
                b.moe.fused_moe(x, w, i, *weights_args)

            ms = timer(lambda: run(be))
            ms_ref = timer(
                lambda: run(ref),
                rep_ms=50,
            )
            y = be.moe.fused_moe(x, weights, ids, *weights_args).float()
            y_ref = ref.moe.fused_moe(x, weights, ids, *weights_args).float()
            err = float((y - y_ref).norm() / y_ref.norm())
            row = {
                "format": fmt,
                "tokens": tokens,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "ref_ms": ms_ref,
                "ref_tflops": flops / ms_ref / 1e9,
                "speedup": ms_ref / ms,
                "rel_err_vs_ref": err,
            }
            rows.append(row)
            log(
                f"moe {fmt} T={tokens:5d}: {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s | "
                f"reference {ms_ref:9.3f} ms "
                f"{row['ref_tflops']:6.1f} TFLOP/s | speedup {ms_ref / ms:6.1f}x err {err:.1e}"
            )
    return rows


# --------------------------------------------------------------------------- DeepSeek-V4


def torch_compressed_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    ckv: torch.Tensor,
    tables: torch.Tensor,
    ctables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    ratio: int,
    window: int,
    sinks: torch.Tensor,
    topk: torch.Tensor | None,
    num_entries: int,
) -> torch.Tensor:
    """Decode compressed attention as a torch composition without host syncs (graph-capturable):
    gather each request's window rows and its top-k (or all num_entries) entries, one masked
    softmax with the sinks. q (B, H, D), kv / ckv (NB, BS, D) -> (B, H, D). Top-k ids distinct."""
    b, _, d = q.shape
    bs, cbs, dev = kv.shape[1], ckv.shape[1], q.device
    pos = seq_lens.long() - 1
    j = pos[:, None] - torch.arange(window - 1, -1, -1, device=dev)  # (B, W)
    wvalid = j >= 0
    j = j.clamp(min=0)
    kw = kv.view(-1, d)[tables.long().gather(1, j // bs) * bs + j % bs]  # (B, W, D)
    ids = torch.arange(num_entries, device=dev).expand(b, -1) if topk is None else topk.long()
    cvalid = (ids >= 0) & (ids < ((pos + 1) // ratio)[:, None])
    ids = torch.where(cvalid, ids, 0)
    kc = ckv.view(-1, d)[ctables.long().gather(1, ids // cbs) * cbs + ids % cbs]  # (B, K, D)
    keys = torch.cat([kw, kc], dim=1).float()
    s = torch.einsum("bhd,bnd->bhn", q.float(), keys) * scale
    s = s.masked_fill(~torch.cat([wvalid, cvalid], dim=1)[:, None, :], float("-inf"))
    top = torch.maximum(s.amax(-1), sinks[None, :])
    e = torch.exp(s - top[..., None])
    den = e.sum(-1) + torch.exp(sinks[None, :] - top)
    return (torch.einsum("bhn,bnd->bhd", e, keys) / den[..., None]).to(q.dtype)


def torch_indexer_decode(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    ctables: torch.Tensor,
    seq_lens: torch.Tensor,
    ratio: int,
    topk: int,
    scale: float,
    num_entries: int,
) -> torch.Tensor:
    """The indexer's decode top-k as a torch composition without host syncs: every entry up to
    num_entries gathered, scored, masked past each request's visible ones, torch.topk."""
    di = q.shape[-1]
    cbs, dev = keys.shape[1], q.device
    ids = torch.arange(num_entries, device=dev)
    rows = keys.view(-1, keys.shape[-1])[ctables.long()[:, ids // cbs] * cbs + ids % cbs][..., :di]
    logits = torch.einsum("bhd,bcd->bhc", q.float(), rows.float())
    scores = (torch.relu(logits) * weights[..., None]).sum(1) * scale  # (B, C)
    scores = scores.masked_fill(ids[None, :] >= (seq_lens.long() // ratio)[:, None], float("-inf"))
    top = scores.topk(min(topk, num_entries), dim=-1)
    return torch.where(torch.isfinite(top.values), top.indices, -1).to(torch.int32)


def v4_paged(
    batch: int, kv_len: int, rows_per_token: int, d: int, keep: int, dev: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 (NB, 64, d) pool and (B, MB) tables for `kv_len // rows_per_token` rows per request,
    of which only the last `keep` have blocks of their own (the window: the rest share block 0)."""
    n = kv_len // rows_per_token
    mb = max(1, math.ceil(n / 64))
    own = min(mb, math.ceil(keep / 64) + 1)
    pool = torch.randn((batch * own + 1, 64, d), generator=gen).to(dev, torch.bfloat16)
    tables = torch.zeros((batch, mb), dtype=torch.int32)
    for b in range(batch):
        tables[b, mb - own :] = torch.arange(1 + b * own, 1 + (b + 1) * own, dtype=torch.int32)
    return pool, tables.to(dev)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


class V4Recorder:
    """Times a kernel and its torch composition (CUDA graph replays; --smoke: eagerly) and keeps
    one row per comparison."""

    def __init__(self, timer: Timer, smoke: bool) -> None:
        self.timer, self.smoke = timer, smoke
        self.rows: list[dict[str, Any]] = []

    def _time(self, fn: Callable[[], object]) -> float:
        if self.smoke:
            return self.timer(fn)
        return self.timer(graph_replayer(lambda: void(fn()), 1))

    def __call__(
        self,
        op: str,
        shape: dict[str, Any],
        kernel: Callable[[], object],
        torch_fn: Callable[[], object],
        diff: float,
    ) -> None:
        ms, torch_ms = self._time(kernel), self._time(torch_fn)
        self.rows.append(
            {"op": op, **shape, "ms": ms, "torch_ms": torch_ms, "speedup": torch_ms / ms, "rel_diff": diff}
        )
        dims = " ".join(f"{k}={v}" for k, v in shape.items())
        log(
            f"v4 {op} {dims}: {ms * 1e3:8.1f} us | torch {torch_ms * 1e3:9.1f} us | "
            f"{torch_ms / ms:6.1f}x diff {diff:.1e}"
        )


def void(_: object) -> None:
    return None


def bench_hc(be: Backend, dev: torch.device, rec: V4Recorder, smoke: bool, gen: torch.Generator) -> None:
    """hc_pre / hc_post / hc_head over T tokens of 4 streams of 4096 (20 Sinkhorn iterations)
    against the reference's torch ops."""
    from deepinfer.reference import v4 as ref_v4

    n, dm, iters, eps = (4, 4096, 20, 1e-6) if not smoke else (4, 64, 20, 1e-6)
    for t in [1, 8, 32, 128, 1024, 8192] if not smoke else [1, 9]:
        s = torch.randn((t, n, dm), generator=gen).to(dev, torch.bfloat16)
        fn = (torch.randn(((2 + n) * n, n * dm), generator=gen) * (n * dm) ** -0.5).to(dev)
        base, scale = torch.randn(((2 + n) * n,), generator=gen).to(dev), torch.ones(3, device=dev)
        y = torch.randn((t, dm), generator=gen).to(dev, torch.bfloat16)
        hfn, hbase, hscale = fn[:n], base[:n], scale[:1]

        def pre(small: Any) -> Any:
            return small.hc_pre(s, fn, base, scale, eps, eps, iters)

        def post(small: Any) -> Any:
            return small.hc_post(y, s, mixes[1], mixes[2])

        def head(small: Any) -> Any:
            return small.hc_head(s, hfn, hbase, hscale, eps, eps)

        mixes = pre(ref_v4)
        for name, op in (("hc_pre", pre), ("hc_post", post), ("hc_head", head)):
            got, want = op(be.small), op(ref_v4)
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            diff = max(rel(g, w) for g, w in pairs)
            rec(name, {"tokens": t}, functools.partial(op, be.small), functools.partial(op, ref_v4), diff)


def bench_v4_decode(
    be: Backend, dev: torch.device, rec: V4Recorder, smoke: bool, gen: torch.Generator
) -> None:
    """One query per request: the indexer (64 x 128, top-512 at ratio 4) and compressed attention
    (64 heads x 512, window 128, sinks; CSA over the indexer's picks, HCA over every entry of
    ratio 128) against the batched torch compositions above."""
    from deepinfer.backend.types import AttentionModifiers, KVCacheSpec, PagedKVCache

    h, d, window, hi, di, k = (64, 512, 128, 64, 128, 512) if not smoke else (4, 32, 8, 4, 16, 8)
    for batch in [1, 32, 128] if not smoke else [2]:
        for kv_len in [8192, 65536] if not smoke else [64]:
            seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
            shape = {"batch": batch, "kv_len": kv_len}
            tok_pool, tok_tables = v4_paged(batch, kv_len, 1, d, window, dev, gen)
            meta = AttentionMetadata.build(tok_tables, [kv_len] * batch, [1] * batch)
            tokens = PagedKVCache(KVCacheSpec(tok_pool.shape[0], 64, d, 0, torch.bfloat16), (tok_pool,))
            sinks = torch.randn((h,), generator=gen).to(dev)
            q = torch.randn((batch, h, d), generator=gen).to(dev, torch.bfloat16)
            for ratio, name in ((4, "csa"), (128, "hca")):
                c = kv_len // ratio
                e_pool, e_tables = v4_paged(batch, kv_len, ratio, d, c, dev, gen)
                entries = PagedKVCache(KVCacheSpec(e_pool.shape[0], 64, d, 0, torch.bfloat16), (e_pool,))
                e_meta = dataclasses.replace(meta, block_tables=e_tables)
                topk = None
                if name == "csa":  # the indexer over these entries, then attention over its picks
                    qi = torch.randn((batch, hi, di), generator=gen).to(dev, torch.bfloat16)
                    wi = torch.randn((batch, hi), generator=gen).to(dev) * hi**-0.5

                    def index(qi: torch.Tensor = qi, wi: torch.Tensor = wi, e: Any = entries) -> torch.Tensor:
                        return be.attention.indexer_topk(qi, wi, e, e_meta, ratio=4, topk=k, scale=di**-0.5)

                    def index_torch(
                        qi: torch.Tensor = qi,
                        wi: torch.Tensor = wi,
                        p: torch.Tensor = e_pool,
                        t: Any = e_tables,
                    ) -> torch.Tensor:
                        return torch_indexer_decode(qi, wi, p, t, seq_lens, 4, k, di**-0.5, c)

                    topk = index()
                    same = (topk.sort(-1).values == index_torch().sort(-1).values).float().mean()
                    rec("indexer_topk", shape, index, index_torch, 1.0 - float(same))  # ids that differ
                mods = AttentionModifiers(window=window, sinks=sinks, topk_indices=topk)

                def attend(
                    m: AttentionModifiers = mods, e: Any = entries, r: int = ratio, t: Any = e_tables
                ) -> Any:
                    return be.attention.compressed_attention(
                        q, tokens, e, meta, scale=d**-0.5, ratio=r, modifiers=m, compressed_block_tables=t
                    )

                def attend_torch(
                    r: int = ratio, p: Any = e_pool, t: Any = e_tables, tk: Any = topk, c: int = c
                ) -> Any:
                    return torch_compressed_decode(
                        q, tok_pool, p, tok_tables, t, seq_lens, d**-0.5, r, window, sinks, tk, c
                    )

                rec(
                    f"compressed_attention/{name}", shape, attend, attend_torch, rel(attend(), attend_torch())
                )
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def bench_v4(be: Backend, dev: torch.device, timer: Timer, smoke: bool) -> list[dict[str, Any]]:
    """DeepSeek-V4's ops at V4-Flash shapes, kernel against torch composition."""
    gen = torch.Generator().manual_seed(3)
    rec = V4Recorder(timer, smoke)
    bench_hc(be, dev, rec, smoke, gen)
    bench_v4_decode(be, dev, rec, smoke, gen)
    return rec.rows


def bench_mla_query(be: Backend, dev: torch.device, timer: Timer, smoke: bool) -> list[dict[str, Any]]:
    """MLA's query preparation, N 128, C 512, R 64, bf16, interleaved rope: 16 heads (V2-Lite, 27
    layers) and 128 (V3; 27 layers here too), T tokens. Each timed call runs every layer's op on
    that layer's own W_UK (27 x 2 MiB or 27 x 16 MiB: not one L2-resident weight); `ms` is per layer."""
    gen = torch.Generator().manual_seed(4)
    rec = V4Recorder(timer, smoke)
    n, c, r, layers = (128, 512, 64, 27) if not smoke else (16, 32, 8, 2)
    table = torch.randn((8192, r), generator=gen).to(dev)
    for h in [16, 128] if not smoke else [2]:
        w = (torch.randn((layers, h, c, n), generator=gen) * n**-0.5).to(dev, torch.bfloat16)

        for t in [1, 32, 128, 4096] if not smoke else [1, 5]:
            q = torch.randn((t, h, n + r), generator=gen).to(dev, torch.bfloat16)
            positions = torch.randint(0, 8192, (t,), generator=gen).to(dev)

            def fused(q: torch.Tensor = q, p: torch.Tensor = positions) -> None:
                for i in range(layers):
                    be.attention.mla_query(q[..., :n], q[..., n:], w[i], p, table, True)

            def composed(q: torch.Tensor = q, p: torch.Tensor = positions) -> None:
                for i in range(layers):
                    AttentionOps.mla_query(be.attention, q[..., :n], q[..., n:], w[i], p, table, True)

            args = (q[..., :n], q[..., n:], w[0], positions, table, True)
            diff = rel(be.attention.mla_query(*args), AttentionOps.mla_query(be.attention, *args))
            rec("mla_query", {"heads": h, "tokens": t}, fused, composed, diff)
    for row in rec.rows:
        row["ms"] /= layers
        row["torch_ms"] /= layers
    return rec.rows


# --------------------------------------------------------------------------- report


def markdown(res: dict[str, Any]) -> str:
    out = [
        f"# CUDA backend benchmarks: {res['gpu']} ({res['date']})",
        "",
        f"torch {res['torch']}, triton {res['triton']}. Copy bandwidth (read + write): "
        f"{res['copy']['gbs']:.0f} GB/s. Dense bf16 matmul (cuBLAS, {res['matmul']['n']}^3): "
        f"{res['matmul']['tflops']:.0f} TFLOP/s.",
        "",
        "## MLA decode (bf16 latent cache, block 64, D 576, Dv 512)",
        "",
        "Times are CUDA-graph replays (GPU time, as an engine runs decode); `eager ms` is the same",
        "call launched from Python each time (host overhead included).",
        "",
        "| heads | batch | KV len | ms | GB/s | of copy | TFLOP/s | of matmul | rel err | eager ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["decode"]:
        if "sweep" in r or "skipped" in r:
            continue
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        out.append(
            f"| {r['heads']} | {r['batch']} | {r['kv_len']} | {r['ms']:.3f} | {r['gbs']:.0f} | "
            f"{r['ratio_to_copy']:.2f} | {r['tflops']:.0f} | {r['ratio_to_matmul']:.2f} | {err} | "
            f"{r['eager_ms']:.3f} |"
        )
    fp8_rows = [r for r in res.get("decode_fp8", []) if "ms" in r]
    if fp8_rows:
        out += [
            "",
            "## MLA decode over the FP8 latent cache (kv_cache_dtype=fp8: 656 bytes a token, bf16: 1152)",
            "",
            "GB/s of the FP8 bytes read; `vs bf16`: the bf16 cache's time over the FP8 cache's, same inputs",
            "(the FP8 rows are the bf16 rows quantised), both CUDA-graph replays in this run;",
            "`ms`: the defaults; `float16-read ms`: attention.FP8_HALF_READ on (e4m3 to float16, float16",
            "MMAs) at the default tiles; rel err: the first requests' against float32 attention over the",
            "dequantised rows (the defaults', the float16 read's).",
            "",
            "| heads | batch | KV len | ms | GB/s | of copy | bf16 ms | vs bf16 | TFLOP/s | rel err "
            "| float16-read ms | vs bf16 | rel err |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in fp8_rows:
            err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
            out.append(
                f"| {r['heads']} | {r['batch']} | {r['kv_len']} | {r['ms']:.3f} | {r['gbs']:.0f} | "
                f"{r['ratio_to_copy']:.2f} | {r['bf16_ms']:.3f} | {r['speedup']:.2f}x | {r['tflops']:.0f} | "
                f"{err} | {r['half_ms']:.3f} | {r['half_speedup']:.2f}x | {r['half_rel_err']:.1e} |"
            )
        for r in fp8_rows:
            if r.get("sweep_ms"):
                tiles = ", ".join(f"{k} {v:.3f} ms" for k, v in r["sweep_ms"].items())
                out.append(f"\nH={r['heads']} B={r['batch']} L={r['kv_len']}, other FP8 variants: {tiles}")
    sweep = [r for r in res["decode"] if "sweep" in r and "ms" in r]
    if sweep:
        out += ["", "Tile sweeps at batch 128, KV length 4096 (first row per head count: the default):", ""]
        out += ["| heads | config | ms | GB/s | of copy |", "| --- | --- | --- | --- | --- |"]
        out += [
            f"| {r['heads']} | {r['sweep']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['ratio_to_copy']:.2f} |"
            for r in sweep
        ]
    out += [
        "",
        "## FP8 block-scaled GEMM (bf16 out) vs cuBLAS per-tensor torch._scaled_mm",
        "",
        "| M | N | K | Triton TFLOP/s | cuBLAS TFLOP/s | ratio | pointer kernel TFLOP/s | rel err "
        "| quant GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["fp8"]:
        if "sweep" in r or "cublas_tflops" not in r:
            continue
        out.append(
            f"| {r['m']} | {r['n']} | {r['k']} | {r['tflops']:.0f} | {r['cublas_tflops']:.0f} | "
            f"{r['ratio']:.2f} | {r['pointer_tflops']:.0f} | {r['rel_err']:.1e} | {r['quant_gbs']:.0f} |"
        )
    sweep = [r for r in res["fp8"] if "sweep" in r]
    if sweep:
        out += ["", "Tile sweep:", "", "| M | N | K | config | TFLOP/s |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {r['m']} | {r['n']} | {r['k']} | {r['sweep']} | {r['tflops']:.0f} |" for r in sweep]
    out += [
        "",
        "## Fused MoE, DeepSeek-V3 layer (hidden 7168, 256 experts, top-8, inter 2048)",
        "",
        "| format | tokens | cuda ms | cuda TFLOP/s | reference ms | reference TFLOP/s | speedup | rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["moe"]:
        out.append(
            f"| {r['format']} | {r['tokens']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['ref_ms']:.2f} | "
            f"{r['ref_tflops']:.1f} | {r['speedup']:.1f}x | {r['rel_err_vs_ref']:.1e} |"
        )
    if res.get("skinny"):
        out += [
            "",
            "## Skinny GEMM (decode-sized float linears of V2-Lite, bf16) vs cuBLAS",
            "",
            "Per call, CUDA graphs of back-to-back calls on weight copies larger than the L2 together.",
            "GB/s: the weight's bytes over the time.",
            "",
            "| shape | heads | N | K | M | cuBLAS us | GB/s | skinny us | GB/s | of copy | speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in res["skinny"]:
            if r.get("chain"):
                chain_rows = [(k, v) for k, v in r.items() if isinstance(v, dict)]
                out += ["", f"Dependent {r['shape']} at M = 1, per product:", ""]
                out += ["| way | us | GB/s | of copy |", "| --- | --- | --- | --- |"]
                out += [
                    f"| {k} | {v['us']:.2f} | {v['gbs']:.0f} | {v['of_copy']:.2f} |" for k, v in chain_rows
                ]
                continue
            if "speedup" not in r:
                continue
            c, sk = r["cublas"], r["skinny"]
            out.append(
                f"| {r['shape']} | {r['heads']} | {r['n']} | {r['k']} | {r['m']} | {c['us']:.2f} | "
                f"{c['gbs']:.0f} | {sk['us']:.2f} | {sk['gbs']:.0f} | {sk['of_copy']:.2f} | "
                f"{r['speedup']:.2f}x |"
            )
        best = [
            (r["shape"], r["m"], min((v["us"], k) for k, v in r.items() if k.startswith("sweep")))
            for r in res["skinny"]
            if any(k.startswith("sweep") for k in r)
        ]
        if best:
            out += ["", "Fastest tile of the sweep:", ""]
            out += ["| shape | M | tile | us |", "| --- | --- | --- | --- |"]
            out += [f"| {s} | {m} | {k[6:]} | {us:.2f} |" for s, m, (us, k) in best]
    if res.get("v4"):
        out += [
            "",
            "## DeepSeek-V4 ops (V4-Flash shapes), Triton kernel vs torch composition, CUDA graphs",
            "",
            "hc_*: N 4 x hidden 4096, 20 Sinkhorn iterations (torch: the reference's ops). Decode, one",
            "query per request: indexer 64 x 128, top-512 at ratio 4; compressed attention 64 heads x",
            "512, window 128, sinks, CSA (ratio 4, the indexer's top-512) and HCA (ratio 128, every",
            "entry) (torch: batched gathers, one masked softmax). `diff`: relative L2 difference of the",
            "outputs (indexer: the fraction of ids that differ).",
            "",
            "| op | shape | kernel us | torch us | speedup | diff |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in res["v4"]:
            shape = ", ".join(f"{k} {r[k]}" for k in ("tokens", "batch", "kv_len") if k in r)
            times = f"{r['ms'] * 1e3:.1f} | {r['torch_ms'] * 1e3:.1f} | {r['speedup']:.1f}x"
            out.append(f"| {r['op']} | {shape} | {times} | {r['rel_diff']:.1e} |")
    if res.get("mla_query"):
        out += [
            "",
            "## MLA query preparation (N 128, C 512, R 64, bf16), one launch vs the composition",
            "",
            "Per layer, CUDA graphs of 27 layers (each its own W_UK). composition: Triton rope, cuBLAS",
            "bmm (with its copy of the transposed q_nope), torch.cat. `diff`: relative L2 difference.",
            "",
            "| heads | tokens | kernel us | composition us | speedup | diff |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in res["mla_query"]:
            times = f"{r['ms'] * 1e3:.1f} | {r['torch_ms'] * 1e3:.1f} | {r['speedup']:.1f}x"
            out.append(f"| {r['heads']} | {r['tokens']} | {times} | {r['rel_diff']:.1e} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="folder for bench_cuda.json / bench_cuda.md")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, host timer (TRITON_INTERPRET=1 on a CPU)"
    )
    p.add_argument(
        "--only", default="decode,decode_fp8,fp8,moe,v4,mla_query", help="comma-separated sections"
    )
    p.add_argument(
        "--no-fp8-sweep", dest="fp8_sweep", action="store_false",
        help="decode_fp8: time the default tiles only (no FP8_WIDE / NARROW / SPLIT sweeps)",
    )  # fmt: skip
    args = p.parse_args(argv)
    registry = BackendRegistry.discover()
    be = registry.create("cuda", BackendOptions())
    dev = be.device.device()
    if dev.type != "cuda" and not args.smoke:
        print("no CUDA device: run on a GPU, or use --smoke under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    os.environ.setdefault("DEEPINFER_REFERENCE_DEVICE", str(dev))
    ref = registry.create("reference", BackendOptions())
    timer = Timer(args.smoke)
    import triton

    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "decode": [],
        "decode_fp8": [],
        "decode_short": [],
        "skinny": [],
        "fp8": [],
        "moe": [],
        "v4": [],
        "mla_query": [],
    }
    only = set(args.only.split(","))
    res["copy"] = bench_copy(dev, timer, args.smoke)
    res["matmul"] = bench_matmul(dev, timer, args.smoke)
    for name, fn in (
        (
            "decode",
            lambda: bench_decode(be, dev, timer, res["copy"]["gbs"], res["matmul"]["tflops"], args.smoke),
        ),
        (
            "decode_fp8",
            lambda: bench_decode_fp8(be, dev, timer, res["copy"]["gbs"], args.smoke, args.fp8_sweep),
        ),
        ("decode_short", lambda: bench_decode_short(be, dev, timer, args.smoke)),
        ("skinny", lambda: bench_skinny(dev, timer, res["copy"]["gbs"], args.smoke)),
        ("fp8", lambda: bench_fp8(be, dev, timer, args.smoke)),
        ("moe", lambda: bench_moe(be, ref, dev, timer, args.smoke)),
        ("v4", lambda: bench_v4(be, dev, timer, args.smoke)),
        ("mla_query", lambda: bench_mla_query(be, dev, timer, args.smoke)),
    ):
        if name in only:
            t0 = time.time()
            try:
                res[name] = fn()  # type: ignore[no-untyped-call]
            except Exception as exc:
                log(f"{name}: FAILED {type(exc).__name__}: {exc}")
                res[name + "_error"] = f"{type(exc).__name__}: {exc}"
            log(f"[{name} took {time.time() - t0:.0f} s]")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    md = markdown(res)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cuda.json").write_text(json.dumps(res, indent=1))
        (args.out / "bench_cuda.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tile configurations of the batch-invariant linear (the cuda backend's chunked-K Triton
matmul), timed at the DeepSeek-V2-Lite shapes a decode step and a prefill run through it.

    python bench/bench_invariant_tiles.py --out DIR        # an NVIDIA GPU; seconds
    python bench/bench_invariant_tiles.py --bits --out DIR # rows' bits across the tiles

In batch-invariant mode every linear (and MLA's per-head absorbed products, batched_matmul)
reduces K in fixed 512-chunks of 128-steps: a row's bits depend on that order, not on the tile,
where the MMA gives every row the same bits in any tile (--bits checks it; on SM90 the backend
then picks the tile by M). For each candidate (tile x split mode) this times each weight shape
of one V2-Lite layer (and the LM head) at M = 1, 32, 256 and 4096 as a CUDA graph of 20
back-to-back calls (as the engine replays them: no launch overhead in the figure), and sums them
into the time of one decode step's invariant GEMMs (27 layers' worth, the head once), with
cuBLAS (the default mode) beside them. Writes DIR/invariant_tiles.json, prints a table, the best
candidate per M, then the best at --pick-m as `BEST BM,BN,BK,WARPS,STAGES` (a value of
DEEPINFER_CUDA_INVARIANT_TILE); the copy bandwidth measured in the same run gives the floor
(weight bytes / copy rate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "cuda"))

from deepinfer_cuda.kernels import gemm as gemm_k  # noqa: E402
from deepinfer_cuda.kernels.gemm import GemmConfig, batched_matmul, matmul  # noqa: E402

# (name, N, K, calls per decode step): V2-Lite, hidden 2048, 16 heads, qk 192, v 128, latent 512
# + rope 64, shared experts 2 x 1408, 26 MoE layers + 1 dense (10944), LM head 102400.
SHAPES = [
    ("q_proj", 3072, 2048, 27),
    ("kv_a_proj", 576, 2048, 27),
    ("o_proj", 2048, 2048, 27),
    ("shared gate_up", 5632, 2048, 26),
    ("shared down", 2048, 2816, 26),
    ("dense gate_up", 21888, 2048, 1),
    ("dense down", 2048, 10944, 1),
    ("lm_head", 102400, 2048, 1),
]
BATCHED = [("absorb q (16 heads)", 16, 512, 128, 27), ("absorb out (16 heads)", 16, 128, 512, 27)]

# Every candidate reduces K in BLOCK_K = 128 steps and INVARIANT_K_CHUNK chunks (the same bits:
# --bits); "split" spreads the chunks over programs at every M, "auto" as the engine does (while
# the tiles are few), "whole" never.
CANDIDATES = {
    f"{bm}x{bn}x128 w{w} s{st} {mode}": (
        GemmConfig(block_m=bm, block_n=bn, block_k=128, num_warps=w, num_stages=st),
        mode,
    )
    for bm, bn, w, st in [(16, 32, 4, 4), (16, 64, 4, 3), (32, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)]
    for mode in ("auto", "split", "whole")
}
SPLIT_MODES = {"auto": gemm_k.SPLIT_BELOW_TILES_PER_SM, "split": 10**9, "whole": 0}


def time_us(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per call of fn: `reps` calls captured in one CUDA graph, the best of 3 replays."""
    fn()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


# Tiles that share BLOCK_K = 128 (the order of the K reduction) but not M/N tiling, warps or stages:
# --bits checks whether a row's bits depend on them on this GPU (the MMA instruction differs:
# mma.sync at 16 rows, wgmma at 64 and up on SM90).
SAME_K = [
    GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=32, block_n=32, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
]


def bits_check(dev: torch.device) -> list[dict[str, object]]:
    """For each V2-Lite shape: rows of M = 1, 32 and 4096 computed under every SAME_K tile,
    compared bit for bit with the first tile's result on the same rows (and M = 1's row with
    row 0 of M = 4096)."""
    out = []
    for name, n, k, _ in SHAPES[:5]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
        base = {m: matmul(x[:m], w, config=SAME_K[0]) for m in (1, 32, 4096)}
        for cfg in SAME_K[1:]:
            equal = all(torch.equal(matmul(x[:m], w, config=cfg), base[m]) for m in base)
            equal &= torch.equal(matmul(x[:4096], w, config=cfg)[:1], base[1])
            tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            out.append({"shape": name, "tile": tile, "bitwise_equal_to_16x32x128": bool(equal)})
            print(f"bits {name:16s} {tile:24s} equal to 16x32x128: {equal}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32, 256, 4096])
    ap.add_argument("--pick-m", type=int, default=32, help="M whose decode-step time picks the best")
    ap.add_argument("--bits", action="store_true", help="only the bitwise check across SAME_K tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.bits:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tile_bits.json").write_text(json.dumps(bits_check(dev), indent=1) + "\n")
        return
    torch.manual_seed(0)
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / time_us(lambda: dst.copy_(src), 10) / 1e3  # bytes per us / 1e3
    rows = []
    bf16 = torch.bfloat16
    weights = {(n, k): torch.randn(n, k, device=dev, dtype=bf16) * 0.02 for _, n, k, _ in SHAPES}
    bweights = {(g, n, k): torch.randn(g, n, k, device=dev, dtype=bf16) * 0.02 for _, g, n, k, _ in BATCHED}
    for m in args.ms:
        xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in {k for _, _, k, _ in SHAPES}}
        bxs = {(g, k): torch.randn(g, m, k, device=dev, dtype=torch.bfloat16) for _, g, _, k, _ in BATCHED}
        floor = sum(n * k * 2 * calls for _, n, k, calls in SHAPES) / copy_gbs / 1e6  # ms
        floor += sum(g * n * k * 2 * calls for _, g, n, k, calls in BATCHED) / copy_gbs / 1e6
        for name, (cfg, mode) in CANDIDATES.items():
            gemm_k.SPLIT_BELOW_TILES_PER_SM = SPLIT_MODES[mode]
            per: dict[str, float] = {}
            step = 0.0
            for shape, n, k, calls in SHAPES:
                w, x = weights[(n, k)], xs[k]
                per[shape] = time_us(lambda w=w, x=x, cfg=cfg: matmul(x, w, config=cfg))
                step += per[shape] * calls
            for shape, g, n, k, calls in BATCHED:
                w, x = bweights[(g, n, k)], bxs[(g, k)]
                per[shape] = time_us(lambda w=w, x=x, cfg=cfg: batched_matmul(x, w, config=cfg))
                step += per[shape] * calls
            rows.append(
                {"m": m, "config": name, "step_ms": step / 1e3, "weights_floor_ms": floor, "per_call_us": per}
            )
            print(f"M={m:5d} {name:28s} step {step / 1e3:7.3f} ms (weights at copy rate {floor:.3f} ms)")
        # the default (not batch-invariant) path beside them: cuBLAS linear and bmm
        step = sum(
            time_us(lambda w=weights[(n, k)], x=xs[k]: torch.nn.functional.linear(x, w)) * calls
            for _, n, k, calls in SHAPES
        )
        step += sum(
            time_us(lambda w=bweights[(g, n, k)], x=bxs[(g, k)]: torch.bmm(x, w.transpose(1, 2))) * calls
            for _, g, n, k, calls in BATCHED
        )
        rows.append(
            {"m": m, "config": "cuBLAS (default mode)", "step_ms": step / 1e3, "weights_floor_ms": floor}
        )
        print(f"M={m:5d} {'cuBLAS (default mode)':28s} step {step / 1e3:7.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    ours = [r for r in rows if r["config"] in CANDIDATES]
    picked = min((r for r in ours if r["m"] == args.pick_m), key=lambda r: r["step_ms"])
    for m in args.ms:
        best = min((r for r in ours if r["m"] == m), key=lambda r: r["step_ms"])
        print(f"best at M={m}: {best['config']} {best['step_ms']:.3f} ms")
    c = CANDIDATES[picked["config"]][0]
    print(f"BEST {c.block_m},{c.block_n},{c.block_k},{c.num_warps},{c.num_stages} ({picked['config']})")
    result = {"copy_GBps": copy_gbs, "rows": rows, "best_at_pick_m": picked["config"]}
    (args.out / "invariant_tiles.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

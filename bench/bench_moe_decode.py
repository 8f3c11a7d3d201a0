"""Decode-sized MoE on one GPU: the GEMV kernels against the grouped GEMM path, and both against
the copy bandwidth measured in the same run.

For each layer shape (DeepSeek-V2-Lite: hidden 2048, 64 routed experts of 1408 + 2 shared, top-6;
DeepSeek-V3: hidden 7168, 256 routed of 2048 + 1 shared, top-8; bf16, and V3 in FP8 too) and
T = 1, 2, 4, 8, 16 tokens: the backend's fused_moe through the grouped path (align, GEMM,
silu_and_mul, GEMM, combine) and through kernels/moe.gemv_moe under each tiling of a small sweep.
Shared experts are routed as experts E .. E + S - 1, as the model fuses them. Every call is timed
as a CUDA-graph replay, rotating over 8 routings so that weights come from memory, not L2.
Bandwidth = bytes of the distinct experts the T tokens touch (routed + shared) / time.

Writes moe_decode.json (rows and the best GEMV setting: DEEPINFER_CUDA_MOE_GEMV's value) and
moe_decode.md; prints the setting as the last line.

    python bench/bench_moe_decode.py --out DIR
    TRITON_INTERPRET=1 python bench/bench_moe_decode.py --smoke    # tiny shapes on the CPU
"""

# ruff: noqa: B023 - every closure below is timed inside the iteration that defines it
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_cuda import Timer, bench_copy, graph_replayer, log, quantize_experts  # noqa: E402

from deepinfer.backend.registry import BackendRegistry  # noqa: E402
from deepinfer.backend.types import BackendOptions, RouterConfig  # noqa: E402

SHAPES = {  # hidden, routed experts, inter, top-k, shared experts
    "v2-lite": (2048, 64, 1408, 6, 2),
    "v3": (7168, 256, 2048, 8, 1),
}
SMOKE_SHAPE = (256, 8, 128, 2, 1)
# (n, k, warps) of the up kernel (timed with the down kernel at DOWN_FIRST), then of the down
# kernel (with the best up tiling); FP8 steps K by 128 whatever k says
UP_TILINGS = [(8, 256, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (16, 1024, 8), (32, 512, 8)]
DOWN_FIRST = (8, 256, 4)
DOWN_TILINGS = [(4, 256, 2), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8)]
# the grouped GEMM's tiles for small row counts (block_m 16): (block_n, block_k, warps, stages)
GROUPED_TILES = [(128, 64, 4, 3), (64, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3)]
SETS = 8  # routings rotated through the replays


def bench_shape(
    name: str, fmt: str, tokens_list: list[int], smoke: bool, timer: Timer
) -> list[dict[str, Any]]:
    from deepinfer_cuda.kernels import moe as moe_k

    dev = torch.device("cuda") if not smoke else torch.device("cpu")
    be = BackendRegistry.discover().create("cuda", BackendOptions())
    hidden, routed, inter, top_k, shared = SMOKE_SHAPE if smoke else SHAPES[name]
    experts = routed + shared
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn((experts, 2 * inter, hidden), device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn((experts, hidden, inter), device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
    weights_args: tuple[Any, ...] = (w13, w2, None, None)
    expert_bytes = 3 * inter * hidden * 2
    if fmt == "fp8":
        (w13q, s13), (w2q, s2) = quantize_experts(w13), quantize_experts(w2)
        weights_args, expert_bytes = (w13q, w2q, s13, s2), 3 * inter * hidden
        del w13, w2
    router = RouterConfig("sigmoid", top_k, shared_experts=shared)
    rows: list[dict[str, Any]] = []
    for tokens in tokens_list:
        sets = []
        for _ in range(SETS):
            x = torch.randn((tokens, hidden), device=dev, generator=gen, dtype=torch.bfloat16)
            w, ids = be.moe.route(torch.randn((tokens, routed), device=dev, generator=gen), router)
            sets.append((x, w, ids))
        hit = sum(len(set(ids.cpu().reshape(-1).tolist())) for _, _, ids in sets) / SETS
        nbytes = hit * expert_bytes

        def timed(fn: Any, sets: list[tuple[torch.Tensor, ...]] = sets) -> float:
            turn = [0]

            def step() -> None:
                x, w, ids = sets[turn[0] % SETS]
                turn[0] += 1
                fn(x, w, ids)

            return timer(step if smoke else graph_replayer(step, SETS))

        from deepinfer_cuda.kernels import gemm as gemm_k

        saved, saved_config = moe_k.GEMV_MAX_TOKENS, gemm_k.grouped_config
        moe_k.GEMV_MAX_TOKENS = 0
        grouped = []
        try:
            for bn, bk, warps, stages in GROUPED_TILES:
                tile = gemm_k.GemmConfig(block_m=16, block_n=bn, block_k=128 if fmt == "fp8" else bk,
                                         num_warps=warps, num_stages=stages)  # fmt: skip
                gemm_k.grouped_config = lambda rows, fp8, inv, tile=tile: tile  # type: ignore[misc]
                ms = timed(lambda x, w, ids: be.moe.fused_moe(x, w, ids, *weights_args))
                grouped.append({"tiles": [16, bn, bk, warps, stages], "ms": ms, "gbs": nbytes / ms / 1e6})
        finally:
            moe_k.GEMV_MAX_TOKENS, gemm_k.grouped_config = saved, saved_config
        ref = be.moe.fused_moe(sets[0][0], sets[0][1], sets[0][2], *weights_args).float()
        row: dict[str, Any] = {
            "shape": name, "format": fmt, "tokens": tokens, "experts_touched": hit,
            "grouped_ms": grouped[0]["ms"], "grouped_gbs": grouped[0]["gbs"], "grouped": grouped,
            "gemv": [],
        }  # fmt: skip

        def gemv(up: tuple[int, int, int], down: tuple[int, int, int]) -> dict[str, Any]:
            cfg = moe_k.GemvConfig(*up, *down)
            w13, w2, s13, s2 = weights_args
            ms = timed(lambda x, w, ids: moe_k.gemv_moe(x, w, ids, w13, w2, s13, s2, config=cfg))
            y = moe_k.gemv_moe(*sets[0], w13, w2, s13, s2, config=cfg).float()
            err = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
            return {"up": list(up), "down": list(down), "ms": ms, "gbs": nbytes / ms / 1e6, "rel_err": err}

        row["gemv"] = [gemv(up, DOWN_FIRST) for up in UP_TILINGS]
        best_up = tuple(min(row["gemv"], key=lambda r: r["ms"])["up"])
        row["gemv"] += [gemv(best_up, down) for down in DOWN_TILINGS if down != DOWN_FIRST]  # type: ignore[arg-type]
        best = min(row["gemv"], key=lambda r: r["ms"])
        best_grouped = min(grouped, key=lambda r: r["ms"])
        row["best"], row["best_grouped"] = best, best_grouped
        log(
            f"{name} {fmt} T={tokens:3d}: {hit:5.1f} experts | grouped now {grouped[0]['ms']:.4f} ms "
            f"({grouped[0]['gbs']:.0f} GB/s), best {best_grouped['tiles']} {best_grouped['ms']:.4f} ms "
            f"({best_grouped['gbs']:.0f} GB/s) | gemv best up {best['up']} down {best['down']} "
            f"{best['ms']:.4f} ms ({best['gbs']:.0f} GB/s, err {best['rel_err']:.1e})"
        )
        rows.append(row)
    return rows


def best_setting(rows: list[dict[str, Any]]) -> str:
    """DEEPINFER_CUDA_MOE_GEMV for the V2-Lite bf16 rows (the e2e benchmark's model): the GEMV
    tiling with the least summed time over the token counts where GEMV beats every grouped
    tiling, and the largest such count below which it wins at every count."""
    mine = [r for r in rows if r["shape"] == rows[0]["shape"] and r["format"] == "bf16"]
    max_tokens = 0
    for r in sorted(mine, key=lambda r: r["tokens"]):
        if r["best"]["ms"] >= r["best_grouped"]["ms"]:
            break
        max_tokens = r["tokens"]
    wins = [r for r in mine if r["tokens"] <= max(max_tokens, 1)]
    pairs = {(tuple(g["up"]), tuple(g["down"])) for g in wins[0]["gemv"]}
    common = [
        p for p in pairs if all(any((tuple(g["up"]), tuple(g["down"])) == p for g in r["gemv"]) for r in wins)
    ]

    def total(p: tuple[tuple[int, ...], tuple[int, ...]]) -> float:
        return sum(g["ms"] for r in wins for g in r["gemv"] if (tuple(g["up"]), tuple(g["down"])) == p)

    up, down = min(common, key=total)
    return ",".join(str(v) for v in (*up, *down, max_tokens))


def markdown(res: dict[str, Any]) -> str:
    out = [
        f"# Decode-sized MoE, {res['device']}",
        "",
        f"Copy bandwidth in the same run: {res['copy']['gbs']:.0f} GB/s. Setting chosen: "
        f"`DEEPINFER_CUDA_MOE_GEMV={res['setting']}`.",
        "",
        "| shape | format | T | experts read | grouped now ms (GB/s) | best grouped tiles | ms (GB/s) "
        "| GEMV best up / down | ms (GB/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        b, g = r["best"], r["best_grouped"]
        out.append(
            f"| {r['shape']} | {r['format']} | {r['tokens']} | {r['experts_touched']:.1f} "
            f"| {r['grouped_ms']:.4f} ({r['grouped_gbs']:.0f}) | {tuple(g['tiles'])} "
            f"| {g['ms']:.4f} ({g['gbs']:.0f}) "
            f"| {tuple(b['up'])} / {tuple(b['down'])} | {b['ms']:.4f} ({b['gbs']:.0f}) |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    timer = Timer(args.smoke)
    tokens = [int(v) for v in args.tokens.split(",")] if not args.smoke else [1, 2]
    dev = torch.device("cuda") if not args.smoke else torch.device("cpu")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)",
        "copy": bench_copy(dev, timer, args.smoke),
        "rows": [],
    }
    for name, fmt in [("v2-lite", "bf16"), ("v3", "bf16"), ("v3", "fp8")]:
        res["rows"] += bench_shape(name, fmt, tokens, args.smoke, timer)
        torch.cuda.empty_cache() if not args.smoke else None
    res["setting"] = best_setting(res["rows"])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_decode.json").write_text(json.dumps(res, indent=1))
        (args.out / "moe_decode.md").write_text(markdown(res))
    print(f"DEEPINFER_CUDA_MOE_GEMV={res['setting']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

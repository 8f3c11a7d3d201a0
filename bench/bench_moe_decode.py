"""Decode-sized MoE on one GPU: the grouped expert path (align, GEMM, silu_and_mul, GEMM,
combine) under a few tilings of its 16-row tiles, against the copy bandwidth measured in the same
run.

For each layer shape (DeepSeek-V2-Lite: hidden 2048, 64 routed experts of 1408 + 2 shared, top-6;
DeepSeek-V3: hidden 7168, 256 routed of 2048 + 1 shared, top-8; bf16, and V3 in FP8 too) and
T = 1, 2, 4, 8 tokens, the backend's fused_moe is timed as a CUDA-graph replay, rotating over 8
routings so that weights come from memory, not L2; the first tiling is the backend's own
(gemm.grouped_config). Shared experts are routed as experts E .. E + S - 1, as the model fuses
them. Bandwidth = bytes of the distinct experts the T tokens touch (routed + shared) / time.

Writes moe_decode.json and moe_decode.md.

    python bench/bench_moe_decode.py --out DIR
    TRITON_INTERPRET=1 python bench/bench_moe_decode.py --smoke    # tiny shapes on the CPU
"""

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
# the grouped GEMM's tiles for small row counts (block_m 16): (block_n, block_k, warps, stages)
GROUPED_TILES = [
    None,
    (128, 64, 4, 3),
    (64, 64, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
]  # None: the backend's
SETS = 8  # routings rotated through the replays


def bench_shape(
    name: str, fmt: str, tokens_list: list[int], smoke: bool, timer: Timer
) -> list[dict[str, Any]]:
    from deepinfer_cuda.kernels import gemm as gemm_k

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

        saved_config = gemm_k.grouped_config
        grouped = []
        try:
            for choice in GROUPED_TILES:
                own = choice is None
                if not own:
                    bn, bk, warps, stages = choice  # type: ignore[misc]
                    tile = gemm_k.GemmConfig(block_m=16, block_n=bn, block_k=128 if fmt == "fp8" else bk,
                                             num_warps=warps, num_stages=stages)  # fmt: skip
                    gemm_k.grouped_config = lambda rows, fp8, inv, tile=tile: tile  # type: ignore[misc]
                cfg = saved_config(tokens * (top_k + shared), fmt == "fp8", False) if own else tile
                ms = timed(lambda x, w, ids: be.moe.fused_moe(x, w, ids, *weights_args))
                gemm_k.grouped_config = saved_config
                tiles = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
                grouped.append({"tiles": tiles, "own": own, "ms": ms, "gbs": nbytes / ms / 1e6})
        finally:
            gemm_k.grouped_config = saved_config
        best = min(grouped, key=lambda r: r["ms"])
        row = {"shape": name, "format": fmt, "tokens": tokens, "experts_touched": hit, "grouped": grouped,
               "own": grouped[0], "best": best}  # fmt: skip
        log(
            f"{name} {fmt} T={tokens:3d}: {hit:5.1f} experts | backend's tiles {grouped[0]['tiles']} "
            f"{grouped[0]['ms']:.4f} ms ({grouped[0]['gbs']:.0f} GB/s) | best {best['tiles']} "
            f"{best['ms']:.4f} ms ({best['gbs']:.0f} GB/s)"
        )
        rows.append(row)
    return rows


def markdown(res: dict[str, Any]) -> str:
    out = [
        f"# Decode-sized MoE, {res['device']}",
        "",
        f"Copy bandwidth in the same run: {res['copy']['gbs']:.0f} GB/s.",
        "",
        "| shape | format | T | experts read | backend's tiles | ms | GB/s | best tiles | ms | GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        o, b = r["own"], r["best"]
        out.append(
            f"| {r['shape']} | {r['format']} | {r['tokens']} | {r['experts_touched']:.1f} "
            f"| {tuple(o['tiles'])} "
            f"| {o['ms']:.4f} | {o['gbs']:.0f} | {tuple(b['tiles'])} | {b['ms']:.4f} | {b['gbs']:.0f} |"
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
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_decode.json").write_text(json.dumps(res, indent=1))
        (args.out / "moe_decode.md").write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

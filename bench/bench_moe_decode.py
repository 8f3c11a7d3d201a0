"""Decode-sized MoE on one GPU: the grouped expert path (align, GEMM, silu_and_mul, GEMM,
combine: 5 launches, 7 with FP8's two quantisations) against the decode kernels (kernels/moe.py
decode_moe: up with silu_and_mul, down with the weighted combine, 2 launches) under a small
sweep of tilings, both against the copy bandwidth measured in the same run.

For each layer shape (DeepSeek-V2-Lite: hidden 2048, 64 routed experts of 1408 + 2 shared, top-6;
DeepSeek-V3: hidden 7168, 256 routed of 2048 + 1 shared, top-8; bf16, and V3 in FP8 too) and
T = 1, 2, 4, 8, 16 tokens, every call is timed as a CUDA-graph replay, rotating over 8 routings
so that weights come from memory, not L2. Shared experts are routed as experts E .. E + S - 1, as
the model fuses them. Bandwidth = bytes of the distinct experts the T tokens touch / time. The
router (router_logits, route) is the same on both paths and not timed.

Writes moe_decode.json and moe_decode.md; the last line printed is the setting to pin:
DEEPINFER_CUDA_MOE_DECODE_TILES=<the tiling with the least summed time over the V2-Lite bf16
token counts where it beats the grouped path>,<the most token copies below which it beats the
grouped path at every count of that shape>.

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
# decode tilings: (up_n, up_k, up_warps, up_stages, down_n, down_k, down_warps, down_stages,
# fused_combine); FP8 steps K by 128 whatever *_k says. Weight bytes in flight per program:
# stages x BLOCK_K x (2 x up_n | down_n) x element size.
TILINGS = [
    (64, 128, 4, 3, 64, 128, 4, 3, 1),  # the default (DecodeConfig(); the grouped GEMM's 16 x 64 x 128)
    (64, 128, 4, 3, 64, 128, 4, 3, 0),  # the same, combine in a third launch
    (64, 128, 4, 3, 32, 128, 4, 5, 1),  # ONE_TOKEN_CONFIG (up to ONE_TOKEN_COPIES copies)
    (32, 128, 4, 4, 32, 128, 4, 4, 1),
    (16, 128, 4, 4, 16, 128, 4, 4, 1),
    (16, 256, 4, 3, 16, 256, 4, 3, 1),
    (16, 512, 4, 3, 16, 512, 4, 3, 1),
    (32, 256, 4, 3, 32, 256, 4, 3, 1),
    (64, 128, 4, 4, 32, 128, 4, 4, 1),
    (32, 128, 4, 3, 16, 256, 4, 4, 1),
    (128, 64, 8, 3, 64, 128, 4, 4, 1),
    (32, 64, 4, 6, 32, 64, 4, 6, 1),
]
SETS = 8  # routings rotated through the replays
REP_MS = 100  # do_bench time per measurement


def bench_shape(
    name: str, fmt: str, tokens_list: list[int], smoke: bool, timer: Timer
) -> list[dict[str, Any]]:
    from deepinfer_cuda.kernels import moe as moe_k

    dev = torch.device("cuda") if not smoke else torch.device("cpu")
    be = BackendRegistry.discover().create("cuda", BackendOptions())
    be.moe.decode = False  # type: ignore[attr-defined]  # fused_moe = the grouped path
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
        sets: list[tuple[torch.Tensor, ...]] = []
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

            return timer(step if smoke else graph_replayer(step, SETS), REP_MS)

        grouped_ms = timed(lambda x, w, ids: be.moe.fused_moe(x, w, ids, *weights_args))
        ref = be.moe.fused_moe(*sets[0], *weights_args).float()
        row: dict[str, Any] = {
            "shape": name, "format": fmt, "tokens": tokens, "copies": tokens * (top_k + shared),
            "experts_touched": hit, "grouped_ms": grouped_ms, "grouped_gbs": nbytes / grouped_ms / 1e6,
            "decode": [],
        }  # fmt: skip
        for tiling in TILINGS:
            cfg = moe_k.DecodeConfig(*tiling[:8], fused_combine=bool(tiling[8]))
            entry: dict[str, Any] = {"tiling": list(tiling)}
            try:
                ms = timed(lambda x, w, ids, cfg=cfg: moe_k.decode_moe(x, w, ids, *weights_args, config=cfg))
                y = moe_k.decode_moe(*sets[0], *weights_args, config=cfg).float()
                err = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
                entry.update(ms=ms, gbs=nbytes / ms / 1e6, rel_err=err)
            except Exception as exc:  # a tiling that does not compile (shared memory) is skipped
                entry.update(ms=float("inf"), gbs=0.0, rel_err=float("nan"), error=repr(exc)[:200])
            row["decode"].append(entry)
        best = min(row["decode"], key=lambda r: r["ms"])
        row["best"] = best
        log(
            f"{name} {fmt} T={tokens:3d}: {hit:5.1f} experts | grouped {grouped_ms:.4f} ms "
            f"({row['grouped_gbs']:.0f} GB/s) | decode best {best['tiling']} {best['ms']:.4f} ms "
            f"({best['gbs']:.0f} GB/s, err {best['rel_err']:.1e}) | {grouped_ms / best['ms']:.2f}x"
        )
        rows.append(row)
    return rows


def max_copies(rows: list[dict[str, Any]], i: int | None = None) -> int:
    """The most token copies up to which the decode kernels (tiling i, else each row's best) beat
    the grouped path at every token count of these rows (0: never)."""
    most = 0
    for r in sorted(rows, key=lambda r: r["tokens"]):
        ms = r["decode"][i]["ms"] if i is not None else r["best"]["ms"]
        if ms >= r["grouped_ms"]:
            break
        most = r["copies"]
    return most


def best_setting(rows: list[dict[str, Any]]) -> str:
    """DEEPINFER_CUDA_MOE_DECODE_TILES for the V2-Lite bf16 rows (the e2e benchmark's model): the
    tiling with the least summed time over the token counts where the decode kernels win, and
    the copy limit that tiling reaches."""
    mine = [r for r in rows if r["shape"] == rows[0]["shape"] and r["format"] == "bf16"]
    wins = [r for r in mine if r["copies"] <= max(max_copies(mine), mine[0]["copies"])]
    totals = {i: sum(r["decode"][i]["ms"] for r in wins) for i in range(len(TILINGS))}
    i = min(totals, key=lambda i: totals[i])
    return ",".join(str(v) for v in (*TILINGS[i], max_copies(mine, i)))


def markdown(res: dict[str, Any]) -> str:
    out = [
        f"# Decode-sized MoE, {res['device']}",
        "",
        f"Copy bandwidth in the same run: {res['copy']['gbs']:.0f} GB/s. Setting chosen: "
        f"`DEEPINFER_CUDA_MOE_DECODE_TILES={res['setting']}`. Decode kernels beat the grouped path "
        f"up to (copies): {res['max_copies']}.",
        "",
        "| shape | format | T | copies | experts read | grouped ms | grouped GB/s | decode best tiling "
        "| decode ms | decode GB/s | default tiling ms | speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        b = r["best"]
        out.append(
            f"| {r['shape']} | {r['format']} | {r['tokens']} | {r['copies']} | {r['experts_touched']:.1f} "
            f"| {r['grouped_ms']:.4f} | {r['grouped_gbs']:.0f} | {tuple(b['tiling'])} | {b['ms']:.4f} "
            f"| {b['gbs']:.0f} | {r['decode'][0]['ms']:.4f} | {r['grouped_ms'] / b['ms']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tokens", default="1,2,4,8,16")
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
    res["max_copies"] = {
        f"{name} {fmt}": max_copies([r for r in res["rows"] if (r["shape"], r["format"]) == (name, fmt)])
        for name, fmt in [("v2-lite", "bf16"), ("v3", "bf16"), ("v3", "fp8")]
    }
    res["tilings"] = [list(t) for t in TILINGS]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_decode.json").write_text(json.dumps(res, indent=1))
        (args.out / "moe_decode.md").write_text(markdown(res))
    print(f"DEEPINFER_CUDA_MOE_DECODE_TILES={res['setting']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

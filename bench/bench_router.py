"""The router at decode sizes on one GPU: moe.select_experts in one launch (the cuda backend's
kernels/moe.py) against router_logits + route (two launches), for the published routers:

  DeepSeek-V2-Lite  hidden 2048,  64 experts, softmax top-6, 2 shared experts fused
  DeepSeek-V3       hidden 7168, 256 experts, sigmoid, 4 of 8 groups, top-8, bias, 1 shared
  DeepSeek-V4-Flash hidden 4096, 256 experts, sqrtsoftplus top-6, bias; and its hash layers

Each way is captured as a CUDA graph of CALLS back-to-back calls (as a decode step replays it),
timed by triton.testing.do_bench (median) and divided by CALLS: kernel time plus the gaps between
launches, without the host (the gate stays in L2 across the calls, for both ways). Every case
also checks that the two ways give the same bits.

    python bench/bench_router.py --out bench/results/DIR      # writes bench_router.json and .md
    TRITON_INTERPRET=1 python bench/bench_router.py --smoke   # tiny shapes on the CPU: checks the code
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.types import RouterConfig

CALLS = 50
V4 = RouterConfig("sqrtsoftplus", top_k=6, renormalize=True, routed_scaling_factor=1.5)
ROUTERS: dict[str, tuple[int, int, RouterConfig, bool, bool]] = {  # hidden, E, config, bias, hash
    "v2-lite": (2048, 64, RouterConfig("softmax", top_k=6, shared_experts=2), False, False),
    "v3": (
        7168, 256,
        RouterConfig(
            "sigmoid", top_k=8, num_groups=8, topk_groups=4, group_score="top2_sum", renormalize=True,
            routed_scaling_factor=2.5, shared_experts=1,
        ),
        True, False,
    ),
    "v4-flash": (4096, 256, V4, True, False),
    "v4-flash-hash": (4096, 256, V4, False, True),
}  # fmt: skip


def graph_of(step: Callable[[], object], calls: int) -> Callable[[], None]:
    """`calls` back-to-back calls of step captured as one CUDA graph (warmed up outside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return graph.replay


Route = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def ways(
    x: torch.Tensor,
    gate: torch.Tensor,
    config: RouterConfig,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    tile: Any = None,
) -> tuple[Route, Route]:
    """(select_experts in one launch, router_logits + route) on these inputs, with this tile
    (None: the kernels' rule)."""
    from deepinfer_cuda.kernels import moe as moe_k

    def one() -> tuple[torch.Tensor, torch.Tensor]:
        return moe_k.select_experts(x, gate, config, bias, hash_ids, tile)

    def two() -> tuple[torch.Tensor, torch.Tensor]:
        return moe_k.route(moe_k.router_logits(x, gate, tile), config, bias, hash_ids, tile)

    return one, two


def label(tile: Any) -> str:
    """A moe.RouterTile as EXPERTSxDxWARPS."""
    return f"{tile.block_e}x{tile.block_d}x{tile.num_warps}"


def run(smoke: bool, tiles: list[Any]) -> list[dict[str, Any]]:
    """Rows per (router, T, tile): tiles are moe.RouterTile's, or None for the kernels' own rule
    (moe.router_tile), which both ways take (a tile orders a row's sums: the ways share it)."""
    from deepinfer_cuda.kernels import moe as moe_k

    dev = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, (hidden, experts, config, with_bias, hashed) in ROUTERS.items():
        if smoke:
            hidden, experts = 96, 32
        for tokens in (1, 8, 64) if not smoke else (1, 3):
            x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
            gate = (torch.randn((experts, hidden), generator=gen) * hidden**-0.5).to(dev)
            bias = (torch.randn(experts, generator=gen) * 0.1).to(dev) if with_bias else None
            hash_ids = None
            if hashed:
                hash_ids = torch.stack(
                    [torch.randperm(experts, generator=gen)[: config.top_k] for _ in range(tokens)]
                )
                hash_ids = hash_ids.to(dev)

            for tile in tiles:
                one, two = ways(x, gate, config, bias, hash_ids, tile)
                (w1, i1), (w2, i2) = one(), two()
                same = torch.equal(w1, w2) and torch.equal(i1, i2)
                row: dict[str, Any] = {
                    "router": name, "tokens": tokens, "experts": experts,
                    "tile": label(tile or moe_k.router_tile(tokens)) + ("" if tile else " (rule)"),
                    "same_bits": same,
                }  # fmt: skip
                if not smoke:
                    from triton.testing import do_bench

                    for key, fn in (("one_launch_us", one), ("two_launches_us", two)):
                        replay = graph_of(fn, CALLS)
                        ms = float(do_bench(replay, warmup=25, rep=200, return_mode="median"))
                        row[key] = 1e3 * ms / CALLS
                    row["saved_us"] = row["two_launches_us"] - row["one_launch_us"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    out = [
        f"# select_experts: one launch vs router_logits + route ({device})",
        "",
        f"Per call, from a CUDA graph of {CALLS} back-to-back calls (median of do_bench).",
        "",
        "| router | T | E | tile (experts x D x warps) | one launch (us) | two launches (us) | saved (us) "
        "| same bits |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    nan = float("nan")
    for r in rows:
        times = [r.get(k, nan) for k in ("one_launch_us", "two_launches_us", "saved_us")]
        cells = [r["router"], r["tokens"], r["experts"], r["tile"], *(f"{t:.2f}" for t in times)]
        cells.append(r["same_bits"])
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, help="directory for bench_router.json and bench_router.md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (the interpreter)")
    p.add_argument(
        "--tiles", default=None,
        help="comma-separated EXPERTSxDxWARPS router tiles to sweep, e.g. 4x512x4,1x2048x1; 'rule': the "
        "kernels' own choice by T (moe.router_tile; the default)",
    )  # fmt: skip
    args = p.parse_args(argv)
    from deepinfer_cuda.kernels import moe as moe_k

    tiles: list[Any] = []
    for spec in (args.tiles or "rule").split(","):
        if spec == "rule":
            tiles.append(None)
            continue
        v = [int(x) for x in spec.split("x")]
        if len(v) != 3:
            p.error(f"--tiles: {spec!r} is not EXPERTSxDxWARPS or 'rule'")
        tiles.append(moe_k.RouterTile(*v))
    rows = run(args.smoke, tiles)
    device = "interpreter" if args.smoke else torch.cuda.get_device_name()
    text = markdown(rows, device)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_router.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        (args.out / "bench_router.md").write_text(text)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

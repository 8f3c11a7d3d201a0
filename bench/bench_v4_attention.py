"""DeepSeek-V4-Flash's compressed attention at decode sizes on one GPU: the cuda backend's
kernel (kernels/v4.compressed_attention) over a 128-token window plus compressed entries, 64
heads of 512, at batch 1, 8, 64, in the tilings a decode step could take: the default dispatch,
DEEPINFER_CUDA_V4_SMALL_GRID's (`small grid`), and head tiles (BLOCK_M 16, 32, 64) x the fewest
key tiles a split may hold (MIN_SPLIT_TILES 1, 2). Layers: HCA (ratio 128: every entry visible)
and CSA (ratio 4, the indexer's top 512 of the visible entries), contexts of 200 and 2048 tokens;
the grid from host lengths of 1024
(a replayed graph's upper bound). Timed as CUDA-graph replays of 20 back-to-back calls, each
on its own cache copy (over the L2), median of triton.testing.do_bench; us per call.

    python bench/bench_v4_attention.py --out DIR        # writes v4_attention.json and .md
    TRITON_INTERPRET=1 python bench/bench_v4_attention.py --smoke   # tiny shapes on the CPU
"""

# ruff: noqa: B023 - every closure below is timed inside the iteration that defines it
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.types import AttentionMetadata

HEADS, DIM, WINDOW, BS = 64, 512, 128, 64
CALLS = 20  # calls per graph replay, each on its own caches


def case(
    batch: int, ctx: int, ratio: int, topk: int, dev: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    """Inputs of one decode step: every request at `ctx` tokens, its window rows and entries in
    blocks of its own (CALLS copies of the caches)."""
    blocks = -(-ctx // BS)
    entries = ctx // ratio
    eblocks = max(1, -(-entries // BS))
    kv = [torch.randn((batch * blocks, BS, DIM), generator=gen).to(dev, torch.bfloat16) for _ in range(CALLS)]
    ckv = [
        torch.randn((batch * eblocks, BS, DIM), generator=gen).to(dev, torch.bfloat16) for _ in range(CALLS)
    ]
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    etables = torch.arange(batch * eblocks, dtype=torch.int32).view(batch, eblocks)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    host = 1024 if ctx <= 1024 else ctx
    wide = -(-host // BS)  # the graph step's table width
    meta = AttentionMetadata(
        block_tables=torch.nn.functional.pad(tables, (0, wide - blocks)).to(dev),
        seq_lens=seq.to(dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32).to(dev),
        seq_lens_host=(host,) * batch,
        query_lens_host=(1,) * batch,
        max_query_len=1,
        max_seq_len=host,
    )
    ids = None
    if topk:
        ids = torch.full((batch, topk), -1, dtype=torch.int32)
        for b in range(batch):
            pick = torch.randperm(entries, generator=gen)[: min(topk, entries)]
            ids[b, : pick.numel()] = pick.int()
        ids = ids.to(dev)
    etables_wide = torch.nn.functional.pad(etables, (0, max(1, -(-(host // ratio) // BS)) - eblocks))
    return {
        "q": torch.randn((batch, HEADS, DIM), generator=gen).to(dev, torch.bfloat16),
        "kv": kv, "ckv": ckv, "meta": meta, "topk": ids, "etables": etables_wide.to(dev),
        "sinks": torch.randn((HEADS,), generator=gen).to(dev),
    }  # fmt: skip


def timed(fn: Any, smoke: bool) -> float:
    """us per call: CUDA-graph replays of CALLS calls (smoke: one eager call, wall time)."""
    import time

    if smoke:
        t = time.perf_counter()
        fn(0)
        return (time.perf_counter() - t) * 1e6
    import triton

    for i in range(CALLS):  # compile, warm
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return float(ms) * 1e3 / CALLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = ap.parse_args()
    from deepinfer_cuda.kernels import attention as attn_k
    from deepinfer_cuda.kernels import v4 as v4_k

    smoke = args.smoke
    global HEADS, DIM, WINDOW, BS, CALLS
    if smoke:
        HEADS, DIM, WINDOW, BS, CALLS = 4, 64, 16, 16, 1
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    batches = [1, 2] if smoke else [1, 8, 64]
    layers = [("hca", 128, 0), ("csa", 4, 512)] if not smoke else [("hca", 16, 0), ("csa", 4, 16)]
    contexts = [200] if smoke else [200, 2048]
    tilings: list[tuple[str, attn_k.AttentionConfig | None, int, bool]] = [
        ("default", None, v4_k.MIN_SPLIT_TILES, False),
        ("small grid", None, v4_k.MIN_SPLIT_TILES, True),  # DEEPINFER_CUDA_V4_SMALL_GRID=1
    ]
    for bm in (16, 32, 64):
        for ms in (1, 2):
            cfg = attn_k.AttentionConfig(block_m=bm, block_n=64, num_warps=8 if bm == 64 else 4)
            tilings.append((f"m{bm} s{ms}", cfg, ms, False))
    rows: list[dict[str, Any]] = []
    default_min = v4_k.MIN_SPLIT_TILES
    for name, ratio, topk in layers:
        for ctx in contexts:
            for b in batches:
                c = case(b, ctx, ratio, topk, dev, gen)
                row: dict[str, Any] = {"layer": name, "context": ctx, "batch": b}
                for label, cfg, min_split, small_grid in tilings:
                    v4_k.MIN_SPLIT_TILES = min_split
                    if smoke and cfg is not None:
                        cfg = attn_k.AttentionConfig(block_m=min(cfg.block_m, HEADS), block_n=16)

                    def call(i: int) -> torch.Tensor:
                        return v4_k.compressed_attention(
                            c["q"], c["kv"][i], c["ckv"][i], c["meta"], scale=DIM**-0.5, ratio=ratio,
                            window=WINDOW, sinks=c["sinks"], topk_indices=c["topk"],
                            compressed_block_tables=c["etables"], config=cfg, small_grid=small_grid,
                        )  # fmt: skip

                    try:
                        got = call(0).float()
                        if label == "default":
                            ref = got
                        row["worst_diff"] = max(row.get("worst_diff", 0.0), (got - ref).abs().max().item())
                        row[label] = timed(call, smoke)
                    except Exception as exc:  # a tiling the GPU cannot run (shared memory)
                        row[label] = f"{type(exc).__name__}: {str(exc)[:80]}"
                v4_k.MIN_SPLIT_TILES = default_min
                rows.append(row)
                print(row, flush=True)
    labels = [t[0] for t in tilings]
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    md = [
        f"# V4-Flash compressed attention, decode ({gpu}; us per call; worst |diff| to the default "
        f"{max(r['worst_diff'] for r in rows):.2e})\n"
    ]
    md.append("| layer | context | batch | " + " | ".join(labels) + " | best |")
    md.append("| --- " * (4 + len(labels)) + "|")
    for r in rows:
        nums = [(r[k], k) for k in labels if isinstance(r[k], float)]
        cells = [f"{r[k]:.1f}" if isinstance(r[k], float) else "err" for k in labels]
        md.append(
            f"| {r['layer']} | {r['context']} | {r['batch']} | " + " | ".join(cells) + f" | {min(nums)[1]} |"
        )
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "v4_attention.json").write_text(json.dumps(rows, indent=1))
        (args.out / "v4_attention.md").write_text(text)


if __name__ == "__main__":
    main()

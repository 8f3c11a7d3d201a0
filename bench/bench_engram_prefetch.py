"""DeepSeek-V4.1's Engram rows from pinned host tables inside one CUDA graph of a stand-in step:
each Engram layer's lookup inline (small.engram_lookup in the layer), or all of them started at
the step's start (small.engram_prefetch: the cuda backend's side stream) and waited for in their
layers (small.engram_wait). The step: `--layers` layers of bf16 GEMMs standing for the other
work (hidden `--hidden`, two (T, D) x (D, D) products a layer), Engram on `--engram-layers`
(V4.1-Flash: 1 and 10), each gathering V4.1-Flash's FP8 rows (2-grams and 3-grams, 8 heads each,
128 values a row, one UE8M0 scale per 32) from a host table of `--rows` rows a head (V4.1-Flash:
about 5e7; smaller here so the tables pin quickly), then one (T, 2048) x (2048, D) product.

Prints, per token count: microseconds a graph replay (CUDA events, median of 5 timings of 20
replays after 3 warm-up replays) inline and prefetched, the lookups with their products alone
(no other layers' GEMMs), and whether both steps give the same bits.
    usage: python bench/bench_engram_prefetch.py [--tokens 1,8,64,512] [--rows 1000003]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from deepinfer.backend.registry import get_backend


class Step:
    """The stand-in step on fixed buffers: ids (T, 3), x0 (T, D) -> out (T, D)."""

    def __init__(
        self, be: Any, tables: list[dict[str, Any]], engram_layers: list[int], layers: int, d: int
    ) -> None:
        self.small, self.tables, self.engram_layers, self.layers = be.small, tables, engram_layers, layers
        dev, gen = be.device.device(), torch.Generator(device=be.device.device()).manual_seed(1)
        k = tables[0]["sizes"].numel() * tables[0]["table"].shape[1]
        self.weights = [
            (torch.randn((d, d), device=dev, generator=gen) * d**-0.5).bfloat16() for _ in range(2)
        ]
        self.wkv = (torch.randn((k, d), device=dev, generator=gen) * k**-0.5).bfloat16()

    def __call__(
        self, ids: torch.Tensor, x0: torch.Tensor, out: torch.Tensor, prefetch: bool, gemms: bool
    ) -> None:
        small, tables = self.small, self.tables
        pending = [small.engram_prefetch(ids, **kw) for kw in tables] if prefetch else []
        x = x0
        for layer in range(self.layers):
            if layer in self.engram_layers:
                j = self.engram_layers.index(layer)
                rows = small.engram_wait(pending[j]) if prefetch else small.engram_lookup(ids, **tables[j])
                x = x + rows @ self.wkv
            if gemms:
                x = x + torch.relu(x @ self.weights[0]) @ self.weights[1]
        out.copy_(x)


def replay_us(be: Any, fn: Callable[[], None]) -> float:
    graph = be.device.capture_graph(fn)
    assert graph is not None, "the cuda backend captures graphs on a GPU"
    for _ in range(3):
        graph.replay()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / 20)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,512")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--engram-layers", default="1,10")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1_000_003, help="rows of each of the 16 heads")
    args = p.parse_args()
    be = get_backend("cuda")
    dev = be.device.device()
    engram_layers = [int(x) for x in args.engram_layers.split(",")]
    heads, dh = 16, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    tables = []
    for i, _ in enumerate(engram_layers):
        sizes = torch.tensor([args.rows + 2 * (i * heads + h) for h in range(heads)], device=dev)
        r = int(sizes.sum())
        codes = torch.randint(0, 0x70, (r, dh), dtype=torch.uint8, device=dev, generator=gen)  # no NaN codes
        table = be.device.pinned_empty((r, dh), torch.float8_e4m3fn)
        table.view(torch.uint8).copy_(codes.cpu())
        del codes
        scales = be.device.pinned_empty((r, dh // 32), torch.uint8)
        scales.copy_(
            torch.randint(118, 126, (r, dh // 32), dtype=torch.uint8, device=dev, generator=gen).cpu()
        )
        mult = torch.randint(0, 2**40, (3,), device=dev, generator=gen) * 2 + 1
        tables.append(dict(multipliers=mult, sizes=sizes, table=table, scales=scales, dtype=torch.bfloat16))
    step = Step(be, tables, engram_layers, args.layers, args.hidden)
    for t in [int(x) for x in args.tokens.split(",")]:
        ids = torch.randint(0, 100_000, (t, 3), device=dev, generator=gen)
        x0 = torch.randn((t, args.hidden), device=dev, generator=gen).bfloat16()
        inline, prefetched, alone = (torch.empty_like(x0) for _ in range(3))
        us = [
            replay_us(be, partial(step, ids, x0, inline, prefetch=False, gemms=True)),
            replay_us(be, partial(step, ids, x0, prefetched, prefetch=True, gemms=True)),
            replay_us(be, partial(step, ids, x0, alone, prefetch=False, gemms=False)),
        ]
        print(
            f"tokens {t:4d}: step inline {us[0]:8.1f} us | prefetched {us[1]:8.1f} us | the "
            f"{len(tables)} lookups and their products alone {us[2]:7.1f} us | same bits: "
            f"{torch.equal(inline, prefetched)}",
            flush=True,
        )


if __name__ == "__main__":
    main()

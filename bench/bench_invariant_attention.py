"""The batch-invariant MLA attention (cuda backend, kernels/attention.py) against the default
mode, at decode and prefill shapes, each call timed in a CUDA graph.

    python bench/bench_invariant_attention.py --out DIR     # an NVIDIA GPU; about a minute

Batch-invariant mode reduces each row's keys in at most 16 chunks whose size depends on the
row's position only, by one of two paths with the same bits: `split` (chunks over programs, then
a fold kernel; decode-sized launches) or `walk` (one program per tile of rows folds its chunks
in registers). For each shape this times the default mode, the invariant mode as the backend
picks its path (`auto`) and both paths forced, and checks that the two paths' outputs are
bitwise equal (`bits`). Decode: 32 requests of 200, 1000 and 4096 keys, 16 and 128 heads (one
latent head of 512 + 64, bf16). Prefill: one request, 1024 new tokens after a 3072-token prefix.
Writes DIR/invariant_attention.json and prints one line per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "backends" / "cuda"))

from deepinfer_cuda.kernels import attention as attn_k  # noqa: E402

from deepinfer.backend.types import AttentionMetadata  # noqa: E402

LAT, ROPE, PAGE = 512, 64, 64


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


def inputs(
    seq_lens: list[int], query_lens: list[int], heads: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q (T, H, 576) and a (NB, 64, 576) bf16 pool over shuffled blocks, with its metadata."""
    need = [-(-n // PAGE) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32)
    start = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[start : start + k]
        start += k
    pool = torch.randn((sum(need), PAGE, LAT + ROPE), generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn((sum(query_lens), heads, LAT + ROPE), generator=gen).to("cuda", torch.bfloat16)
    return q, pool, AttentionMetadata.build(table.cuda(), seq_lens, query_lens)


def measure(
    name: str, seq_lens: list[int], query_lens: list[int], heads: int, gen: torch.Generator
) -> dict[str, Any]:
    q, pool, meta = inputs(seq_lens, query_lens, heads, gen)
    kw: dict[str, Any] = dict(scale=(LAT + ROPE) ** -0.5, v_dim=LAT, latent_dim=LAT)
    modes: dict[str, dict[str, Any]] = {
        "default": {},
        "auto": dict(batch_invariant=True),
        "walk": dict(batch_invariant=True, invariant_split=False),
        "split": dict(batch_invariant=True, invariant_split=True),
    }
    row: dict[str, Any] = {"shape": name, "heads": heads}
    outs = {}
    for mode, extra in modes.items():
        outs[mode] = attn_k.mla_attention(q, pool, meta, **kw, **extra)
        row[f"{mode}_us"] = time_us(lambda extra=extra: attn_k.mla_attention(q, pool, meta, **kw, **extra))
    row["bits"] = bool(torch.equal(outs["walk"].view(torch.int16), outs["split"].view(torch.int16)))
    row["auto_vs_default"] = row["auto_us"] / row["default_us"]
    row["max_diff_vs_default"] = float((outs["auto"].float() - outs["default"].float()).abs().max())
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="folder for invariant_attention.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for heads in (16, 128):
        for kv_len in (200, 1000, 4096):
            rows.append(measure(f"decode B=32 L={kv_len}", [kv_len] * 32, [1] * 32, heads, gen))
        rows.append(measure("prefill 1024 new + 3072 cached", [4096], [1024], heads, gen))
    for r in rows:
        print(
            f"{r['shape']:32s} H={r['heads']:3d}: default {r['default_us']:8.1f} us  invariant auto "
            f"{r['auto_us']:8.1f} us ({r['auto_vs_default']:.2f}x)  walk {r['walk_us']:8.1f}  split "
            f"{r['split_us']:8.1f}  bits walk==split: {r['bits']}  "
            f"max |auto - default| {r['max_diff_vs_default']:.1e}",
            flush=True,
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "invariant_attention.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

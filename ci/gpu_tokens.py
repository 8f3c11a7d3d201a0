"""Greedy and seeded tokens of one tree under every engine mode, as JSON: run it on two trees
(before and after a change that must not change behaviour) and compare the files with
`ci/gpu_tokens.py --compare A.json B.json`.

Modes: async graph steps (the default), synchronous scheduling, eager steps, batch-invariant
mode, seeded sampling, prefix caching, preemption, MTP verification (chained graphs, greedy and
seeded), the block drafter, confidence-scheduled drafts; on the shipped tiny model and, with
--v4 DIR, on a random DeepSeek-V4 checkpoint written once by `--write-v4 DIR` (so both trees
read the same weights whatever their random-weight generators do).

    python ci/gpu_tokens.py --backend cuda --out tokens.json [--v4 DIR]
    python ci/gpu_tokens.py --write-v4 DIR
    python ci/gpu_tokens.py --compare old.json new.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model" / "tiny"
KV_BYTES = 1 << 30  # a fixed KV budget: two trees run side by side on one GPU


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """count token prompts of lengths 3 .. 3 + 37 * count (mod 180), ids from a fixed LCG."""
    out, x = [], seed + 1
    for i in range(count):
        n = 3 + (37 * i) % 180
        row = []
        for _ in range(n):
            x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
            row.append(3 + (x >> 33) % (vocab - 3))
        out.append(row)
    return out


def modes(backend: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (LLM keyword arguments, SamplingParams keyword arguments) on the tiny model."""
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    seeded = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_tokens": 40, "ignore_eos": True}
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    block = {"method": "dspark", "num_speculative_tokens": 4}
    base = {"backend": backend, "max_model_len": 512, "kv_cache_memory_bytes": KV_BYTES}
    return {
        "async_graphs": (base, greedy),
        "sync": ({**base, "async_scheduling": False}, greedy),
        "eager": ({**base, "enforce_eager": True}, greedy),
        "batch_invariant": ({**base, "batch_invariant": True}, greedy),
        "seeded": (base, seeded),
        "prefix_caching": ({**base, "enable_prefix_caching": True}, greedy),
        "preempting": (
            {
                **base,
                "max_model_len": 256,
                "num_gpu_blocks_override": 24,
                "block_size": 16,
                "max_num_seqs": 16,
            },
            greedy,
        ),
        "mtp_greedy": ({**base, "speculative_config": mtp}, greedy),
        "mtp_seeded": ({**base, "speculative_config": mtp}, seeded),
        "mtp_sync": ({**base, "speculative_config": mtp, "async_scheduling": False}, greedy),
        "block_drafter": ({**base, "speculative_config": block}, greedy),
        "block_scheduled": (
            {**base, "speculative_config": {**block, "min_draft_confidence": 0.3, "step_token_budget": 64}},
            greedy,
        ),
    }


def run(llm_kwargs: dict[str, Any], params: dict[str, Any], model: Path, batch: list[list[int]]) -> Any:
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(model), **llm_kwargs)
    sp = [SamplingParams(**params, seed=i if params["temperature"] else None) for i in range(len(batch))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    # a second call on the same engine: the prefix cache (or graph state) of the first one
    again = llm.generate([{"prompt_token_ids": p} for p in batch[:4]], sp[:4], use_tqdm=False)
    del llm
    return {"tokens": tokens, "again": [o.outputs[0].token_ids for o in again], "seconds": round(elapsed, 3)}


def write_v4(path: Path) -> None:
    try:
        from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint
    except ImportError:  # a tree from before the test tools moved to deepinfer.testing
        from deepinfer.models.random_checkpoint import (  # type: ignore[no-redef]
            tiny_v4_config,
            write_random_v4_checkpoint,
        )
    cfg = tiny_v4_config(vocab_size=512, max_position_embeddings=1024)
    write_random_v4_checkpoint(path, cfg, seed=3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--v4", type=Path, help="a V4 checkpoint written by --write-v4")
    ap.add_argument("--write-v4", type=Path)
    ap.add_argument("--compare", type=Path, nargs=2)
    ap.add_argument("--batch", type=int, default=24)
    args = ap.parse_args(argv)
    if args.write_v4:
        write_v4(args.write_v4)
        return 0
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        bad = 0
        for name in sorted(set(a) | set(b)):
            same = (
                name in a
                and name in b
                and {k: a[name][k] for k in ("tokens", "again")}
                == {k: b[name][k] for k in ("tokens", "again")}
            )
            bad += not same
            print(f"{name:24s} {'equal' if same else 'DIFFERENT'}  {a.get(name, {}).get('seconds')} s "
                  f"-> {b.get(name, {}).get('seconds')} s")  # fmt: skip
        print(f"{len(set(a) | set(b)) - bad} equal, {bad} different")
        return 1 if bad else 0
    import deepinfer

    print("deepinfer from", deepinfer.__file__, flush=True)
    results: dict[str, Any] = {}
    batch = prompts(args.batch, 4096, 0)
    for name, (kw, sp) in modes(args.backend).items():
        results[name] = run(kw, sp, TINY, batch)
        print(name, results[name]["seconds"], "s", flush=True)
    if args.v4:
        v4_batch = prompts(8, 512, 1)
        base = {"backend": args.backend, "max_model_len": 512, "dtype": "float32", "block_size": 16}
        base["kv_cache_memory_bytes"] = KV_BYTES
        greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
        seeded = {"temperature": 0.8, "top_k": 40, "max_tokens": 40, "ignore_eos": True}
        mtp = {"method": "mtp", "num_speculative_tokens": 2}
        v4_modes = {
            "v4_plain": (base, greedy),
            "v4_seeded": (base, seeded),
            "v4_chunked": ({**base, "max_num_batched_tokens": 64}, greedy),
            "v4_mtp": ({**base, "speculative_config": mtp}, greedy),
            "v4_mtp_seeded": ({**base, "speculative_config": mtp}, seeded),
        }
        for name, (kw, sp) in v4_modes.items():
            results[name] = run(kw, sp, args.v4, v4_batch)
            print(name, results[name]["seconds"], "s", flush=True)
    assert args.out is not None, "--out is required"
    args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV memory of one DeepSeek-V4 request as it grows to 10,000 tokens, per cache group.

    python bench/bench_v4_memory.py --out bench/results/DIR    # CPU, reference backend, about a minute

Two measurements:
1. engine: a random DeepSeek-V4 model of reduced size (SMALL_CONFIG: one sliding-window, one CSA
   and one HCA layer with V4-Flash's window 128, ratios 4 / 128 and index_topk 512, but D = 64
   and small projections) on the reference backend: one request, a 9,000-token prompt prefilled
   in 2,048-token chunks (16 times its ring: through step scratch, deepinfer.engine.ring) and
   1,001 greedy decode steps (10,000 tokens in the cache), through LLMEngine.step. After each
   step the blocks the request holds in each cache group are read from the block manager; the
   first step at or past each 1k tokens is recorded.
2. flash: the same request's blocks at V4-Flash's size (model/deepseek-v4-flash/config.json: 43
   layers, D = 512, bfloat16), by driving the scheduler and block manager with the groups that
   config gives (no forward: the block counts depend only on the lengths; 8,192-token steps,
   the prompt in two chunks), and what the previous layout (every cache paged by one table, one
   row per token) held at the same lengths.

Bytes held = blocks x block_size x row bytes x caches in the group (rows D wide; the indexer
keys' group, index/4, Di wide). Bytes per token per cache type (per layer) come from the row
widths: a ring row per token for the window and state caches (held for the last R positions
only), a row per m tokens for the compressed entries and the indexer keys.

Writes OUT/memory.json, OUT/memory.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.kv_cache import GroupedBlockManager, cdiv, group_pool_blocks  # noqa: E402
from deepinfer.engine.ring import scratch_blocks  # noqa: E402
from deepinfer.engine.scheduler import Scheduler  # noqa: E402
from deepinfer.engine.sequence import Sequence  # noqa: E402
from deepinfer.models.config import ModelConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import (  # noqa: E402
    WideCache,
    cache_groups,
    cache_kinds,
    ring_lookback,
)
from deepinfer.models.forward_batch import KVCacheGroup  # noqa: E402
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint  # noqa: E402

FLASH = ROOT / "model" / "deepseek-v4-flash" / "config.json"
BLOCK_SIZE = 64
# 10,000 tokens in the cache: a 9,000-token prompt and 1,001 sampled tokens (the last one sampled
# is never fed back)
TOTAL, PROMPT = 10_000, 9_000
DECODE = TOTAL - PROMPT + 1
MARKS = [1_000 * k for k in range(1, 11)]
STEP_TOKENS, ENGINE_STEP_TOKENS = 8192, 2048  # max_num_batched_tokens: V4-Flash's, the engine's
SMALL_CONFIG = tiny_v4_config(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=64,
    q_lora_rank=32, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16, index_n_heads=4,
    index_head_dim=16, index_topk=512, sliding_window=128, max_position_embeddings=16384,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
)  # fmt: skip


def row_bytes(config: ModelConfig, dtype_bytes: int, group: KVCacheGroup | None = None) -> int:
    """Bytes of a cache row of `group` (None: the model's D-wide row)."""
    assert config.v4 is not None
    width = group.row_dim if group is not None and group.row_dim is not None else config.v4.head_dim
    return width * dtype_bytes


def per_type(
    config: ModelConfig, groups: list[KVCacheGroup], dtype_bytes: int, ring_rows: int
) -> list[dict[str, Any]]:
    """Per cache type (per layer of its kind): its group, the bytes a row takes in the cache (a
    row narrower than its group's caches is padded) and what it holds per token."""
    v4 = config.v4
    assert v4 is not None
    names = {0: "sliding", v4.csa_ratio: "CSA", v4.hca_ratio: "HCA"}
    by_name = {g.name: g for g in groups}
    out = []
    for ratio in sorted(set(v4.compress_ratios)):
        for kind, width in cache_kinds(config, ratio):
            ring = kind in ("window", "state", "index_state")
            group = "ring" if ring else f"{'index' if kind == 'index_keys' else 'entries'}/{ratio}"
            row_dim = row_bytes(config, 1, by_name[group])  # values per row of the group's caches
            stored = WideCache.count(width, row_dim) * row_dim * dtype_bytes
            out.append({
                "layer": names[ratio], "layers": v4.compress_ratios.count(ratio), "cache": kind,
                "row_values": width, "row_bytes_stored": stored,
                "group": group,
                "bytes_per_token": None if ring else stored / ratio,
                "bytes_held_at_any_length": stored * ring_rows if ring else None,
            })  # fmt: skip
    return out


def growing_bytes_per_token(cache_types: list[dict[str, Any]]) -> float:
    """Bytes per token of the caches that grow with a request (entries, indexer keys), all layers."""
    return sum(t["bytes_per_token"] * t["layers"] for t in cache_types if t["bytes_per_token"] is not None)


class Recorder:
    """The request's blocks per group at the first step at or past each mark (1k, 2k, ...)."""

    def __init__(self, label: str, groups: list[KVCacheGroup], rows: list[int], log: list[str]) -> None:
        """rows: the bytes of a cache row of each group."""
        self.label, self.groups, self.row, self.log = label, groups, rows, log
        self.marks = list(MARKS)
        self.rows: list[dict[str, Any]] = []

    def __call__(self, seq: Sequence) -> dict[str, Any] | None:
        tokens = seq.num_computed_tokens
        if not self.marks or tokens < self.marks[0]:
            return None
        while self.marks and tokens >= self.marks[0]:
            self.marks.pop(0)
        blocks = [len(t) for t in seq.block_tables]
        held = {
            g.name: n * BLOCK_SIZE * row * g.num_caches for g, n, row in zip(self.groups, blocks, self.row)
        }
        self.rows.append({"tokens": tokens, "blocks": blocks, "bytes": held})
        self.log.append(f"{self.label}: {tokens} tokens, blocks {blocks}")
        return self.rows[-1]


def run_engine(log: list[str]) -> dict[str, Any]:
    """Measurement 1: the small random model through the engine."""
    with tempfile.TemporaryDirectory() as tmp:
        root = write_random_v4_checkpoint(Path(tmp) / "v4", SMALL_CONFIG)
        llm = LLM(
            str(root), backend="reference", dtype="float32", block_size=BLOCK_SIZE, max_model_len=10_240,
            max_num_seqs=1, max_num_batched_tokens=ENGINE_STEP_TOKENS,
            num_gpu_blocks_override=cdiv(10_240, BLOCK_SIZE),
        )  # fmt: skip
    engine = llm.llm_engine
    groups = engine.worker.kv_groups
    assert groups is not None
    config = engine.model.config
    seq = engine.make_sequence(
        {"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(PROMPT)]},
        SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True),
    )
    engine.add(seq)
    record, steps = Recorder("engine", groups, [row_bytes(config, 4, g) for g in groups], log), 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if not seq.is_finished:
            record(seq)
    seconds = time.perf_counter() - start
    total = len(seq.token_ids)
    bm = engine.block_manager
    log.append(f"engine: {total} tokens in {steps} steps, {seconds:.1f} s; all blocks free: "
               f"{bm.num_free_blocks == bm.num_blocks}")  # fmt: skip
    ring_rows = groups[0].ring_blocks * BLOCK_SIZE
    return {
        "model": "random DeepSeek-V4 (SMALL_CONFIG), float32, reference backend",
        "config": SMALL_CONFIG,
        "block_size": BLOCK_SIZE,
        "final_tokens": total,
        "steps": steps,
        "seconds": round(seconds, 1),
        "all_blocks_free_after": bm.num_free_blocks == bm.num_blocks,
        "max_num_batched_tokens": ENGINE_STEP_TOKENS,
        "scratch_blocks": engine.worker.ring_scratch_blocks,
        "groups": [vars(g) for g in groups],
        "ring_rows": ring_rows,
        "rows": record.rows,
        "cache_types": per_type(config, groups, 4, ring_rows),
    }


def run_flash(log: list[str]) -> dict[str, Any]:
    """Measurement 2: V4-Flash's groups, driven through the scheduler and block manager."""
    config = ModelConfig.from_dict(json.loads(FLASH.read_text()))
    assert config.v4 is not None
    groups = cache_groups(config, BLOCK_SIZE)  # no speculative decoding: k = 0
    row = row_bytes(config, 2)  # bfloat16, D wide
    num_caches = sum(g.num_caches for g in groups)
    bm = GroupedBlockManager(groups, group_pool_blocks(groups, cdiv(TOTAL + 1, BLOCK_SIZE), 1), BLOCK_SIZE)
    sched = Scheduler(bm, 1, STEP_TOKENS)
    seq = Sequence("0", None, [3] * PROMPT, SamplingParams(max_tokens=DECODE), max_total_tokens=TOTAL + 1)
    sched.add(seq)
    record = Recorder("flash", groups, [row_bytes(config, 2, g) for g in groups], log)
    while seq.num_computed_tokens < TOTAL:
        sched.advance(sched.schedule())
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(3)  # the sampled token
        got = record(seq)
        if got is not None:  # the first layout: every cache D wide, paged by one table, a row per token
            got["bytes_one_table_layout"] = cdiv(got["tokens"], BLOCK_SIZE) * BLOCK_SIZE * row * num_caches
    ring_rows = groups[0].ring_blocks * BLOCK_SIZE
    return {
        "model": "model/deepseek-v4-flash/config.json, bfloat16 caches",
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": STEP_TOKENS,
        "ring_lookback": ring_lookback(config.v4),
        "ring_step_tokens": groups[0].ring_step_tokens(BLOCK_SIZE),
        # the step scratch of an engine with 256 request slots, shared by all requests
        "scratch_blocks_256_slots": scratch_blocks(
            STEP_TOKENS, 256, BLOCK_SIZE, groups[0].ring_step_tokens(BLOCK_SIZE)
        ),
        "groups": [vars(g) for g in groups],
        "ring_rows": ring_rows,
        "rows": record.rows,
        "cache_types": per_type(config, groups, 2, ring_rows),
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(result: dict[str, Any]) -> str:
    titles = {"flash": "V4-Flash caches (bfloat16), block manager", "engine": "Small model, engine"}
    out = []
    for key, r in result.items():
        names = [g["name"] for g in r["groups"]]
        out.append(f"## {titles[key]}: {r['model']}\n")
        ring = r["groups"][0]["ring_blocks"]
        out.append(
            f"Block size {r['block_size']}; ring {ring} blocks = {r['ring_rows']} rows per request. "
            "Bytes the request holds per cache group (MiB):\n"
        )
        head = ["tokens", *[f"{n} (blocks)" for n in names], *[f"{n} MiB" for n in names], "total MiB"]
        if key == "flash":
            head += ["one-table layout MiB"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for row in r["rows"]:
            cells = [str(row["tokens"]), *map(str, row["blocks"]), *(mib(row["bytes"][n]) for n in names)]
            cells.append(mib(sum(row["bytes"].values())))
            if key == "flash":
                cells.append(mib(row["bytes_one_table_layout"]))
            out.append("| " + " | ".join(cells) + " |")
        out.append(
            f"\nGrowing caches (entries, indexer keys), all layers: "
            f"{growing_bytes_per_token(r['cache_types']):g} bytes per token.\n"
        )
        out.append("Per cache type, per layer of its kind:\n")
        cols = ["layer (count)", "cache", "row values", "row bytes stored", "group", "bytes per token"]
        cols.append("bytes held (ring)")
        out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        for t in r["cache_types"]:
            per_token = "" if t["bytes_per_token"] is None else f"{t['bytes_per_token']:g}"
            held = "" if t["bytes_held_at_any_length"] is None else str(t["bytes_held_at_any_length"])
            cells = [f"{t['layer']} ({t['layers']})", t["cache"], t["row_values"], t["row_bytes_stored"]]
            cells += [t["group"], per_token, held]
            out.append("| " + " | ".join(map(str, cells)) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-engine", action="store_true", help="only the V4-Flash block accounting")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    result = {"flash": run_flash(log)}
    if not args.skip_engine:
        result["engine"] = run_engine(log)
    (args.out / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "memory.md").write_text(markdown(result))
    print("\n".join(log))


if __name__ == "__main__":
    main()

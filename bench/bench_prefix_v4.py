"""Prefix caching of DeepSeek-V4: hit rate and prefill saving on shared-prefix workloads.

    python bench/bench_prefix_v4.py --out bench/results/DIR    # CPU, reference backend, under a minute

Model: testing.checkpoints.tiny_v4_config (a sliding-window, a CSA (m = 4) and an HCA (m = 8)
layer, window 6) with random weights, float32, or --config a V4 config.json (e.g. V4-Flash's
with --num-hidden-layers cut). Two workloads, each run by an engine with prefix caching and one
without, on the same weights:

  system    --requests prompts of a shared --system-len-token prefix and a --user-len-token
            message of their own, in one generate call (max_num_seqs requests at a time, chunked
            by max_num_batched_tokens): what is cached once the first requests computed it
  turn      each conversation's next turn (its prompt + its output + another message), a
            second call

Per workload: prompt tokens, tokens the steps computed (every scheduled token: prompt chunks,
decode, recompute after preemption), with and without caching; tokens served from the cache
(num_prefix_hits); hit rate = cached / prompt tokens; prefill saving = 1 - computed prompt
tokens with caching / without; whether the greedy outputs are equal. Wall time is a side note
(the tiny model on the CPU is dominated by the host, not the compute saved).

Writes OUT/prefix_v4.json and OUT/prefix_v4.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint  # noqa: E402


class Counted:
    """An engine and the tokens its steps computed (every scheduled token, drafts aside)."""

    def __init__(self, root: Path, args: argparse.Namespace, prefix_caching: bool) -> None:
        self.llm = LLM(
            str(root), backend=args.backend, dtype=args.dtype, block_size=args.block_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=prefix_caching,
            num_gpu_blocks_override=args.num_blocks, prefix_ring_blocks=args.prefix_ring_blocks,
        )  # fmt: skip
        self.computed = 0
        sched = self.llm.llm_engine.scheduler
        real = sched.advance

        def advance(batch: Any) -> None:
            self.computed += batch.num_tokens - sum(batch.num_draft_tokens)
            real(batch)

        sched.advance = advance  # type: ignore[method-assign]

    @property
    def hits(self) -> int:
        return self.llm.llm_engine.block_manager.num_prefix_hits

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], dict[str, float]]:
        computed, hits, start = self.computed, self.hits, time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = {
            "computed": self.computed - computed,
            "cached": self.hits - hits,
            "wall_s": time.perf_counter() - start,
            "preemptions": self.llm.llm_engine.scheduler.num_preemptions,
        }
        return [list(o.outputs[0].token_ids) for o in outs], stats


def workloads(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(2, vocab) for _ in range(args.system_len)]
    return [system + [rng.randrange(2, vocab) for _ in range(args.user_len)] for _ in range(args.requests)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", type=Path, default=None, help="a V4 config.json (default: the tiny V4)")
    p.add_argument("--num-hidden-layers", type=int, default=None)
    p.add_argument("--backend", default="reference")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=None, help="num_gpu_blocks_override (default: memory)")
    p.add_argument(
        "--prefix-ring-blocks", type=int, default=None, help="prefix_ring_blocks (default: the engine's)"
    )
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-len", type=int, default=200)
    p.add_argument("--user-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    raw = tiny_v4_config(max_position_embeddings=max(256, args.max_model_len))
    if args.config is not None:
        raw = json.loads(args.config.read_text())
    if args.num_hidden_layers is not None:
        raw["num_hidden_layers"] = args.num_hidden_layers
        for key in ("layer_types", "mlp_layer_types"):
            if key in raw:
                raw[key] = raw[key][: args.num_hidden_layers]
    root = write_random_v4_checkpoint(Path(tempfile.mkdtemp()) / "v4", raw)
    engines = {name: Counted(root, args, name == "cached") for name in ("cold", "cached")}
    prompts = workloads(args, raw["vocab_size"])
    rows = []
    outputs: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():
        outputs[name], first = engine.generate(prompts, args.output_len)
        rows.append({"workload": "system", "engine": name, "prompt": sum(map(len, prompts)), **first})
    turn = [p + o + [7 + i % 50] * args.user_len for i, (p, o) in enumerate(zip(prompts, outputs["cold"]))]
    second: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():
        second[name], stats = engine.generate(turn, args.output_len)
        rows.append({"workload": "turn", "engine": name, "prompt": sum(map(len, turn)), **stats})
    equal = outputs["cold"] == outputs["cached"] and second["cold"] == second["cached"]

    decode = args.requests * (args.output_len - 1)  # decode steps' tokens per workload
    summary = []
    for workload in ("system", "turn"):
        cold, cached = (
            next(r for r in rows if r["workload"] == workload and r["engine"] == e) for e in engines
        )
        prefill_cold, prefill_cached = cold["computed"] - decode, cached["computed"] - decode
        summary.append({
            "workload": workload, "prompt_tokens": cold["prompt"], "cached_tokens": cached["cached"],
            "hit_rate": cached["cached"] / cold["prompt"], "computed_cold": cold["computed"],
            "computed_cached": cached["computed"], "prefill_cold": prefill_cold,
            "prefill_cached": prefill_cached,
            "prefill_saving": 1 - prefill_cached / prefill_cold, "wall_s_cold": cold["wall_s"],
            "wall_s_cached": cached["wall_s"],
        })  # fmt: skip
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "outputs_equal": equal, "rows": rows,
              "summary": summary}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_v4.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| workload | prompt tokens | cached | hit rate | prefill computed (cold -> cached) | saving "
        "| wall s (cold -> cached) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        lines.append(
            f"| {s['workload']} | {s['prompt_tokens']} | {s['cached_tokens']} | {s['hit_rate']:.2f} | "
            f"{s['prefill_cold']} -> {s['prefill_cached']} | {s['prefill_saving']:.2f} | "
            f"{s['wall_s_cold']:.1f} -> {s['wall_s_cached']:.1f} |"
        )
    w = engines["cached"].llm.llm_engine.worker
    lines.append(
        f"\n{w.num_blocks} blocks of {args.block_size} tokens, {w.ring_prefix_pool[1]} blocks of "
        f"retained ring rows; greedy outputs equal with and without caching: {equal}"
    )
    (args.out / "prefix_v4.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a speculative (MTP or DFlash) verified step costs against a plain decode step, both in graphs.

    python bench/bench_spec_step.py --out DIR                        # H200: reduced-depth V4-Flash, bf16
    python bench/bench_spec_step.py --out DIR --random-config PATH --backend reference --small  # CPU
    python bench/bench_spec_step.py --out DIR --method dflash --random-config deepseek-v4.1-flash --k 3 5
                                     # H200: reduced-depth V4.1-Flash with its random DSpark drafter

--method dflash (DeepSeek-V4.1 configs): the model's DSpark draft layers as its DFlash drafter
(random weights, num_nextn_predict_layers of them, conditioned on layer 0 and the first decoder
layer: the depth reduction keeps those), every draft verified; a verified step is the forward
over B (1 + k) rows with the injection into the draft layers' rings, the draw and acceptance,
the drafter's block of B slots and the next step's inputs. Acceptance means nothing with random
weights: the figure is the step cost against a plain step at the same batch.

The goal it measures (issue 34): with a head that always agrees (the acceptance ceiling), a
k-draft verified step costs at most 1.3x a plain step at batch 1 to 64.

Model: random weights (bf16 by default) of --random-config (default deepseek-v4-flash) cut to
its first --num-hidden-layers layers, with its MTP layer, built once and shared by every engine:
plain decoding, then the MTP head with k = each of --k drafts (min_draft_confidence 0: every
draft verified, no confidence scheduling). Each batch B (--batches, default 1 2 4 8 16 32 64)
runs B greedy requests of --prompt-len random tokens (EOS ignored).

A step's cost: the wall time of a generate call of --new-tokens tokens per request less that of
a call of --short-tokens tokens (prefill and the first steps cancel), over the difference of
their engine steps (the median of --repeats pairs of calls, after a warm-up call). Plain
decoding replays decode graphs with async scheduling (the host prepares step n + 1 while the
device runs step n). MTP steps replay chained verification graphs of width k (the host reads
step n while the device runs n + 1): the forward over B (1 + k) rows, the draw of every row,
acceptance, the MTP head over every row and its k - 1 chained passes, the next step's inputs.
Their shapes are fixed, so a step does the same work whatever the head drafts: a random head's
steps cost what the ceiling's do, each of which emits 1 + k tokens per request. ratio = MTP
step / plain step (the goal: ratio <= 1.3); ceiling_speedup = (1 + k) / ratio, the tokens per
second the ceiling reaches over plain decoding. graph_steps: the share of the MTP engine's
speculative steps that replayed verification graphs (batches up to max_num_seqs).

Writes OUT/spec_step.json (rows {"device", "model", "method", "batch", "k", "plain_step_ms",
"spec_step_ms", "ratio", "ceiling_speedup", "meets_goal", "graph_steps", "mean_accepted"}) and
OUT/spec_step.md (the table), after every configuration (a run cut short keeps what it has).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.backend.registry import get_backend  # noqa: E402
from deepinfer.backend.types import BackendOptions  # noqa: E402
from deepinfer.engine.args import engine_config, resolve_engine_config  # noqa: E402
from deepinfer.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer.testing.random_model import random_model, resolve_config  # noqa: E402

GOAL = 1.3  # a k-draft verified step costs at most this many plain steps


def step_cost(
    llm: LLM, batch: list[dict[str, Any]], long: int, short: int, repeats: int
) -> tuple[float, float, float]:
    """(seconds per engine step of the decode phase, tokens emitted per request per step, the
    speculative steps' share of graph replays) of generate calls of `long` and `short` tokens per
    request (median of `repeats` pairs, after a warm-up call)."""
    engine = llm.llm_engine
    sync = engine.backend.device.synchronize
    steps = {"n": 0}
    real = engine.step

    def counted() -> Any:
        steps["n"] += 1
        return real()

    engine.step = counted  # type: ignore[method-assign]

    def call(n: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        gc.collect()
        sync()
        steps["n"] = 0
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        sync()
        return time.perf_counter() - start, steps["n"]

    spec = engine.speculative
    try:
        call(long)  # warm-up
        accepted = engine.num_accepted_tokens
        before = (spec.num_steps, spec.num_graph_steps) if spec else (0, 0)
        pairs = []
        for _ in range(repeats):
            (ws, ns), (wl, nl) = call(short), call(long)
            pairs.append(((wl - ws) / max(nl - ns, 1), nl - ns))
    finally:
        del engine.step
    ran, graphs = (spec.num_steps - before[0], spec.num_graph_steps - before[1]) if spec else (0, 0)
    per_step = sorted(p for p, _ in pairs)[len(pairs) // 2]
    tokens = repeats * len(batch) * (long + short)
    mean_accepted = tokens / max(tokens - (engine.num_accepted_tokens - accepted), 1)
    return per_step, mean_accepted, graphs / ran if ran else 0.0


def markdown(rows: list[dict[str, Any]], header: str, label: str = "MTP") -> str:
    lines = [
        header,
        "",
        f"| batch | k | plain step ms | {label} step ms | ratio | ceiling speed-up | goal (<= 1.3x) "
        "| graph steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['k']} | {r['plain_step_ms']:.3f} | {r['spec_step_ms']:.3f} | "
            f"{r['ratio']:.2f}x | {r['ceiling_speedup']:.2f}x | {'met' if r['meets_goal'] else 'missed'} | "
            f"{r['graph_steps']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--random-config", default="deepseek-v4-flash", help="NAME of model/NAME, or a path")
    ap.add_argument("--num-hidden-layers", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="drafts per verified step")
    ap.add_argument("--method", choices=("mtp", "dflash"), default="mtp", help="the drafter")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="random weights in the published format (FP8 linears, MXFP4 experts)",
    )
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--short-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="batches 1 and 4, few tokens: a CPU run")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds: later configurations are skipped (listed)"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    args.batches = args.batches or ([1, 4] if args.small else [1, 2, 4, 8, 16, 32, 64])
    args.prompt_len = args.prompt_len or (12 if args.small else 128)
    args.new_tokens = args.new_tokens or (12 if args.small else 64)
    args.short_tokens = args.short_tokens or (4 if args.small else 16)
    if not 1 < args.short_tokens < args.new_tokens:
        raise ValueError(f"--short-tokens {args.short_tokens} must be in (1, --new-tokens {args.new_tokens})")

    config_file = resolve_config(args.random_config)
    max_len = args.prompt_len + args.new_tokens + 16
    most = max(args.batches)
    common: dict[str, Any] = {
        "backend": args.backend, "dtype": args.dtype, "max_num_seqs": most, "max_model_len": max_len,
        "block_size": args.block_size, "num_gpu_blocks_override": most * -(-max_len // args.block_size) + 8,
    }  # fmt: skip
    base = resolve_engine_config(engine_config(config_file.parent, common, "bench_spec_step"), config_file)
    backend = get_backend(base.backend, BackendOptions(max_model_len=max_len))
    dflash = args.method == "dflash"
    overrides = None
    if dflash:  # targets the depth reduction keeps: layer 0 and the first decoder (C1) layer
        text = json.loads(config_file.read_text()).get("text_config", {})
        overrides = {"dspark_target_layer_ids": [0, list(text.get("compress_ratios", [1])).index(1)]}
        if text.get("engram_layer_ids"):  # speculative decoding is refused with Engram: dropped
            overrides["engram_layer_ids"] = []
    model = random_model(
        config_file, backend, base.torch_dtype, 0, base.gpu_memory_utilization,
        num_hidden_layers=args.num_hidden_layers, mtp=not dflash, dflash=dflash, text_overrides=overrides,
        fp8=args.fp8,
    )  # fmt: skip
    if not dflash and model.num_mtp_layers < 1:
        raise ValueError(f"{config_file} has no MTP layer (num_nextn_predict_layers)")
    label = "DFlash" if dflash else "MTP"
    device = "H200" if backend.device.device().type == "cuda" else backend.device.device().type
    drafter = f"{model.dflash.num_layers} DFlash layers" if model.dflash is not None else "MTP"
    weights = "FP8 / MXFP4 weights" if args.fp8 else args.dtype
    name = f"{config_file.parent.name}, {args.num_hidden_layers} layers + {drafter}, {weights}"
    print(f"{name} on {backend.name} ({device}), built in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = model.config.vocab_size
    prompts = {
        b: [{"prompt_token_ids": [4 + (97 * i + 31 * j + b) % (vocab - 4) for j in range(args.prompt_len)]}
            for i in range(b)]
        for b in args.batches
    }  # fmt: skip

    def engine(spec: dict[str, Any] | None) -> LLM:
        kwargs = dict(common, speculative_config=spec) if spec else common
        config = resolve_engine_config(
            engine_config(config_file.parent, kwargs, "bench_spec_step"), config_file
        )
        return LLM.from_engine(LLMEngine(config, model=model, backend=backend))

    def release() -> None:  # the last engine's KV pool and graphs, before the next engine's
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    plain: dict[int, float] = {}
    llm = engine(None)
    for b in args.batches:
        plain[b], *_ = step_cost(llm, prompts[b], args.new_tokens, args.short_tokens, args.repeats)
        print(f"plain B={b}: {plain[b] * 1e3:.3f} ms/step", flush=True)
    del llm
    release()

    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    header = (
        f"{label} verified step against a plain step on {device} ({name}, backend {backend.name}): "
        f"{args.prompt_len}-token prompts, steps of the decode phase ({args.short_tokens} to "
        f"{args.new_tokens} tokens), graphs; ceiling speed-up = (1 + k) / ratio."
    )
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        text = markdown(rows, header, label) + (f"\nSkipped: {'; '.join(skipped)}.\n" if skipped else "")
        (args.out / "spec_step.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "spec_step.md").write_text(text)

    for k in args.k:
        if args.time_budget is not None and time.perf_counter() - t0 > args.time_budget:
            skipped.append(f"k={k}: over the time budget")
            continue
        llm = engine({"method": args.method, "num_speculative_tokens": k, "min_draft_confidence": 0.0})
        for b in args.batches:
            cost, accepted, graphs = step_cost(
                llm, prompts[b], args.new_tokens, args.short_tokens, args.repeats
            )
            ratio = cost / plain[b]
            row = {
                "device": device, "model": name, "method": args.method, "batch": b, "k": k,
                "plain_step_ms": round(plain[b] * 1e3, 4), "spec_step_ms": round(cost * 1e3, 4),
                "ratio": round(ratio, 3), "ceiling_speedup": round((1 + k) / ratio, 3),
                "meets_goal": ratio <= GOAL, "graph_steps": round(graphs, 3),
                "mean_accepted": round(accepted, 3),
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            write()  # a run cut short keeps its rows
        del llm
        release()
        write()
    write()
    print(markdown(rows, header, label), flush=True)
    return rows


if __name__ == "__main__":
    main()

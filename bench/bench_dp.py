"""Data parallelism + expert parallelism, measured in one run (random weights, no checkpoint):

1. throughput of one device against two: the DeepSeek-V2-Lite shape in bf16 at a large batch,
   data_parallel_size 1 (the whole model on one device) then 2 (attention data-parallel, each
   device holding half of the routed experts), the same requests;
2. a model that does not fit one device served on two: the DeepSeek-V3 shape in FP8 with its
   layer count cut to --big-layers (default 18: about 178 GB of weights against one H200's
   141 GB; 94 GB a rank over two); first tried on one device, which refuses it before allocating
   (the weights' size is estimated from the config), then served on two, with its decode
   throughput.

Every configuration runs in worker processes the engine starts (deepinfer.entrypoints.data_parallel),
so each starts from a clean device. Decode steps replay graphs on every rank (with expert
parallelism: padded to the bucket the ranks agree on each step, the MoE exchanges inside;
--enforce-eager turns them off) and the host schedules ahead (async scheduling); each run
records and prints whether its ranks had graphs. Results: one JSON file (--out) and a table on
stdout.

    python bench/bench_dp.py --out bench/results/dp_h200x2.json         # two GPUs
    python bench/bench_dp.py --toy --out /tmp/dp_toy.json               # CPU, toy sizes, seconds
    python bench/bench_dp.py --batches 256,512 --skip-big --out dp.json  # one vs two at B = 256, 512
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.args import engine_config, resolve_engine_config
from deepinfer.entrypoints.data_parallel import DataParallelEngine, RandomWeights
from deepinfer.models.config import ModelConfig
from deepinfer.models.hub import REPO_MODEL_DIR
from deepinfer.testing.random_model import estimate_weight_bytes


def engine_kwargs(args: argparse.Namespace, dp: int, max_model_len: int) -> dict[str, Any]:
    return {
        "backend": args.backend,
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "data_parallel_size": dp,
        "enable_expert_parallel": dp > 1,
        "enable_two_batch_overlap": dp > 1 and args.two_batch_overlap,
        "distributed_timeout_s": args.timeout_s,
        "enforce_eager": args.enforce_eager,
    }


def serve(
    config_file: Path, dp: int, args: argparse.Namespace, num_prompts: int, output_len: int, fp8: bool
) -> dict[str, Any]:
    """Start dp workers on random weights of config_file, run one warm-up call and one timed
    call of num_prompts random prompts; -> the figures."""
    max_model_len = args.input_len + output_len
    kwargs = engine_kwargs(args, dp, max_model_len)
    config = resolve_engine_config(engine_config(config_file.parent, kwargs, "bench_dp"), config_file)
    start = time.perf_counter()
    engine = DataParallelEngine(config, LLM.from_engine, random_weights=RandomWeights(str(config_file), fp8))
    startup = time.perf_counter() - start
    try:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, engine.vocab_size, (num_prompts, args.input_len), generator=g).tolist()
        requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]
        warm = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.generate(requests[: 2 * dp], [warm] * (2 * dp), use_tqdm=False)
        params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=output_len)
        start = time.perf_counter()
        outputs = engine.generate(requests, [params] * len(requests), use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "config": str(config_file),
        "data_parallel_size": dp,
        "fp8": fp8,
        "backend": engine.backend_name,
        "num_prompts": num_prompts,
        "input_len": args.input_len,
        "output_len": output_len,
        "startup_s": startup,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_out + num_prompts * args.input_len) / elapsed,
        "num_preemptions": engine.num_preemptions,
        "graph_buckets": engine.graph_buckets,  # the decode graphs every rank captured ([]: eager)
        "async_scheduling": engine.async_scheduling,
    }


def graphs_on(run: dict[str, Any]) -> str:
    """Whether a run's ranks replayed decode graphs, for the table."""
    buckets = run["graph_buckets"]
    scheduling = "async" if run["async_scheduling"] else "sync"
    if not buckets:
        return f"off (eager), {scheduling}"
    return f"on ({len(buckets)} buckets up to {max(buckets)}), {scheduling}"


def with_layers(config_file: Path, layers: int, folder: Path) -> Path:
    """A copy of config_file with num_hidden_layers = layers (and no MTP layer)."""
    config = json.loads(config_file.read_text())
    config["num_hidden_layers"] = layers
    config["num_nextn_predict_layers"] = 0
    out = folder / "config.json"
    out.write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the results' JSON file")
    parser.add_argument("--toy", action="store_true", help="CPU-sized: the tiny config, few requests")
    parser.add_argument("--small-config", default=None, help="default: deepseek-v2-lite (toy: tiny)")
    parser.add_argument("--big-config", default=None, help="default: deepseek-v3 (toy: tiny)")
    parser.add_argument("--big-layers", type=int, default=None, help="default: 18 (toy: 4)")
    parser.add_argument(
        "--skip-big-on-one", action="store_true", help="do not try the big model on one device"
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 2048 (toy: 4)")
    parser.add_argument("--big-num-prompts", type=int, default=None, help="default: 256 (toy: 2)")
    parser.add_argument("--input-len", type=int, default=None, help="default: 256 (toy: 12)")
    parser.add_argument("--output-len", type=int, default=None, help="default: 256 (toy: 4)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 512 (toy: 8)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--backend", default=None, help="default: auto (toy: reference)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (toy: float32)")
    parser.add_argument("--two-batch-overlap", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--enforce-eager", action="store_true", help="no decode graphs on the ranks")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="distributed_timeout_s")
    parser.add_argument(
        "--batches", default=None,
        help="comma-separated batch sizes B: one device against two at each, B requests with max_num_seqs B "
        "(instead of --num-prompts at --max-num-seqs)",
    )  # fmt: skip
    parser.add_argument("--skip-big", action="store_true", help="leave out the big FP8 model")
    args = parser.parse_args(argv)
    toy = args.toy
    defaults = {
        "small_config": "tiny" if toy else "deepseek-v2-lite",
        "big_config": "tiny" if toy else "deepseek-v3",
        "big_layers": 4 if toy else 18,
        "num_prompts": 4 if toy else 2048,
        "big_num_prompts": 2 if toy else 256,
        "input_len": 12 if toy else 256,
        "output_len": 4 if toy else 256,
        "max_num_seqs": 8 if toy else 512,
        "backend": "reference" if toy else "auto",
        "dtype": "float32" if toy else "bfloat16",
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    small = REPO_MODEL_DIR / args.small_config / "config.json"
    results: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "host": platform.node(),
        "torch": torch.__version__,
        "runs": [],
    }

    if args.batches:  # one device against two at each batch size, in the same run
        results["batches"] = []
        for b in (int(v) for v in args.batches.split(",")):
            args.max_num_seqs = b
            pair = [serve(small, dp, args, b, args.output_len, fp8=False) for dp in (1, 2)]
            speedup = pair[1]["output_tokens_per_s"] / pair[0]["output_tokens_per_s"]
            results["batches"].append({"batch": b, "one": pair[0], "two": pair[1], "output_speedup": speedup})
            print(f"batch {b}: one {pair[0]['output_tokens_per_s']:.1f} out tok/s, two "
                  f"{pair[1]['output_tokens_per_s']:.1f} ({speedup:.2f}x)", flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        one, two = results["batches"][-1]["one"], results["batches"][-1]["two"]
    else:
        one = serve(small, 1, args, args.num_prompts, args.output_len, fp8=False)
        two = serve(small, 2, args, args.num_prompts, args.output_len, fp8=False)
    results["runs"] += [one, two]
    results["speedup_two_over_one"] = two["total_tokens_per_s"] / one["total_tokens_per_s"]

    with tempfile.TemporaryDirectory() as folder:
        if args.skip_big:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
            print(f"two devices / one: {results['speedup_two_over_one']:.2f}x  (results: {args.out})")
            return 0
        big = with_layers(REPO_MODEL_DIR / args.big_config / "config.json", args.big_layers, Path(folder))
        mc = ModelConfig.from_file(big)
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        results["big_model"] = {
            "config": f"{args.big_config} with {args.big_layers} layers, FP8",
            "weight_bytes_one_device": estimate_weight_bytes(mc, dtype, fp8=True),
            "weight_bytes_per_rank_of_two": estimate_weight_bytes(mc, dtype, fp8=True, expert_share=0.5),
        }
        if not args.skip_big_on_one:
            try:
                results["big_model"]["one_device"] = serve(
                    big, 1, args, args.big_num_prompts, args.output_len, True
                )
            except Exception as exc:  # expected on a GPU: the weights do not fit
                results["big_model"]["one_device"] = {"refused": f"{type(exc).__name__}: {exc}"}
        results["big_model"]["two_devices"] = serve(big, 2, args, args.big_num_prompts, args.output_len, True)

    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'run':<34} {'startup s':>10} {'elapsed s':>10} {'out tok/s':>12} {'total tok/s':>12}  graphs")
    rows = [("small, one device", one), ("small, two devices", two)]
    one_big = results["big_model"].get("one_device", {})
    if "elapsed_s" in one_big:
        rows.append(("big FP8, one device", one_big))
    rows.append(("big FP8, two devices", results["big_model"]["two_devices"]))
    for name, r in rows:
        print(
            f"{name:<34} {r['startup_s']:>10.1f} {r['elapsed_s']:>10.2f} {r['output_tokens_per_s']:>12.1f} "
            f"{r['total_tokens_per_s']:>12.1f}  {graphs_on(r)}"
        )
    if "refused" in one_big:
        print(f"big FP8, one device: {one_big['refused']}")
    print(f"two devices / one: {results['speedup_two_over_one']:.2f}x  (results: {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

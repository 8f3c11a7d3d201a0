"""`deepinfer bench`: offline throughput on random prompts, as `vllm bench throughput
--dataset-name random`; with --random-config on a random-weight model of a config alone
(deepinfer.testing.random_model), whatever its size on disk."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from deepinfer.engine.args import human_readable_int
from deepinfer.entrypoints.options import (
    DEFAULT_MODEL,
    USER_ERRORS,
    add_engine_options,
    check_writable,
    fail,
    llm_kwargs,
)


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="offline throughput on random prompts (as `vllm bench throughput --dataset-name random`)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or cached hub repo id (default: the shipped tiny model)",
    )
    src.add_argument(
        "--random-config",
        default=None,
        help="random weights for a config: NAME of model/NAME, or a path; refused when the weights "
        "cannot fit in the device's free memory (estimated from the config before anything is built). "
        "Floating point, or with --quantization fp8 the config's FP8 format (DeepSeek-V4-Flash: FP8 "
        "linears and MXFP4 routed experts; V4.1-Flash: FP8 32x32 linears and MXFP4 experts)",
    )
    p.add_argument(
        "--num-hidden-layers",
        type=int,
        default=None,
        help="with --random-config: build only the first N layers (a reduced-depth model of the same "
        "shapes; DeepSeek-V4.1: the first layers of each YOCO half, its sharing lists renumbered)",
    )
    w = p.add_argument_group("workload (vLLM's `bench throughput` names)")
    w.add_argument(
        "--dataset-name", default="random", choices=["random"], help="random token ids (the only one)"
    )
    w.add_argument("--num-prompts", type=human_readable_int, default=32, help="requests (default: 32)")
    w.add_argument(
        "--random-input-len", "--input-len", dest="input_len", type=human_readable_int, default=128,
        help="tokens per prompt (1k = 1000, 1K = 1024)",
    )  # fmt: skip
    w.add_argument(
        "--random-output-len", "--output-len", dest="output_len", type=human_readable_int, default=32,
        help="tokens generated per prompt",
    )  # fmt: skip
    w.add_argument(
        "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
        help="lengths vary: each prompt's input and output length is drawn uniformly from "
        "[len * (1 - r), len * (1 + r)], 0 <= r < 1 (default: 0, fixed lengths)",
    )  # fmt: skip
    w.add_argument(
        "--random-prefix-len", "--prefix-len", dest="prefix_len", type=human_readable_int, default=0,
        help="random tokens shared by every prompt, before its own --random-input-len "
        "(a prefix-caching workload; default: 0)",
    )  # fmt: skip
    w.add_argument("--n", type=int, default=1, help="completions per prompt (SamplingParams.n; default: 1)")
    w.add_argument(
        "--output-json",
        default=None,
        help="also write the results to this file: vLLM's keys (elapsed_time, num_requests, "
        "total_num_tokens, "
        "requests_per_second, tokens_per_second) and deepinfer's",
    )
    add_engine_options(p)
    p.set_defaults(func=cmd_bench)


def weight_format(config_file: Path, fp8: bool) -> str:
    """How random weights of config_file are stored, for the report: "FP8 ", "FP8 + MXFP4 experts ",
    or "" (floating point)."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.testing.random_model import has_fp4_experts

    if not fp8:
        return ""
    return "FP8 + MXFP4 experts " if has_fp4_experts(ModelConfig.from_file(config_file), fp8) else "FP8 "


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The lengths vLLM's random dataset draws from: [floor(len * (1 - r)), ceil(len * (1 + r))],
    at least 1."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def random_workload(
    num_prompts: int,
    input_len: int,
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
    range_ratio: float = 0.0,
    output_len: int = 1,
) -> tuple[list[list[int]], list[int]]:
    """vLLM's random dataset: prompts of random token ids, each a shared prefix of prefix_len
    tokens then its own tokens, input_len of them (uniform in length_range with range_ratio), and
    each prompt's output length (output_len, the same way)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    prompts, output_lens = [], []
    for _ in range(num_prompts):
        n_in = rng.randint(*length_range(input_len, range_ratio))
        prompts.append(prefix + [rng.randrange(vocab_size) for _ in range(n_in)])
        output_lens.append(rng.randint(*length_range(output_len, range_ratio)))
    return prompts, output_lens


def check_lengths(args: argparse.Namespace, max_model_len: int | None, max_positions: int) -> int:
    """The longest request (shared prefix + input + output) against max_model_len (default: that
    length) and the model's max_position_embeddings -> the max_model_len to run with; ValueError
    before any weight is loaded."""
    longest = args.prefix_len + length_range(args.input_len, args.range_ratio)[1]
    longest += length_range(args.output_len, args.range_ratio)[1]
    what = f"the longest request is {longest} tokens (prefix {args.prefix_len} + input + output"
    what += f", range ratio {args.range_ratio})" if args.range_ratio else ")"
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"{what}, more than --max-model-len {max_model_len}: raise it, or shorten them")
    if (max_model_len or longest) > max_positions:
        raise ValueError(
            f"{what if max_model_len is None else f'--max-model-len {max_model_len}'}: more than the "
            f"model's max_position_embeddings {max_positions}; shorten the requests"
        )
    return max_model_len or longest


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM, SamplingParams
    from deepinfer.backend.registry import get_backend
    from deepinfer.backend.types import BackendOptions
    from deepinfer.engine.args import engine_config, resolve_engine_config
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.entrypoints.data_parallel import DataParallelEngine, RandomWeights
    from deepinfer.models.config import ModelConfig
    from deepinfer.testing.random_model import random_model, resolve_config

    flags = {
        "num_prompts": "--num-prompts",
        "input_len": "--random-input-len",
        "output_len": "--random-output-len",
    }
    for name, flag in flags.items():
        if getattr(args, name) <= 0:
            return fail(ValueError(f"{flag} must be positive"))
    if args.prefix_len < 0 or args.n < 1:
        return fail(ValueError("--random-prefix-len must be >= 0 and --n >= 1"))
    if not 0 <= args.range_ratio < 1:
        return fail(ValueError(f"--random-range-ratio must be in [0, 1), got {args.range_ratio}"))
    try:
        kwargs = llm_kwargs(args)
        output_json = check_writable(args.output_json, "--output-json") if args.output_json else None
        if args.num_hidden_layers is not None and (not args.random_config or args.num_hidden_layers < 1):
            return fail(ValueError("--num-hidden-layers needs --random-config and a value >= 1"))
        if args.random_config:
            config_file = resolve_config(args.random_config)
            config = engine_config(config_file.parent, kwargs, "deepinfer bench")
            config = resolve_engine_config(config, config_file)
            max_positions = ModelConfig.from_file(config_file).max_position_embeddings
            kwargs["max_model_len"] = check_lengths(args, config.max_model_len, max_positions)
            config = dataclasses.replace(config, max_model_len=kwargs["max_model_len"])
            if config.data_parallel_size > 1 and args.num_hidden_layers is not None:
                return fail(ValueError("--num-hidden-layers is not supported with data parallelism"))
            fp8 = config.quantization == "fp8"  # the config's published format (V4-Flash: + MXFP4 experts)
            if config.data_parallel_size > 1:  # each worker builds its own (its share of the experts)
                weights = RandomWeights(str(config_file), fp8)
                llm = LLM.from_engine(DataParallelEngine(config, LLM.from_engine, random_weights=weights))
            else:
                invariant, max_len = config.batch_invariant, config.max_model_len
                options = BackendOptions(batch_invariant=invariant, max_model_len=max_len)
                backend = get_backend(config.backend, options)
                model = random_model(
                    config_file, backend, config.torch_dtype, config.seed, config.gpu_memory_utilization,
                    fp8=fp8, num_hidden_layers=args.num_hidden_layers,
                )  # fmt: skip
                llm = LLM.from_engine(LLMEngine(config, model=model, backend=backend))
            source = f"random {weight_format(config_file, fp8)}weights, {config_file}"
        else:
            source = args.model or str(DEFAULT_MODEL)
            resolved = resolve_engine_config(engine_config(source, kwargs, "deepinfer bench"))
            model_config = ModelConfig.from_file(Path(resolved.model) / "config.json")
            max_positions = model_config.max_position_embeddings
            kwargs["max_model_len"] = check_lengths(args, resolved.max_model_len, max_positions)
            llm = LLM(source, **kwargs)
        # data parallelism: the workers' generate calls return once their devices are done
        dp = llm.data_parallel
        engine = llm.llm_engine if dp is None else None
        sync = engine.backend.device.synchronize if engine is not None else lambda: None
        vocab_size = dp.vocab_size if dp is not None else llm.llm_engine.vocab_size
        prompts, output_lens = random_workload(
            args.num_prompts, args.input_len, vocab_size, args.seed, args.prefix_len, args.range_ratio,
            args.output_len,
        )  # fmt: skip
        params = [
            SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=m)
            for m in output_lens
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(requests[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        sync()
        start = time.perf_counter()
        outputs = llm.generate(requests, params)
        sync()
        elapsed = time.perf_counter() - start
    except USER_ERRORS as exc:
        return fail(exc)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_cached = sum(o.num_cached_tokens or 0 for o in outputs)
    result = {
        # vLLM's `bench throughput --output-json` keys
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": num_in + num_out,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        # deepinfer's
        "model": source,
        "backend": engine.backend.name if engine is not None else dp.backend_name,  # type: ignore[union-attr]
        "data_parallel_size": 1 if dp is None else dp.size,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "range_ratio": args.range_ratio,
        "n": args.n,
        "num_cached_tokens": num_cached,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": num_in / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "num_preemptions": engine.scheduler.num_preemptions if engine is not None else dp.num_preemptions,  # type: ignore[union-attr]
        "num_draft_tokens": engine.num_draft_tokens if engine is not None else 0,
        "num_accepted_tokens": engine.num_accepted_tokens if engine is not None else 0,
    }
    ranks = f" x {result['data_parallel_size']} data-parallel ranks" if dp is not None else ""
    print(f"Model: {source} on backend {result['backend']}{ranks}")
    shape = f"{args.prefix_len} shared + " if args.prefix_len else ""
    shape += f"{args.input_len} in, {args.output_len} out"
    shape += f", lengths x [{1 - args.range_ratio:g}, {1 + args.range_ratio:g}]" if args.range_ratio else ""
    shape += f", n={args.n}" if args.n > 1 else ""
    print(f"Requests: {args.num_prompts} x ({shape}), {elapsed:.2f} s")
    r = result
    print(
        f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
        f"{r['input_tokens_per_s']:.2f} input tokens/s, {r['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {num_in}\nTotal num output tokens:  {num_out}")
    if args.prefix_len or num_cached:
        print(f"Prompt tokens from the prefix cache: {num_cached}")
    if output_json is not None:
        try:
            output_json.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            return fail(OSError(f"--output-json {args.output_json}: cannot write: {exc.strerror or exc}"))
    return 0

"""`deepinfer bench`: offline throughput on random prompts, as `vllm bench throughput
--dataset-name random`; with --random-config on a random-weight model of a config alone
(deepinfer.testing.random_model), whatever its size on disk."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

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
    w.add_argument("--num-prompts", type=int, default=32, help="requests (default: 32)")
    w.add_argument(
        "--random-input-len", "--input-len", dest="input_len", type=int, default=128, help="tokens per prompt"
    )
    w.add_argument(
        "--random-output-len", "--output-len", dest="output_len", type=int, default=32,
        help="tokens generated per prompt",
    )  # fmt: skip
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


def random_workload(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, fixed lengths (vLLM's random dataset with range_ratio 0)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM, SamplingParams
    from deepinfer.backend.registry import get_backend
    from deepinfer.backend.types import BackendOptions
    from deepinfer.engine.args import engine_config, resolve_engine_config
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.entrypoints.data_parallel import DataParallelEngine, RandomWeights
    from deepinfer.testing.random_model import random_model, resolve_config

    flags = {
        "num_prompts": "--num-prompts",
        "input_len": "--random-input-len",
        "output_len": "--random-output-len",
    }
    for name, flag in flags.items():
        if getattr(args, name) <= 0:
            return fail(ValueError(f"{flag} must be positive"))
    try:
        kwargs = llm_kwargs(args)
        if kwargs["max_model_len"] is None:
            kwargs["max_model_len"] = args.input_len + args.output_len
        output_json = check_writable(args.output_json, "--output-json") if args.output_json else None
        if args.num_hidden_layers is not None and (not args.random_config or args.num_hidden_layers < 1):
            return fail(ValueError("--num-hidden-layers needs --random-config and a value >= 1"))
        if args.random_config:
            config_file = resolve_config(args.random_config)
            config = engine_config(config_file.parent, kwargs, "deepinfer bench")
            config = resolve_engine_config(config, config_file)
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
            llm = LLM(source, **kwargs)
        # data parallelism: the workers' generate calls return once their devices are done
        dp = llm.data_parallel
        engine = llm.llm_engine if dp is None else None
        sync = engine.backend.device.synchronize if engine is not None else lambda: None
        vocab_size = dp.vocab_size if dp is not None else llm.llm_engine.vocab_size
        prompts = random_workload(args.num_prompts, args.input_len, vocab_size, args.seed)
        params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
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
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
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
    print(f"Requests: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), {elapsed:.2f} s")
    r = result
    print(
        f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
        f"{r['input_tokens_per_s']:.2f} input tokens/s, {r['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {num_in}\nTotal num output tokens:  {num_out}")
    if output_json is not None:
        try:
            output_json.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            return fail(OSError(f"--output-json {args.output_json}: cannot write: {exc.strerror or exc}"))
    return 0

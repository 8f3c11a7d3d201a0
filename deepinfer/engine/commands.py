"""`deepinfer generate` and `deepinfer bench`."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer.backend.registry import BackendError
from deepinfer.engine.random_weights import REPO_MODEL_DIR

DEFAULT_MODEL = REPO_MODEL_DIR / "tiny"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--backend", default="auto", help="backend name (default: auto, see `deepinfer backends`)")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of device memory to use")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    g.add_argument("--enable-prefix-caching", action="store_true", help="reuse KV blocks of shared prefixes")
    g.add_argument("--seed", type=int, default=0, help="engine seed (and the request seed in generate)")
    g.add_argument("--enforce-eager", action="store_true", help="never replay decode steps as graphs")
    g.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="process each step's tokens before scheduling the next (no overlap of host and device)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens per step from the checkpoint's MTP head (speculative decoding, 0 = off)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backend": args.backend,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "speculative_config": (
            {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
            if args.num_speculative_tokens
            else None
        ),
    }


def _fail(exc: Exception) -> int:
    """One line on stderr, exit status 2."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"error: {message}", file=sys.stderr)
    return 2


# What a user's input (arguments, files, checkpoint) can cause: a one-line error, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OSError, BackendError)


def _check_writable(path_arg: str, flag: str) -> Path:
    """The output path, or OSError saying why it cannot be written (checked before a long run)."""
    path = Path(path_arg)
    parent = path.parent
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path_arg}: is a directory")
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path_arg}: directory {parent} does not exist")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise PermissionError(f"{flag} {path_arg}: {target} is not writable")
    return path


# --------------------------------------------------------------------------- generate


def add_generate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from prompts (default model: the shipped tiny one)"
    )
    p.add_argument(
        "--model", default=str(DEFAULT_MODEL), help=f"checkpoint directory (default: {DEFAULT_MODEL})"
    )
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--request-seed", type=int, default=None, help="per-request seed (SamplingParams.seed)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (a file)")
    g.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat)")
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM, SamplingParams, StructuredOutputsParams

    try:
        structured = None
        if args.json_schema is not None:
            path = Path(args.json_schema)
            if not path.is_file():
                raise FileNotFoundError(f"--json-schema: no file {path}")
            structured = StructuredOutputsParams(json=path.read_text())
        elif args.regex is not None or args.choice is not None:
            structured = StructuredOutputsParams(regex=args.regex, choice=args.choice)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.request_seed,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            structured_outputs=structured,
        )
        llm = LLM(args.model, **_engine_kwargs(args))
        if args.chat:
            convs = [[{"role": "user", "content": p}] for p in args.prompt]
            outputs = llm.chat(convs, params)
        else:
            outputs = llm.generate(args.prompt, params)
    except USER_ERRORS as exc:
        return _fail(exc)
    for prompt, out in zip(args.prompt, outputs):
        c = out.outputs[0]
        if args.json:
            record = {
                "prompt": prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"Prompt: {prompt!r}\nOutput: {c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    return 0


# --------------------------------------------------------------------------- bench


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="offline throughput on random prompts (as `vllm bench throughput --dataset-name random`)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory (default: the shipped tiny model)")
    src.add_argument(
        "--random-config", default=None, help="random weights for a config: NAME of model/NAME, or a path"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--output-json", default=None, help="also write the results to this file")
    _add_engine_args(p)
    p.set_defaults(func=cmd_bench)


def random_workload(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, fixed lengths (vLLM's random dataset with range_ratio 0)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM, SamplingParams
    from deepinfer.backend.registry import get_backend
    from deepinfer.backend.types import BackendOptions
    from deepinfer.config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.random_weights import random_model, resolve_config

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) <= 0:
            return _fail(ValueError(f"--{name.replace('_', '-')} must be positive"))
    kwargs = _engine_kwargs(args)
    if kwargs["max_model_len"] is None:
        kwargs["max_model_len"] = args.input_len + args.output_len
    try:
        output_json = _check_writable(args.output_json, "--output-json") if args.output_json else None
        if args.random_config:
            config_file = resolve_config(args.random_config)
            config = EngineConfig(model=str(config_file.parent), **kwargs)
            backend = get_backend(config.backend, BackendOptions(batch_invariant=config.batch_invariant))
            model = random_model(config_file, backend, config.torch_dtype, config.seed)
            llm = LLM.from_engine(LLMEngine(config, model=model, backend=backend))
            source = f"random weights, {config_file}"
        else:
            source = args.model or str(DEFAULT_MODEL)
            llm = LLM(source, **kwargs)
        engine = llm.llm_engine
        prompts = random_workload(args.num_prompts, args.input_len, engine.vocab_size, args.seed)
        params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
        requests = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(requests[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        engine.backend.device.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(requests, params)
        engine.backend.device.synchronize()
        elapsed = time.perf_counter() - start
    except USER_ERRORS as exc:
        return _fail(exc)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": source,
        "backend": engine.backend.name,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": num_in / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_draft_tokens": engine.num_draft_tokens,
        "num_accepted_tokens": engine.num_accepted_tokens,
    }
    print(f"Model: {source} on backend {engine.backend.name}")
    print(f"Requests: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), {elapsed:.2f} s")
    r = result
    print(
        f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
        f"{r['input_tokens_per_s']:.2f} input tokens/s, {r['output_tokens_per_s']:.2f} output tokens/s"
    )
    if output_json is not None:
        try:
            output_json.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            return _fail(OSError(f"--output-json {args.output_json}: cannot write: {exc.strerror or exc}"))
    return 0

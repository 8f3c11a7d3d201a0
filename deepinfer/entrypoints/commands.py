"""`deepinfer generate` and `deepinfer bench` (and the helpers `deepinfer run-batch` shares).

Their engine options are generated from the engine arguments' one definition (EngineConfig's
fields, deepinfer.engine.args): the same names, defaults, help and checks as `LLM(...)`.
"""

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
from deepinfer.engine.args import add_engine_arguments, engine_kwargs
from deepinfer.engine.random_weights import REPO_MODEL_DIR

DEFAULT_MODEL = REPO_MODEL_DIR / "tiny"


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine arguments (one option per EngineConfig field) and the shortcut
    --num-speculative-tokens K (= --speculative-config '{"method": "mtp", "num_speculative_tokens": K}')."""
    add_engine_arguments(p)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens per step from the checkpoint's MTP head (speculative decoding, 0 = off)",
    )


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from the parsed engine options."""
    kwargs = engine_kwargs(args)
    k = getattr(args, "num_speculative_tokens", 0)
    if k:
        if kwargs.get("speculative_config") is not None:
            raise ValueError("give --num-speculative-tokens or --speculative-config, not both")
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return kwargs


def fail(exc: Exception) -> int:
    """One line on stderr, exit status 2."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"error: {message}", file=sys.stderr)
    return 2


# What a user's input (arguments, files, checkpoint) can cause: a one-line error, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OSError, BackendError)


def check_writable(path_arg: str, flag: str) -> Path:
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
        "--model",
        default=str(DEFAULT_MODEL),
        help=f"checkpoint directory, or a Hugging Face repo id in the local hub cache "
        f"(default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--prompt", action="append", default=None, help="prompt text (repeat for several); - reads stdin"
    )
    p.add_argument(
        "--prompts-file",
        default=None,
        help="prompts from a file (- = stdin): one per line, or JSONL (a .jsonl file, or every line a JSON "
        'object): {"prompt": TEXT} or {"prompt_token_ids": [...]} per line',
    )
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
    add_engine_options(p)
    p.set_defaults(func=cmd_generate)


def parse_prompts(text: str, source: str, jsonl: bool = False) -> list[str | dict[str, Any]]:
    """Prompts from a file's content: one per non-blank line, or, when `jsonl` or every non-blank
    line is a JSON object, one JSON value per line: {"prompt": text}, {"prompt_token_ids": [...]}
    or a JSON string. ValueError naming the source and the line."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{source}: no prompts (the input is empty)")
    if not jsonl and not all(line.lstrip().startswith("{") for _, line in lines):
        return [line for _, line in lines]
    prompts: list[str | dict[str, Any]] = []
    for n, line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} line {n}: not valid JSON: {exc}") from exc
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"prompt", "prompt_token_ids"})
            if unknown or not value:
                raise ValueError(
                    f"{source} line {n}: a JSON prompt has 'prompt' (text) or 'prompt_token_ids', got keys "
                    f"{sorted(value)}"
                )
        elif not isinstance(value, str):
            raise ValueError(f"{source} line {n}: expected a JSON object or string, got {line.strip()!r}")
        prompts.append(value)
    return prompts


def _read_text(path: str, flag: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path}: not UTF-8 text: {exc}") from exc


def read_prompts(args: argparse.Namespace) -> list[str | dict[str, Any]]:
    """--prompt (each, in order; - = the prompts on stdin) then --prompts-file."""
    prompts: list[str | dict[str, Any]] = []
    for prompt in args.prompt or []:
        if prompt == "-":
            prompts += parse_prompts(_read_text("-", "--prompt"), "stdin")
        else:
            prompts.append(prompt)
    if args.prompts_file is not None:
        source = "stdin" if args.prompts_file == "-" else args.prompts_file
        text = _read_text(args.prompts_file, "--prompts-file")
        prompts += parse_prompts(text, source, jsonl=args.prompts_file.endswith(".jsonl"))
    if not prompts:
        raise ValueError(
            "give a prompt: --prompt TEXT (repeat for several), --prompt - (stdin) or --prompts-file FILE"
        )
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM, SamplingParams, StructuredOutputsParams

    try:
        prompts = read_prompts(args)
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
        if args.chat and not all(isinstance(p, str) for p in prompts):
            raise ValueError("--chat takes text prompts, not prompt_token_ids")
        llm = LLM(args.model, **llm_kwargs(args))
        if args.chat:
            convs = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(convs, params)
        else:
            outputs = llm.generate(prompts, params)
    except USER_ERRORS as exc:
        return fail(exc)
    for prompt, out in zip(prompts, outputs):
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
        "linears and MXFP4 routed experts)",
    )
    p.add_argument(
        "--num-hidden-layers",
        type=int,
        default=None,
        help="with --random-config: build only the first N layers (a reduced-depth model of the same shapes)",
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
    from deepinfer.engine.random_weights import has_fp4_experts
    from deepinfer.models.config import ModelConfig

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
    from deepinfer.engine.random_weights import random_model, resolve_config
    from deepinfer.parallel.data_parallel import DataParallelEngine, RandomWeights

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
                llm = LLM.from_engine(DataParallelEngine(config, random_weights=weights))
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

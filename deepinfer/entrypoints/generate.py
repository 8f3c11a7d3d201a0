"""`deepinfer generate`: text from prompts given on the command line, stdin or a file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from deepinfer.entrypoints.options import DEFAULT_MODEL, USER_ERRORS, add_engine_options, fail, llm_kwargs


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
    s = p.add_argument_group(
        "sampling",
        "a flag left out takes the model's default (--generation-config: its generation_config.json)",
    )
    s.add_argument(
        "--max-tokens", type=int, default=None, help="default: max_new_tokens of the model, else 64"
    )
    s.add_argument("--min-tokens", type=int, default=None)
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--request-seed", type=int, default=None, help="per-request seed (SamplingParams.seed)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
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


DEFAULT_MAX_TOKENS = 64  # when neither --max-tokens nor the model's generation_config sets it


def sampling_params(base: Any, given: dict[str, Any]) -> Any:
    """The model's default SamplingParams `base` (LLM.get_default_sampling_params, as generate()
    without sampling params) with the flags given; max_tokens, where neither sets it,
    DEFAULT_MAX_TOKENS (SamplingParams' own 16 is short for a command line)."""
    from deepinfer.api import SamplingParams

    if "max_tokens" not in given and base.max_tokens == SamplingParams().max_tokens:
        given = {**given, "max_tokens": DEFAULT_MAX_TOKENS}
    return dataclasses.replace(base, **given)


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
        given: dict[str, Any] = {  # the sampling flags given; the others take the model's defaults
            name: value
            for name, value in (
                ("temperature", args.temperature),
                ("top_p", args.top_p),
                ("top_k", args.top_k),
                ("min_p", args.min_p),
                ("seed", args.request_seed),
                ("max_tokens", args.max_tokens),
                ("min_tokens", args.min_tokens),
                ("stop", args.stop),
                ("ignore_eos", args.ignore_eos),
                ("presence_penalty", args.presence_penalty),
                ("frequency_penalty", args.frequency_penalty),
                ("repetition_penalty", args.repetition_penalty),
                ("structured_outputs", structured),
            )
            if value is not None
        }
        SamplingParams(**{"max_tokens": None, **given})  # a bad flag is refused before the weights load
        if args.chat and not all(isinstance(p, str) for p in prompts):
            raise ValueError("--chat takes text prompts, not prompt_token_ids")
        llm = LLM(args.model, **llm_kwargs(args))
        params = sampling_params(llm.get_default_sampling_params(), given)
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

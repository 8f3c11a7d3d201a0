"""`deepinfer run-batch -i requests.jsonl -o results.jsonl`: vLLM's `run-batch`, the OpenAI batch
file format, served offline by one LLM.

Input: one request per line,
    {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", ...}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}
Output: one line per input line, in input order,
    {"id": "vllm-...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "vllm-batch-...", "body": <completion object>},
     "error": null}
where the body is an OpenAI `text_completion` or `chat.completion` object. A line that cannot be
served (not JSON, an unsupported url, a bad body, a prompt the engine refuses, a chat line for a
model without a chat template) gets status_code 400, body null and
"error": {"message": ..., "type": "BadRequestError", "code": 400}; every other line is served.

The body takes OpenAI's names and vLLM's extra sampling parameters (SamplingParams' field names:
top_k, min_p, repetition_penalty, ...). Parameters a body leaves out take the model's defaults
(generation_config, as generate() does); completions default to max_tokens=16, chat completions
to the rest of the context, as in vLLM. A key deepinfer does not support is an error for that line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.images import chat_prompt
from deepinfer.entrypoints.options import (
    DEFAULT_MODEL,
    USER_ERRORS,
    add_engine_options,
    check_writable,
    fail,
    llm_kwargs,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
MAX_LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot hold
# Body keys read here (the rest must be SamplingParams fields).
COMMON_KEYS = {"model", "user", "stream", "stream_options", "response_format", "logprobs"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "echo", "suffix"}
CHAT_KEYS = COMMON_KEYS | {
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs",
}  # fmt: skip
# SamplingParams fields set otherwise, or not from JSON
NOT_FROM_BODY = {
    "structured_outputs",
    "detokenize",
    "logprobs",
    "output_kind",
    "logits_processors",
    "extra_args",
}


class BadLine(ValueError):
    """A batch line that cannot be served (HTTP 400 in vLLM's server)."""


@dataclass
class Line:
    """One input line: what to run, and then its outcome."""

    number: int
    custom_id: str | None = None
    url: str = ""
    model: str = ""
    prompts: list[Any] = field(default_factory=list)  # generate()'s prompt dicts
    params: Any = None  # SamplingParams
    top_logprobs: int | None = None  # chat: how many alternatives to report per token
    outputs: list[Any] = field(default_factory=list)  # RequestOutput per prompt
    error: str | None = None
    status: int = 200


# --------------------------------------------------------------------------- command line


def add_run_batch_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="serve a file of OpenAI batch requests (/v1/completions, /v1/chat/completions), "
        "as `vllm run-batch`",
    )
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON object per line (- = stdin)")
    p.add_argument(
        "-o", "--output-file", required=True, help="results, one JSON object per line (- = stdout)"
    )
    p.add_argument(
        "--model",
        default=str(DEFAULT_MODEL),
        help=f"checkpoint directory or hub repo id (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name in the responses (default: --model)"
    )
    add_engine_options(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from deepinfer.api import LLM

    try:
        out_path = None if args.output_file == "-" else check_writable(args.output_file, "-o")
        if args.input_file == "-":
            text = sys.stdin.read()
        else:
            try:
                with open(args.input_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise OSError(f"-i {args.input_file}: cannot read: {exc.strerror or exc}") from exc
            except UnicodeDecodeError as exc:
                raise ValueError(f"-i {args.input_file}: not UTF-8 text: {exc}") from exc
        llm = LLM(args.model, **llm_kwargs(args))
        results = run_batch(llm, text, args.served_model_name or args.model)
    except USER_ERRORS as exc:
        return fail(exc)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if out_path is None:
        sys.stdout.write(lines)
    else:
        try:
            out_path.write_text(lines, encoding="utf-8")
        except OSError as exc:
            return fail(OSError(f"-o {args.output_file}: cannot write: {exc.strerror or exc}"))
    failed = sum(r["error"] is not None for r in results)
    print(
        f"run-batch: {len(results) - failed} of {len(results)} requests served, {failed} failed",
        file=sys.stderr,
    )
    return 0


# --------------------------------------------------------------------------- the batch


def _engine(llm: Any) -> Any:
    """The engine that holds the model's files: this process's, or with data_parallel_size > 1
    the workers' calling side (both have config, tokenizer and default_sampling_params)."""
    return llm.data_parallel if llm.data_parallel is not None else llm.llm_engine


def run_batch(llm: Any, text: str, model_name: str, use_tqdm: bool = True) -> list[dict[str, Any]]:
    """The output objects of a batch file's content, one per non-blank line, in input order."""
    base = _engine(llm).default_sampling_params()  # the model's defaults, read once
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        line = Line(number)
        try:
            _parse(base, llm, raw, line, model_name)
        except (BadLine, ValueError, TypeError) as exc:
            line.error, line.status = f"line {number}: {exc}", 400
        lines.append(line)
    _generate(llm, [ln for ln in lines if ln.error is None], use_tqdm)
    return [_result(llm, line) for line in lines]


def _parse(base: Any, llm: Any, raw: str, line: Line, model_name: str) -> None:
    try:
        request = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise BadLine(f"not valid JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise BadLine("a request must be a JSON object")
    custom_id = request.get("custom_id")
    if isinstance(custom_id, str):
        line.custom_id = custom_id
    unknown = sorted(set(request) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BadLine(f"unknown keys {unknown}; a request has custom_id, method, url and body")
    if not isinstance(custom_id, str):
        raise BadLine(f"custom_id must be a string, got {custom_id!r}")
    if request.get("method") != "POST":
        raise BadLine(f"method must be 'POST', got {request.get('method')!r}")
    url = request.get("url")
    if url not in URLS:
        raise BadLine(f"url {url!r} is not supported; supported: {', '.join(URLS)}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise BadLine("body must be a JSON object")
    line.url = url
    line.model = body["model"] if isinstance(body.get("model"), str) else model_name
    if body.get("stream"):
        raise BadLine("stream=true is not supported in a batch")
    if url == COMPLETIONS:
        _parse_completion(base, body, line)
    else:
        _parse_chat(base, llm, body, line)


def _sampling_params(base: Any, body: dict[str, Any], known: set[str], overrides: dict[str, Any]) -> Any:
    """The model's default SamplingParams `base` with the body's values (and `overrides`) in; BadLine
    for a key that is neither known to the endpoint nor a SamplingParams field."""
    from deepinfer.api import SamplingParams, StructuredOutputsParams

    names = {f.name for f in dataclasses.fields(SamplingParams)} - NOT_FROM_BODY
    unknown = sorted(set(body) - known - names)
    if unknown:
        supported = ", ".join(sorted((known | names) - {"stream_options"}))
        raise BadLine(f"unsupported body keys {unknown}; supported: {supported}")
    values = {k: v for k, v in body.items() if k in names}
    if isinstance(values.get("logit_bias"), dict):  # OpenAI writes token ids as strings
        try:
            values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
        except ValueError as exc:
            raise BadLine(f"logit_bias keys must be token ids, got {values['logit_bias']!r}") from exc
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            values["structured_outputs"] = StructuredOutputsParams(json_object=True)
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            values["structured_outputs"] = StructuredOutputsParams(json=fmt["json_schema"].get("schema", {}))
        elif kind != "text":
            raise BadLine(f"response_format must be text, json_object or json_schema, got {fmt!r}")
    values.update(overrides)
    return dataclasses.replace(base, **values)


def _parse_completion(base: Any, body: dict[str, Any], line: Line) -> None:
    if body.get("echo"):
        raise BadLine("echo=true is not supported")
    if body.get("suffix") is not None:
        raise BadLine("suffix is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [{"prompt_token_ids": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]
    else:
        raise BadLine("prompt must be a string, a list of token ids, or a list of those")
    logprobs = body.get("logprobs")
    overrides = {"max_tokens": body.get("max_tokens", 16), "logprobs": logprobs}
    line.prompts = prompts
    line.params = _sampling_params(base, body, COMPLETION_KEYS, overrides)


def _parse_chat(base: Any, llm: Any, body: dict[str, Any], line: Line) -> None:
    from deepinfer.api import SamplingParams

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadLine("messages must be a non-empty list of {role, content} messages")
    tok = _engine(llm).tokenizer
    if tok is None:
        raise BadLine(f"{_engine(llm).config.model} has no tokenizer.json, so no chat template")
    prompt = chat_prompt(
        tok,
        llm.data_parallel.images if llm.data_parallel is not None else llm.llm_engine.requests.images,
        messages,
        chat_template=body.get("chat_template"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        chat_template_kwargs=body.get("chat_template_kwargs"),
    )
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BadLine("give max_tokens or max_completion_tokens, not both")
    from_file = base.max_tokens != SamplingParams().max_tokens  # generation_config.json's max_new_tokens
    max_tokens = body.get(
        "max_completion_tokens", body.get("max_tokens", base.max_tokens if from_file else None)
    )
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise BadLine("top_logprobs needs logprobs=true")
    if body.get("logprobs") not in (None, True, False):
        raise BadLine(f"logprobs must be true or false, got {body.get('logprobs')!r}")
    overrides = {"max_tokens": max_tokens, "logprobs": (top or 0) if body.get("logprobs") else None}
    line.prompts = [prompt]
    line.params = _sampling_params(base, body, CHAT_KEYS, overrides)
    line.top_logprobs = top or 0


_PROMPT_INDEX = re.compile(r"^prompt (\d+): ")


def _generate(llm: Any, lines: list[Line], use_tqdm: bool) -> None:
    """One generate() call for every line's prompts. The engine checks all the requests of a call
    before it runs any and names the first bad one ("prompt K: ..."): that line gets the error
    and the call is made again without it. Any other failure fails every line left."""
    pending = list(lines)
    while pending:
        owners = [line for line in pending for _ in line.prompts]
        prompts = [p for line in pending for p in line.prompts]
        params = [line.params for line in pending for _ in line.prompts]
        try:
            outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        except (ValueError, TypeError) as exc:
            found = _PROMPT_INDEX.match(str(exc))
            if found is None or int(found.group(1)) >= len(owners):
                _fail_all(pending, exc, 400)
                return
            bad = owners[int(found.group(1))]
            bad.error, bad.status = f"line {bad.number}: {str(exc)[found.end() :]}", 400
            pending.remove(bad)
            continue
        except Exception as exc:
            _fail_all(pending, exc, 500)
            return
        for line, out in zip(owners, outputs):
            line.outputs.append(out)
        return


def _fail_all(lines: list[Line], exc: BaseException, status: int) -> None:
    for line in lines:
        line.error, line.status = f"line {line.number}: {type(exc).__name__}: {exc}", status


# --------------------------------------------------------------------------- responses


def _result(llm: Any, line: Line) -> dict[str, Any]:
    request_id = f"vllm-batch-{uuid.uuid4().hex}"
    refused = [
        c.error for o in line.outputs for c in o.outputs if c.finish_reason == "error" and not c.token_ids
    ]
    if line.error is None and refused:  # a request refused before it ran (an image it cannot take)
        line.error, line.status = f"line {line.number}: {refused[0]}", 400
    if line.error is not None:
        error = {
            "message": line.error,
            "type": "BadRequestError" if line.status == 400 else "InternalServerError",
        }
        response = {"status_code": line.status, "request_id": request_id, "body": None}
        return {
            "id": f"vllm-{uuid.uuid4().hex}",
            "custom_id": line.custom_id,
            "response": response,
            "error": {**error, "code": line.status},
        }
    body = _completion_body(llm, line) if line.url == COMPLETIONS else _chat_body(llm, line)
    return {
        "id": f"vllm-{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _usage(line: Line) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in line.outputs)
    completion = sum(len(c.token_ids) for o in line.outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def _token_text(llm: Any, token_id: int, logprob: Any) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return str(logprob.decoded_token)
    tok = _engine(llm).tokenizer
    return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"


def _lp(value: float) -> float:
    return max(float(value), MAX_LOGPROB_FLOOR)


def _completion_logprobs(llm: Any, c: Any) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, position in zip(c.token_ids, c.logprobs):
        text = _token_text(llm, token_id, position.get(token_id))
        tokens.append(text)
        token_logprobs.append(_lp(position[token_id].logprob) if token_id in position else None)
        top.append({_token_text(llm, t, lp): _lp(lp.logprob) for t, lp in position.items()})
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def _completion_body(llm: Any, line: Line) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(line.outputs):
        for c in out.outputs:
            choices.append(
                {
                    "index": i * len(out.outputs) + c.index,
                    "text": c.text,
                    "logprobs": _completion_logprobs(llm, c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": line.model,
        "choices": choices,
        "usage": _usage(line),
    }


def _chat_entry(llm: Any, token_id: int, lp: Any) -> dict[str, Any]:
    text = _token_text(llm, token_id, lp)
    return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(llm: Any, c: Any, k: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, position in zip(c.token_ids, c.logprobs):
        if token_id not in position:
            continue
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:k]
        entry = _chat_entry(llm, token_id, position[token_id])
        entry["top_logprobs"] = [_chat_entry(llm, t, lp) for t, lp in ranked]
        content.append(entry)
    return {"content": content}


def _chat_body(llm: Any, line: Line) -> dict[str, Any]:
    out = line.outputs[0]
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(llm, c, line.top_logprobs or 0),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": line.model,
        "choices": choices,
        "usage": _usage(line),
    }

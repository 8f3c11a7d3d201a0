"""Tokenizer, chat template and incremental detokenisation.

The tokenizer is the checkpoint's Hugging Face tokenizer: transformers' AutoTokenizer over its
files (tokenizer.json, tokenizer_config.json, chat_template.jinja; fast tokenizer, no remote code,
local files only). `LLM.get_tokenizer()` hands that object out and `LLM.chat` renders with its
`apply_chat_template`, so prompts are what transformers (and vLLM) make of the same files. The
engine's own encode / decode go straight to the `tokenizers.Tokenizer` inside it (the same
pipeline without transformers' Python layers), and detokenisation streams through
`tokenizers.decoders.DecodeStream`.

Chat templates are untrusted code: transformers renders them in jinja's sandbox, and deepinfer
adds bounds. A budget (TEMPLATE_MAX_STEPS lines of template code, TEMPLATE_MAX_SECONDS of wall
time, TEMPLATE_MAX_BYTES of growth of the peak RSS, counted by a trace function on the
template's own frames only) turns a template that loops for ever or swells into a ValueError
naming the template file; an attribute the sandbox refuses (`__globals__`, `__class__`, ...) is
an error naming the sandbox, where jinja would render it as an empty string; and a rendered
prompt longer than the tokenizer can encode in the memory available (check_encodable; the
tokenizers library would abort the process) or a MemoryError while rendering is an error
naming the template. (One step that allocates more than the host holds, `'x' * 10**11`, is
beyond a trace function's reach.)
"""

from __future__ import annotations

import inspect
import json
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from deepinfer.backend.host import host_memory_info

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ChatMessage = dict[str, Any]

# A chat template's budget: lines of template code run, and seconds (DeepSeek's templates render
# a long conversation in a few thousand lines and milliseconds).
TEMPLATE_MAX_STEPS = 1_000_000
TEMPLATE_MAX_SECONDS = 10.0
# ... and host memory: growth of the process's peak RSS while it renders (a template that doubles
# a string forty times would otherwise take all of it in a few steps), checked every
# TEMPLATE_MEMORY_EVERY lines (a getrusage call each; measured on the tiny model's template over
# 2001 messages: 47 ms rendering with the step and time budget, 52 ms with this check too, 69 ms
# checking at every line).
TEMPLATE_MAX_BYTES = 256 * 2**20
TEMPLATE_MEMORY_EVERY = 4
# Peak host memory the tokenizers library takes to encode one character (its encoding, offsets
# and words, then the Python list of ids): 120 bytes for "x" * 10**7, 245 for short words,
# measured; 256 to be safe. Past the memory available it aborts the process (a failed Rust
# allocation), so longer texts are refused first: encoding may take half the available memory.
ENCODE_BYTES_PER_CHAR = 256
# Texts shorter than this (64 MiB to encode) are encoded without reading /proc/meminfo.
ENCODE_CHECK_CHARS = 2**18


def lone_surrogate(text: str) -> str | None:
    """A description of the first lone surrogate in text (not encodable as UTF-8), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def check_encodable(text: str) -> None:
    """ValueError where encoding `text` would need more than half the available host memory."""
    if len(text) < ENCODE_CHECK_CHARS:
        return
    need, available = len(text) * ENCODE_BYTES_PER_CHAR, host_memory_info()[0]
    if need > available // 2:
        raise ValueError(
            f"the text is {len(text)} characters: encoding it needs about {need / 2**30:.3g} GiB of host "
            f"memory, more than half the {available / 2**30:.3g} GiB available"
        )


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class TemplateBudgetError(Exception):
    """A chat template ran past its step or time budget (raised inside the template's code)."""


@contextmanager
def template_budget(
    max_steps: int = TEMPLATE_MAX_STEPS,
    max_seconds: float = TEMPLATE_MAX_SECONDS,
    max_bytes: int | None = None,
) -> Iterator[None]:
    """Count the lines jinja-compiled template code runs in this thread ("<template>" frames:
    every other frame is left untraced) and raise TemplateBudgetError past any bound. Memory is
    checked every TEMPLATE_MEMORY_EVERY lines: a line can double a string, so the peak may pass
    the bound by a few doublings. max_bytes None: TEMPLATE_MAX_BYTES."""
    limit = TEMPLATE_MAX_BYTES if max_bytes is None else max_bytes
    deadline = time.monotonic() + max_seconds
    peak = _peak_rss() + limit
    steps = 0

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > max_steps:
                raise TemplateBudgetError(f"more than {max_steps} steps")
            if not steps & 4095 and time.monotonic() > deadline:
                raise TemplateBudgetError(f"more than {max_seconds:g} s")
            if not steps % TEMPLATE_MEMORY_EVERY and _peak_rss() > peak:
                raise TemplateBudgetError(f"more than {limit / 2**20:g} MiB of host memory")
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _refuse_unsafe_attributes(hf: PreTrainedTokenizerBase, template: str | None, tools: Any) -> None:
    """Make the sandbox of the template transformers will render raise SecurityError on an
    unsafe attribute (jinja returns an Undefined that prints as ""). The environment is
    transformers' cached one for that template string, so every render of it refuses alike."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = hf.get_chat_template(template, tools)
        env = _compile_jinja_template(source).environment
    except Exception:  # another transformers layout, or no template: render as transformers does
        return

    def unsafe_undefined(obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    env.unsafe_undefined = unsafe_undefined


def read_json_file(path: Path) -> Any:
    """The JSON content of a checkpoint file, or a ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # Recursion: nested too deeply
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


# The files transformers' AutoTokenizer (and the engine) may open in a tokenizer directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)


def check_tokenizer_files(path: Path) -> None:
    """Every tokenizer file present in `path` (and each additional_chat_templates/*.jinja) stays
    inside it once symlinks are resolved (deepinfer.models.hub.checkpoint_file), before
    transformers opens any of them."""
    from deepinfer.models.hub import checkpoint_file

    for name in TOKENIZER_FILES:
        if (path / name).exists() or (path / name).is_symlink():
            checkpoint_file(path, name)
    extra = path / "additional_chat_templates"
    if extra.is_dir() or extra.is_symlink():
        checkpoint_file(path, "additional_chat_templates")
        for file in sorted(extra.iterdir()):
            checkpoint_file(path, f"additional_chat_templates/{file.name}")


def _load_hf_tokenizer(path: Path, config: dict[str, Any]) -> PreTrainedTokenizerBase:
    """transformers' AutoTokenizer over the checkpoint directory, or a ValueError naming the file
    it could not read."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(
            path, use_fast=True, trust_remote_code=False, local_files_only=True
        )
    except Exception as exc:  # transformers and tokenizers raise many kinds; name the file that is bad
        file = path / "tokenizer.json"
        try:
            BackendTokenizer.from_file(str(file))
        except Exception as file_exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{file} is not a valid tokenizer file: {file_exc}") from file_exc
        raise ValueError(
            f"transformers cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"the tokenizer in {path} did not load as a fast (tokenizer.json) tokenizer")
    # transformers 5 ignores tokenizer_config.json's add_bos_token when there is a tokenizer.json
    # (the file's post-processor decides). DeepSeek's configs say add_bos_token: true, and
    # transformers 4 (LlamaTokenizerFast) honoured it: so do we, where the post-processor does not
    # already add BOS (the setter rebuilds the post-processor; encode then adds BOS once).
    bos = hf.bos_token_id
    if config.get("add_bos_token") is True and bos is not None and hf.encode("")[:1] != [bos]:
        fast: Any = hf  # TokenizersBackend's add_bos_token setter rebuilds the post-processor
        fast.add_bos_token = True
    return hf


class Tokenizer:
    """The checkpoint's tokenizer: `hf_tokenizer` is transformers' object (what users get), encode
    and decode use the `tokenizers.Tokenizer` inside it (`backend`) directly."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        check_tokenizer_files(path)
        cfg_file = path / "tokenizer_config.json"
        cfg = read_json_file(cfg_file) if cfg_file.is_file() else {}
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object")
        self.hf_tokenizer: PreTrainedTokenizerBase = _load_hf_tokenizer(path, cfg)
        self.backend: BackendTokenizer = self.hf_tokenizer.backend_tokenizer
        self.bos_token_id: int | None = self.hf_tokenizer.bos_token_id
        self.eos_token_id: int | None = self.hf_tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' len(tokenizer))."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As hf_tokenizer.encode(text, add_special_tokens=...). ValueError naming a lone
        surrogate (text that is not valid Unicode, so not UTF-8 encodable), or a text too long to
        encode in the host memory available (check_encodable)."""
        check_encodable(text)
        try:
            ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            problem = lone_surrogate(text) if isinstance(text, str) else None
            if problem is None:
                raise
            raise ValueError(f"the text holds {problem}; it is not valid Unicode text") from None
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The tokenizers decoder's text (transformers' decode adds nothing to it for BPE models)."""
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) of one conversation, rendered by transformers'
        apply_chat_template with the same arguments: the ids are those of
        `hf_tokenizer.apply_chat_template(messages, tokenize=True, ...)`. chat_template_kwargs are
        the template's own variables (e.g. DeepSeek's thinking switch). The messages are first
        made what vLLM hands a template (prepare_messages: content parts as content_format says,
        tool-call arguments parsed). ValueError for malformed messages, a missing template, and a
        template that does not compile or fails."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {content_format!r}"
            )
        _check_messages(messages)
        hf = self.hf_tokenizer
        if chat_template is None and hf.chat_template is None:
            raise ValueError(
                f"the tokenizer in {self.path} has no chat template (no chat_template.jinja, and "
                "tokenizer_config.json has no 'chat_template'); pass chat_template=... or use generate() "
                "with a plain prompt"
            )
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & _reserved_template_kwargs(hf))
        if clash:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(clash)}: pass chat()'s own arguments instead"
            )
        source = self._template_source(chat_template, tools)
        if content_format == "auto":
            content_format = "openai" if _loops_over_content(hf, chat_template, tools) else "string"
        messages = prepare_messages(messages, content_format)
        try:
            _refuse_unsafe_attributes(hf, chat_template, tools)
            with template_budget():
                text = hf.apply_chat_template(
                    messages,
                    tools=tools,  # type: ignore[arg-type]
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **kwargs,
                )
        except TemplateBudgetError as exc:
            raise ValueError(
                f"the chat template ({source}) ran past its budget ({exc}; at most {TEMPLATE_MAX_STEPS} "
                f"steps, {TEMPLATE_MAX_SECONDS:g} s and {TEMPLATE_MAX_BYTES / 2**20:g} MiB): it loops too "
                "long (nested loops?) or its output grows too large"
            ) from None
        except SecurityError as exc:
            raise ValueError(f"the chat template ({source}) was stopped by the jinja sandbox: {exc}") from exc
        except MemoryError:
            raise ValueError(
                f"the chat template ({source}) ran out of host memory (its output grows too large)"
            ) from None
        except TemplateSyntaxError as exc:
            raise ValueError(f"the chat template ({source}) does not compile: {exc}") from exc
        except TemplateError as exc:  # raise_exception(...) in the template, or a sandbox refusal
            raise ValueError(f"chat template failed ({source}): {exc}") from exc
        except Exception as exc:
            if not _raised_in_template(exc):
                raise  # transformers' own check of the arguments (ValueError, TypeError)
            # the template's own code: OverflowError, TypeError, ZeroDivisionError, ...
            raise ValueError(f"chat template failed ({source}): {type(exc).__name__}: {exc}") from exc
        assert isinstance(text, str)
        try:
            check_encodable(text)
        except ValueError as exc:
            raise ValueError(f"the chat template ({source}) rendered a prompt too long: {exc}") from None
        # apply_chat_template(tokenize=True) encodes the text exactly so: no special tokens added
        return text, self.encode(text, add_special_tokens=False)

    def _template_source(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        """Where the template that apply_chat_template uses comes from, for error messages."""
        named = self.hf_tokenizer.chat_template
        if chat_template is not None and not (isinstance(named, dict) and chat_template in named):
            return "the chat_template argument"
        name = chat_template or "default"
        if chat_template is None and tools is not None and isinstance(named, dict) and "tool_use" in named:
            name = "tool_use"
        if name == "default":
            file, in_config = self.path / "chat_template.jinja", "tokenizer_config.json"
        else:
            file = self.path / "additional_chat_templates" / f"{name}.jinja"
            in_config = f"tokenizer_config.json, template {name!r}"
        return str(file) if file.is_file() else str(self.path / in_config)


CONTENT_FORMATS = ("auto", "string", "openai")
# Content parts that carry text, and the key that holds it (vLLM's parsers: "input_text" is the
# Responses API's text part, "refusal" an assistant's refusal).
TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal"}


def _loops_over_content(hf: PreTrainedTokenizerBase, template: str | None, tools: Any) -> bool:
    """Whether the chat template has a for loop over a content (`message['content']`,
    `message.content`, or a variable named content, as a macro's parameter): such a template
    takes OpenAI's list of parts (vLLM's "openai" content format); one that does not uses the
    content as a string. vLLM's "auto" detection reads the template's syntax tree alike."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(hf.get_chat_template(template, tools))
    except (TemplateError, ValueError):
        return False  # apply_chat_template reports the template itself

    def is_content(node: nodes.Node) -> bool:
        if isinstance(node, nodes.Name):
            return node.name == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Filter):  # message['content'] | selectattr(...)
            return node.node is not None and is_content(node.node)
        return False

    return any(is_content(loop.iter) for loop in tree.find_all(nodes.For))


def prepare_messages(messages: list[ChatMessage], content_format: str) -> list[ChatMessage]:
    """The conversation as vLLM hands it to a chat template (new dicts; the caller's are left
    alone): a list of content parts becomes its text parts joined by newlines ("string", vLLM's
    format for templates that print the content) or stays a list of parts ("openai"); a part that
    is not text is a ValueError naming its type. An assistant's tool-call arguments given as a
    JSON string (OpenAI's wire format) are parsed into the object templates expect (an empty or
    missing one is {}), as vLLM does; a string that is not JSON is a ValueError."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind not in TEXT_PARTS or not isinstance(part.get(TEXT_PARTS[kind]), str):
                    what = f"{kind!r} parts are not supported" if kind not in TEXT_PARTS else "it has no text"
                    raise ValueError(
                        f"message {i} ({message['role']}), content part {j}: {what}: deepinfer serves "
                        f"text only (content parts of type {', '.join(map(repr, TEXT_PARTS))})"
                    )
                texts.append(part[TEXT_PARTS[kind]])
            message["content"] = (
                "\n".join(texts)
                if content_format == "string"
                else [{"type": "text", "text": t} for t in texts]
            )
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list):
            message["tool_calls"] = [_parsed_call(i, j, call) for j, call in enumerate(calls)]
        out.append(message)
    return out


def _parsed_call(i: int, j: int, call: Any) -> Any:
    """One tool call with its function's arguments parsed from a JSON string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, (dict, list)):
        return call
    if arguments is None or arguments == "":
        parsed: Any = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"message {i} (assistant), tool call {j}: 'arguments' is not valid JSON ({exc}): "
                f"{arguments[:200]!r}"
            ) from exc
    else:
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def _check_messages(messages: object) -> None:
    """A conversation is a non-empty list of {"role": str, "content": ...} dicts; content is a
    string or a list of OpenAI content parts ({"type": "text", "text": ...}); an assistant turn may
    leave it out or set it to None (a tool call)."""
    problem = None
    if not isinstance(messages, list) or not messages:
        problem = "a conversation must be a non-empty list"
    else:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                problem = f"message {i} is not a dict with a string 'role'"
            elif m.get("content") is None and m["role"] != "assistant":
                problem = f"message {i} ({m['role']}) has no 'content'"
            elif not isinstance(m.get("content"), (str, list, type(None))) or (
                isinstance(m.get("content"), list) and not all(isinstance(p, dict) for p in m["content"])
            ):
                problem = f"message {i}: 'content' must be a string or a list of content-part dicts"
            if problem:
                break
    if problem:
        raise ValueError(f"messages must be a list of {{'role': str, 'content': ...}} dicts: {problem}")


def _reserved_template_kwargs(hf: PreTrainedTokenizerBase) -> set[str]:
    """apply_chat_template's own parameters and the variables it sets: not template variables."""
    params = set(inspect.signature(hf.apply_chat_template).parameters) - {"kwargs"}
    return params | {"messages", "documents"}


def _raised_in_template(exc: BaseException) -> bool:
    """Whether the exception came out of the template's code (jinja names compiled templates'
    frames "<template>") rather than transformers' checks around it."""
    return any(frame.filename == "<template>" for frame in traceback.extract_tb(exc.__traceback__))


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, a piece per new token.

    tokenizers' DecodeStream does the work: a token may end inside a multi-byte character, which
    decodes to U+FFFD until the rest arrives, so the stream holds such tokens back and releases the
    text once the character is complete. The concatenated pieces plus flush() equal decoding all
    output tokens at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.backend = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._last: list[int] = []  # the tokens of the last piece released (context for flush)
        self._held: list[int] = []  # the tokens after them, not released yet

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self._held.append(token_id)
        piece: str | None = self._stream.step(self.backend, token_id)
        if piece is None:
            return ""
        self._last, self._held = self._held, []
        return piece

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes to U+FFFD)."""
        if not self._held:
            return ""
        decode, skip = self.backend.decode, self.skip_special_tokens
        # Decode after the same context, so a decoder that treats the first token specially
        # (a Metaspace leading space) cuts where the released text ended.
        prefix = decode(self._last, skip_special_tokens=skip)
        full = decode(self._last + self._held, skip_special_tokens=skip)
        self._last, self._held = [], []
        self._stream = DecodeStream(skip_special_tokens=skip)
        return str(full[len(prefix) :])


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends in the last new_len characters of text.
    Returns (index where it starts, the stop string) or None. Stops may span tokens."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best

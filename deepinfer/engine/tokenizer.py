"""Tokenizer (the checkpoint's tokenizer.json via `tokenizers`), chat template and incremental
detokenisation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def read_json_file(path: Path) -> Any:
    """The JSON content of a checkpoint file, or a ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _token_content(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode, decode and chat-format with the files of a checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{file} is not a valid tokenizer file: {exc}") from exc
        cfg_file = path / "tokenizer_config.json"
        cfg = read_json_file(cfg_file) if cfg_file.is_file() else {}
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object")
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying tokenizers.Tokenizer (for libraries that read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """Render the conversation with the checkpoint's chat template (jinja2, sandboxed)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                f"the tokenizer in {self.path} has no chat template (tokenizer_config.json has no "
                "'chat_template'); pass chat_template=... or use generate() with a plain prompt"
            )
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        source = "the chat_template argument" if chat_template else f"{self.path}/tokenizer_config.json"
        try:
            compiled = env.from_string(template)
        except TemplateError as exc:
            raise ValueError(f"the chat template ({source}) does not compile: {exc}") from exc
        try:
            return compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:  # raise_exception(...) in the template, or a sandbox refusal
            raise ValueError(f"chat template failed ({source}): {exc}") from exc
        except Exception as exc:  # the template's own code: OverflowError, TypeError, ZeroDivisionError, ...
            raise ValueError(f"chat template failed ({source}): {type(exc).__name__}: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, a piece per new token.

    A token may end inside a multi-byte character, and byte-level BPE decodes it to U+FFFD until
    the rest arrives; so each step decodes a short window (prefix_offset..end) and emits only the
    text past the previous window once it no longer ends in U+FFFD. The concatenated pieces equal
    decoding all output tokens at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes to U+FFFD)."""
        prefix = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix) :]


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

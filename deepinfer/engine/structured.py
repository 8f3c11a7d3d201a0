"""Structured output: JSON schema, JSON object, regex, choice and EBNF grammars (xgrammar).

A request asks for one with SamplingParams(structured_outputs=StructuredOutputsParams(...)),
vLLM's names. The engine compiles the grammar once per request (xgrammar caches compiled
grammars) and gives the sequence a grammar matcher. Each step, before sampling, the matcher's
allowed-token bitmask (rows, ceil(V / 32)) int32 is applied to the request's logits through the
backend's `apply_token_bitmask` op; after sampling, the token advances the matcher. When the
grammar is complete the matcher allows only EOS; once it accepts it, the request finishes.

xgrammar is optional (pip install xgrammar, or deepinfer[structured]); a request that needs it
without it gets a ValueError saying so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, dict or string), json_object (any JSON object), regex,
    choice (one of these strings) or grammar (EBNF, xgrammar's GBNF dialect).
    disable_any_whitespace: JSON without free whitespace between tokens (compact output)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (dict or string), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(
            "structured output needs xgrammar: pip install xgrammar (or deepinfer[structured])"
        ) from exc
    return xgrammar


class StructuredOutputs:
    """One grammar compiler for the model's tokenizer; makes a matcher per request.
    vocab_size: the model's logits width (tokens past the tokenizer's vocabulary are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        # xgrammar reads the vocabulary and its encoding (byte-level, byte-fallback, raw) from the
        # Hugging Face tokenizer itself, as vLLM and SGLang do.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info)

    def matcher(self, p: StructuredOutputsParams) -> Any:
        """A fresh grammar matcher for one request; ValueError naming the problem if the schema,
        regex or grammar does not compile."""
        c = self._compiler
        try:
            ws = not p.disable_any_whitespace
            if p.json is not None:
                schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
                grammar = c.compile_json_schema(schema, any_whitespace=ws)
            elif p.json_object:
                grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
            elif p.regex is not None:
                grammar = c.compile_regex(p.regex)
            elif p.choice is not None:
                # json.dumps quotes and escapes each choice as an EBNF string literal
                grammar = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in p.choice))
            else:
                grammar = c.compile_grammar(p.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for bad input
            kind = next(
                (n for n in ("json", "regex", "choice", "grammar") if getattr(p, n) is not None), "json"
            )
            detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())  # xgrammar's log prefix
            raise ValueError(f"structured output: the {kind} does not compile: {detail}") from exc
        return self._xgr.GrammarMatcher(grammar)


def grammar_bitmask(matchers: list[Any], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(rows, ceil(V / 32)) int32 allowed-token masks; rows whose matcher is None allow all."""
    xgr = _xgrammar()
    mask: torch.Tensor = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # every bit set
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(mask, row)
    return mask.to(device)

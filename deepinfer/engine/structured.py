"""Structured output: JSON schema, JSON object, regex, choice and EBNF grammars (xgrammar).

A request asks for one with SamplingParams(structured_outputs=StructuredOutputsParams(...)),
vLLM's names. The engine compiles the grammar once per request (xgrammar caches compiled
grammars) and gives the sequence a grammar matcher. Each step, before sampling, the matcher's
allowed-token bitmask (rows, ceil(V / 32)) int32 is applied to the request's logits through the
backend's `apply_token_bitmask` op; after sampling, the token advances the matcher. When the
grammar is complete the matcher allows only EOS; once it accepts it, the request finishes.

Promises kept or refused: a JSON schema is checked before it is compiled (check_json_schema):
keywords xgrammar does not enforce (it would silently let violating output through: `not`,
`allOf`, `if` / `then` / `else`, `oneOf`'s exclusivity, `uniqueItems`, `contains`, the
`dependent*` keywords, `multipleOf` but for integers, `required` beyond the listed `properties`,
a `pattern` or `format` together with length bounds, an unknown `format`, constraints beside a
`$ref`) and schemas no value can meet
(`false`, a `const` or `enum` outside the schema's `type`, a `required` property that
`additionalProperties: false` forbids) are a ValueError naming the keyword and where it is. A
grammar that admits no first token (a regex that matches nothing) is refused when the request is
added (check_first_tokens). A finished output whose grammar completed is validated against the
promise (validate_output: jsonschema for a JSON schema, `re.fullmatch` for a regex); a violation
finishes the completion with finish_reason "error" and the reason in CompletionOutput.error.

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


# Keywords xgrammar 0.2.9 compiles but does not enforce (probed: it accepts violating output).
UNENFORCED_KEYWORDS = {
    "not": "xgrammar ignores it",
    "allOf": "xgrammar does not intersect the subschemas",
    "if": "xgrammar ignores conditional subschemas",
    "then": "xgrammar ignores conditional subschemas",
    "else": "xgrammar ignores conditional subschemas",
    "oneOf": "xgrammar treats it as anyOf (exactly-one is not enforced); use anyOf",
    "uniqueItems": "xgrammar ignores it",
    "contains": "xgrammar ignores it",
    "minContains": "xgrammar ignores it",
    "maxContains": "xgrammar ignores it",
    "dependentRequired": "xgrammar ignores it",
    "dependentSchemas": "xgrammar ignores it",
    "dependencies": "xgrammar ignores it",
}
# `format` values xgrammar generates (others are ignored).
SUPPORTED_FORMATS = frozenset(
    (
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    )
)  # fmt: skip
# Keywords that describe or name a schema without constraining values.
ANNOTATIONS = frozenset(
    ("$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
     "examples", "deprecated", "readOnly", "writeOnly", "$anchor")
)  # fmt: skip
# Subschema positions: keyword -> how its value holds schemas.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_JSON_TYPES: dict[str, Any] = {
    "null": type(None),
    "boolean": bool,
    "object": dict,
    "array": list,
    "string": str,
}


def _has_type(value: Any, name: str) -> bool:
    """Whether a JSON value is of JSON-schema type `name`."""
    if name in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return name == "number" or float(value).is_integer()
    kind = _JSON_TYPES.get(name)
    return (
        kind is not None and isinstance(value, kind) and not (name != "boolean" and isinstance(value, bool))
    )


def _check_schema_node(node: Any, where: str) -> None:
    """One subschema: refuse unenforced keywords and unsatisfiable combinations, then recurse."""
    if not isinstance(node, dict):
        return
    for key, why in UNENFORCED_KEYWORDS.items():
        if key in node and not (key == "uniqueItems" and node[key] is False):
            raise ValueError(
                f"structured output: JSON-schema keyword {key!r} at {where} is not supported ({why}); "
                "the output could violate the schema"
            )
    if "$ref" in node:
        extra = sorted(k for k in node if k not in ANNOTATIONS)
        if extra:
            raise ValueError(
                f"structured output: JSON-schema keyword {extra[0]!r} beside '$ref' at {where} is not "
                "supported (xgrammar follows the reference and ignores its siblings); move it into the "
                "referenced schema"
            )
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise ValueError(
            f"structured output: JSON-schema 'format' {fmt!r} at {where} is not supported (xgrammar "
            f"ignores it); supported: {', '.join(sorted(SUPPORTED_FORMATS))}"
        )
    if ("pattern" in node or fmt is not None) and ("minLength" in node or "maxLength" in node):
        length = "minLength" if "minLength" in node else "maxLength"
        raise ValueError(
            f"structured output: JSON-schema keyword {length!r} with 'pattern' / 'format' at {where} is "
            "not supported (xgrammar drops the length bound); put the length in the pattern"
        )
    step = node.get("multipleOf")
    if step is not None and not (node.get("type") == "integer" and isinstance(step, int)):
        raise ValueError(
            f"structured output: JSON-schema keyword 'multipleOf' {step!r} at {where} is not supported "
            "(xgrammar enforces it only for an integer multiple on 'type': 'integer')"
        )
    _check_satisfiable(node, where)
    props: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
    required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
    unlisted = [r for r in required if isinstance(r, str) and r not in props]
    if unlisted:
        raise ValueError(
            f"structured output: JSON-schema 'required' property {unlisted[0]!r} at {where} is not in "
            "'properties', and xgrammar enforces 'required' only for the properties listed; add it there"
        )
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check_schema_node(sub, f"{where}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check_schema_node(sub, f"{where}/{key}/{i}")
    for key in _SUBSCHEMAS:
        if key in node:
            _check_schema_node(node[key], f"{where}/{key}")


def _check_satisfiable(node: dict[str, Any], where: str) -> None:
    """Refuse the combinations no value can meet that a glance at one node shows."""
    types = node.get("type")
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if names is not None and "const" in node and not any(_has_type(node["const"], t) for t in names):
        raise ValueError(
            f"structured output: JSON-schema 'const' {node['const']!r} at {where} is not of its 'type' "
            f"{types!r}: no value meets the schema"
        )
    enum = node.get("enum")
    if names is not None and isinstance(enum, list) and not any(_has_type(v, t) for v in enum for t in names):
        raise ValueError(
            f"structured output: no JSON-schema 'enum' value at {where} is of its 'type' {types!r}: "
            "no value meets the schema"
        )
    props: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
    required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
    if node.get("additionalProperties") is False:
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(
                f"structured output: JSON-schema 'required' property {missing[0]!r} at {where} is not in "
                "'properties' and 'additionalProperties' is false: no object meets the schema"
            )
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems")):
        a, b = node.get(low), node.get(high)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
            raise ValueError(
                f"structured output: JSON-schema {low!r} ({a}) exceeds {high!r} ({b}) at {where}: no value "
                "meets the schema"
            )


def json_schema(p: StructuredOutputsParams) -> Any:
    """The JSON schema of a json / json_object request as a Python value (None for the other
    kinds); ValueError if a string schema is not JSON."""
    if p.json_object:
        return {"type": "object"}
    if p.json is None:
        return None
    if isinstance(p.json, dict):
        return p.json
    try:
        return json.loads(p.json)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValueError(
            f"structured output: the json does not compile: it is not valid JSON: {exc}"
        ) from exc


def check_json_schema(schema: Any) -> None:
    """Refuse a JSON schema xgrammar cannot enforce or no value meets, naming the keyword and
    its place (a JSON pointer: `#/properties/name`)."""
    if schema is True:
        return
    if schema is False:  # (`false` inside a schema forbids a property or an item: satisfiable)
        raise ValueError("structured output: the JSON schema is `false`: no value meets it")
    try:
        _check_schema_node(schema, "#")
    except RecursionError:
        raise ValueError("structured output: the JSON schema is nested too deeply to check") from None
    if isinstance(schema, dict):
        try:
            from jsonschema import validators
        except ImportError:
            return  # the checks above still ran; outputs are not validated without jsonschema
        cls = validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except Exception as exc:  # jsonschema.SchemaError
            detail = getattr(exc, "message", str(exc))
            raise ValueError(
                f"structured output: the json does not compile: it is not a valid JSON schema: {detail}"
            ) from exc


def validate_output(p: StructuredOutputsParams, text: str) -> str | None:
    """Why a finished output breaks its structured-output promise (None: it keeps it). JSON is
    checked with jsonschema (where it is installed), a regex with re.fullmatch, a choice by
    membership; an EBNF grammar is what xgrammar enforces."""
    if p.regex is not None:
        try:
            ok = re.fullmatch(p.regex, text) is not None
        except re.error:  # a pattern xgrammar reads but Python's re does not: not checked
            return None
        return None if ok else f"the output {_clip(text)} does not match the regex {p.regex!r}"
    if p.choice is not None:
        return None if text in p.choice else f"the output {_clip(text)} is none of the choices"
    schema = json_schema(p)
    if schema is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the output {_clip(text)} is not JSON: {exc}"
    except RecursionError:
        return f"the output {_clip(text)} is nested too deeply to parse and validate"
    try:
        from jsonschema import validators
    except ImportError:
        return None
    cls = validators.validator_for(schema) if isinstance(schema, dict) else validators.Draft202012Validator
    try:
        error = next(iter(cls(schema).iter_errors(value)), None)
    except RecursionError:
        return f"the output {_clip(text)} is nested too deeply to validate"
    if error is None:
        return None
    at = "/".join(str(x) for x in error.absolute_path)
    return f"the output {_clip(text)} violates the JSON schema at #/{at}: {error.message}"


def _clip(text: str) -> str:
    return repr(text) if len(text) <= 120 else repr(text[:120]) + "..."


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
        schema = json_schema(p) if p.json is not None else None
        if schema is not None:
            check_json_schema(schema)
        try:
            ws = not p.disable_any_whitespace
            if p.json is not None:
                grammar = c.compile_json_schema(json.dumps(json_schema(p)), any_whitespace=ws)
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


def check_first_tokens(matcher: Any, vocab_size: int, allowed: list[int] | None) -> None:
    """At add time: ValueError when a fresh grammar admits no first token at all (e.g. a regex
    that matches nothing), or none of allowed_token_ids."""
    xgr = _xgrammar()
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    ok = bitmask_tokens(mask[0], vocab_size)
    if not ok.any():
        raise ValueError(
            "structured output: the grammar admits no output at all (a regex that matches nothing?)"
        )
    if allowed is not None and not ok[torch.tensor(allowed, dtype=torch.long)].any():
        raise ValueError(
            "allowed_token_ids and structured_outputs leave no token to sample: none of the allowed "
            "tokens can start the output the grammar asks for"
        )


def bitmask_tokens(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) bool: the tokens a host (ceil(V / 32),) int32 bitmask row allows."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((row[:, None] >> bits) & 1).flatten()[:vocab_size].bool()


def grammar_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """(rows, ceil(V / 32)) int32 allowed-token masks on the host; rows whose matcher is None
    allow all."""
    xgr = _xgrammar()
    mask: torch.Tensor = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # every bit set
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(mask, row)
    return mask

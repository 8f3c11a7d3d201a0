"""Structured output (xgrammar) through LLM.generate on the tiny model (random weights, so the
grammar alone makes the output well-formed): JSON schema, JSON object, regex, choice, EBNF;
masks confined to their own rows; bad schemas and parameters give clear errors and the engine
keeps serving."""

from __future__ import annotations

import json
import re
import sys

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install xgrammar)")

PROMPTS = ["The weather", "Hello", "Numbers: 1, 2,"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(TINY), backend="reference", dtype="float32", max_model_len=256)


def generate(
    llm: LLM, so: StructuredOutputsParams, max_tokens: int = 96, **kw: object
) -> list[tuple[str, str]]:
    """(text, finish_reason) per prompt, greedy and sampled."""
    outs = []
    for params in (
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw),  # type: ignore[arg-type]
        SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, structured_outputs=so, **kw),  # type: ignore[arg-type]
    ):
        for r in llm.generate(PROMPTS, params, use_tqdm=False):
            outs.append((r.outputs[0].text, str(r.outputs[0].finish_reason)))
    return outs


def test_regex(llm: LLM) -> None:
    pattern = r"[a-z]{2,4}-[0-9]{2}( ok)?"
    for text, reason in generate(llm, StructuredOutputsParams(regex=pattern)):
        assert reason == "stop" and re.fullmatch(pattern, text), text


def test_choice(llm: LLM) -> None:
    choices = ["yes", "no", 'say "maybe"', "back\\slash"]
    for text, reason in generate(llm, StructuredOutputsParams(choice=choices)):
        assert reason == "stop" and text in choices, text


def test_json_schema(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            # (xgrammar 0.2.9 lets raw control characters into strings under "maxLength", which
            # strict JSON forbids; a pattern keeps this test about the engine)
            "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["a", "b"]},
        },
        "required": ["name", "ok", "kind"],
        "additionalProperties": False,
    }
    for text, reason in generate(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True)):
        assert reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"name", "ok", "kind"}, text
        assert re.fullmatch("[a-z]{1,5}", value["name"]), text
        assert isinstance(value["ok"], bool) and value["kind"] in ("a", "b")


def close_json_prefix(text: str) -> str:
    """`text` completed into a JSON text if it is a prefix of one: close an open string (and a
    cut escape), finish a cut literal or number, give a dangling key or ':' or ',' a value, close
    the open containers. json.loads of the result fails when `text` is no such prefix."""
    stack: list[str] = []
    after = "start"  # the last thing read: start, open, key, colon, comma, value
    in_string = key = False
    escape, hex_left, bare = False, 0, ""
    for ch in text:
        if in_string:
            if hex_left:
                hex_left -= 1
            elif escape:
                escape, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string, after = False, "key" if key else "value"
            continue
        if bare and ch in ' \t\r\n,:]}"[{':
            bare, after = "", "value"
        if ch == '"':
            in_string, key = True, bool(stack) and stack[-1] == "{" and after in ("open", "comma")
        elif ch in "[{":
            stack.append(ch)
            after = "open"
        elif ch in "]}":
            stack.pop() if stack else None
            after = "value"
        elif ch == ":":
            after = "colon"
        elif ch == ",":
            after = "comma"
        elif ch not in " \t\r\n":
            bare += ch
    tail = ""
    if in_string:
        tail += ("0" * hex_left) + ("n" if escape else "") + '"'
        after = "key" if key else "value"
    elif bare:
        literal = next((w for w in ("true", "false", "null") if w.startswith(bare)), None)
        tail += literal[len(bare) :] if literal else ("0" if bare[-1] in "-+.eE" else "")
        after = "value"
    if after == "key":
        tail += ":null"
    elif after == "colon" or (after == "comma" and stack and stack[-1] == "["):
        tail += "null"
    elif after == "comma":
        tail += '"":null'
    return text + tail + "".join("}" if c == "{" else "]" for c in reversed(stack))


def test_close_json_prefix() -> None:
    """The helper closes every prefix of JSON objects and keeps invalid text invalid."""
    value = {
        "a": [1, -2.5e-3, True, False, None, 'x"y\\z\u00e9\n', {"b": {}}, []],
        "c": "\U0001f600",
        "": 0.0,
    }
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=1)):
        for i in range(1, len(text) + 1):
            assert isinstance(json.loads(close_json_prefix(text[:i])), dict), text[:i]
    for bad in ['{"a" 1', "{1", '{"a":1 "b"', "{]", '{"a":tx', '{"a":1}x', '{"a":--1']:
        with pytest.raises(json.JSONDecodeError):
            json.loads(close_json_prefix(bad))


def test_json_object_and_grammar(llm: LLM) -> None:
    # a JSON object: a finished output parses as one; one cut by max_tokens is a prefix of one (it
    # parses once its open string, literal and containers are closed)
    for text, reason in generate(llm, StructuredOutputsParams(json_object=True), max_tokens=40):
        assert text.startswith("{"), text
        what = "a JSON object" if reason == "stop" else "a prefix of a JSON object"
        try:
            value = json.loads(text if reason == "stop" else close_json_prefix(text))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"finish_reason {reason}: not {what}: {exc}: {text!r}") from exc
        assert isinstance(value, dict), text
    for text, reason in generate(llm, StructuredOutputsParams(grammar='root ::= "a" ("b" | "c") "d" [0-9]')):
        assert reason == "stop" and re.fullmatch("a[bc]d[0-9]", text), text


def test_masks_stay_in_their_rows(llm: LLM) -> None:
    """A plain request next to structured ones gets the tokens it gets alone."""
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Hello"], plain, use_tqdm=False)[0].outputs[0].token_ids
    so = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    outs = llm.generate(["The weather", "Hello", "Numbers"], [so, plain, so], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    for i in (0, 2):
        assert re.fullmatch("[0-9]+", outs[i].outputs[0].text), outs[i].outputs[0].text


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputsParams(regex="[a-z"), "the regex does not compile: .*Unclosed"),
        (StructuredOutputsParams(json='{"type": "objec"}'), "the json does not compile: .*objec"),
        (StructuredOutputsParams(json="{not json"), "the json does not compile"),
        (StructuredOutputsParams(grammar="root ::= x"), 'the grammar does not compile: .*"x" is not defined'),
    ],
)
def test_bad_grammar_is_a_clear_error_and_the_engine_keeps_serving(
    llm: LLM, so: StructuredOutputsParams, message: str
) -> None:
    plain = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(["Hello"], plain, use_tqdm=False)[0].outputs[0].token_ids
    bad = SamplingParams(temperature=0, max_tokens=8, structured_outputs=so)
    with pytest.raises(ValueError, match="prompt 1: structured output: " + message):
        llm.generate(["Hello", "Hi"], [plain, bad], use_tqdm=False)
    assert llm.generate(["Hello"], plain, use_tqdm=False)[0].outputs[0].token_ids == before


def test_bad_parameters() -> None:
    with pytest.raises(
        ValueError, match="exactly one of json, json_object, regex, choice or grammar; got none"
    ):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def test_without_xgrammar_a_structured_request_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(TINY), backend="reference", dtype="float32", max_model_len=64)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    so = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="structured output needs xgrammar: pip install xgrammar"):
        llm.generate(["Hello"], so, use_tqdm=False)
    assert (
        len(
            llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 4
    )

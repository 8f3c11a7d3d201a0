"""LLM.chat renders with transformers' apply_chat_template: on the same files and messages the
prompt token ids equal transformers' own (chat_template.jinja next to the checkpoint, DeepSeek's
thinking switch, continue_final_message, add_generation_prompt, tools, tool-call turns with
content None, OpenAI content parts), and get_tokenizer() is transformers' tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_model import TINY
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deepinfer import LLM, SamplingParams

# DeepSeek-V3.1-like: system prompt first, then the tools, a <think> switch after the assistant tag.
TEMPLATE = """\
{%- if thinking is not defined %}{% set thinking = false %}{% endif -%}
{%- macro text(content) -%}
{%- if content is string %}{{ content }}{% else %}{% for part in content if part['type'] == 'text' %}\
{{ part['text'] }}{% endfor %}{% endif -%}
{%- endmacro -%}
{{ bos_token }}
{%- for message in messages if message['role'] == 'system' %}{{ text(message['content']) }}{% endfor %}
{%- if tools %}
{{- '\\n\\n## Tools\\n' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{ '<｜User｜>' + text(message['content']) }}
{%- elif message['role'] == 'assistant' %}
{{- '<｜Assistant｜></think>' }}
{%- if message['content'] is defined %}{{ text(message['content']) }}{% endif %}
{%- for call in message['tool_calls'] | default([]) %}
{%- set args = call['function']['arguments'] %}
{%- set args = args if args is string else args | tojson %}
{{- '<tool_call>' + call['function']['name'] + '(' + args + ')</tool_call>' }}
{%- endfor %}
{{- eos_token }}
{%- elif message['role'] == 'tool' %}{{ '<tool_output>' + text(message['content']) + '</tool_output>' }}
{%- elif message['role'] != 'system' %}{{ raise_exception('unknown role: ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SIMPLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "sunny"},
]
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "The weather "}, {"type": "text", "text": "today?"}],
    },
]
PREFILL = [*SIMPLE, {"role": "assistant", "content": "The weather today is"}]

CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "generation prompt": (SIMPLE, {}),
    "thinking on": (SIMPLE, {"chat_template_kwargs": {"thinking": True}}),
    "thinking off": (SIMPLE, {"chat_template_kwargs": {"thinking": False}}),
    "no generation prompt": (SIMPLE, {"add_generation_prompt": False}),
    "continue final message": (PREFILL, {"add_generation_prompt": False, "continue_final_message": True}),
    "tools and a tool-call turn": (TOOL_TURNS, {"tools": TOOLS}),
    "tool-call turn, no tools": (TOOL_TURNS, {}),
    "content parts": (PARTS, {"chat_template_kwargs": {"thinking": True}}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a chat_template.jinja (tokenizer_config.json keeps its own template:
    the file wins, as in transformers)."""
    root = Path(shutil.copytree(TINY, tmp_path_factory.mktemp("chat") / "tiny"))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return root


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        backend="reference",
        dtype="float32",
        block_size=16,
        max_model_len=512,
        num_gpu_blocks_override=80,
    )


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer over the same files (not the engine's object)."""
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def transformers_ids(hf: PreTrainedTokenizerBase, conv: list[dict[str, Any]], **kw: Any) -> list[int]:
    kw = {"add_generation_prompt": True, **kw}
    kw.update(kw.pop("chat_template_kwargs", {}))
    return list(hf.apply_chat_template(conv, tokenize=True, return_dict=False, **kw))  # type: ignore[arg-type]


GREEDY_1 = SamplingParams(temperature=0, max_tokens=1)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_ids_equal_transformers(llm: LLM, hf: PreTrainedTokenizerBase, case: str) -> None:
    conv, kw = CASES[case]
    out = llm.chat(conv, GREEDY_1, use_tqdm=False, **kw)[0]
    expected = transformers_ids(hf, conv, **kw)
    assert out.prompt_token_ids == expected
    assert out.prompt == hf.decode(expected)
    assert len(out.outputs[0].token_ids) == 1


def test_the_features_change_the_prompt(llm: LLM) -> None:
    """The cases above are not all the same prompt: each argument reaches the template."""
    prompts = {c: llm.chat(conv, GREEDY_1, use_tqdm=False, **kw)[0].prompt for c, (conv, kw) in CASES.items()}
    assert len(set(prompts.values())) == len(prompts) - 1  # "thinking off" is the default
    assert prompts["thinking on"].endswith("<｜Assistant｜><think>")
    assert prompts["generation prompt"].endswith("<｜Assistant｜></think>")
    assert prompts["no generation prompt"].endswith("What is the weather?")
    assert prompts["continue final message"].endswith("<｜Assistant｜></think>The weather today is")
    assert '"name": "get_weather"' in prompts["tools and a tool-call turn"]
    assert '<tool_call>get_weather({"city": "Paris"})</tool_call>' in prompts["tool-call turn, no tools"]
    assert "The weather today?" in prompts["content parts"]


def test_a_list_of_conversations(llm: LLM, hf: PreTrainedTokenizerBase) -> None:
    convs = [SIMPLE, PARTS, TOOL_TURNS]
    outs = llm.chat(convs, GREEDY_1, use_tqdm=False, tools=TOOLS)
    assert [o.prompt_token_ids for o in outs] == [transformers_ids(hf, c, tools=TOOLS) for c in convs]


def test_chat_template_argument(llm: LLM, hf: PreTrainedTokenizerBase) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    out = llm.chat(SIMPLE, GREEDY_1, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "[system]Be brief.[user]What is the weather?"
    assert out.prompt_token_ids == transformers_ids(hf, SIMPLE, chat_template=template)


def test_get_tokenizer_is_transformers_tokenizer(
    llm: LLM, model_dir: Path, hf: PreTrainedTokenizerBase
) -> None:
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase) and tok.is_fast
    assert tok.chat_template == TEMPLATE == hf.chat_template
    out = llm.generate(["The weather today"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("The weather today")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_bad_chat_input_is_a_clear_error_and_the_engine_keeps_serving(llm: LLM) -> None:
    jinja = r"chat template failed \(.*chat_template\.jinja\)"
    with pytest.raises(ValueError, match=jinja + ": unknown role: robot"):
        llm.chat([{"role": "robot", "content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compat"):
        llm.chat(PREFILL, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        llm.chat(SIMPLE, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match=r"messages must be .*message 1 \(tool\) has no 'content'"):
        llm.chat([SIMPLE[1], {"role": "tool", "content": None}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"the chat_template argument\): ZeroDivisionError"):
        llm.chat(SIMPLE, use_tqdm=False, chat_template="{{ 1 // 0 }}")
    assert not llm.llm_engine.has_unfinished()
    assert llm.chat(SIMPLE, GREEDY_1, use_tqdm=False)[0].outputs[0].finish_reason in ("length", "stop")

"""Scripts written the way vLLM's documentation writes them run on deepinfer with only the import
changed (and the model named: the shipped model/tiny).

Each script below is vLLM's offline example as its docs show it (basic generation, with the
model's default sampling parameters too, chat, chat with content parts and tools, token prompts
as an evaluation harness passes them, several completions with log-probabilities, structured
outputs, prefix caching, metrics); the test swaps `vllm` for `deepinfer` in the imports, runs the script
in this process and checks what it printed and returned.
"""

from __future__ import annotations

import json
import re
import runpy
import shutil
from pathlib import Path
from typing import Any

import pytest

MODEL = str(Path(__file__).resolve().parents[1] / "model" / "tiny")

BASIC = """
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)


def main():
    llm = LLM(model=MODEL)
    outputs = llm.generate(prompts, sampling_params)
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    return outputs


RESULT = main()
"""

CHAT = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(temperature=0.5, max_tokens=16)
conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
conversations = [conversation for _ in range(3)]
RESULT = llm.chat(conversations, sampling_params, use_tqdm=True)
"""

BASIC_DEFAULTS = """
from vllm import LLM

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main():
    llm = LLM(model=MODEL)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 8
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\\nGenerated text: {generated_text!r}")
        print("-" * 50)
    return sampling_params, outputs


RESULT = main()
"""

# examples/offline_inference/chat_with_tools.py, with a user turn of content parts; the tiny model
# does not call tools, so the call a tool-calling model would reply with is written out
CHAT_WITH_TOOLS = """
import json
import random
import string

from vllm import LLM
from vllm.sampling_params import SamplingParams

sampling_params = SamplingParams(max_tokens=8, temperature=0)
llm = LLM(model=MODEL)


def generate_random_id(length=9):
    characters = string.ascii_letters + string.digits
    return "".join(random.choice(characters) for _ in range(length))


def get_current_weather(city: str, state: str, unit: "str"):
    return (
        f"The weather in {city}, {state} is 85 degrees {unit}. It is partly cloudly, with highs in the 90's."
    )


tool_functions = {"get_current_weather": get_current_weather}
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city to find the weather for"},
                    "state": {"type": "string", "description": "the two-letter abbreviation for the state"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "state", "unit"],
            },
        },
    }
]
messages = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Hi! How are you doing today?"},
            {"type": "text", "text": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"},
        ],
    }
]
outputs = llm.chat(messages, sampling_params=sampling_params, tools=tools)
output = outputs[0].outputs[0].text.strip()
tool_calls = [
    {"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}
]
messages.append(
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": generate_random_id(),
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
            for call in tool_calls
        ],
    }
)
for call in tool_calls:
    result = tool_functions[call["name"]](**call["arguments"])
    messages.append({"role": "tool", "content": result, "tool_call_id": generate_random_id()})
outputs = llm.chat(messages, sampling_params, tools=tools)
print(outputs[0].outputs[0].text.strip())
RESULT = outputs
"""

# a harness's call (lm-evaluation-harness, OpenCompass): token prompts, no LoRA, equal priorities
HARNESS = """
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput

llm = LLM(model=MODEL)
tokenizer = llm.get_tokenizer()
requests = [tokenizer.encode(text) for text in ["The capital of France is", "2 + 2 ="]]
outputs = llm.generate(
    [TokensPrompt(prompt_token_ids=ids) for ids in requests],
    sampling_params=SamplingParams(temperature=0, max_tokens=6),
    use_tqdm=False,
    lora_request=None,
    priority=[0] * len(requests),
)
assert all(isinstance(o, RequestOutput) for o in outputs)
RESULT = requests, outputs
"""

# examples/offline_inference/prefix_caching.py, without cleanup_dist_env_and_memory (vLLM's
# distributed state; deepinfer has none) and with dtype="float32": in bfloat16 a prompt whose
# prefix comes from the cache is computed in another split than one computed whole, the last bits
# of its logits differ, and a greedy near-tie may go the other way (measured: one of the four
# prompts, at its 10th token)
PREFIX_CACHING = """
from vllm import LLM, SamplingParams

prefix = (
    "You are an expert school principal, skilled in effectively managing "
    "faculty and staff. Draft 10-15 questions for a potential first grade "
    "Head Teacher for my K-12, all-girls', independent school that emphasizes "
    "community, joyful discovery, and life-long learning. The candidate is "
    "coming in for a first-round panel interview for a 8th grade Math "
    "teaching role. They have 5 years of previous teaching experience "
    "as an assistant teacher at a co-ed, public school with experience "
    "in middle school math teaching. Based on these information, fulfill "
    "the following paragraph: "
)
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
generating_prompts = [prefix + prompt for prompt in prompts]
sampling_params = SamplingParams(temperature=0.0)


def main():
    regular_llm = LLM(model=MODEL, gpu_memory_utilization=0.4, dtype="float32")
    print("Results without `enable_prefix_caching`")
    outputs = regular_llm.generate(generating_prompts, sampling_params)
    regular_generated_texts = []
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        regular_generated_texts.append(generated_text)
        print(f"Prompt: {prompt!r}\\nGenerated text: {generated_text!r}")
    del regular_llm
    prefix_cached_llm = LLM(
        model=MODEL, enable_prefix_caching=True, gpu_memory_utilization=0.4, dtype="float32"
    )
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
    cached_generated_texts = []
    for output in outputs:
        cached_generated_texts.append(output.outputs[0].text)
    generated_same = all(
        regular_generated_texts[i] == cached_generated_texts[i] for i in range(len(prompts))
    )
    print(f"Generated answers are the same: {generated_same}")
    return outputs


RESULT = main()
"""

# the beam search of vLLM's documentation (offline inference, "Beam search")
BEAM_SEARCH = """
from vllm import LLM
from vllm.sampling_params import BeamSearchParams

llm = LLM(model=MODEL)
params = BeamSearchParams(beam_width=3, max_tokens=10)
outputs = llm.beam_search([{"prompt": "Hello, my name is "}], params)
for output in outputs:
    generated_text = output.sequences[0].text
    print(f"Generated text: {generated_text!r}")
RESULT = outputs
"""

LOGPROBS = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, max_logprobs=20)
sampling_params = SamplingParams(n=2, temperature=0.8, max_tokens=8, logprobs=3, prompt_logprobs=1, seed=0)
outputs = llm.generate(["def fibonacci(n):"], sampling_params)
for output in outputs:
    for completion in output.outputs:
        for position in completion.logprobs:
            for token_id, logprob in position.items():
                print(token_id, logprob.logprob, logprob.rank, logprob.decoded_token)
RESULT = outputs
"""

STRUCTURED = """
from enum import Enum

from pydantic import BaseModel
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


json_schema = CarDescription.model_json_schema()
llm = LLM(model=MODEL, max_model_len=512)
choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\\w+@\\w+\\.com\\n"), stop=["\\n"])
as_json = SamplingParams(
    structured_outputs=StructuredOutputsParams(json=json_schema, disable_any_whitespace=True), max_tokens=300
)
RESULT = [
    llm.generate("Classify this sentiment: vLLM is wonderful!", choice)[0].outputs[0],
    llm.generate("Generate an example email address for Alan Turing: ", regex)[0].outputs[0],
    llm.generate("Generate a JSON with the brand, model and car_type of a car", as_json)[0].outputs[0],
]
"""

# vLLM's offline metrics example (examples/offline_inference/metrics.py)
METRICS = """
from vllm import LLM, SamplingParams
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=MODEL, disable_log_stats=False)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\\nGenerated text: {generated_text!r}")
        print("-" * 50)
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            print(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, Counter):
            print(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, Vector):
            print(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, Histogram):
            print(f"{metric.name} (histogram)")
            print(f"    sum = {metric.sum}")
            print(f"    count = {metric.count}")
            for bucket_le, value in metric.buckets.items():
                print(f"    {bucket_le} = {value}")
    return outputs


RESULT = main()
"""


def run_as_deepinfer(script: str, tmp_path: Path, model: str = MODEL) -> Any:
    """Swap the imports (the only change a user makes) and run the script as __main__."""
    text = script.replace("from vllm.", "from deepinfer.").replace(
        "from vllm import", "from deepinfer import"
    )
    assert "from vllm" not in text and "import vllm" not in text
    path = tmp_path / "script.py"
    path.write_text(text)
    return runpy.run_path(str(path), init_globals={"MODEL": model}, run_name="__main__")["RESULT"]


def test_basic_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = run_as_deepinfer(BASIC, tmp_path)
    printed = capsys.readouterr().out
    assert len(outputs) == 4 and outputs[0].prompt == "Hello, my name is"
    for o in outputs:
        assert len(o.outputs) == 1 and o.outputs[0].token_ids and o.finished
        assert f"Output:    {o.outputs[0].text!r}" in printed


def test_basic_generation_with_the_models_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params, outputs = run_as_deepinfer(BASIC_DEFAULTS, tmp_path)
    gen = json.loads((Path(MODEL) / "generation_config.json").read_text())
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        gen["temperature"],
        gen["top_p"],
        gen["top_k"],
        gen["repetition_penalty"],
    )
    printed = capsys.readouterr().out
    for o in outputs:
        assert 1 <= len(o.outputs[0].token_ids) <= 8 and f"Generated text: {o.outputs[0].text!r}" in printed


# DeepSeek-style, with the tools and the tool calls printed as JSON (|tojson)
TOOL_TEMPLATE = """\
{{ bos_token }}{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (message['content'] or '') }}
{%- for call in message['tool_calls'] | default([]) %}
{{- '<｜tool▁call▁begin｜>' + call['function']['name'] + '\\n' + (call['function']['arguments'] | tojson) }}
{{- '<｜tool▁call▁end｜>' }}
{%- endfor %}{{ eos_token }}
{%- elif message['role'] == 'tool' %}
{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
{%- endif %}
{%- endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"""


def test_chat_with_content_parts_and_tools(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(MODEL, model)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    (output,) = run_as_deepinfer(CHAT_WITH_TOOLS, tmp_path, str(model))
    prompt = output.prompt
    # the text parts joined by a newline (vLLM's "string" content format)
    assert "<｜User｜>Hi! How are you doing today?\nCan you tell me what the temperate" in prompt
    # the arguments sent as a JSON string reach the template as the object: printed as JSON once
    arguments = json.dumps({"city": "Dallas", "state": "TX", "unit": "fahrenheit"})
    assert f"<｜tool▁call▁begin｜>get_current_weather\n{arguments}<｜tool▁call▁end｜>" in prompt
    assert '\\"city' not in prompt
    assert "<｜tool▁output▁begin｜>The weather in Dallas, TX is 85 degrees fahrenheit." in prompt
    assert prompt.endswith("<｜tool▁output▁end｜><｜Assistant｜>") and output.outputs[0].token_ids


def test_harness_token_prompts(tmp_path: Path) -> None:
    requests, outputs = run_as_deepinfer(HARNESS, tmp_path)
    assert [o.prompt_token_ids for o in outputs] == requests
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)


def test_prefix_caching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = run_as_deepinfer(PREFIX_CACHING, tmp_path)
    assert "Generated answers are the same: True" in capsys.readouterr().out
    # the shared prefix was served from the cache (whole blocks of it)
    assert all(o.num_cached_tokens > 0 for o in outputs)


def test_beam_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (output,) = run_as_deepinfer(BEAM_SEARCH, tmp_path)
    assert len(output.sequences) == 3 and len({tuple(s.tokens) for s in output.sequences}) == 3
    best = output.sequences[0]
    assert f"Generated text: {best.text!r}" in capsys.readouterr().out
    # best first: the scores (cumulative log-probability / length) do not rise
    scores = [s.cum_logprob / len(s.tokens) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    for s in output.sequences:
        assert len(s.logprobs) == 10 and s.cum_logprob == pytest.approx(
            sum(step[t].logprob for step, t in zip(s.logprobs, s.tokens[-10:], strict=True))
        )


def test_chat(tmp_path: Path) -> None:
    outputs = run_as_deepinfer(CHAT, tmp_path)
    assert len(outputs) == 3
    # the chat template's rendering: the last user turn then the assistant's tag
    assert outputs[0].prompt.endswith(
        "Write an essay about the importance of higher education.<｜Assistant｜>"
    )
    assert all(o.outputs[0].token_ids for o in outputs)


def test_several_completions_with_logprobs(tmp_path: Path) -> None:
    (output,) = run_as_deepinfer(LOGPROBS, tmp_path)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token_id in position and 3 <= len(position) <= 4  # the top 3, plus the sampled one
            # ranks 1, 2, 3 down the log-probabilities; a token tied with the one above it may
            # share its rank (the sampled token's rank is 1 + the tokens strictly more likely)
            top = sorted(
                (lp for t, lp in position.items() if t != token_id or lp.rank <= 3),
                key=lambda lp: (-lp.logprob, lp.rank),
            )[:3]
            assert top[0].rank == 1
            for i in (1, 2):
                tied = top[i].logprob == top[i - 1].logprob
                assert top[i].rank == i + 1 or (tied and top[i - 1].rank <= top[i].rank <= i + 1)
            assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)


def test_structured_outputs(tmp_path: Path) -> None:
    pytest.importorskip("pydantic")
    sentiment, email, car = run_as_deepinfer(STRUCTURED, tmp_path)
    assert sentiment.text in ("Positive", "Negative")
    if email.finish_reason == "stop":  # the grammar's end: the whole address (the "\n" is the stop string)
        assert re.fullmatch(r"\w+@\w+\.com", email.text), email.text
    else:  # vLLM's default max_tokens (16) may cut it: a prefix the grammar allows
        assert email.finish_reason == "length"
        assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", email.text), email.text
    assert car.finish_reason == "stop"
    parsed = json.loads(car.text)
    assert set(parsed) == {"brand", "model", "car_type"} and parsed["car_type"] in ("sedan", "SUV")


def test_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = run_as_deepinfer(METRICS, tmp_path)
    printed = capsys.readouterr().out
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    assert f"vllm:generation_tokens (counter) = {generated}" in printed
    assert f"vllm:prompt_tokens (counter) = {prompt}" in printed
    assert "vllm:kv_cache_usage_perc (gauge) = " in printed
    assert (
        "vllm:time_to_first_token_seconds (histogram)\n    sum = " in printed and "    count = 4" in printed
    )

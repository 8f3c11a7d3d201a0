"""Scripts written the way vLLM's documentation writes them run on deepinfer with only the import
changed (and the model named: the shipped model/tiny).

Each script below is vLLM's offline example as its docs show it (basic generation, chat, several
completions with log-probabilities, structured outputs); the test swaps `vllm` for `deepinfer`
in the imports, runs the script in this process and checks what it printed and returned.
"""

from __future__ import annotations

import json
import re
import runpy
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


def run_as_deepinfer(script: str, tmp_path: Path) -> Any:
    """Swap the imports (the only change a user makes) and run the script as __main__."""
    text = script.replace("from vllm.sampling_params import", "from deepinfer import").replace(
        "from vllm import", "from deepinfer import"
    )
    assert "vllm import" not in text
    path = tmp_path / "script.py"
    path.write_text(text)
    return runpy.run_path(str(path), init_globals={"MODEL": MODEL}, run_name="__main__")["RESULT"]


def test_basic_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = run_as_deepinfer(BASIC, tmp_path)
    printed = capsys.readouterr().out
    assert len(outputs) == 4 and outputs[0].prompt == "Hello, my name is"
    for o in outputs:
        assert len(o.outputs) == 1 and o.outputs[0].token_ids and o.finished
        assert f"Output:    {o.outputs[0].text!r}" in printed


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

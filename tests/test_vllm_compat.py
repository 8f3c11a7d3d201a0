"""What a script or an evaluation harness written for vLLM's `LLM` meets on deepinfer (issue 40):
the model's default sampling parameters, lora_request / priority arguments, vLLM's import paths,
OpenAI content parts and tool-call arguments, use_tqdm callables, the application's log level,
SamplingParams' positional order, prompt keys and the pooling calls deepinfer does not have.
Each either works as in vLLM or is an error that names the problem (docs/vllm.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tqdm import tqdm
from transformers import AutoTokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.run_batch import run_batch
from deepinfer.log import LOGGER_NAME, _StderrHandler, configure_logging

MODEL = Path(__file__).resolve().parents[1] / "model" / "tiny"
SMALL = {"backend": "reference", "max_model_len": 128, "block_size": 16, "enforce_eager": True}
GREEDY = SamplingParams(temperature=0, max_tokens=4)
# A template that prints tool calls with |tojson (as Llama's and Qwen's do): a string argument
# would be printed as a JSON string of JSON.
TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] | default([]) %}[{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(MODEL), **SMALL)


def ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# --------------------------------------------------------------------------- 1. default sampling params


def test_default_sampling_params_are_the_models_generation_config(llm: LLM) -> None:
    gen = json.loads((MODEL / "generation_config.json").read_text())
    expected = SamplingParams(
        temperature=gen["temperature"],
        top_p=gen["top_p"],
        top_k=gen["top_k"],
        repetition_penalty=gen["repetition_penalty"],
        max_tokens=gen["max_new_tokens"],
    )
    params = llm.get_default_sampling_params()
    assert params == expected and params != SamplingParams()
    params.max_tokens = 3  # a new object each call: a script's change stays in its own
    assert llm.get_default_sampling_params() == expected
    plain = LLM(str(MODEL), **SMALL, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


# --------------------------------------------------------------------------- 2. lora_request, priority


def test_lora_request_none_and_equal_priorities_change_nothing(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The capital of France is"]
    plain = ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=None, priority=[0, 0])) == plain
    assert ids(llm.generate(prompts, GREEDY, False, None, 3)) == plain  # vLLM's positional order
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, None])) == plain
    conv = [{"role": "user", "content": "Hi"}]
    assert ids(llm.chat(conv, GREEDY, use_tqdm=False, lora_request=None, priority=[1])) == ids(
        llm.chat(conv, GREEDY, use_tqdm=False)
    )


def test_lora_and_different_priorities_are_refused(llm: LLM) -> None:
    prompts = ["a", "b"]
    with pytest.raises(ValueError, match=r"LoRA adapters are not supported.*lora_request=None"):
        llm.generate(prompts, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=("adapter", 1, "/path"))
    with pytest.raises(ValueError, match=r"different priorities \(\[0, 1\]\).*no priority scheduling"):
        llm.generate(prompts, GREEDY, priority=[0, 1])
    with pytest.raises(ValueError, match="got 2 prompts but 3 priorities"):
        llm.generate(prompts, GREEDY, priority=[0, 0, 0])
    with pytest.raises(TypeError, match="priority must be an int or a list of ints"):
        llm.generate(prompts, GREEDY, priority=["high", "low"])


# --------------------------------------------------------------------------- 3. import paths


def test_vllm_import_paths(llm: LLM) -> None:
    import deepinfer
    from deepinfer.engine import outputs as engine_outputs
    from deepinfer.inputs import TextPrompt, TokensPrompt
    from deepinfer.logprobs import Logprob
    from deepinfer.outputs import CompletionOutput, RequestOutput
    from deepinfer.sampling_params import SamplingParams as SP
    from deepinfer.sampling_params import StructuredOutputsParams

    assert SP is SamplingParams and StructuredOutputsParams is deepinfer.StructuredOutputsParams
    assert deepinfer.Logprob is Logprob is engine_outputs.Logprob
    assert deepinfer.TokensPrompt is TokensPrompt and deepinfer.TextPrompt is TextPrompt
    tok = llm.get_tokenizer()
    text = "The future of AI is"
    prompt_ids = tok.encode(text)
    outs = llm.generate(
        [TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=prompt_ids)],
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        use_tqdm=False,
    )
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == prompt_ids
    assert ids(outs)[0] == ids(outs)[1] == ids(llm.generate(text, GREEDY, use_tqdm=False))[0]
    assert all(isinstance(o, RequestOutput) and isinstance(o.outputs[0], CompletionOutput) for o in outs)
    assert all(isinstance(lp, Logprob) for pos in outs[0].outputs[0].logprobs for lp in pos.values())


# --------------------------------------------------------------------------- 4. content parts, tool calls


def test_text_content_parts_are_joined_as_vllms_string_format(llm: LLM) -> None:
    hf = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)  # the oracle: transformers
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "input_text", "text": "there"}],
        },
    ]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    expected = hf.apply_chat_template(joined, tokenize=True, add_generation_prompt=True, return_dict=False)
    before = json.dumps(parts)
    out = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(expected)
    assert json.dumps(parts) == before  # the caller's messages are left as they were
    assert out.outputs[0].token_ids == llm.chat(joined, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # "openai" hands the parts to a template that concatenates strings: its own error
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat(parts, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat(parts, GREEDY, chat_template_content_format="json")
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(
        ValueError, match=r"message 0 \(user\), content part 1: 'image_url' parts are not supported"
    ):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}], GREEDY)


def test_run_batch_joins_content_parts(llm: LLM) -> None:
    def line(custom_id: str, content: Any) -> str:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
        )

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    audio = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    text = "\n".join([line("parts", parts), line("joined", "Hello\nthere"), line("audio", audio)])
    results = run_batch(llm, text, "tiny", use_tqdm=False)
    bodies = [r["response"]["body"] for r in results]
    assert bodies[0]["usage"] == bodies[1]["usage"]
    assert bodies[0]["choices"][0]["message"] == bodies[1]["choices"][0]["message"]
    assert (
        results[2]["error"] is not None
        and "'input_audio' parts are not supported" in results[2]["error"]["message"]
    )


def test_tool_call_arguments_given_as_a_json_string_are_parsed(llm: LLM) -> None:
    hf = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)

    def turns(arguments: Any) -> list[dict[str, Any]]:
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]

    args = {"city": "Paris", "unit": "celsius"}
    expected = hf.apply_chat_template(
        turns(args), chat_template=TOOL_TEMPLATE, tokenize=False
    )  # the dict itself
    out = llm.chat(turns(json.dumps(args)), GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE)[0]
    assert out.prompt == expected and '"city": "Paris"' in out.prompt and '\\"city' not in out.prompt
    empty = llm.chat(turns(""), GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE)[0]  # vLLM: {} for none
    assert empty.prompt == hf.apply_chat_template(turns({}), chat_template=TOOL_TEMPLATE, tokenize=False)
    with pytest.raises(
        ValueError, match=r"message 1 \(assistant\), tool call 0: 'arguments' is not valid JSON"
    ):
        llm.chat(turns("{city: Paris"), GREEDY, chat_template=TOOL_TEMPLATE)


# --------------------------------------------------------------------------- 5. silently different before


def test_use_tqdm_callable_makes_the_bar(llm: LLM) -> None:
    made: list[Any] = []

    class Bar(tqdm):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(kwargs)
            super().__init__(*args, **{**kwargs, "disable": True})
            self.count = 0

        def update(self, n: float | None = 1) -> bool | None:
            self.count += int(n or 0)
            made.append(self.count)
            return super().update(n)

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    assert made[0]["total"] == 3 and made[0]["desc"] == "Processed prompts" and made[-1] == 3
    with pytest.raises(TypeError, match="use_tqdm must be a bool or a callable"):
        llm.generate(["a"], GREEDY, use_tqdm="yes")  # type: ignore[arg-type]


@pytest.fixture
def fresh_logger() -> Iterator[logging.Logger]:
    """The "deepinfer" logger as a new process has it (no handler of ours, level unset), restored after."""
    logger = logging.getLogger(LOGGER_NAME)
    saved = logger.level, list(logger.handlers), logger.propagate
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_an_applications_log_level_is_kept(
    fresh_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DEEPINFER_LOG_LEVEL", raising=False)
    fresh_logger.setLevel(logging.DEBUG)
    configure_logging()  # what the first LLM() does
    assert fresh_logger.level == logging.DEBUG
    fresh_logger.setLevel(logging.NOTSET)
    for h in [h for h in fresh_logger.handlers if isinstance(h, _StderrHandler)]:
        fresh_logger.removeHandler(h)
    configure_logging()  # none set: the library's quiet default
    assert fresh_logger.level == logging.WARNING


def test_sampling_params_positional_order_is_vllms() -> None:
    vllm_order = [  # vLLM's SamplingParams fields, first to prompt_logprobs
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
        "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
        "prompt_logprobs",
    ]  # fmt: skip
    values: list[Any] = [3, 0.5, -0.5, 1.1, 0.7, 0.9, 5, 0.1, 11, ["x"], [7], True, 9, 2, 1, 0]
    params = SamplingParams(*values)
    assert [getattr(params, name) for name in vllm_order] == values
    assert SamplingParams(2).n == 2 and SamplingParams(2).temperature == 1.0
    with pytest.raises(TypeError, match="positional arguments"):
        SamplingParams(*values, True)  # the rest are keywords only (their order differs across vLLM versions)
    assert {f.name for f in dataclasses.fields(SamplingParams)} >= set(vllm_order)


def test_prompt_keys_deepinfer_does_not_serve_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1: multi_modal_data is not supported"):
        llm.generate(["a", {"prompt": "b", "multi_modal_data": {"image": object()}}], GREEDY)
    for key, value in (
        ("mm_processor_kwargs", {"num_crops": 4}),
        ("cache_salt", "s"),
        ("prompt_embeds", [0.0]),
    ):
        with pytest.raises(ValueError, match=f"prompt 0: '{key}' not supported"):
            llm.generate({"prompt": "a", key: value}, GREEDY)
    with pytest.raises(ValueError, match="'promt' not supported"):  # a misspelt key is named too
        llm.generate({"promt": "a"}, GREEDY)
    # keys set to None carry nothing (a harness that fills every field of vLLM's TypedDict)
    same = llm.generate({"prompt": "a", "multi_modal_data": None, "cache_salt": None}, GREEDY, use_tqdm=False)
    assert ids(same) == ids(llm.generate("a", GREEDY, use_tqdm=False))


def test_generate_cli_honours_the_models_generation_config(
    llm: LLM, capsys: pytest.CaptureFixture[str], fresh_logger: logging.Logger
) -> None:
    from deepinfer.entrypoints.cli import main

    args = ["generate", "--prompt", "Once upon a time", "--request-seed", "5", "--max-tokens", "12", "--json"]
    assert main([*args, "--backend", "reference", "--max-model-len", "128", "--block-size", "16"]) == 0
    printed = json.loads(capsys.readouterr().out)["token_ids"]
    defaults = dataclasses.replace(llm.get_default_sampling_params(), seed=5, max_tokens=12)
    assert printed == ids(llm.generate("Once upon a time", defaults, use_tqdm=False))[0]
    # what the command line did before (SamplingParams' own temperature 1.0) samples differently
    before = SamplingParams(seed=5, max_tokens=12)
    assert printed != ids(llm.generate("Once upon a time", before, use_tqdm=False))[0]


def test_run_batch_names_a_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer.entrypoints.cli import main

    src = tmp_path / "requests.jsonl"
    src.write_bytes(b'{"custom_id": "r\xe9sum\xe9"}\n')  # Latin-1
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert f"-i {src}: not UTF-8 text" in capsys.readouterr().err


# --------------------------------------------------------------------------- 6. generative only


@pytest.mark.parametrize("method", ["encode", "embed", "classify", "score", "reward"])
def test_pooling_calls_say_the_engine_is_generative_only(llm: LLM, method: str) -> None:
    with pytest.raises(ValueError, match=rf"LLM.{method}\(\) is not supported: .* generative only"):
        getattr(llm, method)(["a"])


# --------------------------------------------------------------------------- 6. beam search


def exhaustive_beam_search(
    llm: LLM, prompt_ids: list[int], width: int, steps: int, length_penalty: float
) -> list[tuple[list[int], float]]:
    """Beam search over every token of the vocabulary (the engine's whole log-softmax), with no
    EOS handling (ignore_eos): the beams and their cumulative log-probabilities."""
    full = SamplingParams(temperature=0, max_tokens=1, logprobs=-1)
    beams = [(prompt_ids, 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            position = (
                llm.generate({"prompt_token_ids": tokens}, full, use_tqdm=False)[0].outputs[0].logprobs[0]
            )
            candidates += [([*tokens, t], cum + lp.logprob) for t, lp in position.items()]
        beams = sorted(candidates, key=lambda c: c[1] / len(c[0]) ** length_penalty, reverse=True)[:width]
    return beams


def test_beam_search_equals_an_exhaustive_search() -> None:
    from deepinfer.sampling_params import BeamSearchParams

    llm = LLM(str(MODEL), **SMALL, dtype="float32", max_logprobs=-1)
    prompt_ids = llm.get_tokenizer().encode("The capital of France is")
    for width, penalty in ((3, 1.0), (2, 0.5)):
        params = BeamSearchParams(beam_width=width, max_tokens=4, ignore_eos=True, length_penalty=penalty)
        (out,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
        expected = exhaustive_beam_search(llm, prompt_ids, width, 4, penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens) and len(seq.logprobs) == 4
            # the same sum from one forward over the whole beam (prompt_logprobs)
            scored = llm.generate(
                {"prompt_token_ids": seq.tokens},
                SamplingParams(max_tokens=1, prompt_logprobs=0),
                use_tqdm=False,
            )[0].prompt_logprobs
            total = sum(scored[i][seq.tokens[i]].logprob for i in range(len(prompt_ids), len(seq.tokens)))
            assert total == pytest.approx(seq.cum_logprob, abs=1e-3)
    # a text prompt is the engine's encoding of it
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    assert [s.tokens for s in llm.beam_search(["The capital of France is"], params)[0].sequences] == [
        s.tokens for s in llm.beam_search([{"prompt_token_ids": prompt_ids}], params)[0].sequences
    ]


def test_beam_search_finishes_on_eos_and_checks_its_arguments(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from deepinfer.sampling_params import BeamSearchParams

    # the shipped model rarely ends a beam at EOS: call its most likely first token EOS instead
    prompt = "The capital of France is"
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    hf = llm.get_tokenizer()
    monkeypatch.setattr(llm, "get_tokenizer", lambda: SimpleNamespace(eos_token_id=first, decode=hf.decode))
    outs = llm.beam_search(
        [prompt, "Hello"], BeamSearchParams(beam_width=4, max_tokens=6), concurrency_limit=1
    )
    assert len(outs) == 2 and all(len(out.sequences) == 4 for out in outs)
    prompt_ids = hf.encode(prompt)
    ended = [s for s in outs[0].sequences if s.tokens[-1] == first]
    # the one-token beam [first] finished at once, and scored best (its length leaves EOS out)
    assert outs[0].sequences[0].tokens == [*prompt_ids, first] and len(outs[0].sequences[0].logprobs) == 1
    for out in outs:
        for seq in out.sequences:  # a beam ends at EOS: never inside one
            assert first not in seq.tokens[len(seq.tokens) - len(seq.logprobs) : -1]
            assert len(seq.logprobs) == 6 or seq.tokens[-1] == first
    assert ended
    monkeypatch.undo()
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search(["a"], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs=22 is more than max_logprobs=20"):
        llm.beam_search(["a"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())


# --------------------------------------------------------------------------- 7, 8. more of vLLM's names


def test_sampling_params_vllm_fields_and_helpers(llm: LLM) -> None:
    from deepinfer.sampling_params import RequestOutputKind

    params = SamplingParams(stop=["x"], extra_args={"plugin": [1, 2]}, temperature=0.3)
    copy = params.clone()
    assert copy == params and copy.stop is not params.stop
    assert copy.extra_args is not None and copy.extra_args["plugin"] is not params.extra_args["plugin"]  # type: ignore[index]
    assert SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None) == SamplingParams(
        top_p=0.5
    )
    # offline calls return final outputs whatever output_kind says (vLLM's LLM sets FINAL_ONLY); the
    # text is the fast tokenizer's either way (vLLM's fast detokeniser ignores the spaces flag too)
    base = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    for kw in ({"output_kind": RequestOutputKind.DELTA}, {"spaces_between_special_tokens": False}):
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, **kw), use_tqdm=False)[0]
        assert (out.outputs[0].token_ids, out.outputs[0].text) == (base.token_ids, base.text)
    with pytest.raises(ValueError, match="per-request logits_processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be a bool"):
        SamplingParams(spaces_between_special_tokens="no")  # type: ignore[arg-type]


def test_reset_prefix_cache() -> None:
    llm = LLM(str(MODEL), **SMALL, enable_prefix_caching=True, dtype="float32")
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several 16-token blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_get_tokenizer_encodes_as_the_engine(llm: LLM) -> None:
    """get_tokenizer() adds BOS as tokenizer_config.json's add_bos_token says (DeepSeek's configs:
    true), which the engine's prompts use; transformers 5's AutoTokenizer ignores that flag where
    the tokenizer.json's post-processor adds no BOS, so a fresh one may give the ids without it."""
    text = "The capital of France is"
    engine_ids = llm.generate(text, GREEDY, use_tqdm=False)[0].prompt_token_ids
    tok = llm.get_tokenizer()
    assert tok.encode(text) == engine_ids == tok(text)["input_ids"]
    config = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert config.get("add_bos_token") is True and engine_ids[0] == tok.bos_token_id
    fresh = AutoTokenizer.from_pretrained(MODEL, local_files_only=True).encode(text)
    assert engine_ids in (fresh, [tok.bos_token_id, *fresh])

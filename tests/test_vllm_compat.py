"""What a script or an evaluation harness written for vLLM's `LLM` meets on deepinfer (issue 40):
the model's default sampling parameters, lora_request / priority arguments, vLLM's import paths,
OpenAI content parts and tool-call arguments, use_tqdm callables, the application's log level,
SamplingParams' positional order, prompt keys and the pooling calls deepinfer does not have,
model_config, get_metrics, EngineArgs / from_engine_args, human-readable sizes, bench's workload
flags, DEBUG logging and the progress bar's token rates. Each either works as in vLLM or is an
error that names the problem (docs/vllm.md)."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import re
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
    with pytest.raises(ValueError, match=r"prompt 1: multi_modal_data: .* has no vision tower"):
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
    # the documented difference (docs/vllm.md): a fresh AutoTokenizer of the shipped model gives
    # the same ids without the leading BOS
    fresh = AutoTokenizer.from_pretrained(MODEL, local_files_only=True).encode(text)
    assert engine_ids == [tok.bos_token_id, *fresh]


def test_model_config_names_the_served_model(llm: LLM) -> None:
    config = json.loads((MODEL / "config.json").read_text())
    mc = llm.model_config
    assert mc is llm.llm_engine.model_config
    assert (mc.max_model_len, mc.get_vocab_size(), mc.get_hidden_size(), mc.get_num_layers()) == (
        SMALL["max_model_len"],
        config["vocab_size"],
        config["hidden_size"],
        config["num_hidden_layers"],
    )
    assert mc.hf_config.model_type == config["model_type"] and mc.hf_text_config is mc.hf_config
    assert mc.model == str(MODEL) and mc.trust_remote_code is False and mc.seed == 0
    # vLLM's get_diff_sampling_param: the values generation_config.json sets
    gen = json.loads((MODEL / "generation_config.json").read_text())
    diff = mc.get_diff_sampling_param()
    assert diff == {
        k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")
    }


def _by_name(metrics: list[Any]) -> dict[tuple[str, str], Any]:
    return {(m.name, m.labels.get("finished_reason", "")): m for m in metrics}


def test_get_metrics_counts_what_the_calls_did() -> None:
    from deepinfer.v1.metrics.reader import Counter, Gauge, Histogram

    llm = LLM(str(MODEL), **SMALL, enable_prefix_caching=True, dtype="float32")
    assert all(m.value == 0 for m in llm.get_metrics() if isinstance(m, Counter))
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate([prompt, "Hi"], params, use_tqdm=False)
    second = llm.generate([prompt], SamplingParams(n=2, temperature=0.5, max_tokens=3, ignore_eos=True))
    outs = first + second
    m = _by_name(llm.get_metrics())
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert m[("vllm:prompt_tokens", "")].value == prompt_tokens
    assert m[("vllm:generation_tokens", "")].value == 5 + 5 + 2 * 3
    assert m[("vllm:request_success", "length")].value == 4 and m[("vllm:request_success", "stop")].value == 0
    assert m[("vllm:prefix_cache_queries", "")].value == prompt_tokens
    hits = m[("vllm:prefix_cache_hits", "")].value
    assert hits == sum(o.num_cached_tokens for o in outs) and hits >= 16  # the second call's prefix
    assert isinstance(m[("vllm:kv_cache_usage_perc", "")], Gauge)
    assert 0.0 <= m[("vllm:kv_cache_usage_perc", "")].value <= 1.0
    tokens = m[("vllm:request_prompt_tokens", "")]
    assert isinstance(tokens, Histogram) and tokens.count == 3 and tokens.sum == prompt_tokens
    # cumulative buckets, brute force over the samples
    samples = [len(o.prompt_token_ids) for o in outs]
    for bound, count in tokens.buckets.items():
        assert count == sum(1 for s in samples if bound == "+Inf" or s <= float(bound))
    ttft = m[("vllm:time_to_first_token_seconds", "")]
    assert ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum >= 0


def test_from_engine_args_builds_the_engine_llm_builds(llm: LLM) -> None:
    import argparse

    from deepinfer import EngineArgs, LLMEngine
    from deepinfer.engine.arg_utils import EngineArgs as FromArgUtils

    assert FromArgUtils is EngineArgs
    engine_args = EngineArgs(model=str(MODEL), **SMALL)
    assert engine_args.max_model_len == 128 and engine_args.max_num_seqs == llm.llm_engine.config.max_num_seqs
    engine = LLMEngine.from_engine_args(engine_args)
    prompts = ["Hello, my name is", "The capital of France is"]
    assert ids(LLM.from_engine(engine).generate(prompts, GREEDY, use_tqdm=False)) == ids(
        llm.generate(prompts, GREEDY, use_tqdm=False)
    )
    # vLLM's command-line round trip, with a human-readable size
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", str(MODEL), "--max-model-len", "1k"]))
    assert parsed.max_model_len == 1000 and parsed.model == str(MODEL)
    with pytest.raises(ValueError, match="nearest supported one is 'max_num_seqs'"):
        EngineArgs(model=str(MODEL), max_num_seq=2)
    with pytest.raises(AttributeError, match="read-only"):
        engine_args.max_model_len = 64
    with pytest.raises(ValueError, match=r"add_request\(\) is not supported.*LLM.from_engine"):
        engine.add_request("0", "Hello", GREEDY)
    with pytest.raises(TypeError, match="takes an EngineArgs"):
        LLMEngine.from_engine_args({"model": str(MODEL)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2048", 2048),
        ("-1", -1),
        ("1k", 1000),
        ("25.6k", 25600),
        ("1K", 1024),
        ("2M", 2 << 20),
        ("1g", 10**9),
    ],
)
def test_human_readable_sizes(text: str, value: int) -> None:
    from deepinfer.engine.args import human_readable_int

    assert human_readable_int(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [("1.5K", r"binary suffixes \(K\) take whole numbers; did you mean 1.5k"), ("1.0005k", "not a whole"),
     ("1x", "invalid integer '1x'")],
)  # fmt: skip
def test_human_readable_sizes_refused(text: str, message: str) -> None:
    from deepinfer.engine.args import human_readable_int

    with pytest.raises(ValueError, match=message):
        human_readable_int(text)


# --------------------------------------------------------------------------- 9. bench


def test_bench_workload_shares_a_prefix_and_varies_lengths() -> None:
    from deepinfer.entrypoints.bench import length_range, random_workload

    prompts, outs = random_workload(200, 40, 1000, 3, prefix_len=17, range_ratio=0.5, output_len=10)
    assert length_range(40, 0.5) == (20, 60) and length_range(10, 0.5) == (5, 15)
    assert all(p[:17] == prompts[0][:17] for p in prompts)
    lengths = {len(p) - 17 for p in prompts}
    assert min(lengths) >= 20 and max(lengths) <= 60 and len(lengths) > 10  # drawn, not fixed
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    fixed, fixed_outs = random_workload(5, 40, 1000, 3, output_len=10)
    assert {len(p) for p in fixed} == {40} and set(fixed_outs) == {10}


def test_bench_prefix_n_and_range_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer.entrypoints.bench import random_workload
    from deepinfer.entrypoints.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "--backend", "reference", "--block-size", "16", "--enable-prefix-caching", "--seed", "7"]
    args += ["--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "4", "--n", "2"]
    args += ["--prefix-len", "32", "--random-range-ratio", "0.5", "--output-json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    prompts, output_lens = random_workload(4, 12, 8192, 7, 32, 0.5, 4)
    assert result["n"] == 2 and result["prefix_len"] == 32
    assert result["total_num_tokens"] == sum(map(len, prompts)) + 2 * sum(output_lens)
    assert result["num_cached_tokens"] >= 4 * 32  # the warm-up request cached the shared prefix
    assert "Prompt tokens from the prefix cache" in capsys.readouterr().out


def test_bench_refuses_an_impossible_length_before_loading_weights(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import deepinfer.models.loader as loader
    from deepinfer.entrypoints.cli import main

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_model", no_loading)
    base = ["bench", "--backend", "reference"]
    assert main([*base, "--max-model-len", "1k", "--random-input-len", "1K"]) == 2
    assert "the longest request is 1056 tokens" in capsys.readouterr().err  # 1024 + 32 out
    max_positions = json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    assert main([*base, "--random-input-len", str(max_positions)]) == 2
    assert f"max_position_embeddings {max_positions}" in capsys.readouterr().err
    assert main([*base, "--random-range-ratio", "1.5"]) == 2
    assert "--random-range-ratio must be in [0, 1)" in capsys.readouterr().err


# --------------------------------------------------------------------------- 10. logging, progress


def test_debug_logging_shows_engine_events(
    fresh_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "DEBUG")
    small = {**SMALL, "enforce_eager": False, "max_num_seqs": 2, "num_gpu_blocks_override": 8}
    llm = LLM(str(MODEL), **small)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3] * 3  # 3 requests, 8 blocks of 16
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    err = capsys.readouterr().err
    debug = [line for line in err.splitlines() if line.startswith("DEBUG")]
    assert any("KV sizing: 8 blocks of 16 tokens from num_gpu_blocks_override=8" in line for line in debug)
    assert any("graph plan: decode batch sizes [1, 2]" in line for line in debug)
    steps = [line for line in debug if "[scheduler] step:" in line]
    assert steps and any("prefill" in s and "(0 decode" in s for s in steps)
    assert any("2 running, 1 waiting" in s for s in steps)  # max_num_seqs=2 leaves one waiting
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "INFO")
    LLM(str(MODEL), **small).generate(prompts[:1], GREEDY, use_tqdm=False)
    assert "DEBUG" not in capsys.readouterr().err


def test_progress_bar_shows_token_rates(llm: LLM) -> None:
    from deepinfer.log import TokenRates

    shown = io.StringIO()
    bar = functools.partial(tqdm, file=shown, mininterval=0)  # as vLLM's docs pass one
    outs = llm.generate(["a", "b c"], SamplingParams(n=2, temperature=0.5, max_tokens=3), use_tqdm=bar)
    last = shown.getvalue().split("\r")[-1]
    assert "4/4" in last and re.search(r"est\. speed input: [\d.]+ toks/s, output: [\d.]+ toks/s", last)

    class Fake:  # a bar at 2 s elapsed
        def __init__(self) -> None:
            self.format_dict, self.postfix, self.n = {"elapsed": 2.0}, "", 0

        def update(self, k: int) -> None:
            self.n += k

    fake = Fake()
    rates = TokenRates(fake)
    seqs = [
        s
        for o in outs
        for s in llm.llm_engine.make_sequence({"prompt_token_ids": o.prompt_token_ids}, GREEDY).group
    ]
    for seq in seqs:
        seq.token_ids += [1] * 3
    rates.done(seqs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert fake.n == 2 and rates.input_tokens == prompt and rates.output_tokens == 6
    assert fake.postfix == f"est. speed input: {prompt / 2:.2f} toks/s, output: {6 / 2:.2f} toks/s"


def test_the_vllm_page_names_every_engine_argument_and_llm_method() -> None:
    """docs/vllm.md is the one page of differences: every engine argument and every public LLM
    method is on it."""
    from deepinfer.config import engine_fields

    page = (MODEL.parents[1] / "docs" / "vllm.md").read_text()
    missing = [f.name for f in engine_fields() if f"`{f.name}`" not in page]
    methods = [n for n in dir(LLM) if not n.startswith("_") and n not in ("from_engine", "data_parallel")]
    missing += [n for n in methods if n not in page]
    assert not missing, f"docs/vllm.md does not name {missing}"


def test_disable_log_stats_false_logs_each_calls_throughput(
    fresh_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "INFO")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    LLM(str(MODEL), **SMALL).generate(["a", "b"], params, use_tqdm=False)
    assert "prompt throughput" not in capsys.readouterr().err  # vLLM's default: disable_log_stats=True
    LLM(str(MODEL), **SMALL, disable_log_stats=False).generate(["a", "b"], params, use_tqdm=False)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "prompt throughput" in line]
    assert line.startswith("INFO") and "2 requests in " in line and "prefix cache hits 0 tokens" in line

"""Engine behaviour a vLLM user relies on: stop tokens and their text, stop strings under
min_tokens, tiny temperatures, n / best_of, seed range (tiny model, reference backend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams

PROMPT = "The weather"
N = 16


def make_llm(model: Path = TINY) -> LLM:
    return LLM(
        str(model),
        backend="reference",
        dtype="float32",
        block_size=16,
        max_model_len=64,
        num_gpu_blocks_override=16,
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def base(llm: LLM) -> tuple[list[int], list[str]]:
    """The greedy continuation of PROMPT (N tokens, EOS ignored) and each token's own text."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    return tokens, [tok.decode([t]) for t in tokens]


def first_word_token(tokens: list[int], pieces: list[str], start: int) -> int:
    """Index (>= start) of the first token whose text is a plain word that occurs only once in the
    whole continuation (as a token and as text)."""
    text = "".join(pieces)
    for k in range(start, len(tokens)):
        word = pieces[k].strip()
        if word.isalpha() and tokens.count(tokens[k]) == 1 and text.count(pieces[k]) == 1:
            return k
    pytest.fail(
        f"no token from index {start} on of the greedy continuation {tokens} is a plain word that occurs "
        f"once (the tiny model or the engine changed): choose another PROMPT, or these tests check nothing",
        pytrace=False,
    )


def test_stop_token_is_kept_in_token_ids_but_not_in_the_text(
    llm: LLM, base: tuple[list[int], list[str]]
) -> None:
    tokens, _ = base
    tok = llm.get_tokenizer()
    k = first_word_token(tokens, base[1], 2)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[tokens[k]]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[k]
    assert out.token_ids == tokens[: k + 1]
    # vLLM leaves the stopping token's text out (include_stop_str_in_output=False).
    assert out.text == tok.decode(tokens[:k])


def test_include_stop_str_in_output_keeps_the_stop_text(llm: LLM, base: tuple[list[int], list[str]]) -> None:
    tokens, pieces = base
    tok = llm.get_tokenizer()
    k = first_word_token(tokens, pieces, 2)
    text = tok.decode(tokens)
    # a stop token: its text ends the output
    params = SamplingParams(
        temperature=0, max_tokens=N, stop_token_ids=[tokens[k]], include_stop_str_in_output=True
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: k + 1] and out.stop_reason == tokens[k]
    assert out.text == tok.decode(tokens[: k + 1])
    # a stop string: the text runs to its end (and stops there, even inside a token)
    stop = pieces[k].strip()[:2]
    first = text.find(stop)
    params = SamplingParams(
        temperature=0, max_tokens=N, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: first + len(stop)]
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output="yes")  # type: ignore[arg-type]


def test_prompt_of_max_model_len_tokens_gets_one_token(llm: LLM) -> None:
    """As in vLLM: the prompt fills the context, the one token sampled after it ends on "length"."""
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ids = [(7 * i) % 500 + 3 for i in range(64)]  # max_model_len = 64
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="the prompt has 65 tokens, more than max_model_len=64"):
        llm.generate([{"prompt_token_ids": [*ids, 5]}], params, use_tqdm=False)


def test_eos_text_is_left_out_even_with_special_tokens_shown(
    tmp_path: Path, base: tuple[list[int], list[str]]
) -> None:
    tokens, pieces = base
    k = first_word_token(tokens, pieces, 2)
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, tokens[k]]}))
    llm = make_llm(model)
    params = SamplingParams(temperature=0, max_tokens=N, skip_special_tokens=False)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == tokens[: k + 1]
    assert out.text == llm.get_tokenizer().decode(tokens[:k], skip_special_tokens=False)


def test_stop_string_counts_only_after_min_tokens(llm: LLM, base: tuple[list[int], list[str]]) -> None:
    tokens, pieces = base
    k = first_word_token(tokens, pieces, 2)  # token k + 1 (1-based) completes the stop string
    stop = pieces[k]
    text = llm.get_tokenizer().decode(tokens)

    def run(min_tokens: int) -> tuple[list[int], str, str | None]:
        params = SamplingParams(
            temperature=0, max_tokens=N, ignore_eos=True, stop=[stop], min_tokens=min_tokens
        )
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.text, out.finish_reason

    # min_tokens = k: token k + 1 is the first that may stop generation (as EOS could).
    assert run(k) == (tokens[: k + 1], text[: text.find(stop)], "stop")
    # min_tokens = k + 1: the stop string ends inside the first min_tokens tokens, so it does not
    # count (vLLM's rule; EOS and stop_token_ids are banned there too) and it never recurs.
    assert run(k + 1) == (tokens, text, "length")


@pytest.mark.parametrize("temperature", [1e-6, 1e-40])
def test_tiny_temperature_is_greedy(llm: LLM, base: tuple[list[int], list[str]], temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=N, ignore_eos=True, seed=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[0]  # 1e-40: logits / temperature overflowed to NaN before
    assert params.greedy  # below 1e-5, as in vLLM: deterministic, like temperature 0
    # In a batch with sampled rows too (the backend's sample op path).
    hot = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, seed=1)
    outs = llm.generate([PROMPT, PROMPT], [hot, params], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == base[0]
    assert outs[0].outputs[0].token_ids != base[0]


def test_n_and_best_of_are_checked() -> None:
    assert SamplingParams(n=1, best_of=1).n == 1
    assert SamplingParams(n=1, best_of=None).best_of is None
    assert SamplingParams(n=3, best_of=5).best_of == 5  # several completions: tests/test_sampling_features.py
    with pytest.raises(ValueError, match="best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_range_is_a_clear_error(seed: int) -> None:
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=seed)


def test_seed_range_ends_are_usable(llm: LLM) -> None:
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(temperature=1.0, max_tokens=3, seed=seed)
        assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    ("file", "content"),
    [
        ("generation_config.json", '{"eos_token_id": [1,'),
        ("generation_config.json", "[1]"),
        ("tokenizer_config.json", '{"eos'),
        ("tokenizer.json", '{"model": '),
    ],
)
def test_corrupt_optional_files_are_named(tmp_path: Path, file: str, content: str) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    (model / file).write_text(content)
    with pytest.raises(ValueError, match=rf"{file}"):
        make_llm(model)

"""Sampling parameters checked where a request is added (issues 13 and 16): hostile values at
construction and set afterwards (vLLM's examples do `sp.stop = [...]`, `sp.n = 3`) give a clear
error naming the field and the value, and the same LLM keeps serving; a changed stop list is
honoured; generate() without parameters takes the model's generation_config.json defaults; a
failure in one request's output processing aborts that request alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sequence import Sequence
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

PROMPT = "The quick brown fox"
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NAN, INF = float("nan"), float("inf")


def make_llm(model: Path = TINY, **kw: Any) -> LLM:
    return LLM(str(model), backend="reference", dtype="float32", max_model_len=128, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[int]:
    """What GOOD gives for PROMPT on a fresh LLM: the engine must still give it after an error."""
    return tokens(llm, PROMPT, GOOD)


def tokens(llm: LLM, prompt: Any, params: SamplingParams | None = None) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def check_consistent(outs: list[Any]) -> None:
    """A request is reported finished exactly when it has a finish reason."""
    for out in outs:
        assert out.finished == (out.outputs[0].finish_reason is not None)


# (field, hostile value, a fragment the error must contain besides the field's name)
HOSTILE: list[tuple[str, Any, str]] = [
    ("temperature", NAN, "finite number, got nan"),
    ("temperature", INF, "finite number, got inf"),
    ("temperature", -INF, "finite number, got -inf"),
    ("temperature", -3, ">= 0 (0 = greedy), got -3"),
    ("temperature", 1e39, "got 1e+39"),  # inf in float32
    ("temperature", "0.5", "got '0.5'"),
    ("temperature", True, "got True"),
    ("top_p", NAN, "got nan"),
    ("top_p", 0.0, "(0, 1], got 0.0"),
    ("top_p", 1.5, "got 1.5"),
    ("top_k", 2**63, f"got {2**63}"),
    ("top_k", -2, "got -2"),
    ("top_k", 2.0, "got 2.0"),
    ("top_k", True, "got True"),
    ("min_p", NAN, "got nan"),
    ("min_p", -0.1, "got -0.1"),
    ("presence_penalty", NAN, "got nan"),
    ("presence_penalty", INF, "got inf"),
    ("presence_penalty", 2.5, "[-2, 2], got 2.5"),
    ("frequency_penalty", -INF, "got -inf"),
    ("repetition_penalty", NAN, "got nan"),
    ("repetition_penalty", INF, "got inf"),
    ("repetition_penalty", 0.0, "got 0.0"),
    ("repetition_penalty", -1.0, "got -1.0"),
    ("repetition_penalty", 1e-45, "got 1e-45"),  # 0 in float32: x / p would be inf
    ("seed", 2**64, f"got {2**64}"),
    ("seed", -(2**63) - 1, f"got {-(2**63) - 1}"),
    ("seed", 1.5, "got 1.5"),
    ("seed", True, "got True"),
    ("max_tokens", 0, "got 0"),
    ("max_tokens", 2.0, "got 2.0"),
    ("max_tokens", True, "got True"),
    ("min_tokens", -1, "got -1"),
    ("min_tokens", 9, "must not exceed max_tokens (8)"),
    ("min_tokens", True, "got True"),
    ("logprobs", -2, "got -2"),
    ("logprobs", 1.5, "got 1.5"),
    ("logprobs", True, "got True"),
    ("stop_token_ids", [-1], "got [-1]"),
    ("stop_token_ids", [True], "got [True]"),
    ("stop_token_ids", 5, "got 5"),
    ("stop", "", "must not be empty"),
    ("stop", ["a", 3], "got ['a', 3]"),
    ("stop", 5, "got 5"),
    ("n", 0, "got 0"),
    ("n", True, "got True"),
    ("best_of", 0, "an integer >= n (1) or None, got 0"),
    ("prompt_logprobs", -2, "got -2"),
    ("logit_bias", {1: NAN}, "got {1: nan}"),
    ("logit_bias", {"a": 1.0}, "got {'a': 1.0}"),
    ("allowed_token_ids", [], "non-empty list of token ids >= 0, got []"),
    ("bad_words", ["ok", ""], "got ['ok', '']"),
    ("truncate_prompt_tokens", 0, "got 0"),
    ("detokenize", "no", "must be a bool, got 'no'"),
    ("ignore_eos", 1, "must be a bool, got 1"),
    ("include_stop_str_in_output", "yes", "got 'yes'"),
    ("skip_special_tokens", None, "got None"),
    ("structured_outputs", {"regex": "a+"}, "got dict"),
]
IDS = [f"{name}={value!r}" for name, value, _ in HOSTILE]


@pytest.mark.parametrize(("name", "value", "fragment"), HOSTILE, ids=IDS)
def test_hostile_value_at_construction(name: str, value: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{"max_tokens": 8, name: value})
    assert str(info.value).startswith(name) and fragment in str(info.value)


@pytest.mark.parametrize(("name", "value", "fragment"), HOSTILE, ids=IDS)
def test_hostile_value_set_after_construction(
    llm: LLM, expected: list[int], name: str, value: Any, fragment: str
) -> None:
    bad = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    setattr(bad, name, value)
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPT, "Hello"], [GOOD, bad], use_tqdm=False)
    assert str(info.value).startswith(f"prompt 1: {name}") and fragment in str(info.value)
    assert not llm.llm_engine.has_unfinished()
    assert tokens(llm, PROMPT, GOOD) == expected  # the same LLM serves the next request as before


def test_min_tokens_with_structured_output_set_after_construction(llm: LLM, expected: list[int]) -> None:
    """It used to pass construction and crash mid-generation; both orders of setting are caught."""
    for first, then in (("structured", "min_tokens"), ("min_tokens", "structured")):
        sp = SamplingParams(temperature=0, max_tokens=8)
        for which in (first, then):
            if which == "min_tokens":
                sp.min_tokens = 3
            else:
                sp.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
        with pytest.raises(
            ValueError,
            match=r"prompt 0: min_tokens cannot be combined with structured_outputs.*got min_tokens=3",
        ):
            llm.generate([PROMPT], sp, use_tqdm=False)
        assert tokens(llm, PROMPT, GOOD) == expected


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("stop_token_ids", [5, 100_000], "stop token id 100000 is outside the vocabulary"),
        ("logprobs", 100_000, "logprobs=100000 exceeds the vocabulary size"),
    ],
)
def test_model_limits_checked_when_added(
    llm: LLM, expected: list[int], name: str, value: Any, match: str
) -> None:
    sp = SamplingParams(temperature=0, max_tokens=8)
    setattr(sp, name, value)
    with pytest.raises(ValueError, match=f"prompt 0: {match}"):
        llm.generate([PROMPT], sp, use_tqdm=False)
    assert tokens(llm, PROMPT, GOOD) == expected


def test_unknown_field_cannot_be_set() -> None:
    """As with vLLM's SamplingParams: a misspelt or unsupported field is an error, not ignored."""
    sp = SamplingParams()
    with pytest.raises(AttributeError, match="temprature"):
        sp.temprature = 0.5  # type: ignore[attr-defined]


def test_changed_stop_is_honoured(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length"
    word = full.text.split()[1]
    sp.stop = [word]
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[: full.text.find(word)], "stop", word)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    # changed in place, and back to none
    sp.stop.clear()
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids == full.token_ids
    sp.stop = word  # a single string
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].stop_reason == word
    sp.stop = None
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids == full.token_ids


def test_changed_temperature_and_max_tokens_are_honoured(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = tokens(llm, PROMPT, sp)
    sp.temperature, sp.seed = 1.0, 5
    sampled = tokens(llm, PROMPT, sp)
    assert sampled != greedy and sampled == tokens(llm, PROMPT, sp)  # seeded: reproducible
    sp.max_tokens = 3
    assert tokens(llm, PROMPT, sp) == sampled[:3]


def test_request_keeps_the_parameters_it_was_added_with(llm: LLM) -> None:
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, stop=["a"], stop_token_ids=[3])
    seq = engine.make_sequence(PROMPT, sp)
    assert seq.params is not sp and seq.params == sp
    sp.stop.append("b")  # type: ignore[union-attr]
    sp.stop_token_ids.append(4)  # type: ignore[union-attr]
    sp.temperature = NAN
    assert seq.params.stop_strings == ("a",) and seq.params.stop_token_ids == [3]
    assert seq.params.temperature == 0


def test_numpy_numbers_are_accepted_as_plain_numbers(llm: LLM) -> None:
    np = pytest.importorskip("numpy")
    sp = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(5), seed=np.uint64(2**64 - 1), max_tokens=4
    )
    seq = llm.llm_engine.make_sequence(PROMPT, sp)
    assert type(seq.params.temperature) is float and type(seq.params.top_k) is int
    assert type(seq.params.seed) is int and seq.params.seed == 2**64 - 1
    with pytest.raises(ValueError, match="temperature must be a finite number, got"):
        SamplingParams(temperature=np.float32("nan"))
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingParams(top_k=np.bool_(True))


def test_top_k_past_the_vocabulary_keeps_every_token(llm: LLM) -> None:
    """The largest top_k accepted (2**63 - 1) samples as top_k off, and does not crash a step."""
    off = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    huge = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, top_k=2**63 - 1)
    outs = llm.generate([PROMPT, PROMPT], [off, huge], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


# ---------------------------------------------------------------- generation_config.json defaults


def model_with_generation_config(tmp_path: Path, content: dict[str, Any]) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for f in TINY.iterdir():  # copies: a symlink out of the directory is refused
        if f.is_file() and f.name != "generation_config.json":
            shutil.copy(f, model / f.name)
    (model / "generation_config.json").write_text(json.dumps(content))
    return model


GEN = {
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def test_tiny_model_defaults_are_sampling_params_defaults(llm: LLM) -> None:
    # model/tiny/generation_config.json sets only token ids: nothing to take
    assert llm.llm_engine.default_sampling_params() == SamplingParams()


def test_generation_config_defaults_are_applied(tmp_path: Path) -> None:
    model = model_with_generation_config(tmp_path, GEN)
    a, b = make_llm(model), make_llm(model)
    defaults = a.llm_engine.default_sampling_params()
    assert defaults == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7
    )
    prompts = [PROMPT, "Hello", "Numbers: one, two"]
    got = a.generate(prompts, use_tqdm=False)
    check_consistent(got)
    for out in got:
        c = out.outputs[0]
        assert 1 <= len(c.token_ids) <= 7 and (c.finish_reason == "stop" or len(c.token_ids) == 7)
    # the same draws as the same parameters passed explicitly (same engine seed, fresh engine)
    want = b.generate(prompts, defaults, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_explicit_sampling_params_override_the_defaults(tmp_path: Path) -> None:
    llm = make_llm(model_with_generation_config(tmp_path, GEN))
    plain = make_llm()
    explicit = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([PROMPT], explicit, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12  # not max_new_tokens=7
    assert out.token_ids == tokens(plain, PROMPT, explicit)  # and no repetition penalty either
    # SamplingParams() passed explicitly is vLLM's defaults, not the model's
    assert (
        len(llm.generate([PROMPT], SamplingParams(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
        == 16
    )


def test_bad_generation_config_value_is_a_clear_error(tmp_path: Path) -> None:
    llm = make_llm(model_with_generation_config(tmp_path, {"temperature": -1.0, "eos_token_id": 1}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature must be >= 0"):
        llm.generate([PROMPT], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()
    assert len(tokens(llm, PROMPT, GOOD)) == 8


# ---------------------------------------------------------------- one request's failure


class RejectingGrammar:
    """A grammar matcher that allows every token and rejects the `reject_at`-th one sampled."""

    def __init__(self, reject_at: int) -> None:
        self.left = reject_at

    def fill_next_token_bitmask(self, mask: Any, row: int) -> None:
        pass  # the mask starts with every bit set: all tokens allowed

    def accept_token(self, token: int) -> bool:
        self.left -= 1
        return self.left > 0

    def is_terminated(self) -> bool:
        return False


def plant(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, target: Any, hook: Any) -> None:
    """hook(seq) on the sequence made for the prompt `target`."""
    real = engine.requests.make_sequence

    def make_sequence(prompt: Any, params: SamplingParams) -> Sequence:
        seq = real(prompt, params)
        if prompt == target:
            hook(seq)
        return seq

    monkeypatch.setattr(engine.requests, "make_sequence", make_sequence)


def check_isolated(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, prompts: list[Any], hook: Any, k: int, reason: str = "abort"
) -> None:
    """prompts[1] fails at its k-th token (finish_reason `reason`: "error" for a broken
    promise, with CompletionOutput.error); the others give what they give alone."""
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    engine = llm.llm_engine
    plant(monkeypatch, engine, prompts[1], hook)
    outs = llm.generate(prompts, params, use_tqdm=False)
    check_consistent(outs)
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert outs[i].outputs[0].text == alone[i].outputs[0].text
        assert outs[i].outputs[0].finish_reason == "length"
    failed, ref = outs[1].outputs[0], alone[1].outputs[0]
    assert failed.finish_reason == reason and outs[1].finished and failed.stop_reason is None
    assert (failed.error is not None) == (reason == "error"), failed
    assert failed.token_ids == ref.token_ids[: k - 1]  # the failing token is not part of it
    assert ref.text.startswith(failed.text)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    monkeypatch.undo()
    again = llm.generate(prompts, params, use_tqdm=False)  # and the engine keeps serving
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_grammar_rejection_fails_only_that_request(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    pytest.importorskip("xgrammar", reason="grammar bitmasks need xgrammar")
    llm = make_llm(async_scheduling=async_scheduling)

    def hook(seq: Sequence) -> None:
        seq.grammar = RejectingGrammar(reject_at=5)

    check_isolated(llm, monkeypatch, [PROMPT, "Hello", "Numbers: one, two"], hook, k=5, reason="error")


def test_detokenizer_failure_aborts_only_that_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def hook(seq: Sequence) -> None:
        assert seq.detokenizer is not None
        real, calls = seq.detokenizer.step, [0]

        def step(token: int) -> str:
            calls[0] += 1
            if calls[0] == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
            return real(token)

        seq.detokenizer.step = step  # type: ignore[method-assign]

    check_isolated(llm, monkeypatch, [PROMPT, "Hello", "Numbers: one, two"], hook, k=3)


def test_grammar_rejection_with_speculative_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xgrammar", reason="grammar bitmasks need xgrammar")
    ckpt = write_random_checkpoint(tmp_path / "mtp", tiny_config(), seed=3)
    llm = LLM(
        str(ckpt),
        backend="reference",
        dtype="float32",
        max_model_len=128,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    prompts = [
        {"prompt_token_ids": [5 + (7 * i + 3 * j) % 120 for j in range(n)]} for i, n in enumerate([9, 4, 17])
    ]

    def hook(seq: Sequence) -> None:
        seq.grammar = RejectingGrammar(reject_at=6)

    check_isolated(llm, monkeypatch, prompts, hook, k=6, reason="error")


def test_finished_only_with_a_finish_reason(llm: LLM) -> None:
    engine = llm.llm_engine
    running = engine.make_sequence(PROMPT, GOOD)
    out = engine.to_output(running)
    assert not out.finished and out.outputs[0].finish_reason is None
    engine.add(running)
    engine.abort_all()  # dropped without a reason (what an error in a step does)
    out = engine.to_output(running)
    assert out.finished and out.outputs[0].finish_reason == "abort"

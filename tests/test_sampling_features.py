"""Sampling as vLLM users write it: vLLM's n / best_of, logprobs=-1, prompt_logprobs, logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, detokenize=False, RequestOutput.metrics and
num_cached_tokens. Oracles: transformers' DeepseekV3ForCausalLM on the same weights (float32
logits, log-softmax in float64) for prompt and sampled log-probabilities and for greedy decoding
under each logits processor; the engine itself with n=1 for the completions of n > 1.
(tests/test_async_graphs.py checks that async scheduling and graphs give the same outputs.)"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_model import TINY

from deepinfer import LLM, SamplingParams
from deepinfer.engine.requests import completion_seed
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 978
PROMPT = "The capital of France is"


def make_llm(**kw: Any) -> LLM:
    args: dict[str, Any] = {
        "backend": "reference",
        "dtype": "float32",
        "block_size": 16,
        "max_model_len": 128,
        "max_logprobs": -1,
    }
    return LLM(str(TINY), **{**args, **kw})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float64: row i = log-probabilities of the token after ids[: i + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def generate(llm: LLM, prompts: list[Any], params: Any) -> list[Any]:
    wrapped = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return llm.generate(wrapped, params, use_tqdm=False)


# ---------------------------------------------------------------------------- n and best_of


def test_n_completions_are_sampled_independently(llm: LLM) -> None:
    """n=3: one RequestOutput with completions 0, 1, 2; completion i is what a request of n=1
    seeded completion_seed(seed, i) samples (completion 0: the request's own seed)."""
    sp = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "completions are not independent"
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(
            temperature=1.0, seed=completion_seed(42, i), max_tokens=10, ignore_eos=True, logprobs=1
        )
        ref = llm.generate([PROMPT], alone, use_tqdm=False)[0].outputs[0]
        assert (c.token_ids, c.text) == (ref.token_ids, ref.text)
        assert c.cumulative_logprob == pytest.approx(ref.cumulative_logprob, rel=1e-5)  # batch of 3 vs 1
    assert completion_seed(42, 0) == 42
    n1 = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    assert llm.generate([PROMPT], n1, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_n_without_seed_is_reproducible_per_engine() -> None:
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True)
    first = [[c.token_ids for c in o.outputs] for o in generate(make_llm(seed=5), [PROMPT, "Hello"], sp)]
    again = [[c.token_ids for c in o.outputs] for o in generate(make_llm(seed=5), [PROMPT, "Hello"], sp)]
    assert first == again
    assert all(a != b for a, b in first)


def test_best_of_returns_the_n_of_highest_cumulative_logprob(llm: LLM) -> None:
    """best_of=4, n=2 generates the 4 completions n=4 generates (same seeds) and returns the two
    whose sampled tokens have the highest total log-probability, best first."""
    base: dict[str, Any] = {"temperature": 1.2, "seed": 9, "max_tokens": 8, "ignore_eos": True}
    (all4,) = llm.generate([PROMPT], SamplingParams(n=4, logprobs=0, **base), use_tqdm=False)
    (best,) = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, **base), use_tqdm=False)
    for c in all4.outputs:  # the cumulative log-probability is the sum of the sampled tokens'
        assert c.logprobs is not None and c.cumulative_logprob is not None
        assert math.isclose(
            c.cumulative_logprob, sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids))
        )
    ranked = sorted(all4.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:2]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best.outputs] == [c.cumulative_logprob for c in ranked]
    assert all(c.logprobs is None for c in best.outputs)  # logprobs were not asked for
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_n_with_stop_and_structured_output(llm: LLM) -> None:
    """Each completion has its own stop state and its own grammar matcher."""
    pytest.importorskip("xgrammar")
    from deepinfer import StructuredOutputsParams

    sp = SamplingParams(
        n=3,
        temperature=0.9,
        seed=1,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}"),
    )
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    import re

    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(r"[a-z]{2,6}", c.text), c.text


# ---------------------------------------------------------------------------- log-probabilities


PROMPT_LENGTHS = [1, 5, 17, 40, 70]


def check_prompt_logprobs(out: Any, model: torch.nn.Module, k: int) -> None:
    """out.prompt_logprobs against transformers: None first, then the prompt token's
    log-probability and rank, and the top-k tokens with theirs (float32, within 1e-5)."""
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    if len(ids) == 1:
        return
    ref = hf_logprobs(model, ids)
    for p in range(1, len(ids)):
        entry, row = entries[p], ref[p - 1]
        token = ids[p]
        assert math.isclose(entry[token].logprob, float(row[token]), abs_tol=1e-5), (p, token)
        # the rank counts the tokens above it; tokens within the logprob tolerance of it may
        # fall on either side (float32 against transformers' row)
        above, near = int((row > row[token] + 1e-5).sum()), int((row >= row[token] - 1e-5).sum())
        assert above + 1 <= entry[token].rank <= near, (p, token, entry[token].rank, above, near)
        top = row.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for r in range(k):
            t = int(top.indices[r])
            assert math.isclose(entry[t].logprob, float(top.values[r]), abs_tol=1e-5)
            assert entry[t].rank == r + 1


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},  # prompts prefilled in chunks of up to 16 tokens
        {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 9, "max_num_seqs": 8},  # + preemption
    ],
    ids=["one-pass", "chunked", "chunked+preemption"],
)
def test_prompt_logprobs_match_transformers(hf_model: torch.nn.Module, engine_args: dict[str, Any]) -> None:
    llm = make_llm(**engine_args)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    outs = generate(llm, prompts, sp)
    for out in outs:
        check_prompt_logprobs(out, hf_model, 3)
        assert all(
            e is None or all(v.decoded_token is not None for v in e.values()) for e in out.prompt_logprobs
        )
    if "num_gpu_blocks_override" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_prompt_logprobs_with_prefix_caching(hf_model: torch.nn.Module) -> None:
    """A request with prompt_logprobs does not read the prefix cache (its positions would have no
    logits); the others do. Its log-probabilities are complete and right either way."""
    llm = make_llm(enable_prefix_caching=True, max_num_batched_tokens=32)
    (base,) = random_prompts([50], seed=2)
    prompts = [base + t for t in random_prompts([3, 9, 1], seed=3)]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    generate(llm, [base], plain)  # caches the first 48 tokens (3 blocks of 16)
    with_lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = generate(llm, prompts, [with_lp, plain, with_lp])
    assert [o.num_cached_tokens for o in outs] == [0, 48, 0]
    for out in (outs[0], outs[2]):
        check_prompt_logprobs(out, hf_model, 2)
    assert outs[1].prompt_logprobs is None
    uncached = generate(make_llm(), prompts, plain)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in uncached]


def test_prompt_logprobs_whole_vocabulary_and_zero(llm: LLM, hf_model: torch.nn.Module) -> None:
    (prompt,) = random_prompts([9], seed=4)
    full, zero = generate(
        llm,
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1),
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
        ],
    )
    ref = hf_logprobs(hf_model, prompt)
    for p in range(1, len(prompt)):
        entry = full.prompt_logprobs[p]
        assert len(entry) == VOCAB
        got = torch.tensor([entry[t].logprob for t in range(VOCAB)], dtype=torch.float64)
        torch.testing.assert_close(got, ref[p - 1], rtol=0, atol=1e-5)
        assert {v.rank for v in entry.values()} == set(range(1, VOCAB + 1))
        assert list(zero.prompt_logprobs[p]) == [prompt[p]]  # 0: only the prompt token


def test_logprobs_whole_vocabulary_match_transformers(llm: LLM, hf_model: torch.nn.Module) -> None:
    (prompt,) = random_prompts([7], seed=5)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=-1, ignore_eos=True)
    (out,) = generate(llm, [prompt], sp)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    ref = hf_logprobs(hf_model, prompt + c.token_ids)
    for i, entry in enumerate(c.logprobs):
        assert len(entry) == VOCAB
        row = ref[len(prompt) - 1 + i]
        got = torch.tensor([entry[t].logprob for t in range(VOCAB)], dtype=torch.float64)
        torch.testing.assert_close(got, row, rtol=0, atol=1e-5)
        assert {v.rank for v in entry.values()} == set(range(1, VOCAB + 1))


def test_whole_vocabulary_needs_max_logprobs() -> None:
    llm = make_llm(max_logprobs=20)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"prompt 0: {name}=-1 is more than max_logprobs=20"):
            llm.generate([PROMPT], SamplingParams(**{name: -1}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=21), use_tqdm=False)


# ---------------------------------------------------------------------------- logits processors


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, process: Any) -> list[int]:
    """Greedy decoding with transformers' logits, process(logits float64 (V,), output so far)
    applied before the argmax."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        out.append(int(process(logits, out).argmax()))
    return out


def engine_greedy(llm: LLM, prompt: list[int], n: int, **kw: Any) -> list[int]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return generate(llm, [prompt], sp)[0].outputs[0].token_ids


def test_logit_bias_matches_a_float64_oracle(llm: LLM, hf_model: torch.nn.Module) -> None:
    (prompt,) = random_prompts([6], seed=6)
    plain = engine_greedy(llm, prompt, 10)
    bias = {plain[2]: -5.0, 17: 4.0, 300: 2.5, plain[0]: -0.5}

    def add_bias(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for t, b in bias.items():
            logits[t] += b
        return logits

    got = engine_greedy(llm, prompt, 10, logit_bias=bias)
    assert got == hf_greedy(hf_model, prompt, 10, add_bias)
    assert got != plain, "the bias was meant to change the output"


def test_allowed_token_ids_matches_a_float64_oracle(llm: LLM, hf_model: torch.nn.Module) -> None:
    (prompt,) = random_prompts([6], seed=7)
    allowed = [*range(40, 90), 500, 977]

    def only_allowed(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0
        return logits + mask

    got = engine_greedy(llm, prompt, 10, allowed_token_ids=allowed)
    assert got == hf_greedy(hf_model, prompt, 10, only_allowed)
    sampled = SamplingParams(
        temperature=1.5, seed=3, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed
    )
    assert set(generate(llm, [prompt], sampled)[0].outputs[0].token_ids) <= set(allowed)


def test_bad_words_tokenisation_follows_vllm(llm: LLM) -> None:
    tok = llm.llm_engine.tokenizer
    assert tok is not None
    for word in ("hello", " world", "capital city"):
        alone = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        assert llm.llm_engine.requests.bad_words_token_ids([word]) == want


def test_bad_words_match_a_float64_oracle(llm: LLM, hf_model: torch.nn.Module) -> None:
    """Banned: the last token of a bad word's tokenisation wherever the output ends with the
    others (vLLM: output tokens only); greedy decoding equals transformers' under that rule."""
    tok = llm.llm_engine.tokenizer
    assert tok is not None
    (prompt,) = random_prompts([5], seed=8)
    plain = engine_greedy(llm, prompt, 12)
    # words the unconstrained output contains: one token, and two tokens that re-encode as such
    words = [tok.decode([plain[1]]).strip() or "x"]
    for i in range(3, 10):
        text = tok.decode(plain[i : i + 2])
        if tok.encode(text.lstrip(), add_special_tokens=False) == plain[i : i + 2] and text.strip():
            words.append(text)
            break
    banned_ids = llm.llm_engine.requests.bad_words_token_ids(words)

    def ban(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for w in banned_ids:
            if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1 :] == w[:-1]):
                logits[w[-1]] = float("-inf")
        return logits

    got = engine_greedy(llm, prompt, 12, bad_words=words)
    assert got == hf_greedy(hf_model, prompt, 12, ban)
    assert got != plain, "the bad words were meant to change the output"


def test_processors_with_sampling_and_penalties_keep_the_seeded_noise(llm: LLM) -> None:
    """A bias of 0 on every token changes nothing: the processors add to the logits and nothing
    else (the noise of a seeded request is the same)."""
    base: dict[str, Any] = {"temperature": 0.9, "seed": 21, "max_tokens": 12, "ignore_eos": True}
    plain = generate(llm, [PROMPT], SamplingParams(**base))[0].outputs[0].token_ids
    zero = SamplingParams(
        **base, logit_bias=dict.fromkeys(range(VOCAB), 0.0), allowed_token_ids=list(range(VOCAB))
    )
    assert generate(llm, [PROMPT], zero)[0].outputs[0].token_ids == plain


# ---------------------------------------------------------------------------- prompts and text


def test_truncate_prompt_tokens_keeps_the_last_k(llm: LLM) -> None:
    (prompt,) = random_prompts([30], seed=9)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (cut,) = generate(
        llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=11)
    )
    (ref,) = generate(llm, [prompt[-11:]], sp)
    assert cut.prompt_token_ids == prompt[-11:]
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids
    text = llm.generate([PROMPT], SamplingParams(max_tokens=1, truncate_prompt_tokens=2), use_tqdm=False)[0]
    assert text.prompt == PROMPT and text.prompt_token_ids == llm.llm_engine.tokenizer.encode(PROMPT)[-2:]  # type: ignore[union-attr]
    # -1: as many as leave room for max_tokens, so a prompt past max_model_len is served (its
    # last 128 - 1 tokens for max_tokens=1)
    long = random_prompts([300], seed=10)[0]
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        generate(llm, [long], SamplingParams(max_tokens=1))
    (out,) = generate(llm, [long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == long[-127:] and out.outputs[0].finish_reason == "length"


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    base: dict[str, Any] = {"temperature": 0.7, "seed": 4, "max_tokens": 8, "ignore_eos": True, "logprobs": 2}
    (with_text,) = llm.generate([PROMPT], SamplingParams(**base, prompt_logprobs=1), use_tqdm=False)
    (ids_only,) = llm.generate(
        [PROMPT], SamplingParams(**base, prompt_logprobs=1, detokenize=False), use_tqdm=False
    )
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert a.text and b.text == ""
    assert a.token_ids == b.token_ids
    assert b.logprobs is not None and a.logprobs is not None
    assert all(v.decoded_token is None for lp in b.logprobs for v in lp.values())
    assert all(v.decoded_token is not None for lp in a.logprobs for v in lp.values())
    assert [{t: v.logprob for t, v in lp.items()} for lp in a.logprobs] == [
        {t: v.logprob for t, v in lp.items()} for lp in b.logprobs
    ]
    assert ids_only.prompt_logprobs is not None
    assert all(v.decoded_token is None for e in ids_only.prompt_logprobs if e for v in e.values())
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])


# ---------------------------------------------------------------------------- metrics


def test_metrics_and_num_cached_tokens() -> None:
    llm = make_llm(enable_prefix_caching=True)
    prompt = random_prompts([40], seed=11)[0]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (first,) = generate(llm, [prompt], sp)
    (second,) = generate(llm, [prompt], sp)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32  # two full blocks of 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    for out in (first, second):
        m = out.metrics
        assert m is not None and m.finished_time is not None and m.first_scheduled_time is not None
        assert m.first_token_time is not None and m.last_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert first.metrics.finished_time <= second.metrics.arrival_time  # type: ignore[union-attr]
    (group,) = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=4, seed=1), use_tqdm=False)
    assert group.metrics is not None and group.metrics.finished_time is not None


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 2, "best_of": 1}, r"best_of must be an integer >= n \(2\) or None, got 1"),
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"logprobs": -2}, "logprobs must be an integer >= -1"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be an integer >= -1"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias must be a dict"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias must be a dict"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must be a dict"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [1, -3]}, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-blank strings"),
        ({"bad_words": "word"}, "bad_words must be a list"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1, -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be"),
        ({"detokenize": 0}, "detokenize must be a bool"),
    ],
)
def test_invalid_new_fields(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logit_bias": {978: 1.0}}, r"logit_bias: token id 978 is outside the vocabulary \[0, 978\)"),
        ({"allowed_token_ids": [5, 1000]}, "allowed_token_ids: token id 1000 is outside"),
        ({"prompt_logprobs": 979}, "prompt_logprobs=979 exceeds the vocabulary size 978"),
    ],
)
def test_model_limits_of_new_fields(llm: LLM, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"prompt 0: {match}"):
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()


def test_fields_set_after_construction_are_honoured(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sp.n = 2
    sp.prompt_logprobs = 1
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert len(out.outputs) == 2 and out.prompt_logprobs is not None
    sp.best_of = 1  # now below n
    with pytest.raises(ValueError, match=r"prompt 0: best_of must be an integer >= n \(2\)"):
        llm.generate([PROMPT], sp, use_tqdm=False)


# ---------------------------------------------------------------------------- speculative decoding


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", tiny_config(), seed=3)


def test_features_with_speculative_decoding_equal_plain_decoding(mtp_ckpt: Path) -> None:
    args: dict[str, Any] = {
        "backend": "reference",
        "dtype": "float32",
        "block_size": 8,
        "max_model_len": 96,
        "max_num_batched_tokens": 16,
    }
    prompts = [
        {"prompt_token_ids": [5 + (7 * i + 3 * j) % 120 for j in range(n)]} for i, n in enumerate([3, 21, 9])
    ]
    params = [
        SamplingParams(
            temperature=0.8, top_k=40, seed=1, max_tokens=10, ignore_eos=True, n=2, prompt_logprobs=2
        ),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={7: 3.0}, prompt_logprobs=0),
        SamplingParams(temperature=0.9, seed=2, max_tokens=8, ignore_eos=True, best_of=3, n=2, logprobs=1),
    ]

    def run(llm: LLM) -> list[Any]:
        return [
            (
                [(c.index, c.token_ids, round(c.cumulative_logprob or 0.0, 4)) for c in o.outputs],
                [
                    None if e is None else sorted((t, round(v.logprob, 4)) for t, v in e.items())
                    for e in o.prompt_logprobs or []
                ],
            )
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]

    plain = LLM(str(mtp_ckpt), **args, async_scheduling=False, enforce_eager=True)
    spec = LLM(str(mtp_ckpt), **args, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert run(spec) == run(plain)
    assert spec.llm_engine.num_draft_tokens > 0

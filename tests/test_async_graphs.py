"""Async scheduling and decode graphs change no request's output.

The baseline is the plain engine: synchronous steps, eager forwards. Against it, token for token
(and text, finish reasons, log-probabilities): async scheduling, graph replays padded to the
batch-size buckets, and both, under greedy and seeded sampling, penalties, stop strings,
min_tokens, structured output, several completions per prompt (n / best_of), whole-vocabulary
and prompt log-probabilities, logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens,
detokenize=False, preemption in a small KV pool, chunked prefill and prefix caching. The
reference backend's graphs are emulated (a replay runs the captured function again with its
capture-time host values), so a graph step here reads exactly what a real replay reads.
The same comparison runs on the cuda backend's kernels under the Triton interpreter
(tests/test_cuda_interpret.py) and, with real CUDA graphs, on a GPU (ci/gpu_check.sh).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams, StructuredOutputsParams, envs
from deepinfer.engine.graphs import graph_buckets, prefill_graph_shapes
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

PROMPTS = ["The capital of France is", "Hello", "def fibonacci(n):", "1, 2, 3,", "import os", "Once"]
MODES = {
    "async": {"async_scheduling": True, "enforce_eager": True},
    "graphs": {"async_scheduling": False, "enforce_eager": False},
    "async+graphs": {"async_scheduling": True, "enforce_eager": False},
}
BASELINE = {"async_scheduling": False, "enforce_eager": True}


def make(backend: str, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": backend, "dtype": "float32", "block_size": 16, "max_model_len": 128}
    return LLM(str(TINY), **{**args, **kw})


def mixed_params() -> list[SamplingParams]:
    """One request of each kind, different lengths so that requests leave the batch at different
    steps (the batch shrinks through the buckets)."""
    return [
        SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=13, logprobs=3),
        SamplingParams(temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=15),
        SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=6, max_tokens=19, stop=["e"]),
        SamplingParams(temperature=0.8, seed=2, max_tokens=9, stop_token_ids=[5, 9, 13]),
    ]


def outputs(llm: LLM, params: list[SamplingParams], prompts: list[str] = PROMPTS) -> list[tuple[Any, ...]]:
    res = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            r.outputs[0].token_ids,
            r.outputs[0].text,
            r.outputs[0].finish_reason,
            r.outputs[0].stop_reason,
            [
                sorted((t, round(v.logprob, 4), v.rank) for t, v in lp.items())
                for lp in r.outputs[0].logprobs or []
            ],
        )
        for r in res
    ]


def graph_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (batch size, bucket) of every step the worker serves from a graph."""
    graphs = llm.llm_engine.worker.decode_graphs
    real = graphs.bucket_for
    seen: list[tuple[int, int]] = []

    def spy(batch: Any) -> int | None:
        bucket = real(batch)
        if bucket is not None:
            seen.append((len(batch), bucket))
        return bucket

    monkeypatch.setattr(graphs, "bucket_for", spy)
    return seen


# cuda under the Triton interpreter (tests/test_cuda_interpret.py), or on a GPU with
# DEEPINFER_TEST_BACKEND=cuda (ci/gpu_check.sh: real CUDA graphs)
BACKENDS = [envs.read().test_backend or ("cuda" if INTERPRET else "reference")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 48},  # preemption, chunked prefill
        {"enable_prefix_caching": True, "max_num_batched_tokens": 24},
    ],
    ids=["plain", "preempting", "prefix-cache"],
)
def test_async_and_graphs_equal_the_plain_engine(
    backend: str, engine_args: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    params = mixed_params()
    prompts = PROMPTS
    if "enable_prefix_caching" in engine_args:  # shared prefixes: later requests hit the cache
        prompts = [(PROMPTS[0] + " ") * 5 + p for p in PROMPTS]
    baseline = make(backend, **BASELINE, **engine_args)
    expected = outputs(baseline, params, prompts)
    # the Triton interpreter (minutes per engine): both together, the kernels' graphs and padding;
    # each alone runs on the reference backend and on a GPU
    modes = {"async+graphs": MODES["async+graphs"]} if INTERPRET else MODES
    for name, mode in modes.items():
        llm = make(backend, **mode, **engine_args)
        seen = graph_steps(llm, monkeypatch)
        assert outputs(llm, params, prompts) == expected, name
        if not mode["enforce_eager"]:
            assert seen, f"{name}: no step replayed a graph"
            assert any(b < bucket for b, bucket in seen), f"{name}: no step was padded to its bucket"
            assert llm.llm_engine.worker.num_prefill_graph_steps > 0, f"{name}: no prefill graph step"
        if "num_gpu_blocks_override" in engine_args:
            assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        if "enable_prefix_caching" in engine_args:
            assert llm.llm_engine.block_manager.num_prefix_hits > 0
        engine = llm.llm_engine
        assert not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def feature_params() -> list[SamplingParams]:
    """The vLLM sampling features, one request each (with PROMPTS): several completions
    (n, best_of), whole-vocabulary and prompt log-probabilities, logit_bias, allowed_token_ids,
    bad_words, truncate_prompt_tokens, detokenize=False."""
    return [
        SamplingParams(
            n=3, temperature=0.9, top_k=30, seed=3, max_tokens=11, ignore_eos=True, prompt_logprobs=2
        ),
        SamplingParams(best_of=3, n=2, temperature=1.0, seed=8, max_tokens=14, logprobs=-1),
        SamplingParams(temperature=0.8, seed=1, max_tokens=9, logit_bias={5: 2.0, 9: -1.0, 200: 3.0}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=list(range(30, 330))),
        SamplingParams(temperature=0.7, seed=4, max_tokens=16, bad_words=["the", "is a"], prompt_logprobs=0),
        SamplingParams(
            temperature=0.6,
            seed=6,
            max_tokens=7,
            truncate_prompt_tokens=3,
            detokenize=False,
            logprobs=2,
            presence_penalty=0.4,
        ),
    ]


def feature_outputs(
    llm: LLM, params: list[SamplingParams], prompts: list[str]
) -> tuple[list[tuple[Any, ...]], list[float]]:
    """Everything but the log-probability values (token ids, texts, ranks of the logprob
    entries), and those values in order (compared within a tolerance: a whole vocabulary of
    float32 values rounded would sit on rounding boundaries)."""
    values: list[float] = []

    def entries(lps: Any) -> list[Any]:
        out = []
        for e in lps:
            if e is None:
                out.append(None)
                continue
            if len(e) < 100:
                out.append(sorted((t, v.rank) for t, v in e.items()))
            else:  # a whole vocabulary: near-ties may swap ranks; each rank is there once
                out.append((sorted(e), sorted(v.rank for v in e.values())))
            values.extend(v.logprob for _, v in sorted(e.items()))
        return out

    def cumulative(c: Any) -> bool:
        if c.cumulative_logprob is not None:
            values.append(c.cumulative_logprob)
        return c.cumulative_logprob is None

    results = [
        (
            r.prompt_token_ids,
            entries(r.prompt_logprobs or []),
            [
                (
                    c.index,
                    c.token_ids,
                    c.text,
                    c.finish_reason,
                    c.stop_reason,
                    cumulative(c),
                    entries(c.logprobs or []),
                )
                for c in r.outputs
            ],
        )
        for r in llm.generate(prompts, params, use_tqdm=False)
    ]
    return results, values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 8},  # preemption, chunked prefill
        {"enable_prefix_caching": True, "max_num_batched_tokens": 24},
    ],
    ids=["plain", "preempting", "prefix-cache"],
)
def test_sampling_features_async_and_graphs(
    backend: str, engine_args: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The processors run between the forward graph and the draw; prompt log-probabilities need
    the hidden states of every prompt position, so those steps run eagerly (also when a chunk of
    one prompt token would fit a graph bucket): outputs equal the plain engine's."""
    params = feature_params()
    prompts = PROMPTS
    if "enable_prefix_caching" in engine_args:
        prompts = [(PROMPTS[0] + " ") * 5 + p for p in PROMPTS]
    baseline = make(backend, **BASELINE, **engine_args, max_logprobs=-1)
    expected, expected_values = feature_outputs(baseline, params, prompts)
    assert len(expected[0][2]) == 3 and len(expected[1][2]) == 2
    assert expected[5][2][0][2] == "" and len(expected[5][0]) <= 3
    for name, mode in MODES.items():
        llm = make(backend, **mode, **engine_args, max_logprobs=-1)
        seen = graph_steps(llm, monkeypatch)
        got, values = feature_outputs(llm, params, prompts)
        assert got == expected, name
        assert values == pytest.approx(expected_values, rel=0, abs=1e-4), name
        if not mode["enforce_eager"]:
            assert seen, f"{name}: no step replayed a graph"
        if "num_gpu_blocks_override" in engine_args:
            assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        if "enable_prefix_caching" in engine_args:
            assert llm.llm_engine.block_manager.num_prefix_hits > 0
        engine = llm.llm_engine
        assert not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


ONE_TOKEN_CHUNKS: dict[str, Any] = {"max_num_batched_tokens": 4, "max_num_seqs": 4}


def one_token_chunks(prompt_logprobs: int | None) -> tuple[list[Any], list[SamplingParams]]:
    """A budget of 4 tokens (ONE_TOKEN_CHUNKS) with 3 requests decoding leaves 1 token a step for
    the fourth request's 20-token prompt: steps of one-token rows, one of them a prompt chunk."""
    prompts: list[Any] = [{"prompt_token_ids": [5 + i, 9]} for i in range(3)]
    prompts.append({"prompt_token_ids": [3 + (7 * j) % 900 for j in range(20)]})
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    params.append(
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    )
    return prompts, params


def eager_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch, when: Callable[[Any], bool]) -> list[int]:
    """Record the size of every one-token-rows step for which when(batch) holds, asserting that
    the worker served it eagerly (no graph bucket)."""
    graphs = llm.llm_engine.worker.decode_graphs
    real = graphs.bucket_for
    seen: list[int] = []

    def spy(batch: Any) -> int | None:
        bucket = real(batch)
        if all(n == 1 for n in batch.num_new_tokens) and when(batch):
            assert bucket is None
            seen.append(len(batch))
        return bucket

    monkeypatch.setattr(graphs, "bucket_for", spy)
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_in_one_token_chunks(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """one_token_chunks with prompt_logprobs: such all-one-token steps would fit a graph bucket but
    run eagerly (they need the hidden states), and give the plain engine's log-probabilities."""
    prompts, params = one_token_chunks(prompt_logprobs=3)
    expected = feature_outputs(make(backend, **BASELINE, **ONE_TOKEN_CHUNKS), params, prompts)
    for name, mode in MODES.items():
        llm = make(backend, **mode, **ONE_TOKEN_CHUNKS)
        forced = eager_steps(llm, monkeypatch, lambda b: any(s.wants_prompt_logprobs for s in b.seqs))
        got = feature_outputs(llm, params, prompts)
        assert got[0] == expected[0], name
        assert got[1] == pytest.approx(expected[1], rel=0, abs=1e-4), name
        assert forced, f"{name}: no prompt chunk of one token"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_prompt_chunks_beside_decodes(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """one_token_chunks without prompt log-probabilities: a step of one-token rows whose prompt
    chunk samples nothing runs eagerly (a decode graph's logits rows are its tokens, every one
    sampling), and the tokens are the plain engine's."""
    prompts, params = one_token_chunks(prompt_logprobs=None)
    expected = outputs(make(backend, **BASELINE, **ONE_TOKEN_CHUNKS), params, prompts)
    for name, mode in MODES.items():
        llm = make(backend, **mode, **ONE_TOKEN_CHUNKS)
        chunks = eager_steps(
            llm, monkeypatch, lambda b: any(s.num_computed_tokens + 1 != s.num_tokens for s in b.seqs)
        )
        assert outputs(llm, params, prompts) == expected, name
        assert chunks, f"{name}: no prompt chunk of one token beside the decodes"


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_output_async_and_graphs(backend: str) -> None:
    pytest.importorskip("xgrammar")
    regex = StructuredOutputsParams(regex=r"[a-z]{3,8}( [0-9]{1,3}){2}")
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=24, structured_outputs=regex) for i in range(3)
    ] + [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    prompts = PROMPTS[:4]
    expected = outputs(make(backend, **BASELINE), params, prompts)
    for name, mode in MODES.items():
        assert outputs(make(backend, **mode), params, prompts) == expected, name


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", tiny_config(), seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_decoding_with_async_scheduling_equals_plain_decoding(
    backend: str, mtp_ckpt: Path
) -> None:
    """Steps with drafts run synchronously (the in-flight tokens read first) while async
    scheduling and graphs stay on for the engine's plain steps; outputs stay exact."""
    args: dict[str, Any] = {"backend": backend, "dtype": "float32", "block_size": 8, "max_model_len": 96}
    prompts = [
        {"prompt_token_ids": [5 + (7 * i + 3 * j) % 120 for j in range(n)]} for i, n in enumerate([3, 17, 9])
    ]
    params = [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)
    ]
    plain = LLM(str(mtp_ckpt), **args, async_scheduling=False, enforce_eager=True)
    spec = LLM(str(mtp_ckpt), **args, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec.llm_engine.async_scheduling
    got = [r.outputs[0].token_ids for r in spec.generate(prompts, params, use_tqdm=False)]
    assert got == [r.outputs[0].token_ids for r in plain.generate(prompts, params, use_tqdm=False)]
    assert spec.llm_engine.num_draft_tokens > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_does_not_depend_on_the_batch(backend: str) -> None:
    """The noise is a function of (seed, position): a seeded request alone and among others
    (with graphs and async scheduling on) samples the same tokens."""
    llm = make(backend)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7)]
    batch = llm.generate(PROMPTS[:4], [others[0], others[1], p, others[2]], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone


def test_graph_buckets_cover_every_batch_size() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(256)[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80]
    assert graph_buckets(256)[-1] == 256
    for n in (3, 7, 100, 255, 300):
        buckets = graph_buckets(n)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= n and buckets[-2] < n


def test_enforce_eager_captures_nothing() -> None:
    assert not make("reference", enforce_eager=True).llm_engine.worker.decode_graphs
    llm = make("reference", max_num_seqs=20)
    assert sorted(llm.llm_engine.worker.decode_graphs) == graph_buckets(20)  # the last bucket, 24, > 20
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=3, ignore_eos=True)
    assert all(len(r.outputs[0].token_ids) == 3 for r in llm.generate(PROMPTS * 4, params, use_tqdm=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_graphs_equal_eager_prefills(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill steps of a few requests replay prefill graphs, each request padded to a width
    (prompt chunks of 40 tokens, one request or several, decode rows among them); a chunk whose
    padding would pass max_model_len runs eagerly. Tokens and log-probabilities are the eager
    engine's."""
    engine_args = {"max_model_len": 128, "max_num_batched_tokens": 40}
    prompts: list[Any] = [
        {"prompt_token_ids": [7 + (i * 13) % 500 for i in range(n)]} for n in (5, 33, 9, 120)
    ]
    params = [
        SamplingParams(temperature=0.8, seed=4, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, seed=9, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
    ]
    expected = outputs(make(backend, **BASELINE, **engine_args), params, prompts)
    llm = make(backend, async_scheduling=True, **engine_args)
    worker = llm.llm_engine.worker
    assert (1, 16) in worker.prefill_graphs and (8, 128) in worker.prefill_graphs
    real = worker.prefill_graphs.shape_for
    served: list[tuple[int, int]] = []
    eager: list[int] = []  # the request count of prefill steps that ran eagerly

    def spy(batch: Any, max_model_len: int) -> tuple[int, int] | None:
        shape = real(batch, max_model_len)
        if shape is not None:
            served.append(shape)
            b, q = shape
            assert len(batch) <= b and max(batch.num_new_tokens) <= q
            assert all(s.num_computed_tokens + q <= 128 for s in batch.seqs)
        elif any(n > 1 for n in batch.num_new_tokens):
            eager.append(len(batch))
        return shape

    monkeypatch.setattr(worker.prefill_graphs, "shape_for", spy)
    assert outputs(llm, params, prompts) == expected
    assert served and eager, (served, eager)  # the 120-token prompt's later chunks ran eagerly
    assert any(b > 1 for b, _ in served)
    assert worker.num_prefill_graph_steps == len(served)


def test_prefill_graph_shapes() -> None:
    shapes = prefill_graph_shapes(256, 1024, 4096)
    assert (1, 16) in shapes and (1, 512) in shapes and (8, 128) in shapes and (2, 512) in shapes
    assert all(b * q <= 1024 for b, q in shapes) and (4, 512) not in shapes
    assert prefill_graph_shapes(2, 1024, 4096) == [(b, q) for b, q in shapes if b <= 2]
    assert max(q for _, q in prefill_graph_shapes(256, 1024, 100)) == 64
    assert prefill_graph_shapes(256, 0, 4096) == []
    assert not make("reference", max_prefill_graph_tokens=0).llm_engine.worker.prefill_graphs
    assert not make("reference", enforce_eager=True).llm_engine.worker.prefill_graphs


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_mode_with_graphs_and_async(backend: str) -> None:
    """batch_invariant=True: a request's tokens AND log-probabilities are bitwise the same alone
    and in batches of other sizes (other buckets, other padding), graphs and async scheduling on."""
    llm = make(backend, dtype="bfloat16", batch_invariant=True)
    assert llm.llm_engine.worker.decode_graphs and llm.llm_engine.async_scheduling
    p = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(prompts: list[str], at: int) -> tuple[list[int], list[list[tuple[int, float]]]]:
        params = [
            SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))
        ]
        params[at] = p
        out = llm.generate(prompts, params, use_tqdm=False)[at].outputs[0]
        assert out.logprobs is not None
        return out.token_ids, [sorted((t, v.logprob) for t, v in lp.items()) for lp in out.logprobs]

    alone = run([PROMPTS[0]], 0)
    assert run([PROMPTS[1], PROMPTS[0], PROMPTS[2]], 1) == alone
    assert run(PROMPTS, 0) == alone


@pytest.mark.parametrize("mode", list(MODES))
def test_context_limit_with_chunked_prefill(mode: str) -> None:
    """A prompt of exactly max_model_len tokens, prefilled in chunks, gets one token; one near
    the limit stops there ("length"), with the last token still in flight under async."""
    llm = make("reference", **MODES[mode], max_model_len=64, max_num_batched_tokens=16)
    full = {"prompt_token_ids": [3 + i % 900 for i in range(64)]}
    near = {"prompt_token_ids": [5 + i % 900 for i in range(57)]}
    out = llm.generate(
        [full, near], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )
    assert [len(r.outputs[0].token_ids) for r in out] == [1, 7]
    assert [r.outputs[0].finish_reason for r in out] == ["length", "length"]

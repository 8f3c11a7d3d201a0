"""Speculative decoding with the checkpoint's MTP head (speculative_config): the outputs are those
of plain decoding, greedy and seeded sampling, through chunked prefill, preemption and prefix
caching, in eager steps and in verification graph replays (chained or not), and with batches
too large for those graphs; right drafts are accepted (fewer steps), wrong ones rejected; the
head's incremental drafts, eager or drafted inside the graphs, equal a from-scratch computation
over the whole sequence and each other; bad configurations are errors.

Drafts of a random MTP head are almost never right; `mirrored` is a checkpoint whose head mostly
drafts what the model samples (write_mirrored_mtp_checkpoint), so that accepted drafts (the
head's cache written at the accepted rows only) are exercised too."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    tiny_config,
    write_mirrored_mtp_checkpoint,
    write_random_checkpoint,
)
from deepinfer.testing.paged_runner import PagedRunner, build_batch

SPEC = {"method": "mtp", "num_speculative_tokens": 1}
PROMPTS = [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 66, 1])]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", tiny_config(), seed=3)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mirrored_mtp_checkpoint(tmp_path_factory.mktemp("mirrored") / "ckpt", seed=3)


def make(ckpt: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 256}
    return LLM(str(ckpt), **{**args, **kw})


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill, drafts dropped when the budget is short
        {"num_gpu_blocks_override": 16, "max_model_len": 128, "max_num_batched_tokens": 64},  # preemptions
        {"enable_prefix_caching": True},
    ],
    ids=["plain", "chunked", "preempting", "prefix-cache"],
)
def test_outputs_equal_plain_decoding(ckpt: Path, engine_args: dict[str, Any], k: int) -> None:
    plain = make(ckpt, **engine_args)
    spec = make(ckpt, speculative_config={**SPEC, "num_speculative_tokens": k}, **engine_args)
    assert run(spec, GREEDY) == run(plain, GREEDY)
    assert run(spec, SEEDED) == run(plain, SEEDED)
    assert spec.llm_engine.num_draft_tokens > 0
    assert spec.llm_engine.speculative is not None and spec.llm_engine.speculative.num_graph_steps > 0
    if "num_gpu_blocks_override" in engine_args:
        assert spec.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 3])
def test_right_drafts_are_accepted_and_wrong_ones_rejected(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """Drafts from an oracle that knows plain decoding's output, one in four wrong: the output
    is unchanged, every right draft up to the first wrong one is accepted, and the run takes
    fewer steps. Eager steps: the oracle stands in for their proposals."""
    plain = make(ckpt)
    expected = run(plain, GREEDY)
    by_prompt = {tuple(p): p + out for p, out in zip(PROMPTS, expected)}
    spec = make(ckpt, speculative_config={**SPEC, "num_speculative_tokens": k}, enforce_eager=True)
    engine = spec.llm_engine
    calls = {"n": 0, "right": 0}

    def oracle(seqs, spans, rows, wants, limits):  # type: ignore[no-untyped-def]
        drafts = []
        for seq, want in zip(seqs, wants):
            full = by_prompt[tuple(seq.prompt_token_ids)]
            chain, prefix_right = [], True
            for i in range(want):
                n = seq.num_tokens + i
                calls["n"] += 1
                right = n < len(full) and calls["n"] % 4 != 0
                truth = full[n] if n < len(full) else 0
                prefix_right = prefix_right and right
                calls["right"] += prefix_right and n < len(full) - 1  # verifiable and acceptable
                chain.append((truth if right else (truth + 1) % 128, 1.0))
            drafts.append(chain)
        return drafts

    monkeypatch.setattr(engine.worker, "propose", oracle)
    steps = {"n": 0}
    real_step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        steps["n"] += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counting_step)
    assert run(spec, GREEDY) == expected
    # every right draft after right ones is accepted, except when max_tokens ends the request
    # first; a wrong draft and all after it are rejected
    assert 0 < engine.num_accepted_tokens <= calls["right"]
    assert engine.num_accepted_tokens >= calls["right"] - k * len(PROMPTS)
    assert engine.num_draft_tokens > engine.num_accepted_tokens
    # plain decoding takes 24 steps for 24 tokens (the prefill step samples the first)
    assert 24 // (k + 1) <= steps["n"] < 24


def fresh_drafts(model: Any, tokens: list[int], k: int) -> list[int]:
    """k drafts after `tokens`, with the MTP head run from scratch (fresh caches): over every
    position, then chained on its own output and its previous draft."""
    backend = model.backend
    main = PagedRunner(model, backend, num_blocks=64, block_size=8)
    main.step([(0, tokens)], all_logits=True)
    assert main.last_hidden is not None
    mtp = PagedRunner(model, backend, num_blocks=64, block_size=8, seed=1)
    batch = build_batch(mtp.alloc, [(0, tokens[1:])], mtp.device, all_logits=True)
    h = model.forward_mtp(batch, main.last_hidden[:-1], mtp.kv_caches[:1])[-1:]
    drafts = [int(model.compute_logits(h).argmax())]
    for _ in range(k - 1):
        batch = build_batch(mtp.alloc, [(0, drafts[-1:])], mtp.device, all_logits=True)
        h = model.forward_mtp(batch, h, mtp.kv_caches[:1])
        drafts.append(int(model.compute_logits(h).argmax()))
    return drafts


def record_drafts(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, ...], list[int]]:
    """token ids of a request -> the drafts the engine proposed after them (from eager steps'
    proposals and from verification graph steps alike, before the confidence cut)."""
    decoder = llm.llm_engine.speculative
    assert decoder is not None
    seen: dict[tuple[int, ...], list[int]] = {}
    real = decoder._keep_confident

    def record(seq, chain):  # type: ignore[no-untyped-def]
        chain = list(chain)
        if chain:
            seen[tuple(seq.token_ids)] = [d for d, _ in chain]
        real(seq, chain)

    monkeypatch.setattr(decoder, "_keep_confident", record)
    return seen


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_equal_a_fresh_computation(
    mirrored: Path, monkeypatch: pytest.MonkeyPatch, k: int, eager: bool
) -> None:
    """The head's drafts after incremental steps (chunked prefill, then decode, its own paged
    cache written at the accepted rows, chained drafts whose cache rows are rewritten later)
    equal the head run once over the whole sequence with fresh caches: drafted by eager steps,
    and inside verification graph replays (chained)."""
    spec = make(
        mirrored, speculative_config={**SPEC, "num_speculative_tokens": k}, max_num_batched_tokens=24,
        enforce_eager=eager,
    )  # fmt: skip
    seen = record_drafts(spec, monkeypatch)
    run(spec, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    decoder = spec.llm_engine.speculative
    assert decoder is not None and (decoder.num_graph_steps > 0) == (not eager)
    assert spec.llm_engine.num_accepted_tokens > 0
    assert len(seen) >= len(PROMPTS) * 4

    model: Any = load_model(str(mirrored), create_reference_backend(), torch.float32)
    items = sorted(seen.items())
    for tokens, drafts in items[:: max(1, len(items) // 12)]:
        assert len(drafts) == min(k, 256 - len(tokens))
        assert fresh_drafts(model, list(tokens), len(drafts)) == drafts


@pytest.mark.parametrize("k", [2, 3])
def test_graph_drafts_equal_eager_drafts(mirrored: Path, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """Eager steps, verification graph steps, and chained graph steps: the same outputs as plain
    decoding (greedy and seeded), the same drafts after the same tokens, and as many of them
    accepted."""
    params = [GREEDY, *SEEDED[:3], GREEDY, SEEDED[4]]
    want = run(make(mirrored), params)
    drafts, counts = [], []
    for eager, overlap in ((True, False), (False, False), (False, True)):
        llm = make(mirrored, speculative_config={**SPEC, "num_speculative_tokens": k}, enforce_eager=eager)
        decoder = llm.llm_engine.speculative
        assert decoder is not None
        decoder.overlap = overlap
        chained = {"n": 0}
        real = llm.llm_engine.worker.verify_launch

        def count(batch, *args, real=real, chained=chained):  # type: ignore[no-untyped-def]
            chained["n"] += batch is None
            return real(batch, *args)

        monkeypatch.setattr(llm.llm_engine.worker, "verify_launch", count)
        drafts.append(record_drafts(llm, monkeypatch))
        assert run(llm, params) == want
        assert (decoder.num_graph_steps > 0) == (not eager) and (chained["n"] > 0) == overlap
        counts.append((llm.llm_engine.num_draft_tokens, llm.llm_engine.num_accepted_tokens))
    assert counts[0][1] > 0 and counts[0] == counts[1] == counts[2]
    for graph in drafts[1:]:
        common = set(drafts[0]) & set(graph)
        assert len(common) >= len(drafts[0]) // 2
        assert all(drafts[0][t] == graph[t] for t in common)


def test_graph_drafting_writes_the_accepted_rows_only(mirrored: Path) -> None:
    """mtp_drafts, the drafting inside a verification graph, against the MTP head run by hand:
    the same drafts and confidences; the head's cache written at the accepted rows and at the
    chained drafts' rows below the limit, every other row (rejected drafts, padding, rows past
    the limit, other requests' blocks) untouched."""
    from deepinfer.backend.types import AttentionMetadata
    from deepinfer.engine.drafters import mtp_drafts
    from deepinfer.models.forward_batch import ForwardBatch

    model: Any = load_model(str(mirrored), create_reference_backend(), torch.float32)
    bs, q, k = 8, 3, 3
    gen = torch.Generator().manual_seed(0)
    before = torch.randn((8, bs, 40), generator=gen)  # (NB, BS, D): stale rows everywhere
    # request b starts at starts[b] (blocks tables[b]) with a accepted; a third is padding
    starts, accepted, limits = [10, 5, 0], [2, 0, 0], [16, 7, 0]
    tables = torch.tensor([[1, 2], [3, 0], [0, 0]], dtype=torch.int32)
    sampled = torch.randint(2, 128, (3, q), generator=gen)
    hidden = torch.randn((3 * q, 64), generator=gen)
    pos = torch.tensor(starts)[:, None] + torch.arange(q)
    slots = tables.long().gather(1, pos // bs) * bs + pos % bs
    slots[2] = -1
    fb = ForwardBatch(
        input_ids=sampled.view(-1), positions=pos.view(-1), slot_mapping=slots.view(-1),
        attn=AttentionMetadata(
            block_tables=tables, seq_lens=(pos[:, -1] + 1).int(),
            query_start_loc=torch.arange(0, 4 * q, q, dtype=torch.int32), seq_lens_host=(64,) * 3,
            query_lens_host=(q,) * 3, max_query_len=q, max_seq_len=64,
        ),
        logits_indices=torch.arange(3 * q),
    )  # fmt: skip
    spec = model.kv_cache_spec(8, bs)
    graph = model.backend.kv_cache.allocate(spec, 1)
    graph[0].tensors[0].copy_(before)
    drafts, conf = mtp_drafts(
        model, graph, bs, fb, sampled, hidden, torch.tensor(accepted), torch.tensor(limits), k
    )
    hand = model.backend.kv_cache.allocate(spec, 1)
    hand[0].tensors[0].copy_(before)
    written = torch.zeros((8, bs), dtype=torch.bool)
    for b in range(2):  # the head over rows 0..a, then chained while its rows are below the limit
        n, table = accepted[b] + 1, tables[b : b + 1]
        p = torch.arange(starts[b], starts[b] + n)
        one = ForwardBatch(
            input_ids=sampled[b, :n], positions=p, slot_mapping=slots[b, :n],
            attn=AttentionMetadata.build(table, [starts[b] + n], [n]), logits_indices=torch.tensor([n - 1]),
        )  # fmt: skip
        h = model.forward_mtp(one, hidden[b * q : b * q + n], hand)[-1:]
        want, chance = [], 1.0
        for i in range(k):
            probs = torch.softmax(model.compute_logits(h), dim=-1)[0]
            want.append(int(probs.argmax()))
            chance *= float(probs.max())
            assert drafts[b, i] == want[-1] and float(conf[b, i]) == pytest.approx(chance, rel=1e-5)
            at = starts[b] + n + i
            if i == k - 1 or at >= limits[b]:  # the next draft's row would not be written
                break
            slot = int(table[0, at // bs]) * bs + at % bs
            one = ForwardBatch(
                input_ids=torch.tensor(want[-1:]), positions=torch.tensor([at]),
                slot_mapping=torch.tensor([slot]), attn=AttentionMetadata.build(table, [at + 1], [1]),
                logits_indices=torch.tensor([0]),
            )  # fmt: skip
            h = model.forward_mtp(one, h, hand)
        for row in [
            *range(starts[b], starts[b] + n),
            *range(starts[b] + n, min(starts[b] + n + k - 1, limits[b])),
        ]:
            written[int(tables[b, row // bs]), row % bs] = True
    out, ref = graph[0].tensors[0], hand[0].tensors[0]
    assert torch.equal(out[~written], before[~written])  # untouched: rejected, padding, past limits
    assert not torch.equal(out[written], before[written])
    torch.testing.assert_close(out[written], ref[written], rtol=1e-5, atol=1e-5)


def test_batches_past_64_requests_verify_in_graphs(mirrored: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """72 requests (the graph bucket of 80): their verification steps replay graphs (none runs
    eagerly once every request decodes), and the outputs are plain decoding's, greedy and seeded.
    The graph memory reserve is that of the largest verification step: its forward and draw
    (measured; here a stand-in per (bucket, width)) and the graphs' copies of its rows."""
    n = 72
    prompts = [{"prompt_token_ids": [5 + (7 * i + 3 * j) % 120 for j in range(3 + i % 5)]} for i in range(n)]
    params = [  # greedy and seeded, short and long
        SamplingParams(temperature=0.8 * (i % 3 > 0), seed=i, max_tokens=3 if i % 2 else 12, ignore_eos=True)
        for i in range(n)
    ]

    def outputs(llm: LLM) -> list[list[int]]:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]

    want = outputs(make(mirrored))
    llm = make(mirrored, speculative_config={**SPEC, "num_speculative_tokens": 2}, max_num_seqs=n)
    worker = llm.llm_engine.worker
    assert max(b for b, _ in worker.verify_graphs) == 80
    graphs = worker.verify_graphs
    real = graphs.bucket_for
    seen: list[tuple[int, bool]] = []  # (requests, served by a graph) of every drafting step that decodes

    def spy(batch: Any) -> tuple[int, int] | None:
        graph = real(batch)
        if all(n == 1 + nd for n, nd in zip(batch.num_new_tokens, batch.num_draft_tokens)):
            seen.append((len(batch), graph is not None))
        return graph

    monkeypatch.setattr(graphs, "bucket_for", spy)
    assert outputs(llm) == want
    assert any(b > 64 and g for b, g in seen) and all(g for _, g in seen)
    spec = llm.llm_engine.speculative
    assert spec is not None and spec.num_graph_steps > 0
    assert llm.llm_engine.num_accepted_tokens > 0

    def stand_in(bucket: int, width: int | None = None, prefill: bool = False) -> int:
        return 1000 * bucket * (1 + (width or 0))

    monkeypatch.setattr(worker, "_step_memory_bytes", stand_in)
    buckets = sorted({b for b, _ in graphs})
    hidden_bytes = 4 * llm.llm_engine.model.config.hidden_size  # float32 rows
    rows = 80 * 3
    assert worker._graph_reserve(buckets, buckets, []) == 1000 * rows + rows * (4 * 128 + hidden_bytes + 8)
    assert worker._graph_reserve(buckets, [], []) == 1000 * 80


def test_mtp_steps_run_eagerly_where_graphs_cannot_serve_them(
    mirrored: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No verification graphs (decode graphs stay), eager steps, plain decoding's outputs: at a
    max_model_len whose padding drafts would leave the rope table (here without its padding
    rows), and on a backend
    whose graphs cannot compute attention lengths (DeviceOps.graph_lengths_on_device)."""
    import deepinfer.models.deepseek as deepseek_model
    from deepinfer.reference.backend import ReferenceDevice

    want = run(make(mirrored), GREEDY)
    spec = {**SPEC, "num_speculative_tokens": 3}
    for args, on_device in (({"max_model_len": 510}, True), ({}, False)):
        monkeypatch.setattr(ReferenceDevice, "graph_lengths_on_device", on_device)
        monkeypatch.setattr(deepseek_model, "SPECULATIVE_PADDING_POSITIONS", 0 if on_device else 32)
        llm = make(mirrored, speculative_config=spec, **args)
        engine = llm.llm_engine
        assert engine.worker.decode_graphs and not engine.worker.verify_graphs
        assert run(llm, GREEDY) == want
        assert engine.speculative is not None and engine.speculative.num_graph_steps == 0
        assert engine.num_accepted_tokens > 0


def test_confidence_threshold_schedules_only_likely_drafts(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts the head is less sure of than min_draft_confidence are not verified; outputs stay.
    Eager steps: the test marks the confidences of their proposals."""
    expected = run(make(ckpt), GREEDY)
    spec = make(ckpt, speculative_config={**SPEC, "min_draft_confidence": 0.5}, enforce_eager=True)
    worker = spec.llm_engine.worker
    real = worker.propose
    confident = {"n": 0, "all": 0}

    def sure_every_other(seqs, spans, rows, wants, limits):  # type: ignore[no-untyped-def]
        out = []
        for i, chain in enumerate(real(seqs, spans, rows, wants, limits)):
            confident["all"] += 1
            confident["n"] += i % 2 == 0
            out.append([(d, 0.9 if i % 2 == 0 else 0.1) for d, _ in chain])
        return out

    monkeypatch.setattr(worker, "propose", sure_every_other)
    assert run(spec, GREEDY) == expected
    assert 0 < spec.llm_engine.num_draft_tokens <= confident["n"] < confident["all"]


def test_bad_speculative_configs(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_draft_confidence must be in"):
        make(ckpt, speculative_config={**SPEC, "min_draft_confidence": 1.5})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 8\], got 9"):
        make(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 9})
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        make(ckpt, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="unknown keys"):
        make(ckpt, speculative_config={"method": "mtp", "model": "x"})
    no_mtp = write_random_checkpoint(tmp_path / "plain", tiny_config(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="has no MTP layer"):
        make(no_mtp, speculative_config=SPEC)


def test_max_model_len_stop_tokens_and_grammars_with_drafts(tmp_path: Path) -> None:
    """Drafts near the end of the context, stop tokens and a grammar: same outputs as plain."""
    from tiny_model import TINY as tiny  # the random tiny model's tokenizer (978 tokens)

    ckpt = write_random_checkpoint(tmp_path / "c", tiny_config(vocab_size=978), seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, ckpt / name)
    plain = make(ckpt, max_model_len=48)
    spec = make(ckpt, max_model_len=48, speculative_config=SPEC)

    def both(prompts: list[Any], params: SamplingParams) -> list[list[int]]:
        outs = []
        for llm in (plain, spec):
            outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)])
        assert outs[0] == outs[1]
        return outs[0]

    # prompts ending 1, 2 and 10 tokens before max_model_len: generation runs into the limit
    long = [{"prompt_token_ids": [3 + i % 900 for i in range(n)]} for n in (47, 46, 38)]
    out = both(long, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [len(t) for t in out] == [1, 2, 10]
    first = both(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first[5]])
    assert both(["Hello"], stop)[0][-1] == first[5]

    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(regex="[a-z]{2,6}-[0-9]{1,3}")
    both(["Hello", "The weather"], SamplingParams(temperature=0, max_tokens=16, structured_outputs=so))
    assert spec.llm_engine.num_draft_tokens > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_cuda_backend_outputs_equal_plain_decoding(mirrored: Path) -> None:
    """Verification rows (1 + k query tokens next to decode rows) through the cuda kernels, in
    graph steps (the MTP head over the verified rows and chained inside the graphs) and, with
    a logits processor (a repetition penalty), eager steps."""
    prompts = [{"prompt_token_ids": t} for t in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True)
    penalty = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2, ignore_eos=True)
    outs, counts = [], []
    for spec in (None, {**SPEC, "num_speculative_tokens": 3}):
        llm = make(mirrored, backend="cuda", max_model_len=128, speculative_config=spec)
        assert llm.llm_engine.backend.name == "cuda"
        for batch, params in ((prompts, [greedy, seeded, greedy]), (prompts[:1], [penalty])):
            outs.append([r.outputs[0].token_ids for r in llm.generate(batch, params, use_tqdm=False)])
        decoder = llm.llm_engine.speculative
        counts.append((decoder.num_graph_steps, llm.llm_engine.num_accepted_tokens) if decoder else (0, 0))
    assert outs[0] == outs[2] and outs[1] == outs[3]
    assert counts[1][0] > 0 and counts[1][1] > 0


@pytest.mark.skipif(
    "torch_npu" not in sys.modules,
    reason="the ascend backend on the torch_npu simulation: tests/test_ascend_conformance.py runs it",
)
def test_ascend_backend_outputs_equal_plain_decoding(tmp_path: Path) -> None:
    """Verification rows through the ascend backend's fused ops (simulated), bfloat16."""
    ckpt = write_random_checkpoint(tmp_path / "c", tiny_config(torch_dtype="bfloat16"), seed=3)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": t} for t in PROMPTS[:3]]
    outs = []
    for spec in (None, {**SPEC, "num_speculative_tokens": 3}):
        llm = make(ckpt, backend="ascend", dtype="bfloat16", block_size=16, speculative_config=spec)
        assert llm.llm_engine.backend.name == "ascend"
        outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, p, use_tqdm=False)])
    assert outs[0] == outs[1]

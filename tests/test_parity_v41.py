"""DeepSeek-V4.1's text model against the independent float64 oracle (deepinfer.testing.v41_oracle,
whole-sequence math written from the published description, sharing no code with the model):
greedy tokens through LLM.generate on the reference backend in float32 equal the oracle's, on
tiny random checkpoints covering every layer type (window only, C1, C2), the sharing topology
(KV, index-key and top-k consumers), candidate blocks (two-stage top-k on C1 and C2 layers),
YOCO's shared hidden state in the decoder half, shifted and unshifted hyper-connections, YaRN
and plain rope, Engram layers (identity and tokenizer-compressed vocabularies, n-grams of up to
4 tokens); prompts past the window and across many C2 pairs and
prompts shorter than the n-grams; whole prefill, chunked prefill that cuts pairs anywhere, and
preemption with recompute; decode graphs and async scheduling (the engine's defaults).
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.testing.v41_checkpoint import (
    random_v41_tensors,
    tiny_v41_config,
    write_merging_tokenizer,
    write_v41_checkpoint,
)
from deepinfer.testing.v41_oracle import V41Oracle

PROMPT_LENS = (1, 2, 7, 13, 26, 41)
NEW_TOKENS = 8
TOKENIZER = -1  # engram_compressed_vocab_size: the size of the tokenizer's compressed vocabulary
# name -> tiny_v41_config knobs
CONFIGS: dict[str, dict[str, Any]] = {
    # window, C2, then the C1 decoder half; every compressed layer its own source
    "plain": dict(layers=4),
    # C2 segment (KV and index keys of layer 1, top-k of 1 and 2), decoder half C1 with an index-key
    # consumer that runs its own indexer (layer 4) and a top-k consumer (layer 5)
    "shared": dict(
        layers=6,
        ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_k_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 4],
    ),
    # V4's mHC (an HC head), plain rope on the compressed layers
    "unshifted": dict(layers=4, hc_shifted=False, yarn=False),
    # C2 in the decoder half (from h*), top-k above every entry count, a 3-token window, 3 streams
    "decoder_c2": dict(
        layers=5,
        ratios=[2, 0, 1, 2, 1],
        index_topk=64,
        window=3,
        hc_mult=3,
        kv_source_layer_ids=[0, 1, 2, 3, 4],
        index_source_layer_ids=[0, 1, 2, 3, 4],
    ),
    # one top-k entry, a wide window
    "topk1": dict(layers=3, ratios=[1, 2, 1], index_topk=1, window=9, kv_source_layer_ids=[0, 1, 2]),
    # candidate blocks (two-stage selection) from layer 1: 8 blocks of 2 entries; layer 2 (KV and
    # index keys of layer 1, its own indexer) and layer 3 pick inside them, layer 4 takes 3's top-k
    "candidates": dict(
        layers=5,
        ratios=[0, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_k_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 2, 3],
        candidate_source_layer_id=1,
    ),
    # candidate blocks on C2 layers (after a C1 layer: the whole model is the decoder half), blocks
    # of one entry, 4 top-k entries, unshifted HC
    "candidates_c2": dict(
        layers=4,
        ratios=[1, 0, 2, 2],
        index_topk=4,
        hc_shifted=False,
        kv_source_layer_ids=[0, 1, 2, 3],
        candidate_source_layer_id=2,
        candidate_block_size=1,
    ),
    # Engram on both encoder layers (the window layer and C2), 2- and 3-grams, the identity vocabulary
    "engram": dict(layers=4, engram=True, engram_layer_ids=[0, 1], engram_compressed_vocab_size=None),
    # Engram through the compressed vocabulary of a tokenizer.json (three raw ids per compressed
    # one), n-grams of 2..4 tokens, 3 heads each, 3 streams, unshifted HC
    "engram_tokenizer": dict(
        layers=4,
        engram=True,
        engram_layer_ids=[1, 0],
        hc_mult=3,
        hc_shifted=False,
        engram_max_ngram_size=4,
        engram_n_heads=3,
        engram_compressed_vocab_size=TOKENIZER,
    ),
}


def normalised(text: str) -> str:
    """Engram's token normalisation, written here with unicodedata: NFKC, NFD, combining marks
    dropped, lowercase, whitespace runs to one space, stripped unless the text is one space."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in t if not unicodedata.combining(c)).lower())
    return (t if t == " " else t.strip()) or text


def compressed_ids(tokens: list[str]) -> list[int]:
    first: dict[str, int] = {}
    return [first.setdefault(normalised(t), len(first)) for t in tokens]


class Case:
    def __init__(self, name: str, root: Path) -> None:
        raw = tiny_v41_config(**CONFIGS[name])
        raw.pop("quantization_config")  # float weights: the dequantised twin of a published checkpoint
        raw["dtype"] = "float32"
        text = raw["text_config"]
        lookup = None
        if text.get("engram_compressed_vocab_size") == TOKENIZER:
            root.mkdir(parents=True, exist_ok=True)
            lookup = compressed_ids(write_merging_tokenizer(root, text["vocab_size"]))
            assert lookup[text["engram_pad_token_id"]] == text["engram_pad_token_id"]
            text["engram_compressed_vocab_size"] = max(lookup) + 1
            assert max(lookup) + 1 < text["vocab_size"] // 2  # ids merge
        tensors = random_v41_tensors(raw, seed=len(name))
        self.root = write_v41_checkpoint(root, raw, tensors)
        self.raw, self.tensors, self.lookup = raw, tensors, lookup
        oracle = V41Oracle(raw, tensors, engram_lookup=lookup)
        gen = torch.Generator().manual_seed(7)
        vocab = raw["text_config"]["vocab_size"]
        self.prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        self.expected = [list(oracle.greedy(p, NEW_TOKENS)) for p in self.prompts]

    def llm(self, **kwargs: Any) -> LLM:
        # unquantised caches: the oracle's exact KV (tests/test_parity_v41_kv.py: the published formats)
        args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 64}
        args = args | {"kv_cache_dtype": "bf16"} | kwargs
        return LLM(str(self.root), **args)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_whole_prefill_matches_the_oracle(case: Case) -> None:
    assert greedy(case.llm(), case.prompts) == case.expected


def test_chunked_prefill_matches_the_oracle(case: Case) -> None:
    """A 5-token step budget: chunks end inside C2 pairs and inside the window."""
    llm = case.llm(max_num_batched_tokens=5, enable_chunked_prefill=True)
    assert greedy(llm, case.prompts) == case.expected


def test_preemption_recomputes_exactly(case: Case) -> None:
    """30 blocks of 4 tokens for six requests of up to 49 tokens: requests are preempted and
    recomputed; the tokens do not change."""
    llm = case.llm(max_num_batched_tokens=16, enable_chunked_prefill=True, num_gpu_blocks_override=30)
    assert greedy(llm, case.prompts[::-1]) == case.expected[::-1]
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_candidate_blocks_change_the_tokens(tmp_path: Path) -> None:
    """The parity above could not miss the second stage: without the candidate source (every
    layer picks among all its entries) the oracle's tokens differ."""
    for name in ("candidates", "candidates_c2"):
        c = Case(name, tmp_path / name)
        raw = dict(c.raw, text_config=dict(c.raw["text_config"], candidate_source_layer_id=None))
        free = V41Oracle(raw, c.tensors)
        assert [free.greedy(p, NEW_TOKENS) for p in c.prompts] != c.expected, name


ENGRAM_CASES = ["engram", "engram_tokenizer"]


@pytest.fixture(scope="module", params=ENGRAM_CASES)
def engram_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_engram_changes_the_tokens(engram_case: Case) -> None:
    """The parity above could not miss Engram: without its value projection (g * v = 0) the
    oracle's tokens differ; with another tokenizer table (each raw id its own) they differ too."""
    c = engram_case
    no_value = dict(c.tensors)
    for name in [n for n in no_value if n.endswith("engram.wkv.weight")]:
        no_value[name] = torch.zeros_like(no_value[name])
    plain = V41Oracle(c.raw, no_value, engram_lookup=c.lookup)
    assert [plain.greedy(p, NEW_TOKENS) for p in c.prompts] != c.expected
    if c.lookup is not None:
        raw = dict(c.raw, text_config=dict(c.raw["text_config"], engram_compressed_vocab_size=None))
        identity = V41Oracle(raw, c.tensors)
        assert [identity.greedy(p, NEW_TOKENS) for p in c.prompts] != c.expected


def test_engram_decodes_many_steps(engram_case: Case) -> None:
    """40 decode steps after prompts of 1 to 3 tokens (shorter than the longest n-gram), in one
    batch with a longer prompt: every step's n-grams come from the token history the engine
    passes (the pending token resolved on the device under async scheduling, decode graphs)."""
    c = engram_case
    oracle = V41Oracle(c.raw, c.tensors, engram_lookup=c.lookup)
    prompts = [[5], [9, 17], [33, 4, 60], c.prompts[3]]
    want = [oracle.greedy(p, 40) for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = c.llm().generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_engram_tables_in_host_memory(engram_case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_ENGRAM_HOST_TABLES=1: the tables are the host tensors pinned_empty gave (on the
    CPU reference backend host memory is the device's), the tokens unchanged, chunked prefill."""
    monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1")
    llm = engram_case.llm(max_num_batched_tokens=5, enable_chunked_prefill=True)
    engrams = [b.engram for b in llm.llm_engine.model.layers if b.engram is not None]
    assert engrams and all(e.host_table and e.table.device.type == "cpu" for e in engrams)
    assert greedy(llm, engram_case.prompts) == engram_case.expected


def test_host_tables_need_a_backend_that_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer.reference.backend import create_reference_backend

    monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1")
    reference = create_reference_backend()
    backend = dataclasses.replace(
        reference, capabilities=dataclasses.replace(reference.capabilities, reads_host_tables=False)
    )
    raw = tiny_v41_config(layers=4, engram=True, engram_compressed_vocab_size=None)
    raw.pop("quantization_config")
    with pytest.raises(ValueError, match=r"backend 'reference' cannot read Engram tables in host memory"):
        DeepseekV41ForCausalLM(ModelConfig.from_dict(raw), backend, torch.float32)


def counting_prefetches(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The engine's engram_prefetch and engram_wait calls from now on, counted."""
    small, calls = llm.llm_engine.backend.small, Counter[str]()

    def counted(name: str) -> Any:
        op = getattr(small, name)

        def call(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return op(*args, **kw)

        return call

    for name in ("engram_prefetch", "engram_wait"):
        monkeypatch.setattr(small, name, counted(name))
    return calls


def test_engram_prefetch_keeps_the_tokens(engram_case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_ENGRAM_PREFETCH=1 (tables in host memory, chunked prefill): every Engram
    layer's rows fetched at the start of the forward and waited for in its layer (one prefetch
    and one wait per layer and step), the greedy tokens those of the engine without the
    prefetch and the oracle's."""
    monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1")
    args = dict(max_num_batched_tokens=5, enable_chunked_prefill=True)
    plain = greedy(engram_case.llm(**args), engram_case.prompts)
    monkeypatch.setenv("DEEPINFER_ENGRAM_PREFETCH", "1")
    llm = engram_case.llm(**args)
    calls = counting_prefetches(llm, monkeypatch)
    assert greedy(llm, engram_case.prompts) == plain == engram_case.expected
    layers = len(engram_case.raw["text_config"]["engram_layer_ids"])
    assert calls["engram_prefetch"] == calls["engram_wait"] > 0 and calls["engram_wait"] % layers == 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_engram_prefetch_on_the_cuda_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda backend's engram_prefetch / engram_wait (on CPU tensors: the synchronous
    lookup, no side stream) in the model with its tables in host memory, decode graphs (the
    interpreter's RerunGraph): the oracle's tokens, which test_engram_on_the_cuda_backend gets
    from the same prompts without the prefetch."""
    monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1")
    monkeypatch.setenv("DEEPINFER_ENGRAM_PREFETCH", "1")
    c = Case("engram_tokenizer", tmp_path)
    llm = c.llm(backend="cuda")
    calls = counting_prefetches(llm, monkeypatch)
    assert greedy(llm, c.prompts[:2]) == c.expected[:2]
    assert calls["engram_prefetch"] == calls["engram_wait"] > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_engram_on_the_cuda_backend(engram_case: Case) -> None:
    """The cuda backend's Triton Engram kernels (lookup, gate) inside the whole model, float32:
    the oracle's greedy tokens."""
    c = engram_case
    llm = c.llm(backend="cuda")
    assert llm.llm_engine.backend.name == "cuda"
    assert greedy(llm, c.prompts[:4]) == c.expected[:4]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_candidate_blocks_on_the_cuda_backend(tmp_path: Path) -> None:
    """The cuda backend's Triton candidate-block kernels (both stages) inside the whole model,
    float32, chunked prefill: the oracle's greedy tokens."""
    c = Case("candidates", tmp_path)
    llm = c.llm(backend="cuda", max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert llm.llm_engine.backend.name == "cuda"
    assert greedy(llm, c.prompts[3:5]) == c.expected[3:5]


def test_engram_without_its_tokenizer_is_refused(tmp_path: Path) -> None:
    raw = tiny_v41_config(layers=4, engram=True)  # engram_compressed_vocab_size set, no tokenizer.json
    raw.pop("quantization_config")
    raw["dtype"] = "float32"
    write_v41_checkpoint(tmp_path, raw, random_v41_tensors(raw))
    with pytest.raises(
        ValueError, match=r"engram_compressed_vocab_size is 64: .*tokenizer.json, which is missing"
    ):
        LLM(str(tmp_path), backend="reference", dtype="float32")


# --------------------------------------------------------------------------- refused configs


def _text(**overrides: Any) -> dict[str, Any]:
    raw = tiny_v41_config(layers=4)
    raw["text_config"] |= overrides
    return raw


@pytest.mark.parametrize(
    "raw,match",
    [
        (
            _text(compress_ratios=[0, 4, 1, 1]),
            r"compress_ratios holds \[4\]; DeepSeek-V4.1's layer types are 0, 1 and 2",
        ),
        (_text(compress_ratios=[0, 2, 1]), r"one ratio per layer and draft layer \(4 \+ 0\)"),
        (_text(compress_ratios=[0, 2, 2, 2]), r"no C1 layer"),
        (
            _text(kv_source_layer_ids=[1]),
            r"kv_source_layer_ids: layer 2 \(ratio 1\) would read layer 1's state, of ratio 2",
        ),
        (
            _text(compress_ratios=[2, 0, 1, 1], kv_source_layer_ids=[0, 2, 3]),
            r"kv_source_layer_ids: layer 1 \(sliding window only\) falls in layer 0's segment",
        ),
        (
            _text(
                kv_source_layer_ids=[1, 2, 3],
                index_k_source_layer_ids=[1, 2],
                index_source_layer_ids=[1, 2, 3],
            ),
            r"index_k_source_layer_ids: layer 3 reads layer 2's index keys but attends layer 3's KV",
        ),
        (
            _text(
                kv_source_layer_ids=[1, 2, 3],
                index_k_source_layer_ids=[1, 2, 3],
                index_source_layer_ids=[1, 2],
            ),
            r"index_source_layer_ids: layer 3 takes layer 2's top-k but scores layer 3's index keys",
        ),
        (
            _text(
                kv_source_layer_ids=[1, 2],
                index_source_layer_ids=[1, 2],
                candidate_source_layer_id=3,
                candidate_topk_blocks=8,
                candidate_block_size=2,
            ),
            r"candidate_source_layer_id 3 takes layer 2's top-k; the candidate source must run its own",
        ),
        (
            _text(candidate_source_layer_id=1, candidate_topk_blocks=8, candidate_block_size=2),
            r"candidate_source_layer_id 1: every layer from it on must share its ratio, found \[1, 2\]",
        ),
        (_text(scoring_func="softmax"), r"scoring_func 'softmax' is not supported"),
        (
            _text(
                engram_layer_ids=[2],
                engram_max_ngram_size=3,
                engram_vocab_size=40,
                engram_n_heads=2,
                engram_head_dim=8,
                engram_pad_token_id=2,
            ),
            r"engram_layer_ids: layer 2 is not in the encoder half",
        ),
        (
            dict(_text(), model_type="deepseek_v4_1"),
            r"'deepseek_v4_1' is not DeepSeek's name.*'deepseek_v41'",
        ),
        (
            dict(_text(), quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
            r"quantization_config expert_dtype None is not supported for deepseek_v41",
        ),
        (
            {k: v for k, v in _text().items() if k != "text_config"},
            r"'text_config', an object; it is missing",
        ),
    ],
)
def test_bad_configs_name_the_field(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_the_shipped_v41_flash_config_parses() -> None:
    from deepinfer.models.hub import REPO_MODEL_DIR

    cfg = ModelConfig.from_file(REPO_MODEL_DIR / "deepseek-v4.1-flash")
    v41 = cfg.v41
    assert v41 is not None and cfg.num_hidden_layers == 40 and v41.n_prefill_layer == 20
    assert v41.sharing.kv[19] == 14 and v41.sharing.kv[20] == 20 and v41.hc_shifted

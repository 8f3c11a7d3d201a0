"""DeepSeek-V4.1's KV caches in their published formats (kv_cache_dtype "auto": FP8 window rings,
FP4 main entries and index keys; "fp8": FP8 main entries) against the float64 oracle rounding its
KV the same way (deepinfer.testing.v41_oracle.kv_round, written from the formats' definitions):
greedy tokens through LLM.generate on the reference backend in float32 equal the oracle's on tiny
configs covering window / C1 / C2 layers and KV, index-key and top-k sharing, with whole and
chunked prefill and preemption with recompute; the index queries are FP4 like the index keys.
Then the KV budget: the caches are counted at their
real bytes, so the same memory holds more blocks in the ratio of the bytes per token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backend.kv_formats_v41 import bytes_per_entry_v41
from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint
from deepinfer.testing.v41_oracle import V41Oracle

PROMPT_LENS = (3, 14, 29)
NEW_TOKENS = 6
# rows of whole scale blocks: 32-value blocks (FP8, FP4 index keys) in D and Di
WIDTHS = dict(head_dim=32, index_head_dim=32, rope_dim=8)
CONFIGS: dict[str, dict[str, Any]] = {
    # window, C2, then the C1 decoder half; every compressed layer its own source
    "plain": dict(layers=4),
    # a C2 segment sharing KV and index keys, a C1 decoder half with an index-key consumer running
    # its own indexer (layer 4) and a top-k consumer (layer 5)
    "shared": dict(
        layers=6,
        ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_k_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 4],
    ),
    # C2 in the decoder half, a 3-token window
    "decoder_c2": dict(
        layers=5,
        ratios=[2, 0, 1, 2, 1],
        window=3,
        kv_source_layer_ids=[0, 1, 2, 3, 4],
        index_source_layer_ids=[0, 1, 2, 3, 4],
    ),
    # candidate blocks (two-stage selection) over the MXFP4 index keys, from C1 layer 1: 8 blocks
    # of 2 entries; layer 2 (layer 1's KV and index keys, its own indexer) and layer 3 pick inside
    # them, layer 4 takes 3's top-k
    "candidates": dict(
        layers=5,
        ratios=[0, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_k_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 2, 3],
        candidate_source_layer_id=1,
    ),
    # candidate blocks on C2 layers (the whole model the decoder half), blocks of one entry
    "candidates_c2": dict(
        layers=4,
        ratios=[1, 0, 2, 2],
        index_topk=4,
        kv_source_layer_ids=[0, 1, 2, 3],
        candidate_source_layer_id=2,
        candidate_block_size=1,
    ),
}
FORMATS = ("auto", "fp8")
# (config, kv_cache_dtype): the published default on every config, FP8 main entries on two
CASES = [
    ("plain", "auto"), ("shared", "auto"), ("decoder_c2", "auto"), ("candidates", "auto"),
    ("candidates_c2", "auto"), ("plain", "fp8"), ("shared", "fp8"),
]  # fmt: skip


class Case:
    def __init__(self, name: str, kv_cache_dtype: str, root: Path) -> None:
        raw = tiny_v41_config(**CONFIGS[name], **WIDTHS)
        raw.pop("quantization_config")
        raw["dtype"] = "float32"
        tensors = random_v41_tensors(raw, seed=3 + len(name))
        self.root = write_v41_checkpoint(root, raw, tensors)
        self.raw, self.tensors = raw, tensors
        self.kv_cache_dtype = kv_cache_dtype
        gen = torch.Generator().manual_seed(11)
        vocab = raw["text_config"]["vocab_size"]
        self.prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        oracle = V41Oracle(raw, tensors, kv_cache_dtype=kv_cache_dtype)
        self.expected = [oracle.greedy(p, NEW_TOKENS) for p in self.prompts]
        exact = V41Oracle(raw, tensors)
        self.exact = [exact.greedy(p, NEW_TOKENS) for p in self.prompts]

    def llm(self, **kwargs: Any) -> LLM:
        args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 64}
        return LLM(str(self.root), **(args | {"kv_cache_dtype": self.kv_cache_dtype} | kwargs))


_BUILT: dict[tuple[str, str], Case] = {}


def built(name: str, fmt: str, tmp_path_factory: pytest.TempPathFactory) -> Case:
    """Each case's checkpoint and oracle tokens, built once for the module."""
    if (name, fmt) not in _BUILT:
        _BUILT[name, fmt] = Case(name, fmt, tmp_path_factory.mktemp(f"{name}-{fmt}"))
    return _BUILT[name, fmt]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return built(*request.param, tmp_path_factory)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_whole_prefill_matches_the_rounding_oracle(case: Case) -> None:
    assert greedy(case.llm(), case.prompts) == case.expected


def test_chunked_prefill_matches_the_rounding_oracle(case: Case) -> None:
    """A 5-token step budget: chunks end inside C2 pairs and inside the window; the rows a chunk
    reads back are the quantised ones the earlier chunk wrote."""
    llm = case.llm(max_num_batched_tokens=5, enable_chunked_prefill=True)
    assert greedy(llm, case.prompts) == case.expected


def test_preemption_recomputes_exactly(case: Case) -> None:
    """12 blocks of 4 tokens for requests of 9, 20 and 35 tokens: requests are preempted and
    recomputed, rewriting their quantised rows; the tokens do not change."""
    llm = case.llm(
        max_num_batched_tokens=12, enable_chunked_prefill=True, num_gpu_blocks_override=12, max_model_len=40
    )
    assert greedy(llm, case.prompts[::-1]) == case.expected[::-1]
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_candidate_blocks_change_the_tokens(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The parity above could not miss the second stage over quantised keys: without the
    candidate source (every indexer over all visible entries) the rounding oracle's tokens differ
    in some prompt of each candidate config."""
    for name in ("candidates", "candidates_c2"):
        c = built(name, "auto", tmp_path_factory)
        raw = dict(c.raw, text_config=dict(c.raw["text_config"], candidate_source_layer_id=None))
        oracle = V41Oracle(raw, c.tensors, kv_cache_dtype="auto")
        assert any(oracle.greedy(p, NEW_TOKENS) != e for p, e in zip(c.prompts, c.expected)), name


def test_the_rounding_is_visible(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The parity above could not pass with exact caches: on these cases the rounding oracle's
    tokens differ from the exact oracle's in some prompt, for each format."""
    for fmt in FORMATS:
        cases = [built(name, f, tmp_path_factory) for name, f in CASES if f == fmt]
        assert any(c.expected != c.exact for c in cases), fmt


def test_the_query_rounding_is_visible(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The parity above could not pass with float index queries: an oracle that keeps the index Q
    unrounded (FP4 keys only) gives other tokens in some prompt of every case."""
    for name, fmt in CASES:
        c = built(name, fmt, tmp_path_factory)
        oracle = V41Oracle(c.raw, c.tensors, kv_cache_dtype=fmt, round_index_queries=False)
        assert any(oracle.greedy(p, NEW_TOKENS) != e for p, e in zip(c.prompts, c.expected)), (name, fmt)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
    reason="the cuda backend's kernels on a GPU, or in the Triton interpreter (tests/test_cuda_interpret.py)",
)
def test_published_formats_on_the_cuda_backend(tmp_path: Path) -> None:
    """The cuda backend's Triton kernels over the quantised rows (attention, indexer scoring and
    both candidate-block stages dequantising in registers) inside the whole model, float32,
    decode graphs: the rounding oracle's greedy tokens, sharing and candidate blocks included."""
    c = Case("shared", "auto", tmp_path / "shared")
    llm = c.llm(backend="cuda")
    assert llm.llm_engine.backend.name == "cuda"
    assert greedy(llm, c.prompts) == c.expected
    c = Case("candidates", "auto", tmp_path / "candidates")
    assert greedy(c.llm(backend="cuda"), c.prompts[1:]) == c.expected[1:]


# --------------------------------------------------------------------------- the KV budget


def _blocks(root: Path, kv_cache_dtype: str, budget: int) -> tuple[int, float, dict[str, tuple[int, int]]]:
    """(blocks of tokens `budget` bytes hold, the blocks the bytes per token below predict, per
    group (caches, bytes per row))."""
    llm = LLM(
        str(root), backend="reference", dtype="bfloat16", block_size=4, max_model_len=256,
        kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype, max_num_seqs=16,
        max_num_batched_tokens=64,
    )  # fmt: skip
    w = llm.llm_engine.worker
    spec = llm.llm_engine.model.kv_cache_spec(1, 4)
    rows = {g.name: (g.num_caches, g.cache_spec(spec).bytes_per_token) for g in w.kv_groups}
    # bytes of one token in the growing groups (a row per 1 or 2 tokens); the rings (one per
    # request slot) and the ring's step scratch are a fixed part of the budget
    per_token = sum(n * b / int(name[-1]) for name, (n, b) in rows.items() if name != "ring")
    fixed = w.kv_pool_bytes(0)
    return w.num_blocks, (budget - fixed) / (4 * per_token), rows


def test_kv_budget_counts_the_real_bytes(tmp_path: Path) -> None:
    """Window, C2 and C1 layers: each group's rows are the formats' bytes (528 / 288 / 68 per
    512 / 512 / 128 values scale to 33 / 18 / 17 per 32), and the same budget holds more blocks
    of tokens by the ratio of the growing groups' bytes per token (320 / 87.5 = 3.7x here)."""
    raw = tiny_v41_config(layers=4, **WIDTHS)
    raw.pop("quantization_config")
    raw["dtype"] = "bfloat16"
    root = write_v41_checkpoint(tmp_path, raw, random_v41_tensors(raw, seed=1))
    d, di = WIDTHS["head_dim"], WIDTHS["index_head_dim"]
    budget = 5 << 16
    plain_blocks, plain_want, plain = _blocks(root, "bf16", budget)
    quant_blocks, quant_want, quant = _blocks(root, "auto", budget)
    assert plain["ring"][1] == 2 * d and quant["ring"][1] == bytes_per_entry_v41("window", d, "auto") == 33
    for name in ("entries/1", "entries/2"):
        assert plain[name] == (quant[name][0], 2 * d)
        assert quant[name][1] == bytes_per_entry_v41("main", d, "auto") == 18
    for name in ("index/1", "index/2"):
        assert plain[name][1] == 2 * di and quant[name][1] == bytes_per_entry_v41("index", di, "auto") == 17
    # each count within a block of the prediction (partial blocks of the ratio-2 pools round up)
    assert abs(plain_blocks - plain_want) <= 1 and abs(quant_blocks - quant_want) <= 1
    assert quant_blocks > 3.7 * plain_blocks, (quant_blocks, plain_blocks)  # the rings shrink too


# --------------------------------------------------------------------------- the engine argument


def test_bad_kv_cache_dtypes_name_the_value_and_the_choices(tmp_path: Path) -> None:
    raw = tiny_v41_config(layers=4, **WIDTHS)
    raw.pop("quantization_config")
    raw["dtype"] = "float32"
    root = write_v41_checkpoint(tmp_path / "v41", raw, random_v41_tensors(raw))
    args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 32}
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp3' is not supported; choose one of .*'bf16'"):
        LLM(str(root), kv_cache_dtype="fp3", **args)  # a value no model takes: EngineConfig's check
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8_e4m3' is not supported for deepseek_v41; .*'bf16'"
    ):
        LLM(str(root), kv_cache_dtype="fp8_e4m3", **args)  # an MLA model's name: V4.1's own check
    narrow = tiny_v41_config(layers=4)  # head_dim 24: no whole 32-value scale blocks
    narrow.pop("quantization_config")
    narrow["dtype"] = "float32"
    root = write_v41_checkpoint(tmp_path / "narrow", narrow, random_v41_tensors(narrow))
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='auto' cannot hold .*head_dim 24.*use kv_cache_dtype='bf16'"
    ):
        LLM(str(root), **args)
    from tiny_model import TINY  # DeepSeek-V2 architecture: the model dtype or FP8 latent rows

    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype='fp4' is not supported for deepseek_v\d; choose one of "
        r"\('auto', 'fp8', 'fp8_e4m3'\)",
    ):
        LLM(str(TINY), backend="reference", kv_cache_dtype="fp4")


def test_kv_cache_dtype_is_a_command_line_option() -> None:
    import argparse

    from deepinfer.engine.args import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(parser.parse_args([]))["kv_cache_dtype"] == "auto"

"""DeepSeek-V4.1's text model against the independent float64 oracle (deepinfer.testing.v41_oracle,
whole-sequence math written from the published description, sharing no code with the model):
greedy tokens through LLM.generate on the reference backend in float32 equal the oracle's, on
tiny random checkpoints covering every layer type (window only, C1, C2), the sharing topology
(KV, index-key and top-k consumers), YOCO's shared hidden state in the decoder half, shifted and
unshifted hyper-connections, YaRN and plain rope; prompts past the window and across many C2
pairs; whole prefill, chunked prefill that cuts pairs anywhere, and preemption with recompute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint
from deepinfer.testing.v41_oracle import V41Oracle

PROMPT_LENS = (1, 2, 7, 13, 26, 41)
NEW_TOKENS = 8
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
}


class Case:
    def __init__(self, name: str, root: Path) -> None:
        raw = tiny_v41_config(**CONFIGS[name])
        raw.pop("quantization_config")  # float weights: the dequantised twin of a published checkpoint
        raw["dtype"] = "float32"
        tensors = random_v41_tensors(raw, seed=len(name))
        self.root = write_v41_checkpoint(root, raw, tensors)
        self.raw = raw
        oracle = V41Oracle(raw, tensors)
        gen = torch.Generator().manual_seed(7)
        vocab = raw["text_config"]["vocab_size"]
        self.prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        self.expected = [list(oracle.greedy(p, NEW_TOKENS)) for p in self.prompts]

    def llm(self, **kwargs: Any) -> LLM:
        args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 64} | kwargs
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


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(
                engram_layer_ids=[0],
                engram_max_ngram_size=3,
                engram_vocab_size=40,
                engram_n_heads=2,
                engram_head_dim=8,
                engram_pad_token_id=2,
            ),
            "Engram layers",
        ),
        (
            dict(candidate_source_layer_id=2, candidate_topk_blocks=8, candidate_block_size=2),
            "candidate-block",
        ),
    ],
)
def test_parts_not_built_yet_are_refused_by_name(
    tmp_path: Path, overrides: dict[str, Any], match: str
) -> None:
    raw = _text(**overrides)
    raw.pop("quantization_config")
    raw["dtype"] = "float32"
    write_v41_checkpoint(tmp_path, raw, random_v41_tensors(raw))
    with pytest.raises(NotImplementedError, match=match):
        LLM(str(tmp_path), backend="reference", dtype="float32")


def test_the_shipped_v41_flash_config_parses() -> None:
    from deepinfer.models.hub import REPO_MODEL_DIR

    cfg = ModelConfig.from_file(REPO_MODEL_DIR / "deepseek-v4.1-flash")
    v41 = cfg.v41
    assert v41 is not None and cfg.num_hidden_layers == 40 and v41.n_prefill_layer == 20
    assert v41.sharing.kv[19] == 14 and v41.sharing.kv[20] == 20 and v41.hc_shifted

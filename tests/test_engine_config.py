"""Engine configuration and KV-pool sizing."""

from __future__ import annotations

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"block_size": -16}, "block_size must be a positive integer"),
        ({"max_model_len": 1.5}, "max_model_len must be a positive integer"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"dtype": "float8"}, "unknown dtype 'float8'"),
    ],
)
def test_invalid_engine_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(TINY), **kwargs)  # type: ignore[arg-type]


def test_kv_pool_from_an_explicit_byte_budget() -> None:
    llm = LLM(str(TINY), backend="reference", block_size=16, max_model_len=64, kv_cache_memory_bytes=200_000)
    engine = llm.llm_engine
    spec = engine.model.kv_cache_spec(1, 16)
    per_block = spec.bytes_per_token * 16 * engine.model.num_kv_layers
    assert engine.block_manager.num_blocks == 200_000 // per_block
    assert engine.worker.kv_caches[0].spec.num_blocks == engine.block_manager.num_blocks


def test_kv_pool_from_memory_info_is_capped_by_what_requests_can_use() -> None:
    llm = LLM(str(TINY), backend="reference", block_size=16, max_model_len=64, max_num_seqs=3)
    assert llm.llm_engine.block_manager.num_blocks == 3 * 4


def test_too_little_memory_for_one_request_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(TINY), backend="reference", block_size=16, max_model_len=512, kv_cache_memory_bytes=10_000)


def test_max_model_len_beyond_the_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        LLM(str(TINY), backend="reference", max_model_len=4096, num_gpu_blocks_override=64)


def test_generation_stops_at_max_model_len() -> None:
    llm = LLM(str(TINY), backend="reference", block_size=16, max_model_len=20, num_gpu_blocks_override=4)
    out = llm.generate(
        [{"prompt_token_ids": list(range(5, 20))}],
        SamplingParams(max_tokens=50, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_params_per_prompt_must_match_the_prompts() -> None:
    llm = LLM(str(TINY), backend="reference", block_size=16, max_model_len=32, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 0: a prompt must be a string"):
        llm.generate([42], use_tqdm=False)  # type: ignore[list-item]

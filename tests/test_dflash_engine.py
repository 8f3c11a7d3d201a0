"""The DFlash (DSpark) drafter in the engine (speculative_config {"method": "dflash"}): outputs
equal plain decoding token for token, greedy and seeded (rejection sampling with the drafter's
greedy, one-hot proposal), in verification graph steps chained and not, eager steps, with the
threshold and with confidence scheduling, through preemption and prefix caching; bad
configurations are errors. The drafter's own forward is checked in tests/test_dflash.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.config import ModelConfig
from deepinfer.models.dflash import DFlashConfig, save_dflash
from deepinfer.testing.checkpoints import random_dflash_state_dict, tiny_config, write_random_checkpoint

PROMPTS = [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([3, 17, 40, 9])]
GREEDY = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(4)]
SEEDED = [
    SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(4)
]
DFLASH = DFlashConfig(
    num_layers=2, block_size=4, target_layer_ids=(0, 1), markov_rank=8, noise_token_id=5,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_random_checkpoint(tmp_path_factory.mktemp("dflash") / "ckpt", tiny_config(), seed=3)
    save_dflash(root, DFLASH, random_dflash_state_dict(ModelConfig.from_dict(tiny_config()), DFLASH, 1))
    return root


def make(ckpt: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 128}
    return LLM(str(ckpt), **{**args, **kw})


def run(llm: LLM, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [
        r.outputs[0].token_ids
        for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> tuple[list[list[int]], list[list[int]]]:
    plain = make(ckpt, async_scheduling=False, enforce_eager=True)
    return run(plain, GREEDY), run(plain, SEEDED)


@pytest.mark.parametrize(
    "spec, engine_args, graphs",
    [
        ({"num_speculative_tokens": 4}, {}, True),
        ({"num_speculative_tokens": 3, "min_draft_confidence": 0.2}, {}, True),
        ({"num_speculative_tokens": 2}, {"enforce_eager": True}, False),
        ({"num_speculative_tokens": 4, "confidence_scheduling": True, "step_token_budget": 7}, {}, True),
        ({"num_speculative_tokens": 3}, {"num_gpu_blocks_override": 10, "max_model_len": 64}, True),
        ({"num_speculative_tokens": 3}, {"enable_prefix_caching": True}, True),
    ],
    ids=["graphs-k4", "threshold", "eager", "budget-scheduled", "preempting", "prefix-cache"],
)
def test_outputs_equal_plain_decoding(
    ckpt: Path, expected: Any, spec: dict[str, Any], engine_args: dict[str, Any], graphs: bool
) -> None:
    llm = make(ckpt, speculative_config={"method": "dflash", **spec}, **engine_args)
    assert (run(llm, GREEDY), run(llm, SEEDED)) == expected
    engine = llm.llm_engine
    assert engine.num_draft_tokens > 0
    assert engine.speculative is not None and (engine.speculative.num_graph_steps > 0) == graphs
    if "num_gpu_blocks_override" in engine_args:
        assert engine.scheduler.num_preemptions > 0


def test_chained_and_unchained_steps_equal_plain_decoding(ckpt: Path, expected: Any) -> None:
    """Chained verification steps (the next step's inputs written on the device) and steps read
    one by one give the same tokens."""
    outs = []
    for overlap in (True, False):
        llm = make(ckpt, speculative_config={"method": "dflash", "num_speculative_tokens": 4})
        assert llm.llm_engine.speculative is not None
        llm.llm_engine.speculative.overlap = overlap
        outs.append((run(llm, GREEDY), run(llm, SEEDED)))
    assert outs[0] == expected and outs[1] == expected


def test_bad_configs(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the DFlash drafter's block_size 4"):
        make(ckpt, speculative_config={"method": "dflash", "num_speculative_tokens": 5})
    bare = write_random_checkpoint(tmp_path / "bare", tiny_config(), seed=3)
    with pytest.raises(Exception, match=r"has no dflash/config\.json"):
        make(bare, speculative_config={"method": "dflash", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="use 'mtp', 'dspark' or 'dflash'"):
        make(ckpt, speculative_config={"method": "dsparkle"})

"""Speculative decoding with expert parallelism over two gloo processes on the CPU: drafts verified
on ranks that each hold half of the routed experts (the MTP layer's included). Tokens equal one
process holding every expert with the same speculation, greedy and seeded. Rank 1 has fewer
and shorter requests, so it runs idle forwards (the target's and the MTP head's) while rank 0
still verifies drafts; with a step token budget of 3, rank 0's three requests leave no room for
drafts (plain steps) while rank 1 drafts, and rank 0 joins the head's exchanges idle. The DFlash
drafter holds all of its own experts on every rank and the block drafter has none: their
forwards make no exchange."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer import LLM, SamplingParams
from deepinfer.models.config import ModelConfig
from deepinfer.models.dflash import DFlashConfig, save_dflash
from deepinfer.models.drafter import BlockDrafter, DrafterConfig
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    random_dflash_state_dict,
    tiny_config,
    tiny_v4_config,
    write_mirrored_mtp_checkpoint,
    write_random_checkpoint,
    write_random_v4_checkpoint,
)

WORLD = 2
# rank 0: three requests of up to 24 tokens; rank 1: one of 6, then idle
PROMPTS = {
    0: [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 17, 4])],
    1: [[11 + (5 * j) % 100 for j in range(6)]],
}
MAX_TOKENS = {0: 24, 1: 6}
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
SCHEDULED = {**SPEC, "confidence_scheduling": True, "step_token_budget": 3}
DFLASH_SPEC = {"method": "dflash", "num_speculative_tokens": 3}
BLOCK_SPEC = {"method": "dspark", "num_speculative_tokens": 3}
V4_SPEC = {"method": "mtp", "num_speculative_tokens": 2, "min_draft_confidence": 0.0}  # DeepSeek-V4
DFLASH = DFlashConfig(
    num_layers=1, block_size=4, target_layer_ids=(0, 1), markov_rank=8, noise_token_id=5,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
)  # fmt: skip
RANKS_DEADLINE_S = 300.0


def engine_args() -> dict[str, Any]:
    return {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 128}


def params(rank: int, seeded: bool) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.8 if seeded else 0.0,
            seed=10 * rank + i,
            max_tokens=MAX_TOKENS[rank],
            ignore_eos=True,
        )
        for i in range(len(PROMPTS[rank]))
    ]


def generate(llm: LLM, rank: int, seeded: bool) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[rank]]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params(rank, seeded), use_tqdm=False)]


def _worker(rank: int, ckpt: str, store: str, out_dir: str, spec: dict[str, Any]) -> None:
    import os

    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        os.environ["LOCAL_RANK"] = str(rank)
        llm = LLM(ckpt, enable_expert_parallel=True, speculative_config=spec, **engine_args())
        engine = llm.llm_engine
        worker = engine.worker
        idle_drafts = [0]
        real = worker.idle_draft

        def counted(calls: int | None = None) -> None:
            idle_drafts[0] += 1
            real(calls)

        worker.idle_draft = counted  # type: ignore[method-assign]

        def moe(layer: Any) -> Any:  # DeepSeek-V3's MoE, or V4's
            return layer.mlp if hasattr(layer, "mlp") else layer.ffn

        experts = engine.model.config.n_routed_experts
        target = moe(engine.model.layers[-1])
        result["local_experts"] = [target.local.start, len(target.local), experts]
        if spec["method"] == "mtp":
            mtp = moe(engine.model.mtp[0].block)
            result["mtp_local_experts"] = [mtp.local.start, len(mtp.local), experts]
        result["verify_graphs"] = len(worker.verify_graphs)
        result["greedy"] = generate(llm, rank, seeded=False)
        result["seeded"] = generate(llm, rank, seeded=True)
        assert engine.speculative is not None
        result["drafted"] = engine.num_draft_tokens
        result["accepted"] = engine.num_accepted_tokens
        result["idle_drafts"] = idle_drafts[0]
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize(
    "spec",
    [SPEC, SCHEDULED, DFLASH_SPEC, BLOCK_SPEC, V4_SPEC],
    ids=["mtp", "mtp-scheduled", "dflash", "block", "v4-mtp"],
)
def test_speculation_under_expert_parallelism_equals_one_process(
    tmp_path: Path, spec: dict[str, Any]
) -> None:
    if spec is V4_SPEC:
        ckpt = write_random_v4_checkpoint(tmp_path / "ckpt", tiny_v4_config(), seed=3)
    elif spec["method"] == "mtp":
        ckpt = write_mirrored_mtp_checkpoint(tmp_path / "ckpt", seed=3)
    else:
        ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config(), seed=3)
    if spec is DFLASH_SPEC:
        save_dflash(ckpt, DFLASH, random_dflash_state_dict(ModelConfig.from_dict(tiny_config()), DFLASH, 1))
    if spec is BLOCK_SPEC:
        config = DrafterConfig(
            hidden_size=64,
            vocab_size=128,
            draft_hidden_size=32,
            intermediate_size=48,
            block_size=5,
            markov_rank=8,
        )
        BlockDrafter(config, create_reference_backend(), seed=1).save(ckpt)
    args = (str(ckpt), str(tmp_path / "store"), str(tmp_path), spec)
    workers = spawn(_worker, args=args, nprocs=WORLD, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + RANKS_DEADLINE_S
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the expert-parallel ranks did not finish within {RANKS_DEADLINE_S:.0f} s")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"

    single = LLM(str(ckpt), speculative_config=spec, **engine_args())
    plain = LLM(str(ckpt), **engine_args())
    for r in range(WORLD):
        for mode in ("greedy", "seeded"):
            want = generate(single, r, seeded=mode == "seeded")
            assert results[r][mode] == want, f"rank {r}, {mode}"
        assert results[r]["greedy"] == generate(plain, r, seeded=False), f"rank {r} against plain decoding"
    assert single.llm_engine.speculative is not None and single.llm_engine.speculative.num_graph_steps > 0
    for r in range(WORLD):  # half of the experts each
        start, count, experts = results[r]["local_experts"]
        assert (start, count) == (r * experts // 2, experts // 2)
    assert results[0]["verify_graphs"] == 0 and results[1]["verify_graphs"] == 0
    if spec in (DFLASH_SPEC, BLOCK_SPEC):  # no experts split over the ranks: no idle forwards of it
        assert results[0]["drafted"] > 0 and results[1]["drafted"] > 0
        assert results[0]["idle_drafts"] == 0 and results[1]["idle_drafts"] == 0
        return
    # the MTP layer's experts are split too: its forwards exchange tokens like the target's
    assert results[0]["mtp_local_experts"] == results[0]["local_experts"]
    assert results[1]["mtp_local_experts"] == results[1]["local_experts"]
    accepts = spec is not V4_SPEC  # the mirrored head drafts what the model samples; V4's is random
    assert results[1]["drafted"] > 0 and (results[1]["accepted"] > 0 or not accepts)
    # a rank without drafts at a step where the other drafts joined the MTP head's exchanges idle:
    # rank 1 once out of requests; with the budget, rank 0 at every step (it never drafts)
    assert results[1]["idle_drafts"] > 0
    if spec is SCHEDULED:
        assert results[0]["drafted"] == 0 and results[0]["idle_drafts"] > 0
    else:
        assert results[0]["drafted"] > 0 and (results[0]["accepted"] > 0 or not accepts)


def test_combinations_still_refused(tmp_path: Path) -> None:
    ckpt = write_mirrored_mtp_checkpoint(tmp_path / "ckpt", seed=3)
    for name in ("enable_two_batch_overlap", "enable_eplb"):
        with pytest.raises(ValueError, match=f"speculative_config cannot be combined with {name}"):
            LLM(
                str(ckpt),
                enable_expert_parallel=True,
                speculative_config=SPEC,
                **{name: True},
                **engine_args(),
            )
    with pytest.raises(ValueError, match="data_parallel_size > 1 needs enable_expert_parallel"):
        LLM(str(ckpt), data_parallel_size=2, speculative_config=SPEC, **engine_args())


def test_engine_started_ranks_with_mtp(tmp_path: Path) -> None:
    """LLM(data_parallel_size=2, enable_expert_parallel=True) with the MTP head: the engine's
    own worker processes give one process's tokens, greedy and seeded (unseeded requests draw
    the engine's seeds in prompt order)."""
    ckpt = write_mirrored_mtp_checkpoint(tmp_path / "ckpt", seed=3)
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS[0], *PROMPTS[1]]]
    sampled = [
        SamplingParams(temperature=0.8, seed=i if i % 2 else None, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[list[int]]]:
        return [
            [list(r.outputs[0].token_ids) for r in llm.generate(prompts, p, use_tqdm=False)]
            for p in (greedy, sampled)
        ]

    want = tokens(LLM(str(ckpt), speculative_config=SPEC, seed=7, **engine_args()))
    llm = LLM(
        str(ckpt), data_parallel_size=2, enable_expert_parallel=True, speculative_config=SPEC, seed=7,
        **engine_args(),
    )  # fmt: skip
    assert llm.data_parallel is not None
    try:
        assert tokens(llm) == want
    finally:
        llm.data_parallel.close()

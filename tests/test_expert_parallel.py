"""Attention data parallelism + MoE expert parallelism over two gloo processes on the CPU: each
rank serves its own requests and holds half of the routed experts; the outputs equal one
process serving the same requests with every expert. A rank that runs out of requests keeps
stepping with empty batches; a bad request on one rank fails that call on every rank, and the
ranks go on serving."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer import LLM, SamplingParams
from deepinfer.models.random_checkpoint import tiny_config, write_random_checkpoint

WORLD = 2
# rank 0 gets more and longer work than rank 1, which then idles while rank 0 still steps
PROMPTS = {
    0: [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 30, 4])],
    1: [[11 + (5 * j) % 100 for j in range(6)]],
}
MAX_TOKENS = {0: 20, 1: 5}


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def engine_args(backend: str = "reference") -> dict[str, Any]:
    return {"backend": backend, "dtype": "float32", "block_size": 8, "max_model_len": 128}


def _worker(rank: int, ckpt: str, store: str, out_dir: str, backend: str) -> None:
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        os.environ["LOCAL_RANK"] = str(rank)
        llm = LLM(ckpt, enable_expert_parallel=True, **engine_args(backend))
        moe = llm.llm_engine.model.layers[1].mlp
        result["local_experts"] = [moe.local.start, len(moe.local), int(moe.w13.shape[0])]
        result["w13_dtype"] = str(moe.w13.dtype)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[rank]]
        result["first"] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        # a bad request on rank 1 only: the call fails on both ranks, nothing hangs
        bad = [{"prompt_token_ids": [999999]}] if rank == 1 else prompts
        try:
            llm.generate(bad, params, use_tqdm=False)
        except (ValueError, RuntimeError) as exc:
            result["bad"] = f"{type(exc).__name__}: {exc}"
        # and both keep serving
        result["again"] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not INTERPRET,
                reason="cuda's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
            ),
        ),
    ],
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
def test_expert_parallel_outputs_equal_one_process(tmp_path: Path, backend: str, fp8: bool) -> None:
    cfg = tiny_config(num_nextn_predict_layers=0, hidden_size=128, moe_intermediate_size=128)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=6, fp8=fp8)
    args = (str(ckpt), str(tmp_path / "store"), str(tmp_path), backend)
    workers = spawn(_worker, args=args, nprocs=WORLD, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + 180
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:  # a collective that never completes must not hang CI
            for proc in workers.processes:
                proc.kill()
            pytest.fail("the expert-parallel ranks did not finish within 180 s")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"

    single = LLM(str(ckpt), **engine_args(backend))
    for r in range(WORLD):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[r], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[r]]
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
        assert results[r]["first"] == expected, f"rank {r}"
        assert results[r]["again"] == expected, f"rank {r} after the failed call"
    experts = cfg["n_routed_experts"]
    assert ("float8" in results[0]["w13_dtype"]) == fp8
    assert results[0]["local_experts"] == [0, experts // 2, experts // 2]
    assert results[1]["local_experts"] == [experts // 2, experts // 2, experts // 2]
    assert results[1]["bad"].startswith("ValueError: prompt 0: token id 999999 is outside the vocabulary")
    assert results[0]["bad"].startswith("RuntimeError: generate failed on another expert-parallel rank")


def test_expert_parallel_needs_torch_distributed(tmp_path: Path) -> None:
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config(num_nextn_predict_layers=0))
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs torch\.distributed initialised"):
        LLM(str(ckpt), enable_expert_parallel=True, **engine_args())
    with pytest.raises(ValueError, match="cannot be combined with enable_expert_parallel"):
        LLM(str(ckpt), enable_expert_parallel=True, speculative_config={"method": "mtp"}, **engine_args())

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


def _exchange_worker(rank: int, store: str, out_dir: str) -> None:
    """fixed_exchange against dispatch_combine and the dense sum, 7 experts over 2 ranks; then its
    failure promise: rank 1's experts raise, zeros go back, and a forward that stops after its
    first exchange completes the second with log.complete (no rank waits)."""
    import torch

    from deepinfer.parallel.exchanges import log_exchanges
    from deepinfer.parallel.expert_parallel import dispatch_combine, fixed_exchange
    from deepinfer.reference.backend import create_reference_backend

    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        collectives = create_reference_backend().collectives
        bounds, t, k = [0, 4, 7], 5, 3
        lo = bounds[rank]
        g = torch.Generator().manual_seed(10 + rank)
        x, w = torch.randn(t, 6, generator=g), torch.rand(t, k, generator=g)
        ids = torch.randint(0, 7, (t, k), generator=g, dtype=torch.int32)
        scale = torch.arange(1, 8, dtype=torch.float32) * 0.25  # expert e multiplies by scale[e]

        def pairs(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return rows * scale[local_ids.long() + lo].unsqueeze(-1)

        def fused(rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return (rows.unsqueeze(1) * (weights * scale[local_ids.long() + lo]).unsqueeze(-1)).sum(1)

        dense = (x.unsqueeze(1) * (w * scale[ids.long()]).unsqueeze(-1)).sum(1)
        fixed = fixed_exchange(collectives, x, w, ids, bounds, rank, fused)
        sized = dispatch_combine(collectives, x, w, ids, bounds, rank, pairs)
        result["fixed_vs_dense"] = float((fixed - dense).abs().max())
        result["fixed_vs_sized"] = float((fixed - sized).abs().max())

        def failing(rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("experts failed")

        with log_exchanges() as log:
            try:
                fixed_exchange(collectives, x, w, ids, bounds, rank, failing if rank == 1 else fused)
                if rank == 0:  # rank 1 stopped after its first exchange: it owes the second
                    result["second"] = fixed_exchange(collectives, x, w, ids, bounds, rank, fused).tolist()
            except RuntimeError as exc:
                result["raised"] = str(exc)
                result["log"] = [log.done, log.open]
                log.complete(2)
        result["rank0_dense"] = dense.tolist()
        # rank 0's tokens got no share from rank 1's experts: only those of rank 0 (0..3) count
        own = torch.where(ids < 4, w, 0.0)
        result["rank0_own"] = (x.unsqueeze(1) * (own * scale[ids.long()]).unsqueeze(-1)).sum(1).tolist()
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def test_fixed_exchange_equals_the_sized_one_and_keeps_its_failure_promise(tmp_path: Path) -> None:
    import torch

    workers = spawn(_exchange_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + 180
    while not workers.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail("the ranks did not finish within 180 s: an exchange hung")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["fixed_vs_dense"] < 1e-5 and res["fixed_vs_sized"] < 1e-5, (r, res)
    assert results[1]["raised"] == "experts failed" and results[1]["log"] == [1, False]
    assert "raised" not in results[0]
    torch.testing.assert_close(torch.tensor(results[0]["second"]), torch.tensor(results[0]["rank0_own"]))


def test_expert_parallel_needs_torch_distributed(tmp_path: Path) -> None:
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config(num_nextn_predict_layers=0))
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs torch\.distributed initialised"):
        LLM(str(ckpt), enable_expert_parallel=True, **engine_args())
    with pytest.raises(ValueError, match="cannot be combined with enable_expert_parallel"):
        LLM(str(ckpt), enable_expert_parallel=True, speculative_config={"method": "mtp"}, **engine_args())

"""The cuda backend's DeepEP adapter (deepinfer_cuda.deepep) against DeepEP 2.5's EPBuffer API,
through a simulation of the calls it makes (tests/deepep_sim.py) over two gloo processes:

- one MoE exchange through the adapter equals the all_to_all path's and the dense float64 sum,
  with a different number of tokens per rank (none on one), in deterministic mode or not;
- two ranks serving a tiny DeepSeek-V3 in bf16 with every eager MoE exchange through the adapter
  give the tokens of the same ranks exchanging by all_to_all;
- asking for it (DEEPINFER_CUDA_EXPERT_EXCHANGE=deepep) without DeepEP, or with DeepEP's V1 API
  only, is an error when the backend is created; a layer it cannot serve is an error too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer import envs
from deepinfer.backend.types import BackendOptions

ROOT = Path(__file__).resolve().parents[1]
RANKS_DEADLINE_S = 300.0
ARGS = {
    "backend": "reference",
    "dtype": "bfloat16",
    "block_size": 8,
    "max_model_len": 96,
    "enforce_eager": True,
}
PROMPTS = {
    0: [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 14])],
    1: [[11, 3, 9, 40]],
}


def _deepep(exchange_cls: Any, fake: Any, deterministic: bool) -> Any:
    """collectives.expert_exchange served by the adapter over the simulated EPBuffer."""
    made: dict[Any, Any] = {}

    def expert_exchange(num_experts: int, x: torch.Tensor, top_k: int) -> Any:
        key = (num_experts, x.shape[1], top_k)
        if key not in made:
            made[key] = exchange_cls(
                fake, dist.group.WORLD, num_experts, x.shape[1], top_k, 64, deterministic
            )
        return made[key]

    return expert_exchange


def _worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        sys.path.insert(0, str(ROOT))
        from deepinfer_cuda.deepep import DeepEPExchange

        from deepinfer import LLM, SamplingParams
        from deepinfer.parallel.expert_parallel import dispatch_combine
        from deepinfer.reference.backend import create_reference_backend
        from tests import deepep_sim

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        os.environ["LOCAL_RANK"] = str(rank)
        # 1. one exchange: 6 experts over 2 ranks, 5 tokens on rank 0, none on rank 1
        plain = create_reference_backend().collectives
        g = torch.Generator().manual_seed(3)
        t, k, dm = (5, 0)[rank], 2, 16
        x = torch.randn(t, dm, generator=g).to(torch.bfloat16)
        w = torch.rand(t, k, generator=g)
        ids = (
            torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(t)])
            if t
            else torch.zeros(0, k).long()
        )
        scale = torch.linspace(-1.0, 2.0, 6)
        local = range(3 * rank, 3 * rank + 3)

        def experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return (rows.float() * scale[local.start + local_ids].unsqueeze(-1)).to(rows.dtype)

        want = (x.double().unsqueeze(1) * scale[ids].double().unsqueeze(-1) * w.double().unsqueeze(-1)).sum(1)
        a2a = dispatch_combine(plain, x, w, ids, [0, 3, 6], rank, experts)
        result["a2a_err"] = float((a2a.double() - want).abs().max()) if t else 0.0
        for deterministic in (True, False):
            fused = create_reference_backend().collectives
            fused.expert_exchange = _deepep(DeepEPExchange, deepep_sim, deterministic)  # type: ignore[method-assign]
            got = dispatch_combine(fused, x, w, ids, [0, 3, 6], rank, experts)
            result[f"deepep_err_{deterministic}"] = float((got.double() - want).abs().max()) if t else 0.0
            result[f"deepep_vs_a2a_{deterministic}"] = (
                float((got.double() - a2a.double()).abs().max()) if t else 0.0
            )
            result["shape"] = list(got.shape)
        # 2. serving: the adapter against all_to_all on the same ranks
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[rank]]
        llm = LLM(ckpt, enable_expert_parallel=True, **ARGS)
        result["a2a"] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.backend.collectives.expert_exchange = _deepep(DeepEPExchange, deepep_sim, True)  # type: ignore[method-assign]
        before = dict(deepep_sim.calls)
        result["deepep"] = [
            list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)
        ]
        result["calls"] = {n: deepep_sim.calls[n] - before[n] for n in before}
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def test_deepep_adapter_equals_the_all_to_all_path(tmp_path: Path) -> None:
    from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

    cfg = tiny_config(num_nextn_predict_layers=0, num_hidden_layers=3)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=8)
    workers = spawn(_worker, args=(str(ckpt), str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + RANKS_DEADLINE_S
    while not workers.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the ranks did not finish within {RANKS_DEADLINE_S:.0f} s")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    tol = 0.05  # bf16 activations; DeepEP sums the ranks' partials in bf16
    assert results[0]["a2a_err"] < tol
    for deterministic in (True, False):
        assert results[0][f"deepep_err_{deterministic}"] < tol
        assert results[0][f"deepep_vs_a2a_{deterministic}"] < tol
    assert results[0]["shape"] == [5, 16] and results[1]["shape"] == [0, 16]
    for r in range(2):
        assert results[r]["deepep"] == results[r]["a2a"], f"rank {r}"
        # 2 MoE layers a forward: every eager step's exchanges went through the adapter
        assert results[r]["calls"]["dispatch"] == results[r]["calls"]["combine"] > 0
        assert results[r]["calls"]["dispatch"] % 2 == 0
    assert results[0]["calls"] == results[1]["calls"]


def test_asking_for_deepep_without_it_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "backends" / "cuda"))
    from deepinfer_cuda.collectives import CudaCollectives

    env = envs.read({"DEEPINFER_CUDA_EXPERT_EXCHANGE": "deepep"})
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # not installed
    with pytest.raises(RuntimeError, match="deep_ep cannot be imported"):
        CudaCollectives(BackendOptions(), torch.device("cpu"), env)
    v1 = types.ModuleType("deep_ep")
    v1.Buffer = object  # type: ignore[attr-defined]
    v1.__version__ = "1.2.1"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", v1)
    with pytest.raises(
        RuntimeError, match=r"deep_ep 1\.2\.1 has none \(its V1 deep_ep\.Buffer API is not supported"
    ):
        CudaCollectives(BackendOptions(), torch.device("cpu"), env)
    # the default: no DeepEP, the all_to_all exchange
    assert (
        CudaCollectives(BackendOptions(), torch.device("cpu")).expert_exchange(8, torch.empty(1, 4), 2)
        is None
    )
    with pytest.raises(ValueError, match="not an expert exchange"):
        envs.read({"DEEPINFER_CUDA_EXPERT_EXCHANGE": "pplx"})


def test_a_layer_deepep_cannot_serve_is_an_error() -> None:
    sys.path.insert(0, str(ROOT / "backends" / "cuda"))
    from deepinfer_cuda.deepep import DeepEPExchanges

    from tests import deepep_sim

    exchanges = DeepEPExchanges(deepep_sim, 64, False)
    with pytest.raises(
        ValueError, match=r"dispatches bfloat16 activations; the model runs in torch\.float32"
    ):
        exchanges.get(8, torch.empty(1, 4), 2)
    with pytest.raises(ValueError, match="runs over an NCCL group"):
        exchanges.get(8, torch.empty(1, 4, dtype=torch.bfloat16), 2)

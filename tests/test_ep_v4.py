"""Expert parallelism for DeepSeek-V4 and V4.1 over two gloo processes on the CPU: each rank
serves its own requests (its own window rings and compressed caches) and holds half of the
routed experts of every layer, hash-routed and top-k-routed; the greedy tokens equal one process
serving the same requests with every expert. Small step budgets make rank 0 prefill in chunks
longer than its ring (step-scratch blocks) across many compressed entries, between decode steps
that replay graphs on both ranks (the fixed-shape exchange inside); rank 1 finishes early and
joins the exchanges with padding rows."""

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
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint
from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint

WORLD = 2
RANKS_DEADLINE_S = 300.0  # past this the ranks hang: a collective that never completes fails the test
ARGS = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 64,
        "max_num_seqs": 4, "max_num_batched_tokens": 12}  # fmt: skip


def _requests(vocab: int) -> dict[int, list[tuple[list[int], int]]]:
    """rank -> (prompt, max_tokens): rank 0 more and longer work (a 29-token prompt in chunks)."""
    return {
        0: [([3 + (7 * i + 3 * j) % (vocab - 3) for j in range(n)], m)
            for i, (n, m) in enumerate([(29, 6), (5, 9), (11, 4)])],
        1: [([4 + (5 * j) % (vocab - 4) for j in range(7)], 3)],
    }  # fmt: skip


def _tokens(llm: LLM, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


def _worker(rank: int, ckpt: str, store: str, out_dir: str, vocab: int) -> None:
    import deepinfer.parallel.expert_parallel as ep_module

    result: dict[str, Any] = {"exchanges": {"fixed": 0, "sized": 0}}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        os.environ["LOCAL_RANK"] = str(rank)
        llm = LLM(ckpt, enable_expert_parallel=True, **ARGS)
        ffns = [block.ffn for block in llm.llm_engine.model.layers]
        result["local"] = [[f.local.start, f.local.stop, int(f.w13.shape[0])] for f in ffns]
        result["buckets"] = sorted(llm.llm_engine.worker.decode_graphs)

        def counted(name: str, real: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                result["exchanges"][name] += 1
                return real(*a, **k)

            return wrapper

        for name, kind in (("fixed_exchange", "fixed"), ("dispatch_combine", "sized")):
            setattr(ep_module, name, counted(kind, getattr(ep_module, name)))
        result["tokens"] = _tokens(llm, _requests(vocab)[rank])
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run_ranks(ckpt: Path, tmp_path: Path, vocab: int) -> dict[int, dict[str, Any]]:
    args = (str(ckpt), str(tmp_path / "store"), str(tmp_path), vocab)
    workers = spawn(_worker, args=args, nprocs=WORLD, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + RANKS_DEADLINE_S
    while not workers.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the expert-parallel ranks did not finish within {RANKS_DEADLINE_S:.0f} s")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def _check(results: dict[int, dict[str, Any]], ckpt: Path, vocab: int, experts: int) -> None:
    single = LLM(str(ckpt), **ARGS)
    requests = _requests(vocab)
    for r in range(WORLD):
        assert results[r]["tokens"] == _tokens(single, requests[r]), f"rank {r}"
        assert results[r]["buckets"] == [1, 2, 4]
        # both exchanges ran, as many on each rank: eager steps and graph replays alike
        assert results[r]["exchanges"]["fixed"] > 0 and results[r]["exchanges"]["sized"] > 0, r
        assert results[r]["exchanges"] == results[1 - r]["exchanges"]
    half = (experts + 1) // 2
    for layer in results[0]["local"]:
        assert layer == [0, half, half]
    for layer in results[1]["local"]:
        assert layer == [half, experts, experts - half]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "fp8-mxfp4"])
def test_v4_expert_parallel_equals_one_process(tmp_path: Path, quantized: bool) -> None:
    """A window-only layer with a hash-routed MoE, a CSA layer (indexer) and an HCA layer with
    top-k routing; 5 experts over 2 ranks (3 and 2); float weights, or DeepSeek's published
    format (FP8 linears, MXFP4 routed experts)."""
    cfg = tiny_v4_config(n_routed_experts=5)
    ckpt = write_random_v4_checkpoint(tmp_path / "ckpt", cfg, seed=3, quantized=quantized, mtp=False)
    _check(_run_ranks(ckpt, tmp_path, cfg["vocab_size"]), ckpt, cfg["vocab_size"], 5)


def test_v41_expert_parallel_equals_one_process(tmp_path: Path) -> None:
    """V4.1: a window layer, C2, then the C1 YOCO half; 4 experts over 2 ranks; the published KV
    formats (kv_cache_dtype auto: rows of 32-value scale blocks)."""
    raw = tiny_v41_config(head_dim=32, index_head_dim=32)
    raw.pop("quantization_config")  # float weights
    raw["dtype"] = "float32"
    ckpt = write_v41_checkpoint(tmp_path / "ckpt", raw, random_v41_tensors(raw, seed=4))
    vocab, experts = raw["text_config"]["vocab_size"], raw["text_config"]["n_routed_experts"]
    _check(_run_ranks(ckpt, tmp_path, vocab), ckpt, vocab, experts)

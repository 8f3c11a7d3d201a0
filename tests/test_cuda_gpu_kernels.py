"""The CUDA backend's Triton kernels that only a GPU runs: tl.dot_scaled has no interpreter path,
so tests/test_cuda_interpret.py cannot run these on the CPU (tests/test_cuda_compile.py checks
their PTX there instead). Oracles are float64 and the reference backend, as in
tests/test_cuda_kernels.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: no interpreter")
DEV = torch.device("cuda")


def test_grouped_gemm_fp4_on_the_microscaled_product(gen: torch.Generator) -> None:
    """_grouped_mx_kernel (tl.dot_scaled; CudaGemm's MXFP4 grouped GEMM for bf16 x from 4 rows
    an expert): every code under scales 2^-126 .. 2^125 through identity rows gives the
    dequantised weights exactly in bf16; random groups (empty ones, K not a multiple of the tile,
    N past the last tile) within bf16 rounding of float64, for both tiles of grouped_mx_config
    and the backend's dispatch (the microscaled kernel for two of the three group sizes, the
    nibble pairs for the last)."""
    from deepinfer_cuda import backend as cuda_backend
    from deepinfer_cuda.kernels import gemm as gemm_k

    from deepinfer import envs
    from deepinfer.backend import fp4
    from deepinfer.backend.types import BackendOptions
    from deepinfer.reference.gemm import grouped_gemm_fp4 as ref_grouped_fp4

    n, k = 16, 64
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)[None]
    scales = torch.tensor([1, 2, 126, 127, 128, 200, 252, 100] * 4, dtype=torch.uint8).view(1, n, 2)
    want = fp4.dequantize_weight(packed[0], scales[0]).T.to(torch.bfloat16)
    sizes = torch.tensor([k], device=DEV)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    y = gemm_k.grouped_gemm_fp4(eye, packed.to(DEV), scales.to(DEV), sizes, scaled=True)
    assert torch.equal(y.cpu(), want), (y.cpu().float() - want.float()).abs().max()

    gemm = cuda_backend.create_cuda_backend(BackendOptions()).gemm
    off = dataclasses.replace(envs.read(), cuda_mx_fp4=False)
    assert gemm.mx_fp4 and not cuda_backend.create_cuda_backend(BackendOptions(), off).gemm.mx_fp4
    e, n, k = 5, 200, 320
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 124, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    for counts in ([0, 7, 0, 1, 12], [40, 0, 33, 300, 2], [1, 0, 0, 0, 0]):
        sizes = torch.tensor(counts, dtype=torch.int32)
        x = torch.randn((sum(counts), k), generator=gen).to(torch.bfloat16)
        want = ref_grouped_fp4(x.double(), packed, scales, sizes)
        tol = dict(rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        xd, pd, sd, zd = x.to(DEV), packed.to(DEV), scales.to(DEV), sizes.to(DEV)
        for rows in (16, 2048):  # grouped_mx_config's two tilings (16 x 128, 64 x 256)
            cfg = gemm_k.grouped_mx_config(rows, groups=1)
            y = gemm_k.grouped_gemm_fp4(xd, pd, sd, zd, config=cfg, scaled=True)
            torch.testing.assert_close(y.cpu().double(), want, **tol)
        torch.testing.assert_close(gemm.grouped_gemm_fp4(xd, pd, sd, zd).cpu().double(), want, **tol)
    with pytest.raises(ValueError, match="microscaled kernel takes bf16"):
        gemm_k.grouped_gemm_fp4(xd.float(), pd, sd, zd, scaled=True)


def test_engram_prefetch_in_decode_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V4.1 with its Engram tables in pinned host memory (DEEPINFER_ENGRAM_HOST_TABLES=1)
    and DEEPINFER_ENGRAM_PREFETCH=1: the decode graphs capture each layer's lookup on the side
    stream (forked and joined inside the captured forward; the prefetch hands back an event) and
    serve the decode steps; the greedy tokens equal the eager engine's without the prefetch (each
    layer's lookup inline on the main stream) and the graphs' with the tables on the device
    (DEEPINFER_ENGRAM_HOST_TABLES=0, no prefetch). float32, two requests (graph bucket 2: the
    eager shapes, no padding rows)."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.backend.types import PendingRows
    from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint

    raw = tiny_v41_config(layers=4, engram=True, engram_layer_ids=[1, 0], engram_compressed_vocab_size=None)
    raw.pop("quantization_config")
    raw["dtype"] = "float32"
    root = write_v41_checkpoint(tmp_path, raw, random_v41_tensors(raw, seed=3))
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 64, (n,), generator=gen).tolist()} for n in (5, 19)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(prefetch: bool, eager: bool, host: bool = True) -> list[list[int]]:
        monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1" if host else "0")
        monkeypatch.setenv("DEEPINFER_ENGRAM_PREFETCH", "1" if prefetch else "0")
        llm = LLM(
            str(root), backend="cuda", dtype="float32", block_size=4, max_model_len=64, kv_cache_dtype="bf16",
            max_num_seqs=2, enforce_eager=eager,
        )  # fmt: skip
        worker, small = llm.llm_engine.worker, llm.llm_engine.backend.small
        engrams = [b.engram for b in llm.llm_engine.model.layers if b.engram is not None]
        assert len(engrams) == 2 and all(e.table.is_pinned() == host for e in engrams)
        assert bool(worker.decode_graphs) != eager
        served, fetched = [], []
        bucket_for, prefetch_op = worker.decode_graphs.bucket_for, small.engram_prefetch

        def spy_bucket(batch: Any) -> int | None:
            served.append(bucket_for(batch))
            return served[-1]

        def spy_prefetch(*args: Any, **kw: Any) -> PendingRows:
            fetched.append(prefetch_op(*args, **kw))
            return fetched[-1]

        monkeypatch.setattr(worker.decode_graphs, "bucket_for", spy_bucket)
        monkeypatch.setattr(small, "engram_prefetch", spy_prefetch)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert eager or 2 in served, "no decode step replayed a graph"
        assert all(isinstance(p.ready, torch.cuda.Event) for p in fetched) and bool(fetched) == prefetch
        return [list(o.outputs[0].token_ids) for o in outs]

    want = tokens(prefetch=False, eager=True)
    assert tokens(prefetch=True, eager=False) == want
    assert tokens(prefetch=False, eager=False, host=False) == want

"""The model on another torch device (the reference backend with DEEPINFER_REFERENCE_DEVICE set,
e.g. cuda:0) gives the CPU's logits: no op of the model code is tied to the CPU.

Skipped unless DEEPINFER_REFERENCE_DEVICE names a device other than the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models_util import rel_err

from deepinfer.models.loader import load_model
from deepinfer.models.random_checkpoint import tiny_config, write_random_checkpoint
from deepinfer.models.runner_util import PagedRunner
from deepinfer.reference.backend import DEVICE_ENV, create_reference_backend

DEVICE = os.environ.get(DEVICE_ENV, "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu", reason=f"set {DEVICE_ENV} to a non-CPU device")

PROMPTS = {0: [3, 17, 42, 5, 99, 64, 7], 1: list(range(20, 45))}


def _run(root: Path, dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setenv(DEVICE_ENV, device)
    backend = create_reference_backend()
    model = load_model(root, backend, dtype=dtype)
    assert model.embed_tokens.device.type == torch.device(device).type
    runner = PagedRunner(model, backend, num_blocks=32, block_size=4)
    out = [runner.step(list(PROMPTS.items()), all_logits=True)]
    for step in range(4):  # fixed decode tokens: both runs see the same inputs
        out.append(runner.step([(r, [(7 * step + 3 * r) % 128]) for r in PROMPTS]))
    return torch.cat(out).cpu()


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_device_matches_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp8: bool, dtype: torch.dtype
) -> None:
    cfg = tiny_config(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)  # no routing ties
    root = write_random_checkpoint(tmp_path / "m", cfg, seed=2, fp8=fp8)
    on_device = _run(root, dtype, DEVICE, monkeypatch)
    on_cpu = _run(root, dtype, "cpu", monkeypatch)
    err = rel_err(on_device, on_cpu)
    print(f"{DEVICE} vs cpu, {dtype}, fp8={fp8}: rel {err:.2e}")
    # float32: same arithmetic up to summation order. bfloat16: outputs rounded to 8 bits. bfloat16
    # with FP8: a 1-ulp bfloat16 difference moves an activation across an e4m3 rounding tie, so
    # each device draws its own ~5% quantisation error (as against float64; see
    # deepinfer/testing/conformance/test_model.py, whose FP8 budget this is).
    bound = 1e-4 if dtype == torch.float32 else (0.12 if fp8 else 3e-2)
    assert err <= bound

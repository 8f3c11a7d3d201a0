"""Decode-step fusions in the model code, on the reference backend:

1. MLA's q (or q_a) and kv_a projections read the same input: one GEMM over their concatenated
   weights (MLAttention.qkv_a_proj), its output split by views;
2. the shared experts as S more experts of the routed experts' grouped GEMM (MoE, with
   RouterConfig.shared_experts).
DEEPINFER_MODEL_UNFUSED switches them off (both: 1, or by name), read when a model is loaded.

Each must give the unfused model's logits (float32 rounding) and remove backend ops from every
decode step; the ops the model calls are counted here, per layer.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import envs
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import BackendOptions
from deepinfer.models.attention import MLAttention
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import fusion_enabled
from deepinfer.models.loader import load_model
from deepinfer.models.moe import MoE
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint
from deepinfer.testing.paged_runner import PagedRunner

V2_LITE_LIKE = tiny_config(  # no q_lora, softmax greedy routing, two shared experts
    model_type="deepseek_v2",
    q_lora_rank=None,
    topk_method="greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    n_shared_experts=2,
    num_nextn_predict_layers=0,
    num_hidden_layers=3,
)
# FP8 with whole 128-row blocks: q_a_proj (128 rows) and the experts (I = 128) fuse
V3_FP8 = tiny_config(hidden_size=128, q_lora_rank=128, moe_intermediate_size=128, num_nextn_predict_layers=0)
# FP8 with I = 32 and q_a_proj 48 rows: neither fuses (a scale block would span two parts)
V3_FP8_ODD = tiny_config(num_nextn_predict_layers=0)
CASES = {"v3": (tiny_config(), False), "v2_lite": (V2_LITE_LIKE, False), "v3_fp8": (V3_FP8, True)}
CASES["v3_fp8_odd"] = (V3_FP8_ODD, True)

# the ops a decoder layer calls on the backend (their own composite calls are not counted)
MODEL_OPS = {
    "gemm": ("linear", "linear_fp8", "batched_linear"),
    "small": ("rms_norm", "add_rms_norm", "rope", "silu_and_mul"),
    "moe": ("route", "fused_moe"),
    "kv_cache": ("write_mla_kv",),
    "attention": ("mla_query", "decode", "prefill"),
}


def _checkpoint(tmp_path: Path, cfg: dict[str, Any], fp8: bool) -> Path:
    from deepinfer.testing.checkpoints import FP8_QUANTIZATION_CONFIG, quantize_state_dict

    state = random_state_dict(ModelConfig.from_dict(cfg), seed=5, mtp=False)
    if fp8:
        state, _ = quantize_state_dict(state)
        cfg = {**cfg, "quantization_config": dict(FP8_QUANTIZATION_CONFIG)}
    return write_checkpoint(tmp_path / "ckpt", cfg, state)


def _count_model_ops(backend: Backend) -> Counter[str]:
    """Wraps the ops in MODEL_OPS on `backend` to count the calls made from outside them."""
    calls: Counter[str] = Counter()
    depth = [0]

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                calls[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for part_name, ops in MODEL_OPS.items():
        part = getattr(backend, part_name)
        for op in ops:
            setattr(part, op, wrap(f"{part_name}.{op}", getattr(part, op)))
    return calls


def _run(root: Path, backend: Backend) -> tuple[torch.Tensor, Counter[str], Any]:
    """Prefill of two prompts, then three decode steps: (logits, ops of the last decode step, model)."""
    model = load_model(root, backend)
    runner = PagedRunner(model, backend, num_blocks=32, block_size=4)
    out = [runner.step([(0, [3, 9, 27, 81, 5]), (1, list(range(10, 23)))], all_logits=True)]
    calls = _count_model_ops(backend)
    for step in range(3):
        calls.clear()
        out.append(runner.step([(0, [7 + step]), (1, [40 + 3 * step])]))
    return torch.cat(out), Counter(calls), model


@pytest.mark.parametrize("name", list(CASES))
def test_fusions_keep_the_logits_and_remove_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    cfg, fp8 = CASES[name]
    root = _checkpoint(tmp_path, cfg, fp8)
    fused_logits, fused_ops, model = _run(root, create_reference_backend())
    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "1")
    plain_logits, plain_ops, plain = _run(root, create_reference_backend())
    if fp8:  # the sums' float32 rounding differs, and downstream an activation may then round to
        # the next e4m3 value (steps of 2^-4): 0.3% seen; unrelated logits differ by ~140%
        err = float((fused_logits - plain_logits).norm() / plain_logits.norm())
        assert err < 0.02, f"FP8 logits differ by {err:.2%}"
    else:
        torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-4, atol=1e-4)

    c = ModelConfig.from_dict(cfg)
    layers = c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(layers))
    attn = [m for m in model.modules() if isinstance(m, MLAttention)]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(attn) == layers and len(moes) == moe_layers
    fuses_q = not fp8 or (c.q_lora_rank or c.num_attention_heads * c.qk_head_dim) % 128 == 0
    fuses_shared = not fp8 or c.moe_intermediate_size % 128 == 0
    assert all((a.qkv_a_proj is not None) == fuses_q for a in attn)
    assert all((m.shared_experts is None) == fuses_shared for m in moes)
    for m in moes:
        if fuses_shared:
            assert m.router.shared_experts == c.n_shared_experts
            assert m.w13.shape[0] == c.n_routed_experts + c.n_shared_experts
    assert all(
        m.shared_experts is not None and m.router.shared_experts == 0
        for m in plain.modules()
        if isinstance(m, MoE)
    )

    gemm = "gemm.linear_fp8" if fp8 else "gemm.linear"
    # one GEMM fewer per layer for q + kv_a; two per MoE layer (the shared MLP) and its silu_and_mul
    removed = Counter({gemm: layers * fuses_q + 2 * moe_layers * fuses_shared})
    removed["small.silu_and_mul"] = moe_layers * fuses_shared
    assert plain_ops - fused_ops == +removed and not fused_ops - plain_ops, (plain_ops, fused_ops)


def test_shared_experts_fuse_in_batch_invariant_mode(tmp_path: Path) -> None:
    """Batch-invariant mode fuses the shared experts too (the grouped GEMM and the combine reduce
    each row alone), and a row's logits stay the same bits alone and beside other rows."""
    cfg = tiny_config(num_nextn_predict_layers=0)
    root = _checkpoint(tmp_path, cfg, False)
    model = load_model(root, create_reference_backend(BackendOptions(batch_invariant=True)))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    shared = cfg["n_shared_experts"]
    assert moes and all(m.shared_experts is None and m.router.shared_experts == shared for m in moes)
    x = torch.randn(5, cfg["hidden_size"], dtype=torch.float32)
    alone = moes[0](x[:1].clone())
    together = moes[0](x)
    assert torch.equal(alone[0], together[0])


def test_model_fusions_switched_off_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def enabled(name: str) -> bool:
        return fusion_enabled(name, envs.read().model_unfused)  # as load_model reads it

    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "shared_experts")
    assert enabled("qkv_a") and not enabled("shared_experts")
    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "qkv_a, shared_experts")
    assert not enabled("qkv_a") and not enabled("shared_experts")
    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "0")
    assert enabled("qkv_a") and enabled("shared_experts")
    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "all")
    assert not enabled("qkv_a") and not enabled("shared_experts")
    monkeypatch.setenv(envs.MODEL_UNFUSED.name, "shared")
    with pytest.raises(ValueError, match="unknown shared; name any of qkv_a, shared_experts"):
        enabled("qkv_a")

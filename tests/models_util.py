"""Helpers for the model tests: tiny random transformers DeepSeek models saved with save_pretrained,
and comparisons against them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PARITY_CONFIGS = Path(__file__).resolve().parent.parent / "model" / "parity"


def parity_config(name: str) -> dict[str, Any]:
    """A tiny config from model/parity/<name>.json (transformers 5 field names)."""
    cfg: dict[str, Any] = json.loads((PARITY_CONFIGS / f"{name}.json").read_text())
    return cfg


def build_hf_model(cfg: dict[str, Any], seed: int = 0) -> Any:
    """A random transformers DeepseekV2/V3ForCausalLM in float32, with every weight (norms, router
    bias included) randomised so that no parameter is left at a neutral value."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    config_cls, model_cls = {
        "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model: Any = model_cls(config_cls(**cfg)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return model


def build_hf_v4(fields: dict[str, Any], seed: int) -> Any:
    """A random float32 DeepseekV4ForCausalLM with no parameter left at a neutral value (norms,
    sinks, compressor position biases, mHC biases and scales, router bias, hash table)."""
    import transformers

    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "dtype")}
    cfg = transformers.DeepseekV4Config(**fields)
    torch.manual_seed(seed)
    model: Any = transformers.DeepseekV4ForCausalLM(cfg)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base", ".scale", "hc_scale")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".fn", "hc_fn")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(cfg.vocab_size)]))
    return model


def save_hf_model(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm())


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())

"""The model and its MTP draft head against an independent float64 forward (deepinfer.testing.oracles),
on random checkpoints with DeepSeek's published tensor names (transformers drops MTP weights, so
this is the oracle for the draft head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import rel_err

from deepinfer.models.config import ModelConfig
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint
from deepinfer.testing.oracles import reference_forward64, reference_mtp64
from deepinfer.testing.paged_runner import PagedRunner, build_batch

RTOL = 1e-4

V2_LIKE = tiny_config(
    model_type="deepseek_v2",
    q_lora_rank=None,
    topk_method="group_limited_greedy",
    scoring_func="softmax",
    norm_topk_prob=True,  # V2 semantics: normalised weights, no routed_scaling_factor
    routed_scaling_factor=16.0,
    n_shared_experts=2,
    num_nextn_predict_layers=0,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)


def _checkpoint(tmp_path: Path, cfg: dict[str, Any], seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    state = random_state_dict(ModelConfig.from_dict(cfg), seed)
    return write_checkpoint(tmp_path / "ckpt", cfg, state), state


@pytest.mark.parametrize("cfg", [tiny_config(), V2_LIKE], ids=["v3", "v2"])
def test_logits_match_float64_reference(tmp_path: Path, cfg: dict[str, Any]) -> None:
    root, state = _checkpoint(tmp_path, cfg)
    backend = create_reference_backend()
    model = load_model(root, backend)
    prompts = {0: [3, 9, 27, 81 % 128, 5, 77, 101], 1: list(range(10, 30))}
    runner = PagedRunner(model, backend, num_blocks=32, block_size=4)
    logits = runner.step(list(prompts.items()), all_logits=True)
    start = 0
    for p in prompts.values():
        _, want = reference_forward64(state, cfg, p)
        got = logits[start : start + len(p)]
        start += len(p)
        assert rel_err(got, want) <= RTOL


def test_mtp_head_matches_float64_reference(tmp_path: Path) -> None:
    cfg = tiny_config()
    root, state = _checkpoint(tmp_path, cfg, seed=5)
    backend = create_reference_backend()
    model = load_model(root, backend)
    assert model.num_mtp_layers == 1
    tokens = [4, 8, 15, 16, 23, 42, 99, 7, 3, 64, 50]
    main = PagedRunner(model, backend, num_blocks=16, block_size=4)
    main.step([(0, tokens)], all_logits=True)
    assert main.last_hidden is not None
    hidden = main.last_hidden[:-1]  # h_0 .. h_{n-2}

    # MTP step: row i = (token i+1, position i, hidden h_i), over its own paged cache.
    mtp = PagedRunner(model, backend, num_blocks=16, block_size=4, seed=1)
    mtp_caches = mtp.kv_caches[: model.num_mtp_layers]
    batch = build_batch(mtp.alloc, [(0, tokens[1:])], mtp.device, all_logits=True)
    got = model.compute_logits(model.forward_mtp(batch, hidden, mtp_caches))

    h64, _ = reference_forward64(state, cfg, tokens)
    want = reference_mtp64(state, cfg, h64[:-1], tokens[1:])
    err = rel_err(got, want)
    print(f"MTP logits vs float64: rel {err:.2e}")
    assert err <= RTOL
    # A real dependence on both inputs: other next tokens change the prediction.
    other = build_batch(mtp.alloc, [(1, [t + 1 for t in tokens[1:]])], mtp.device, all_logits=True)
    moved = model.compute_logits(model.forward_mtp(other, hidden, mtp_caches))
    assert rel_err(moved, got) > 1e-2


def test_mtp_absent_when_checkpoint_has_none(tmp_path: Path) -> None:
    cfg = tiny_config()
    state = random_state_dict(ModelConfig.from_dict(cfg), 0, mtp=False)
    model = load_model(write_checkpoint(tmp_path / "c", cfg, state), create_reference_backend())
    assert model.num_mtp_layers == 0
    with pytest.raises(ValueError, match="MTP depth 0 requested but the checkpoint has 0 MTP layers"):
        batch = build_batch(
            PagedRunner(model, create_reference_backend()).alloc, [(0, [1])], torch.device("cpu")
        )
        model.forward_mtp(batch, torch.zeros(1, cfg["hidden_size"]), [])

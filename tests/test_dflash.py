"""The DFlash (DSpark) drafter (deepinfer.models.dflash) against its independent dense forward
(deepinfer.testing.dflash_oracle, float64) on tiny random configs: KV injection during the
target's prefill and decode steps, the bidirectional block, the Markov correction and the
confidence head; loading errors that name the tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import rel_err

from deepinfer.models.config import ModelConfig
from deepinfer.models.dflash import DFlashConfig, save_dflash
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    random_dflash_state_dict,
    random_state_dict,
    tiny_config,
    write_checkpoint,
)
from deepinfer.testing.dflash_oracle import dflash_block, dflash_draft64, target_trunks64
from deepinfer.testing.paged_runner import PagedRunner

RTOL = 1e-4


def _setup(
    tmp_path: Path, cfg: dict[str, Any], dcfg: DFlashConfig, seed: int = 0
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    mc = ModelConfig.from_dict(cfg)
    state = random_state_dict(mc, seed, mtp=False)
    root = write_checkpoint(tmp_path / "ckpt", {**cfg, "num_nextn_predict_layers": 0}, state)
    weights = random_dflash_state_dict(mc, dcfg, seed + 1)
    save_dflash(root, dcfg, weights)
    model = load_model(root, create_reference_backend(), dflash=True)
    return model, state, weights


def _draft(model: Any, runner: PagedRunner, rid: int, token: int, k: int, logits: list[torch.Tensor]) -> Any:
    """The drafter's block after request rid's computed positions, emitted token `token`."""
    d = model.dflash
    req = runner.alloc.requests[rid]
    start = req.length
    runner.alloc.append_slots(rid, d.block_size)  # blocks for the slots' rows
    req.length = start
    table = torch.tensor([req.blocks], dtype=torch.int32)
    n = model.config.num_hidden_layers
    lim = torch.tensor([start + d.block_size])
    return d.draft(
        torch.tensor([token]), torch.tensor([start]), table, lim, runner.kv_caches[n:], model.embed_tokens,
        model.lm_head, k, start + d.block_size, logits,
    )  # fmt: skip


CASES = [  # (block size, draft layers, routed experts, experts per token, target layers read)
    (1, 1, 2, 1, [1]),
    (3, 2, 4, 2, [0, 1]),
    (5, 3, 6, 2, [1, 2]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-L{c[1]}-E{c[2]}" for c in CASES])
def test_draft_matches_float64_oracle(tmp_path: Path, case: tuple[int, int, int, int, list[int]]) -> None:
    b, layers, experts, per_tok, targets = case
    cfg = tiny_config(num_hidden_layers=3)
    dcfg = DFlashConfig(
        num_layers=layers, block_size=b, target_layer_ids=tuple(targets), markov_rank=8, noise_token_id=5,
        n_routed_experts=experts, num_experts_per_tok=per_tok, moe_intermediate_size=16,
        confidence_temperature=(0.7,) if b < 3 else tuple(1.0 + 0.5 * s for s in range(b)),
    )  # fmt: skip
    model, state, weights = _setup(tmp_path, cfg, dcfg)
    runner = PagedRunner(model, create_reference_backend(), num_blocks=32, block_size=4)
    prompts = {0: [3, 9, 27, 81, 5, 77, 101], 1: list(range(10, 23))}
    runner.step(list(prompts.items()))  # prefill: injection into the drafter's caches
    emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    dd = dcfg.to_dict()
    for rid, tokens in prompts.items():
        token = 40 + rid
        logits: list[torch.Tensor] = []
        drafts, conf = _draft(model, runner, rid, token, b, logits)
        trunks = target_trunks64(state, cfg, tokens, targets)
        want, want_logits, want_conf = dflash_draft64(
            weights, cfg, dd, emb, head, trunks, len(tokens) - 1, token, b
        )
        assert drafts[0].tolist() == want
        assert rel_err(torch.stack(logits, 1)[0], want_logits) <= RTOL
        assert rel_err(conf[0], want_conf) <= RTOL
        assert bool((conf[0][1:] <= conf[0][:-1]).all())
    # a decode step of request 0 (its emitted token and one draft): injection overwrites the
    # block's rows there, and the next block sees the new context
    step = [40, 7]
    runner.step([(0, step)])
    tokens = prompts[0] + step
    logits = []
    drafts, conf = _draft(model, runner, 0, 11, b, logits)
    trunks = target_trunks64(state, cfg, tokens, targets)
    want, want_logits, want_conf = dflash_draft64(weights, cfg, dd, emb, head, trunks, len(tokens) - 1, 11, b)
    assert drafts[0].tolist() == want
    assert rel_err(torch.stack(logits, 1)[0], want_logits) <= RTOL
    assert rel_err(conf[0], want_conf) <= RTOL


def test_block_is_bidirectional_and_conditioned(tmp_path: Path) -> None:
    """Slot 0's logits depend on the slots after it (bidirectional) and on the context (KV
    injection), in the oracle and in the model alike."""
    cfg = tiny_config()
    dcfg = DFlashConfig(
        num_layers=1, block_size=4, target_layer_ids=(1,), markov_rank=4, noise_token_id=5,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
    )  # fmt: skip
    _, state, weights = _setup(tmp_path, cfg, dcfg)
    emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    trunks = target_trunks64(state, cfg, list(range(3, 12)), [1])
    args = (torch.tensor([8]), torch.tensor([9]), torch.tensor([[9, 0, 0, 0]]))
    base, _ = dflash_block(weights, cfg, dcfg.to_dict(), emb, head, trunks, *args)
    other, _ = dflash_block(weights, cfg, {**dcfg.to_dict(), "noise_token_id": 6}, emb, head, trunks, *args)
    assert rel_err(other[0, 0], base[0, 0]) > 1e-3  # slot 0 sees the noise slots after it
    shorter, _ = dflash_block(weights, cfg, dcfg.to_dict(), emb, head, trunks, torch.tensor([4]), *args[1:])
    assert rel_err(shorter[0, 0], base[0, 0]) > 1e-3  # and the injected context


def test_load_errors_name_the_tensor(tmp_path: Path) -> None:
    cfg = tiny_config()
    dcfg = DFlashConfig(
        num_layers=2, block_size=3, target_layer_ids=(1,), markov_rank=4, noise_token_id=5,
        n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
    )  # fmt: skip
    mc = ModelConfig.from_dict(cfg)
    root = write_checkpoint(tmp_path / "c", cfg, random_state_dict(mc, 0))
    backend = create_reference_backend()
    with pytest.raises(Exception, match=r"no dflash/config\.json"):
        load_model(root, backend, dflash=True)
    weights = random_dflash_state_dict(mc, dcfg, 1)
    missing = {k: v for k, v in weights.items() if k != "mtp.1.markov_w1.weight"}
    save_dflash(root, dcfg, missing)
    with pytest.raises(Exception, match=r"missing tensor 'mtp\.1\.markov_w1\.weight'"):
        load_model(root, backend, dflash=True)
    save_dflash(root, dcfg, {**weights, "mtp.2.extra.weight": torch.zeros(2)})
    with pytest.raises(Exception, match=r"unexpected tensors .*'mtp\.2\.extra\.weight'"):
        load_model(root, backend, dflash=True)
    save_dflash(root, DFlashConfig.from_dict({**dcfg.to_dict(), "target_layer_ids": [7]}), weights)
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] are not layers of the target"):
        load_model(root, backend, dflash=True)

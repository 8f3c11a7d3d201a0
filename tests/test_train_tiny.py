"""The training script (train/train_tiny.py) and its training twin (train/twin.py).

- The twin's logits equal deepinfer's on the same weights (main model and MTP head, reference
  backend, float32), and transformers' DeepseekV3ForCausalLM's (the parity oracle) on the
  main model, so what the script trains is the architecture the engine serves.
- Sharded saving: shards stay under the size limit and the loader reads them back.
- The toy CPU run lowers the loss, and deepinfer.LLM loads and generates from what it writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import rel_err

from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.paged_runner import PagedRunner, build_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
import train_tiny
from twin import Twin, TwinConfig

RTOL = 1e-4
CFG = TwinConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=3,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    max_position_embeddings=128,
)


def random_twin(seed: int = 0) -> Twin:
    """Every weight random, norms away from 1 and a router bias large enough to change selection."""
    gen = torch.Generator().manual_seed(seed)
    model = Twin(CFG)
    model.init_weights(gen, std=0.2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for moe in model.moe_layers():
            moe.e_score_correction_bias.copy_(0.2 * torch.randn(CFG.n_routed_experts, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Twin, Path]:
    model = random_twin()
    root = tmp_path_factory.mktemp("twin")
    train_tiny.write_checkpoint(model, root, "float32", shard_mib=15.0)
    return model, root


def test_twin_equals_deepinfer_main_and_mtp(saved: tuple[Twin, Path]) -> None:
    twin, root = saved
    tokens = [5, 17, 3, 88, 42, 9, 61, 23, 70, 11, 2, 96, 33]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = twin(ids)
        want = twin.lm_head(hidden)[0]
        want_mtp = twin.lm_head(twin.mtp_forward(hidden[:, :-1], ids[:, 1:]))[0]

    backend = create_reference_backend()
    model = load_model(root, backend, dtype=torch.float32)
    assert model.num_mtp_layers == 1
    main = PagedRunner(model, backend, num_blocks=16, block_size=4)
    got = main.step([(0, tokens)], all_logits=True)
    assert main.last_hidden is not None
    assert rel_err(got, want) <= RTOL
    assert rel_err(main.last_hidden, hidden[0]) <= RTOL

    mtp = PagedRunner(model, backend, num_blocks=16, block_size=4, seed=1)
    batch = build_batch(mtp.alloc, [(0, tokens[1:])], mtp.device, all_logits=True)
    with torch.no_grad():
        got_mtp = model.compute_logits(model.forward_mtp(batch, main.last_hidden[:-1], mtp.kv_caches[:1]))
    assert rel_err(got_mtp, want_mtp) <= RTOL
    # The router bias matters: without it the same weights select other experts and the logits move.
    unbiased = random_twin()
    with torch.no_grad():
        for moe in unbiased.moe_layers():
            moe.e_score_correction_bias.zero_()
        moved = unbiased.lm_head(unbiased(ids))[0]
    assert rel_err(moved, want) > 1e-3


def test_twin_equals_transformers(saved: tuple[Twin, Path]) -> None:
    pytest.importorskip("transformers")
    from transformers import DeepseekV3ForCausalLM

    twin, root = saved
    hf: Any = DeepseekV3ForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    for moe_name, buf in hf.named_buffers():
        if moe_name.endswith("e_score_correction_bias"):  # the checkpoint's bias was read, not reset
            assert bool(buf.abs().sum() > 0), moe_name
    ids = torch.tensor([[4, 50, 2, 77, 31, 8, 90, 12, 19]])
    with torch.no_grad():
        want = twin.lm_head(twin(ids))[0]
        got = hf(ids).logits[0].float()
    assert rel_err(got, want) <= RTOL


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    twin = random_twin(seed=3)
    train_tiny.write_checkpoint(twin, tmp_path, "float32", shard_mib=0.2)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert all(p.stat().st_size <= 0.2 * (1 << 20) for p in shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    backend = create_reference_backend()
    model = load_model(tmp_path, backend, dtype=torch.float32)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    got = PagedRunner(model, backend, num_blocks=8, block_size=4).step([(0, tokens)], all_logits=True)
    with torch.no_grad():
        want = twin.lm_head(twin(torch.tensor([tokens])))[0]
    assert rel_err(got, want) <= RTOL


def test_toy_run_lowers_loss_and_engine_generates(tmp_path: Path) -> None:
    from deepinfer import LLM, SamplingParams

    log = train_tiny.main(["--toy", "--out", str(tmp_path), "--device", "cpu"])
    curve = log["loss_curve"]
    first, last = curve[0]["loss"], sum(e["loss"] for e in curve[-5:]) / 5
    assert last < first - 1.0, (first, last)
    held = log["held_out"]
    assert held["perplexity"] < held["unigram_perplexity"]
    assert 0.0 < held["mtp_top1_accuracy"] < 1.0
    on_disk = json.loads((tmp_path / "train_log.json").read_text())
    assert on_disk["corpus"]["sha256_of_file_list"] == log["corpus"]["sha256_of_file_list"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).is_file(), name

    llm = LLM(str(tmp_path), backend="reference", dtype="float32", max_model_len=128, seed=0)
    out = llm.generate(["def main():"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12
    assert isinstance(out[0].outputs[0].text, str) and out[0].outputs[0].text

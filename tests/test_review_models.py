"""Loader corner: a checkpoint with tied input / output embeddings (no lm_head.weight, as
transformers saves one) against the float64 reference forward."""

from __future__ import annotations

from pathlib import Path

from models_util import rel_err

from deepinfer.models.config import ModelConfig
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint
from deepinfer.testing.oracles import reference_forward64
from deepinfer.testing.paged_runner import PagedRunner


def test_tied_embeddings_checkpoint_without_lm_head(tmp_path: Path) -> None:
    cfg = tiny_config(tie_word_embeddings=True)
    state = random_state_dict(ModelConfig.from_dict(cfg), seed=2, mtp=False)
    assert "lm_head.weight" not in state
    backend = create_reference_backend()
    model = load_model(write_checkpoint(tmp_path / "tied", cfg, state), backend)
    tokens = [3, 9, 27, 81, 5, 77, 101]
    got = PagedRunner(model, backend, num_blocks=8, block_size=4).step([(0, tokens)], all_logits=True)
    embed = state["model.embed_tokens.weight"]
    _, want = reference_forward64({**state, "lm_head.weight": embed}, cfg, tokens)
    assert rel_err(got, want) <= 1e-4
    # The head really is the embedding: untied, another head gives other logits.
    _, other = reference_forward64({**state, "lm_head.weight": -embed}, cfg, tokens)
    assert rel_err(got, other) > 0.5

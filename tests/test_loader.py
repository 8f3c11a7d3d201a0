"""Checkpoint loading: layouts (single file, sharded index, fused experts) and every user error."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.loader import (
    CheckpointError,
    CorruptCheckpointError,
    Fp8NotSupportedError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    load_model,
)
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    random_state_dict,
    tiny_config,
    write_checkpoint,
    write_random_checkpoint,
)
from deepinfer.testing.paged_runner import PagedRunner

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _logits(root: Path) -> torch.Tensor:
    backend = create_reference_backend()
    model = load_model(root, backend)
    return PagedRunner(model, backend, num_blocks=8, block_size=4).step([(0, PROMPT)], all_logits=True)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "single", seed=3)


def _rewrite(root: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Apply edits to the single-file checkpoint: name -> new tensor, or None to delete."""
    state = load_file(str(root / "model.safetensors"))
    for name, t in edit.items():
        if t is None:
            del state[name]
        else:
            state[name] = t
    save_file(state, str(root / "model.safetensors"))


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, ckpt: Path) -> None:
    sharded = write_random_checkpoint(tmp_path / "sharded", seed=3, shards=3)
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    assert (sharded / "model.safetensors.index.json").is_file()
    backend = create_reference_backend()
    for (name, x), (_, y) in zip(
        load_model(sharded, backend).named_buffers(), load_model(ckpt, backend).named_buffers()
    ):
        assert torch.equal(x, y), name
    torch.testing.assert_close(_logits(sharded), _logits(ckpt), rtol=1e-5, atol=1e-5)


def test_fused_expert_layout_loads_like_per_expert(tmp_path: Path, ckpt: Path) -> None:
    """transformers keeps experts fused in memory (experts.gate_up_proj (E, 2I, Dm), experts.down_proj
    (E, Dm, I)); a checkpoint in that layout loads to the same model."""
    cfg = ModelConfig.from_file(ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts"
        ups, downs = [], []
        for e in range(cfg.n_routed_experts):
            ups.append(
                torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")])
            )
            downs.append(state.pop(f"{p}.{e}.down_proj.weight"))
        state[f"{p}.gate_up_proj"], state[f"{p}.down_proj"] = torch.stack(ups), torch.stack(downs)
    fused = write_checkpoint(tmp_path / "fused", json.loads((ckpt / "config.json").read_text()), state)
    backend = create_reference_backend()
    a, b = load_model(fused, backend), load_model(ckpt, backend)
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(x, y), name
    # (GEMM kernels may round differently for differently aligned copies of equal weights)
    torch.testing.assert_close(_logits(fused), _logits(ckpt), rtol=1e-5, atol=1e-5)


def test_memory_mapped_weights_do_not_alias_the_file(ckpt: Path) -> None:
    """Weights are read tensor by tensor; the model keeps working after the files are gone."""
    before = _logits(ckpt)
    backend = create_reference_backend()
    model = load_model(ckpt, backend)
    (ckpt / "model.safetensors").unlink()
    after = PagedRunner(model, backend, num_blocks=8, block_size=4).step([(0, PROMPT)], all_logits=True)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_missing_tensor_names_tensor_and_files(ckpt: Path) -> None:
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(ckpt, {name: None})
    with pytest.raises(MissingTensorError, match=rf"missing tensor '{name}'.*searched model\.safetensors"):
        load_model(ckpt, create_reference_backend())


def test_missing_tensor_listed_in_index_names_its_file(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "s", seed=1, shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    file = index["weight_map"][name]
    state = load_file(str(root / file))
    del state[name]
    save_file(state, str(root / file))
    with pytest.raises(MissingTensorError, match=rf"'{name}'.*index assigns it to {file}"):
        load_model(root, create_reference_backend())


def test_unexpected_tensor_names_tensor_and_file(ckpt: Path) -> None:
    _rewrite(ckpt, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    with pytest.raises(
        UnexpectedTensorError,
        match=r"'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq' in model\.safetensors",
    ):
        load_model(ckpt, create_reference_backend())


def test_wrong_shape_gives_expected_and_found(ckpt: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(ckpt, {name: torch.zeros(64, 63)})
    with pytest.raises(ShapeMismatchError, match=r"expected shape \(64, 64\), found \(64, 63\)"):
        load_model(ckpt, create_reference_backend())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_file(ckpt: Path, damage: str) -> None:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"{not a header}" + data[30:100])
    else:
        path.write_bytes(b"")
    with pytest.raises(
        CorruptCheckpointError, match=r"model\.safetensors is not a readable safetensors file"
    ):
        load_model(ckpt, create_reference_backend())


def test_fp8_checkpoint_on_backend_without_fp8(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "fp8", fp8=True)
    ref = create_reference_backend()
    no_fp8 = dataclasses.replace(
        ref, name="plain-cpu", capabilities=dataclasses.replace(ref.capabilities, supports_fp8=False)
    )
    with pytest.raises(
        Fp8NotSupportedError, match=r"FP8 checkpoint.*backend 'plain-cpu' does not support FP8"
    ):
        load_model(root, no_fp8)
    # Scale tensors without quantization_config are caught too, naming the tensor and the backend.
    cfg = json.loads((root / "config.json").read_text())
    del cfg["quantization_config"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8NotSupportedError, match=r"weight_scale_inv\) but backend 'plain-cpu'"):
        load_model(root, no_fp8)
    # The reference backend (FP8 emulated) loads it, weights kept in e4m3.
    model = load_model(root, ref, dtype=torch.float32)
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn  # type: ignore[union-attr]


def test_missing_directory_and_config(tmp_path: Path) -> None:
    backend = create_reference_backend()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope", backend)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        load_model(tmp_path / "empty", backend)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_model(tmp_path / "file", backend)


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "pickled"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(tiny_config()))
    torch.save({"model.norm.weight": torch.ones(64)}, root / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match=r"found pytorch_model\.bin: pickle checkpoints are never loaded"
    ):
        load_model(root, create_reference_backend())


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "llama", tiny_config(model_type="llama"), {})
    with pytest.raises(ModelConfigError, match=r"unsupported model_type 'llama'.*deepseek_v2, deepseek_v3"):
        load_model(root, create_reference_backend())


def test_unsupported_dtype_for_backend(ckpt: Path) -> None:
    ref = create_reference_backend()
    narrow = dataclasses.replace(
        ref, capabilities=dataclasses.replace(ref.capabilities, dtypes=(torch.float32,))
    )
    with pytest.raises(ValueError, match=r"does not support dtype torch\.bfloat16; supported: float32"):
        load_model(ckpt, narrow, dtype=torch.bfloat16)


def test_bfloat16_load_runs(ckpt: Path) -> None:
    """Loading in bf16 casts the float32 weights; logits stay close to the float32 model's."""
    backend = create_reference_backend()
    model = load_model(ckpt, backend, dtype=torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert model.kv_cache_spec(4, 4).dtype == torch.bfloat16
    got = PagedRunner(model, backend, num_blocks=8, block_size=4).step([(0, PROMPT)], all_logits=True)
    want = _logits(ckpt)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 0.05


def test_kv_cache_spec_and_interface(ckpt: Path) -> None:
    model = load_model(ckpt, create_reference_backend())
    cfg = ModelConfig.from_file(ckpt)
    spec = model.kv_cache_spec(num_blocks=10, block_size=16)
    assert (spec.latent_dim, spec.rope_dim, spec.head_dim) == (32, 8, 40)
    assert (spec.num_blocks, spec.block_size) == (10, 16)
    assert model.num_kv_layers == cfg.num_hidden_layers == 2
    assert model.config.vocab_size == 128 and model.config.eos_token_id == (1,)
    state = random_state_dict(cfg, 0)
    assert "model.layers.2.eh_proj.weight" in state  # the MTP layer is in the checkpoint
    assert model.num_mtp_layers == 1

"""`deepinfer bench --random-config <V4.1 config> --num-hidden-layers N`: the reduced-depth
config (config_v41.reduce_depth) keeps both YOCO halves and every kept layer's KV, index-key and
top-k sources, checked against the full config's parsed topology layer by layer; the random
model it builds has N layers in the published format (FP8 32 x 32, MXFP4 experts); its weight
estimate equals the built model's bytes; the command runs end to end on the reference backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.backend.registry import get_backend
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.config_v41 import reduce_depth
from deepinfer.models.hub import REPO_MODEL_DIR
from deepinfer.testing.random_model import estimate_weight_bytes, random_model
from deepinfer.testing.v41_checkpoint import tiny_v41_config

SHIPPED = REPO_MODEL_DIR / "deepseek-v4.1-flash" / "config.json"


def tiny(**extra: Any) -> dict[str, Any]:
    """Six layers: a window layer, a C2 segment (1, 2), the C1 decoder half with a KV source per
    two layers (3, 5) and a top-k consumer (4); a drafter targeting layers 2 and 5."""
    return tiny_v41_config(
        layers=6, ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3, 5],
        index_k_source_layer_ids=[1, 3, 5], index_source_layer_ids=[1, 3, 5], **extra,
    )  # fmt: skip


def check_reduction(raw: dict[str, Any], layers: int) -> ModelConfig:
    """reduce_depth(raw, layers) against raw's own topology: the kept layers are a prefix of each
    half, in order; each keeps its ratio and its sources (renumbered); both halves are there."""
    full = ModelConfig.from_dict(raw).v41
    cfg = ModelConfig.from_dict(reduce_depth(raw, layers))
    v = cfg.v41
    assert full is not None and v is not None and cfg.num_hidden_layers == layers
    p = full.n_prefill_layer
    enc = v.n_prefill_layer  # kept encoder layers: 0 .. enc-1, then decoder layers p ..
    kept = list(range(enc)) + list(range(p, p + layers - enc))
    n = raw["text_config"]["num_hidden_layers"]
    assert len(kept) == layers and kept[-1] < n
    assert enc <= p and (enc == min(p, layers // 2) or layers - enc == n - p)  # half, or all the decoder
    new = {old: i for i, old in enumerate(kept)}
    for i, old in enumerate(kept):
        assert v.compress_ratios[i] == full.compress_ratios[old], (layers, i, old)
        for name in ("kv", "index_k", "index"):
            src = getattr(full.sharing, name)[old]
            assert getattr(v.sharing, name)[i] == new[src], (layers, name, i, old)
    assert v.compress_ratios[enc] == 1  # the decoder half starts at the first kept C1 layer
    return cfg


@pytest.mark.parametrize("layers", range(1, 7))
def test_tiny_reductions_keep_the_topology(layers: int) -> None:
    check_reduction(tiny(), layers)


def test_every_depth_of_the_shipped_config() -> None:
    raw = json.loads(SHIPPED.read_text())
    n = raw["text_config"]["num_hidden_layers"]
    for layers in range(1, n + 1):
        cfg = check_reduction(raw, layers)
        v = cfg.v41
        assert v is not None
        engram = [] if v.engram is None else list(v.engram.layer_ids)
        assert engram == [i for i in raw["text_config"]["engram_layer_ids"] if i < v.n_prefill_layer]
    four = ModelConfig.from_dict(reduce_depth(raw, 4)).v41  # 2 encoder (window) + 2 decoder (C1)
    assert four is not None and four.compress_ratios[:4] == (0, 0, 1, 1) and four.n_prefill_layer == 2


def test_drafter_targets_follow_or_the_drafter_goes() -> None:
    raw = tiny(
        num_nextn_predict_layers=1, compress_ratios=[0, 2, 2, 1, 1, 1, 0], dspark_target_layer_ids=[2, 5],
        dspark_block_size=4, dspark_markov_rank=4, dspark_noise_token_id=3, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )  # fmt: skip
    text = reduce_depth(raw, 4)["text_config"]  # keeps 0, 1 | 3, 4: target 2 dropped, 5 too
    assert text["num_nextn_predict_layers"] == 0 and "dspark_target_layer_ids" not in text
    assert len(text["compress_ratios"]) == 4
    text = reduce_depth(raw, 6)["text_config"]
    assert text["dspark_target_layer_ids"] == [2, 5] and text["compress_ratios"][-1] == 0
    text = reduce_depth(raw, 5)["text_config"]  # keeps 0, 1 | 3, 4, 5
    assert text["dspark_target_layer_ids"] == [4] and len(text["compress_ratios"]) == 6


@pytest.mark.parametrize("layers", [0, 7])
def test_depth_out_of_range_is_refused(layers: int) -> None:
    with pytest.raises(ModelConfigError, match=r"a reduced depth must be in 1\.\.6"):
        reduce_depth(tiny(), layers)


def test_random_model_in_the_published_format(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny(vision=True)))
    model: Any = random_model(
        tmp_path / "config.json", get_backend("reference"), fp8=True, num_hidden_layers=3
    )
    assert len(model.layers) == 3 and model.v41.n_prefill_layer == 1
    assert (
        model.vision is not None and model.vision.blocks[0].wqkv.weight.dtype == torch.bfloat16
    )  # bf16 tower
    for layer in model.layers:
        for linear in (
            layer.attn.wq_a,
            layer.attn.wq_b,
            layer.attn.wkv,
            layer.attn.wo_b,
            layer.ffn.shared_down,
        ):
            assert linear.weight.dtype == torch.float8_e4m3fn and linear.block == 32
        assert layer.ffn.w13.dtype == torch.uint8  # MXFP4 experts
        if layer.attn.compressor is not None:
            assert not layer.attn.compressor.wkv.is_fp8


@pytest.mark.parametrize(
    "shifted,engram,vision",
    [(True, False, False), (False, False, False), (True, True, False), (True, False, True)],
)
def test_weight_estimate_matches_the_built_model(
    tmp_path: Path, shifted: bool, engram: bool, vision: bool
) -> None:
    knobs: dict[str, Any] = dict(engram=True, engram_layer_ids=[0, 2], engram_compressed_vocab_size=None)
    raw = tiny(hc_shifted=shifted, vision=vision, **(knobs if engram else {}))
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = random_model(tmp_path / "config.json", get_backend("reference"), torch.float32)
    tensors = [t for t in [*model.buffers(), *model.parameters()] if t.device.type != "meta"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert estimate_weight_bytes(ModelConfig.from_dict(raw), torch.float32) == sum(storages.values())


def test_engram_tables_in_the_estimate(tmp_path: Path) -> None:
    """The published format: Engram tables as FP8 rows (a byte a value, a scale byte per 32) are
    in the built model as estimated; in host memory (envs.ENGRAM_HOST_TABLES) they leave the
    device's share. The shipped V4.1-Flash at 4 layers keeps Engram layer 1: its table (about
    95 GiB of FP8 rows) is most of the device estimate, and none of it with host tables."""
    raw = tiny(engram=True, engram_layer_ids=[0], engram_compressed_vocab_size=None, engram_head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model: Any = random_model(tmp_path / "config.json", get_backend("reference"), fp8=True)
    e = model.layers[0].engram
    assert e.table.dtype == torch.float8_e4m3fn and e.scales.shape == (e.rows, e.head_dim // 32)
    cfg = ModelConfig.from_dict(raw)
    table = e.table.numel() + e.scales.numel()
    fp8 = estimate_weight_bytes(cfg, torch.bfloat16, fp8=True)
    assert fp8 - estimate_weight_bytes(cfg, torch.bfloat16, fp8=True, host_tables=True) == table
    shipped = ModelConfig.from_dict(reduce_depth(json.loads(SHIPPED.read_text()), 4))
    assert shipped.v41 is not None and shipped.v41.engram is not None
    assert shipped.v41.engram.layer_ids == (1,)
    device = estimate_weight_bytes(shipped, torch.bfloat16, fp8=True)
    host = estimate_weight_bytes(shipped, torch.bfloat16, fp8=True, host_tables=True)
    rows = 16 * 49999991 * 128  # 2 n-gram sizes x 8 heads of primes just above engram_vocab_size
    assert 0 < (device - host) - rows * (1 + 1 / 32) < 16 * 200 * 128 * 2  # prime gaps of < 200
    assert host < 0.5 * device


@pytest.mark.parametrize("engram", [False, True], ids=["plain", "engram-fp8-rows"])
def test_bench_reduced_depth_runs(run_deepinfer: Any, tmp_path: Path, engram: bool) -> None:
    """The published formats: FP8 weights, MXFP4 experts, the default KV formats (rows of whole
    32-value scale blocks), with and without FP8 Engram rows."""
    knobs: dict[str, Any] = dict(engram=True, engram_compressed_vocab_size=None, engram_head_dim=32)
    raw = tiny(head_dim=32, index_head_dim=32, **(knobs if engram else {}))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = run_deepinfer(
        "bench", "--random-config", str(tmp_path / "config.json"), "--num-hidden-layers", "3",
        "--quantization", "fp8", "--backend", "reference", "--num-prompts", "2",
        "--random-input-len", "9", "--random-output-len", "3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "random FP8 + MXFP4 experts weights" in r.stdout and "Total num output tokens:  6" in r.stdout

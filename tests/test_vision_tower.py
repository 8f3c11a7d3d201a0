"""DeepSeek-V4.1's vision tower (deepinfer.models.vision) on the reference backend against the
independent float64 oracle (deepinfer.testing.vision_oracle): tiny random towers, several image
sizes and aspect ratios, several images in one call (attention must stay inside each image)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.models.config import ModelConfigError
from deepinfer.models.config_v41 import parse_vision
from deepinfer.models.config_vision import vit_intermediate
from deepinfer.models.loader import CheckpointReader
from deepinfer.models.vision import VisionModel
from deepinfer.models.vision_layout import image_token_count
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.v41_checkpoint import TINY_VISION, random_v41_tensors, tiny_v41_config
from deepinfer.testing.vision_oracle import VisionOracle


def _build(vision: dict[str, Any], seed: int, root: Path) -> tuple[VisionModel, VisionOracle, dict[str, Any]]:
    raw = tiny_v41_config(vision=True, hidden=24)
    raw["vision_config"] = dict(TINY_VISION, **vision)
    tensors = {
        k: v
        for k, v in random_v41_tensors(raw, seed).items()
        if k.startswith(("vision.", "aligner.", "image_"))
    }
    backend = create_reference_backend()
    v = parse_vision(raw["vision_config"])
    assert v is not None
    model = VisionModel(backend, v, 24, torch.float64)
    save_file(tensors, str(root / "model.safetensors"))
    reader = CheckpointReader(root, torch.device("cpu"), allow_fp8=False, backend_name="reference")
    model.load(reader, "")
    assert not reader.unread(), reader.unread()
    return model, VisionOracle(raw, tensors), raw


def _image(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize(
    "vision,sizes",
    [
        ({}, [(28, 28)]),  # one aligned token
        ({}, [(56, 84), (84, 28)]),  # landscape and portrait together
        ({"num_heads": 4, "depth": 1, "hidden_size": 32}, [(28, 112), (56, 56)]),  # head width 8
        ({"downsample_ratio": 1, "patch_size": 8}, [(16, 40), (8, 8), (24, 16)]),  # d = 1, small patch
        ({"downsample_ratio": 3, "patch_size": 4, "intermediate_size": 40}, [(24, 12)]),  # d = 3
    ],
)
def test_tower_matches_float64_oracle(
    vision: dict[str, Any], sizes: list[tuple[int, int]], tmp_path: Path
) -> None:
    model, oracle, _ = _build(vision, len(sizes), tmp_path)
    images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]
    spans = model.encode(images)
    assert len(spans) == len(images)
    p, d = model.config.patch_size, model.config.downsample_ratio
    for i, (span, img) in enumerate(zip(spans, images)):
        n_h, n_w = img.shape[0] // (p * d), img.shape[1] // (p * d)
        assert span.shape == (image_token_count(n_h, n_w), 24)
        want = oracle.span(img)
        # the contract's ops compute norms, rope and softmax in float32: 1e-5 of values of order 1
        torch.testing.assert_close(span, want, rtol=1e-5, atol=1e-5, msg=f"image {i} {tuple(img.shape)}")


def test_images_do_not_attend_to_each_other(tmp_path: Path) -> None:
    """An image's span is the same alone and next to another image (bitwise, float64)."""
    model, _, _ = _build({}, 3, tmp_path)
    a, b = _image(56, 28, 1), _image(28, 56, 2)
    alone = model.encode([a])[0]
    together = model.encode([b, a, b])
    assert torch.equal(alone, together[1])
    assert not torch.allclose(together[0], model.encode([_image(28, 56, 9)])[0])


def test_vision_config_defaults_and_errors() -> None:
    full = parse_vision(
        {"hidden_size": 1024, "downsample_ratio": 2, "patch_size": 14, "max_image_tokens": 4096}
    )
    assert full is not None
    assert (full.width, full.depth, full.heads, full.head_dim, full.intermediate) == (1024, 32, 16, 64, 2816)
    assert vit_intermediate(1024) == 2816
    assert parse_vision(None) is None
    with pytest.raises(ModelConfigError, match="num_heads"):
        parse_vision({"hidden_size": 16, "max_image_tokens": 16})  # 16 heads of width 1
    with pytest.raises(ModelConfigError, match="max_image_tokens"):
        parse_vision({"hidden_size": 16, "num_heads": 2})


def test_bench_vision_smoke(tmp_path: Path) -> None:
    """bench/bench_vision.py --smoke on the CPU: it runs and writes one result per batch."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "bench_vision.py"), "--backend", "reference", "--smoke"]
    proc = subprocess.run(
        [*cmd, "--batches", "1,3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "vision.json").read_text())
    assert [r["images"] for r in got["results"]] == [1, 3] and got["grid"] == [4, 4]

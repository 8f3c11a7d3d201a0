"""Random-weight models from a config.json alone, for benchmarks (`deepinfer bench --random-config`).

The model is built by its own loading code (`load_weights`), fed by a reader that makes up each
tensor it is asked for, so every architecture the loader knows works unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.ops import Backend

REPO_MODEL_DIR = Path(__file__).resolve().parents[2] / "model"


class RandomReader:
    """Stands in for deepinfer.models.loader.CheckpointReader: any tensor, random, seeded.

    Norm weights are ones, routing-correction biases zeros, other weights N(0, std^2). Reports no
    optional tensors (no FP8 scales, no MTP layers)."""

    def __init__(self, device: torch.device, seed: int = 0, std: float = 0.02) -> None:
        self.device = device
        self.fp8_dtype = torch.float8_e4m3fn
        self.location: dict[str, str] = {}
        self.std = std
        self.generator = torch.Generator(device=device).manual_seed(seed)  # draws on the device

    def has(self, name: str) -> bool:
        return False

    def skip(self, name: str) -> None:
        pass

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        dtype, device = dtype or torch.float32, self.device
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        if "correction_bias" in name:
            return torch.zeros(shape, dtype=dtype, device=device)
        t = torch.randn(shape, generator=self.generator, device=device, dtype=dtype)
        return t.mul_(1.0 if "embed" in name else self.std)

    def linear(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return self.get(f"{prefix}.weight", shape, dtype), None

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return self.get(f"{prefix}.weight", shape, dtype)

    def unread(self) -> list[tuple[str, str]]:
        return []


def resolve_config(name: str) -> Path:
    """A config NAME from the repository's model/ folder (model/NAME/config.json), or a path to a
    directory or a config.json file."""
    for candidate in (Path(name), REPO_MODEL_DIR / name):
        if candidate.is_file() and candidate.suffix == ".json":
            return candidate
        if (candidate / "config.json").is_file():
            return candidate / "config.json"
    known = (
        sorted(p.parent.name for p in REPO_MODEL_DIR.glob("*/config.json")) if REPO_MODEL_DIR.is_dir() else []
    )
    raise FileNotFoundError(
        f"no config {name!r}: not a config.json path, a directory with one, or a folder of "
        f"{REPO_MODEL_DIR} (known: {', '.join(known) or 'none'})"
    )


def random_model(config_file: Path, backend: Backend, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """The model of config_file with random weights, on backend's device."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.deepseek import DeepseekForCausalLM

    config = ModelConfig.from_file(config_file)
    if config.quantization is not None and dtype is None:
        dtype = torch.bfloat16  # random weights are never FP8
    model = DeepseekForCausalLM(config, backend, dtype or config.torch_dtype)
    model.load_weights(RandomReader(backend.device.device(), seed))  # type: ignore[arg-type]
    return model.eval()

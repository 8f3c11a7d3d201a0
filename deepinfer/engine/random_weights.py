"""Random-weight models from a config.json alone, for benchmarks (`deepinfer bench --random-config`).

The model is built by its own loading code (`load_weights`), fed by a reader that makes up each
tensor it is asked for, so every architecture the loader knows works unchanged.

A config can describe a model far larger than the device (DeepSeek-V3's 671 B parameters on one
GPU, or on the host): its size is estimated from the config first (`estimate_weight_bytes`), and
one whose weights do not fit in the device's free memory is refused before anything is
allocated (ModelTooLargeError); one that fits but leaves less than a tenth of the memory share
(gpu_memory_utilization) for the KV cache and activations is built with a warning.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.backend.ops import Backend

if TYPE_CHECKING:
    from deepinfer.models.config import ModelConfig

logger = logging.getLogger(__name__)

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


class ModelTooLargeError(ValueError):
    """The weights a config describes do not fit in the device's free memory."""


def estimate_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights (in `dtype`; the router's in float32) and the rotary table of the
    model `config` describes, as random_model builds it (no MTP layers, no FP8), from the config
    alone: embedding and head, per layer MLA (q_a/q_b or q, kv_a, kv_b, o, norms) and a dense MLP
    or the routed + shared experts with their router."""
    c = config
    d, h = c.hidden_size, c.num_attention_heads
    if c.q_lora_rank:
        attention = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
    else:
        attention = d * h * c.qk_head_dim
    attention += d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a_proj + its norm
    attention += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d
    params, float32 = 0, 0
    for layer in range(c.num_hidden_layers):
        params += attention + 2 * d  # + the two norms
        if c.is_moe_layer(layer):
            params += 3 * d * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts)
            float32 += c.n_routed_experts * (d + 1)  # router weight and correction bias
        else:
            params += 3 * d * c.intermediate_size
    params += c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d  # embedding, head, final norm
    rotary = c.max_position_embeddings * c.qk_rope_head_dim * 4  # float32 cos/sin table
    return params * torch.empty((), dtype=dtype).element_size() + float32 * 4 + rotary


def check_fits(
    config: ModelConfig, dtype: torch.dtype, backend: Backend, memory_share: float = 0.9, name: str = ""
) -> int:
    """The estimated weight bytes; ModelTooLargeError if they exceed the device's free memory,
    a warning if they leave less than a tenth of `memory_share` of it for the rest."""
    need = estimate_weight_bytes(config, dtype)
    free, total = backend.device.memory_info()
    what = (
        f"random weights for {name or 'this config'}: about {need / 2**30:.2f} GiB "
        f"({str(dtype).replace('torch.', '')})"
    )
    where = (
        f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB on {backend.device.device()} "
        f"(backend {backend.name})"
    )
    if need > free:
        raise ModelTooLargeError(
            f"{what} do not fit in the {where}; building them would run the device out of memory. "
            "Use a smaller config or dtype, or a device with more free memory"
        )
    if need > 0.9 * memory_share * free:
        logger.warning(
            "%s take most of the %s: little is left for the KV cache and activations, and the engine "
            "may run out of memory",
            what, where,
        )  # fmt: skip
    return need


def random_model(
    config_file: Path,
    backend: Backend,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    memory_share: float = 0.9,
) -> Any:
    """The model of config_file with random weights, on backend's device. Refused before
    anything is allocated when the weights cannot fit (check_fits; memory_share is the engine's
    gpu_memory_utilization)."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.deepseek import DeepseekForCausalLM

    config = ModelConfig.from_file(config_file)
    if config.quantization is not None and dtype is None:
        dtype = torch.bfloat16  # random weights are never FP8
    dtype = dtype or config.torch_dtype
    need = check_fits(config, dtype, backend, memory_share, str(config_file))
    start = time.perf_counter()
    model = DeepseekForCausalLM(config, backend, dtype)
    model.load_weights(RandomReader(backend.device.device(), seed))  # type: ignore[arg-type]
    backend.device.synchronize()
    logger.info(
        "random weights for %s built in %.2f s: %.2f GiB (estimated), on %s",
        config_file, time.perf_counter() - start, need / 2**30, backend.name,
    )  # fmt: skip
    return model.eval()

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

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer import envs
from deepinfer.backend.fp4 import E8M0_BIAS
from deepinfer.backend.fp4 import scale_shape as fp4_scale_shape
from deepinfer.backend.ops import Backend

if TYPE_CHECKING:
    from deepinfer.models.config import ModelConfig
    from deepinfer.parallel.expert_parallel import ExpertParallel

logger = logging.getLogger(__name__)

REPO_MODEL_DIR = Path(__file__).resolve().parents[2] / "model"


class RandomReader:
    """Stands in for deepinfer.models.loader.CheckpointReader: any tensor, random, seeded.

    Norm weights are ones, routing-correction biases zeros, other weights N(0, std^2). Reports no
    optional tensors (no MTP layers); with fp8, every linear layer a DeepSeek FP8 checkpoint
    quantizes is FP8 (e4m3 values N(0, 1), block scales std; deepseek_v4.stored_in_fp8 says
    which); with fp4_experts, DeepSeek-V4's routed experts are MXFP4 (random e2m1 codes, one
    power-of-two scale that gives them about std)."""

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        std: float = 0.02,
        fp8: bool = False,
        fp4_experts: bool = False,
    ) -> None:
        self.device = device
        self.fp8_dtype = torch.float8_e4m3fn
        self.location: dict[str, str] = {}
        self.std = std
        self.fp8, self.fp4_experts = fp8, fp4_experts
        self.unfused = envs.read().model_unfused  # as load_model reads DEEPINFER_MODEL_UNFUSED
        self.generator = torch.Generator(device=device).manual_seed(seed)  # draws on the device

    def has(self, name: str) -> bool:
        return self.fp8 and name.endswith(".weight_scale_inv")

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

    def linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype, fp4: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from deepinfer.models.deepseek_v4 import stored_in_fp8

        n, k = shape
        if fp4 and self.fp4_experts:  # uniform codes: RMS sqrt(mean e2m1^2) = 2.93 before scaling
            packed = torch.randint(256, (n, k // 2), generator=self.generator, device=self.device)
            exponent = E8M0_BIAS + round(math.log2(self.std / 2.93))
            scale = torch.full(fp4_scale_shape(n, k), exponent, dtype=torch.uint8, device=self.device)
            return packed.to(torch.uint8), scale
        if not self.fp8 or not stored_in_fp8(prefix):
            return self.get(f"{prefix}.weight", shape, dtype), None
        # drawn in bfloat16, then cast: a float32 (N, K) would double the peak
        w = torch.randn(shape, generator=self.generator, device=self.device, dtype=torch.bfloat16)
        scale = torch.full((-(-n // 128), -(-k // 128)), self.std, dtype=torch.float32, device=self.device)
        return w.to(self.fp8_dtype), scale

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return self.get(f"{prefix}.weight", shape, dtype)

    def get_ids(self, name: str, shape: tuple[int, ...], upper: int) -> torch.Tensor:
        """Integer tables (DeepSeek-V4's hash routing token -> experts): uniform in [0, upper)."""
        return torch.randint(upper, shape, generator=self.generator, device=self.device)

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


def has_fp4_experts(config: ModelConfig, fp8: bool) -> bool:
    """Whether random FP8 weights of `config` hold MXFP4 routed experts: DeepSeek-V4 configs whose
    expert_dtype is fp4 (V4-Flash); other experts are FP8 with the dense linears."""
    q = config.quantization
    return fp8 and config.v4 is not None and q is not None and q.expert_dtype == "fp4"


def estimate_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, fp8: bool = False, expert_share: float = 1.0
) -> int:
    """Bytes of the weights (in `dtype`; the router's in float32) and the rotary table of the
    model `config` describes, as random_model builds it (no MTP layers), from the config
    alone: embedding and head, per layer the attention's projections (MLA: q_a/q_b or q, kv_a,
    kv_b, o; DeepSeek-V4: q_a/q_b, kv, the grouped output, compressors and indexer) and norms,
    and a dense MLP or the routed + shared experts with their router. fp8: the linear layers at
    one byte a weight (block scales neglected), MXFP4 experts (has_fp4_experts) at half a byte
    plus a scale byte per 32; expert_share: the share of the routed experts held (expert
    parallelism)."""
    c = config
    act = torch.empty((), dtype=dtype).element_size()
    linear = 1 if fp8 else act
    expert = 0.5 + 1 / 32 if has_fp4_experts(c, fp8) else linear
    d = c.hidden_size
    params, linears, experts, float32 = 0, 0, 0, 0
    for layer in range(c.num_hidden_layers):
        params += 2 * d  # the two norms
        attention, attention_float = _attention_params(c, layer)
        linears += attention
        params += attention_float
        if c.is_moe_layer(layer):
            experts += 3 * d * c.moe_intermediate_size * round(c.n_routed_experts * expert_share)
            linears += 3 * d * c.moe_intermediate_size * c.n_shared_experts
            float32 += c.n_routed_experts * (d + 1)  # router weight and correction bias
        else:
            linears += 3 * d * c.intermediate_size
    params += c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d  # embedding, head, final norm
    # float32 cos/sin tables: V4's main and compressed branches' (max_position_embeddings rows);
    # V2/V3's one, with the rows past it that speculative padding drafts read
    if c.v4 is not None:
        rotary = 2 * c.max_position_embeddings * c.qk_rope_head_dim * 4
    else:
        from deepinfer.models.deepseek import SPECULATIVE_PADDING_POSITIONS

        rotary = (c.max_position_embeddings + SPECULATIVE_PADDING_POSITIONS) * c.qk_rope_head_dim * 4
    return int(params * act + linears * linear + experts * expert + float32 * 4 + rotary)


def _attention_params(c: ModelConfig, layer: int) -> tuple[int, int]:
    """(weights of the linears an FP8 checkpoint quantises, other weights) of one layer's attention."""
    d, h = c.hidden_size, c.num_attention_heads
    v4 = c.v4
    if v4 is None:  # MLA
        if c.q_lora_rank:
            attention = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
        else:
            attention = d * h * c.qk_head_dim
        attention += d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a_proj + its norm
        attention += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d
        return attention, 0
    q_lora, hd, out = c.q_lora_rank or 0, h * v4.head_dim, v4.o_groups * v4.o_lora_rank
    # wq_a, wq_b, wkv, wo_a ((H*D/G) -> r per group), wo_b
    quantised = d * q_lora + q_lora * hd + d * v4.head_dim + hd * v4.o_lora_rank + out * d
    other = q_lora + v4.head_dim + h  # norms and sinks
    ratio = v4.compress_ratios[layer]
    if ratio:  # the compressor's kv and gate projections, two series wide for CSA
        other += 2 * d * (2 if ratio == v4.csa_ratio else 1) * v4.head_dim
    if ratio == v4.csa_ratio:  # the indexer: its compressor, weights_proj, and wq_b (quantised)
        other += 2 * d * 2 * v4.index_head_dim + d * v4.index_n_heads
        quantised += q_lora * v4.index_n_heads * v4.index_head_dim
    return quantised, other


def check_fits(
    config: ModelConfig,
    dtype: torch.dtype,
    backend: Backend,
    memory_share: float = 0.9,
    name: str = "",
    fp8: bool = False,
    expert_share: float = 1.0,
) -> int:
    """The estimated weight bytes; ModelTooLargeError if they exceed the device's free memory,
    a warning if they leave less than a tenth of `memory_share` of it for the rest."""
    need = estimate_weight_bytes(config, dtype, fp8, expert_share)
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
    expert_parallel: ExpertParallel | None = None,
    fp8: bool = False,
    num_hidden_layers: int | None = None,
) -> Any:
    """The model of config_file with random weights, on backend's device. Refused before
    anything is allocated when the weights cannot fit (check_fits; memory_share is the engine's
    gpu_memory_utilization). expert_parallel: only this rank's routed experts; fp8: FP8 linear
    layers with block scales, as DeepSeek's FP8 checkpoints (the backend must support FP8), and
    for DeepSeek-V4 configs with expert_dtype fp4 (V4-Flash) MXFP4 routed experts, as published;
    num_hidden_layers: overrides the config's depth (the first layers of its schedule)."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.deepseek import DeepseekForCausalLM
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = ModelConfig.from_file(config_file)
    if num_hidden_layers is not None:  # a reduced-depth model of the same shapes
        raw = json.loads(config_file.read_text())
        config = ModelConfig.from_dict(raw | {"num_hidden_layers": num_hidden_layers})
    if config.quantization is not None and dtype is None:
        dtype = torch.bfloat16  # activations of an FP8 model
    dtype = dtype or config.torch_dtype
    if fp8 and not backend.capabilities.supports_fp8:
        raise ValueError(f"FP8 random weights need a backend with FP8 GEMMs; {backend.name!r} has none")
    share = 1.0 if expert_parallel is None else 1.0 / expert_parallel.world_size
    need = check_fits(config, dtype, backend, memory_share, str(config_file), fp8, share)
    start = time.perf_counter()
    if config.v4 is not None:
        if expert_parallel is not None:
            raise ValueError("expert parallelism is not supported for DeepSeek-V4 yet")
        model: DeepseekForCausalLM | DeepseekV4ForCausalLM = DeepseekV4ForCausalLM(config, backend, dtype)
    else:
        model = DeepseekForCausalLM(config, backend, dtype, expert_parallel)
    reader = RandomReader(backend.device.device(), seed, fp8=fp8, fp4_experts=has_fp4_experts(config, fp8))
    model.load_weights(reader)  # type: ignore[arg-type]
    backend.device.synchronize()
    logger.info(
        "random weights for %s built in %.2f s: %.2f GiB (estimated), on %s",
        config_file, time.perf_counter() - start, need / 2**30, backend.name,
    )  # fmt: skip
    return model.eval()

"""Random-weight models from a config.json alone, for benchmarks (`deepinfer bench --random-config`).

The model is built by its own loading code (`load_weights`), fed by a RandomSource
(deepinfer.testing.weights, BENCH_INIT: norms ones, router correction biases zeros, the rest
N(0, 0.02^2), drawn on the device) that makes up each tensor it is asked for, so every
architecture the loader knows works unchanged. No MTP layers are reported; with fp8 every linear
layer a DeepSeek FP8 checkpoint quantizes is FP8 (e4m3 values N(0, 1), block scales 0.02), and
with MXFP4 experts (has_fp4_experts) DeepSeek-V4's / V4.1's routed experts are random e2m1 codes
with one power-of-two scale; DeepSeek-V4.1's FP8 linears are those its published checkpoint
stores in FP8 (deepseek_v41.stored_in_fp8), with 32 x 32 scale blocks.

A config can describe a model far larger than the device (DeepSeek-V3's 671 B parameters on one
GPU, or on the host): its size is estimated from the config first (`estimate_weight_bytes`), and
one whose weights do not fit in the device's free memory is refused before anything is
allocated (ModelTooLargeError); one that fits but leaves less than a tenth of the memory share
(gpu_memory_utilization) for the KV cache and activations is built with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.backend.fp8 import FP8_BLOCK
from deepinfer.backend.ops import Backend
from deepinfer.models.config import ModelConfig
from deepinfer.models.config_v41 import reduce_depth
from deepinfer.models.deepseek import SPECULATIVE_PADDING_POSITIONS, DeepseekForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, stored_in_fp8
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41 import stored_in_fp8 as v41_stored_in_fp8
from deepinfer.models.engram import table_sizes
from deepinfer.models.hub import REPO_MODEL_DIR
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.testing.weights import BENCH_INIT, RandomSource

logger = logging.getLogger(__name__)


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
    """Whether random FP8 weights of `config` hold MXFP4 routed experts: DeepSeek-V4 / V4.1
    configs whose expert_dtype is fp4 (V4-Flash, V4.1-Flash); other experts are FP8 with the
    dense linears."""
    q = config.quantization
    new = config.v4 is not None or config.v41 is not None
    return fp8 and new and q is not None and q.expert_dtype == "fp4"


def reduced_config(
    config_file: Path, layers: int, text_overrides: dict[str, Any] | None = None
) -> ModelConfig:
    """The config of config_file with `layers` main layers: DeepSeek-V4.1's nested text_config
    through config_v41.reduce_depth (every per-layer list and the sharing topology with it;
    text_overrides: text_config keys replaced before, e.g. dspark_target_layer_ids that the
    reduction keeps), the others' flat num_hidden_layers (their first layers)."""
    raw = json.loads(config_file.read_text())
    if raw.get("model_type") == "deepseek_v41":
        raw["text_config"] = {**raw["text_config"], **(text_overrides or {})}
        return ModelConfig.from_dict(reduce_depth(raw, layers))
    return ModelConfig.from_dict(raw | {"num_hidden_layers": layers})


def estimate_weight_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    fp8: bool = False,
    expert_share: float = 1.0,
    host_tables: bool = False,
) -> int:
    """Bytes of the weights (in `dtype`; the router's in float32) and the rotary table of the
    model `config` describes, as random_model builds it (no MTP layers), from the config
    alone: embedding and head, per layer the attention's projections (MLA: q_a/q_b or q, kv_a,
    kv_b, o; DeepSeek-V4: q_a/q_b, kv, the grouped output, compressors and indexer) and norms,
    and a dense MLP or the routed + shared experts with their router; DeepSeek-V4.1's vision
    tower where its config has one. fp8: the linear layers at
    one byte a weight (block scales neglected), MXFP4 experts (has_fp4_experts) at half a byte
    plus a scale byte per 32; expert_share: the share of the routed experts held (expert
    parallelism). DeepSeek-V4.1's Engram layers: the FP8 wkv, the fused gate weight, the small
    hash tables and the n-gram table (FP8 rows with fp8: a byte a value and a scale byte per 32),
    which host_tables (envs.ENGRAM_HOST_TABLES) leaves out: it lives in host memory."""
    c = config
    act = torch.empty((), dtype=dtype).element_size()
    linear = 1 if fp8 else act
    expert = 0.5 + 1 / 32 if has_fp4_experts(c, fp8) else linear
    d = c.hidden_size
    params, linears, experts, float32, tables = 0, 0, 0, 0, 0
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
    if c.v41 is not None and c.v41.engram is not None:
        e, n = c.v41.engram, c.v41.hc_mult
        heads = (e.max_ngram_size - 1) * e.n_heads
        ints = c.vocab_size  # the raw -> compressed vocabulary, int64
        for sizes in table_sizes(e).values():
            linears += heads * e.head_dim * (n + 1) * d  # wkv
            float32 += n * d  # q_weight * k_weight
            ints += heads + e.max_ngram_size  # head sizes, hash multipliers
            if not host_tables:
                values = sum(sizes) * e.head_dim
                tables += values + values // 32 if fp8 else values * act
        float32 += 2 * ints  # int64: two float32s each
    if c.v41 is not None:  # hyper-connections: per sublayer fn, base, scale; the head's if unshifted
        n = c.v41.hc_mult
        float32 += c.num_hidden_layers * 2 * ((2 + n) * n * (n * d + 1) + 3)
        if not c.v41.hc_shifted:
            float32 += n * n * d + n + 1
        v = c.v41.vision
        if v is not None:  # the vision tower (models.vision): linears with biases, float32 norms
            w, p2, dd = v.width, 3 * v.patch_size**2, v.downsample_ratio**2
            params += w * p2 + w + v.depth * (4 * w * w + 4 * w + 3 * w * v.intermediate)
            params += d * w * dd + d + d * d + d + 3 * d  # the aligner, the image vectors
            float32 += (2 * v.depth + 1) * w
    # float32 cos/sin tables: V4's main and compressed branches' (max_position_embeddings rows);
    # V2/V3's one, with the rows past it that speculative padding drafts read
    if c.v4 is not None or c.v41 is not None:
        rotary = 2 * c.max_position_embeddings * c.qk_rope_head_dim * 4
    else:
        rotary = (c.max_position_embeddings + SPECULATIVE_PADDING_POSITIONS) * c.qk_rope_head_dim * 4
    return int(params * act + linears * linear + experts * expert + float32 * 4 + rotary + tables)


def _attention_params(c: ModelConfig, layer: int) -> tuple[int, int]:
    """(weights of the linears an FP8 checkpoint quantises, other weights) of one layer's attention."""
    d, h = c.hidden_size, c.num_attention_heads
    if c.v41 is not None:
        return _v41_attention_params(c, layer)
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


def _v41_attention_params(c: ModelConfig, layer: int) -> tuple[int, int]:
    """As _attention_params for DeepSeek-V4.1: wq_a, wq_b, wkv, wo_a, wo_b and the indexer's wq_b
    FP8; the compressor (a KV source's), weights_proj and wk (index sources') bf16; norms, sinks."""
    v = c.v41
    assert v is not None
    d, h, dh, q_lora = c.hidden_size, c.num_attention_heads, v.head_dim, c.q_lora_rank or 0
    quantised = (
        d * q_lora + q_lora * h * dh + d * dh + h * dh * v.o_lora_rank + v.o_groups * v.o_lora_rank * d
    )
    other = q_lora + dh + h
    ratio, topo = v.compress_ratios[layer], v.sharing
    if ratio and topo.kv[layer] == layer:
        other += d * dh * ratio + dh  # wkv (and wgate for C2), norm
    if ratio and topo.index[layer] == layer:
        quantised += q_lora * v.index_n_heads * v.index_head_dim
        other += d * v.index_n_heads
    if ratio and topo.index_k[layer] == layer:
        other += dh * v.index_head_dim + v.index_head_dim
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
    host = envs.read().engram_host_tables
    need = estimate_weight_bytes(config, dtype, fp8, expert_share, host)
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
        tables = need - estimate_weight_bytes(config, dtype, fp8, expert_share, True)
        hint = (
            f" ({tables / 2**30:.2f} GiB of them Engram tables: {envs.ENGRAM_HOST_TABLES.name}=1 keeps "
            "those in host memory)"
            if tables
            else ""
        )
        raise ModelTooLargeError(
            f"{what} do not fit in the {where}{hint}; building them would run the device out of memory. "
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
    mtp: bool = False,
    by_name: bool = False,
    dflash: bool = False,
    text_overrides: dict[str, Any] | None = None,
) -> DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """The model of config_file with random weights, on backend's device. Refused before
    anything is allocated when the weights cannot fit (check_fits; memory_share is the engine's
    gpu_memory_utilization). expert_parallel: only this rank's routed experts; fp8: FP8 linear
    layers with block scales, as DeepSeek's FP8 checkpoints (the backend must support FP8), and
    for DeepSeek-V4 configs with expert_dtype fp4 (V4-Flash) MXFP4 routed experts, as published;
    num_hidden_layers: overrides the config's depth (the first layers of its schedule; DeepSeek-V4.1:
    reduced_config); mtp: DeepSeek-V4's MTP layers too (num_nextn_predict_layers of them, DeepSeek's
    mtp.{k}.*; not counted by the fit check); dflash: DeepSeek-V4.1's DSpark draft layers as its
    DFlash drafter (mtp.{i}.*; not counted by the fit check either); text_overrides: V4.1
    text_config keys replaced before a depth reduction (reduced_config)."""
    config = ModelConfig.from_file(config_file)
    if num_hidden_layers is not None:  # a reduced-depth model of the same shapes
        config = reduced_config(config_file, num_hidden_layers, text_overrides)
    if config.quantization is not None and dtype is None:
        dtype = torch.bfloat16  # activations of an FP8 model
    dtype = dtype or config.torch_dtype
    if fp8 and not backend.capabilities.supports_fp8:
        raise ValueError(f"FP8 random weights need a backend with FP8 GEMMs; {backend.name!r} has none")
    share = 1.0 if expert_parallel is None else 1.0 / expert_parallel.world_size
    need = check_fits(config, dtype, backend, memory_share, str(config_file), fp8, share)
    start = time.perf_counter()
    model: DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM
    fp8_linears, fp8_block = stored_in_fp8, FP8_BLOCK
    if config.v41 is not None:
        model = DeepseekV41ForCausalLM(config, backend, dtype, expert_parallel=expert_parallel, dflash=dflash)
        fp8_linears = v41_stored_in_fp8
        if config.quantization is not None:
            fp8_block = config.quantization.weight_block_size[0]
    elif config.v4 is not None:
        model = DeepseekV4ForCausalLM(config, backend, dtype, expert_parallel)
    else:
        model = DeepseekForCausalLM(config, backend, dtype, expert_parallel)
    device, fp4_experts = backend.device.device(), has_fp4_experts(config, fp8)
    if dflash and config.v41 is None:
        raise ValueError("random DFlash draft layers are built for DeepSeek-V4.1 configs only")
    if mtp and config.v4 is None:
        raise ValueError("random MTP layers are built for DeepSeek-V4 configs only")
    present = [f"mtp.{k}.enorm.weight" for k in range(config.num_nextn_predict_layers)] if mtp else []
    source = RandomSource(
        BENCH_INIT,
        seed,
        device,
        present=present,
        fp8=fp8,
        fp4_experts=fp4_experts,
        fp8_block=fp8_block,
        fp8_linears=fp8_linears,
        by_name=by_name,
    )
    model.load_weights(source)
    backend.device.synchronize()
    logger.info(
        "random weights for %s built in %.2f s: %.2f GiB (estimated), on %s",
        config_file, time.perf_counter() - start, need / 2**30, backend.name,
    )  # fmt: skip
    return model.eval()

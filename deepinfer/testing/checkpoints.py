"""Random DeepSeek checkpoints with the published tensor names, for tests and the conformance suite
(no transformers needed): float32 or DeepSeek's FP8 format (DeepSeek-V4: FP8 + MXFP4 experts),
one file or sharded with an index. The weights come from deepinfer.testing.weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from deepinfer.backend import fp4
from deepinfer.backend.fp8 import dequantize_weight, quantize_weight
from deepinfer.models.config import ModelConfig
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, stored_in_fp8
from deepinfer.models.dflash import DFlashConfig
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.weights import CHECKPOINT_INIT, V4_INIT, RandomSource

FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3-shaped config.json dict (published field names), with one MTP layer."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 512,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def _layer_tensors(c: ModelConfig, prefix: str, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one decoder layer's tensors (excluding MTP extras)."""
    dm, h = c.hidden_size, c.num_attention_heads
    t: dict[str, tuple[int, ...]] = {
        f"{prefix}.input_layernorm.weight": (dm,),
        f"{prefix}.post_attention_layernorm.weight": (dm,),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, dm),
        f"{prefix}.self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        f"{prefix}.self_attn.kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        f"{prefix}.self_attn.o_proj.weight": (dm, h * c.v_head_dim),
    }
    if c.q_lora_rank is None:
        t[f"{prefix}.self_attn.q_proj.weight"] = (h * c.qk_head_dim, dm)
    else:
        t[f"{prefix}.self_attn.q_a_proj.weight"] = (c.q_lora_rank, dm)
        t[f"{prefix}.self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)
        t[f"{prefix}.self_attn.q_b_proj.weight"] = (h * c.qk_head_dim, c.q_lora_rank)

    def mlp(p: str, inter: int) -> None:
        t[f"{p}.gate_proj.weight"] = (inter, dm)
        t[f"{p}.up_proj.weight"] = (inter, dm)
        t[f"{p}.down_proj.weight"] = (dm, inter)

    if c.is_moe_layer(layer_idx):
        t[f"{prefix}.mlp.gate.weight"] = (c.n_routed_experts, dm)
        if c.topk_method == "noaux_tc":
            t[f"{prefix}.mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        for e in range(c.n_routed_experts):
            mlp(f"{prefix}.mlp.experts.{e}", c.moe_intermediate_size)
        if c.n_shared_experts:
            mlp(f"{prefix}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
    else:
        mlp(f"{prefix}.mlp", c.intermediate_size)
    return t


def tensor_shapes(config: ModelConfig, mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of a float checkpoint of `config`, name -> shape (DeepSeek's names)."""
    c, dm = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, dm)}
    for i in range(c.num_hidden_layers):
        shapes.update(_layer_tensors(c, f"model.layers.{i}", i))
    shapes["model.norm.weight"] = (dm,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, dm)
    for k in range(c.num_nextn_predict_layers if mtp else 0):
        idx = c.num_hidden_layers + k
        p = f"model.layers.{idx}"
        shapes.update(_layer_tensors(c, p, idx))
        shapes[f"{p}.enorm.weight"] = (dm,)
        shapes[f"{p}.hnorm.weight"] = (dm,)
        shapes[f"{p}.eh_proj.weight"] = (dm, 2 * dm)
        shapes[f"{p}.shared_head.norm.weight"] = (dm,)
    return shapes


def random_state_dict(config: ModelConfig, seed: int = 0, mtp: bool = True) -> dict[str, torch.Tensor]:
    """float32 weights of every tensor_shapes() tensor, drawn in that order (CHECKPOINT_INIT:
    matrices ~ N(0, 1/fan_in) (logits O(1)), router gates ~ N(0, 4/fan_in), norms 1 + N(0, 0.1^2),
    router correction bias N(0, 0.1^2), embeddings N(0, 1))."""
    source = RandomSource(CHECKPOINT_INIT, seed, record=True)
    for name, shape in tensor_shapes(config, mtp).items():
        source.get(name, shape, torch.float32)
    return source.tensors


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek's FP8 checkpoints store in e4m3: every linear weight except the
    embedding, the output head(s) and the router gate."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    return not (
        name.endswith("embed_tokens.weight")
        or name.endswith("head.weight")
        or name.endswith("mlp.gate.weight")
    )


def quantize_state_dict(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(FP8 checkpoint tensors with weight_scale_inv, the same weights dequantised to float32)."""
    fp8: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if is_fp8_weight(name, t):
            q, scale = quantize_weight(t)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequant[name] = dequantize_weight(q, scale)
        else:
            fp8[name] = dequant[name] = t
    return fp8, dequant


def write_checkpoint(
    path: str | Path, config: dict[str, Any], state: dict[str, torch.Tensor], shards: int = 1
) -> Path:
    """config.json + model.safetensors (shards == 1) or model-0000i-of-0000n.safetensors + index."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = sorted(state)
    if shards == 1:
        save_file({n: state[n].contiguous() for n in names}, str(root / "model.safetensors"))
        return root
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: state[n].contiguous() for n in part}, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    index["weight_map"] = weight_map  # type: ignore[assignment]
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return root


def write_random_checkpoint(
    path: str | Path,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    fp8: bool = False,
    shards: int = 1,
    mtp: bool = True,
) -> Path:
    """A random checkpoint of `config` (default tiny_config()) at `path`; FP8 adds the
    quantization_config DeepSeek publishes and stores linear weights in e4m3 with block scales."""
    cfg = dict(config or tiny_config())
    state = random_state_dict(ModelConfig.from_dict(cfg), seed, mtp)
    if fp8:
        state, _ = quantize_state_dict(state)
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return write_checkpoint(path, cfg, state, shards)


def write_mirrored_mtp_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A random one-layer tiny_config checkpoint whose MTP head mostly drafts what the model then
    samples (speculative tests that need accepted drafts). The MTP layer is a copy of the decoder
    layer that reads only the next token's embedding (eh_proj = [I | 0], embeddings of unit RMS,
    enorm 1; the final norm shared): at position p on token p + 1 it computes what the model
    computes at position p + 1, except that its attention lacks token 0."""
    cfg = tiny_config(**{"num_hidden_layers": 1, "first_k_dense_replace": 0, **overrides})  # both MoE
    state = random_state_dict(ModelConfig.from_dict(cfg), seed)
    dm = cfg["hidden_size"]
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed / embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    for name in [n for n in state if n.startswith("model.layers.0.")]:
        state[name.replace("model.layers.0.", "model.layers.1.")] = state[name].clone()
    state["model.layers.1.enorm.weight"] = torch.ones(dm)
    state["model.layers.1.eh_proj.weight"] = torch.cat([torch.eye(dm), torch.zeros(dm, dm)], dim=1)
    state["model.layers.1.shared_head.norm.weight"] = state["model.norm.weight"].clone()
    return write_checkpoint(path, cfg, state)


# --------------------------------------------------------------------------- DeepSeek-V4


def tiny_v4_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V4 config.json dict (transformers' field names): a sliding-window-only, a
    CSA and an HCA layer, the first MoE hash-routed."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 128,
        "hidden_size": 32,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "head_dim": 16,
        "q_lora_rank": 24,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 6,
        "o_groups": 2,
        "o_lora_rank": 8,
        "index_n_heads": 4,
        "index_head_dim": 8,
        "index_topk": 3,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 5,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


# DeepSeek-V4's published format: FP8 linears with UE8M0 block scales, MXFP4 routed experts
# (the expert format at the top level of config.json, where V4 names it)
V4_QUANTIZATION_CONFIG = dict(FP8_QUANTIZATION_CONFIG, scale_fmt="ue8m0")
V4_EXPERT_DTYPE = "fp4"
E8M0 = torch.float8_e8m0fnu  # the scales' dtype in V4's safetensors


def quantize_v4_state_dict(
    state: dict[str, torch.Tensor], expert_dtype: str = V4_EXPERT_DTYPE
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(DeepSeek-V4's published format, the same weights dequantised to float32) of a float V4
    state dict (transformers' or DeepSeek's names). Routed experts' w1 / w2 / w3: MXFP4, packed
    int8 with float8_e8m0fnu `.scale` (deepinfer.backend.fp4), or with expert_dtype "fp8"
    (V4-Flash-Base) FP8 as the linears; the linears DeepSeek keeps in FP8
    (deepseek_v4.stored_in_fp8): e4m3 with power-of-two block scales as float8_e8m0fnu `.scale`;
    the rest (embedding, head, router, compressors, norms, mixing parameters) as they are."""
    quantized: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        linear = t.dim() == 2 and prefix != name and "embed" not in name and not name.endswith("head.weight")
        routed = ".experts." in prefix  # (shared experts are `.shared_experts.`)
        if linear and routed and expert_dtype == "fp4":
            packed, scale = fp4.quantize_weight(t)
            quantized[name], quantized[f"{prefix}.scale"] = packed.view(torch.int8), scale.view(E8M0)
            dequant[name] = fp4.dequantize_weight(packed, scale)
        elif linear and stored_in_fp8(prefix):
            q, scale = quantize_weight(t, ue8m0=True)
            quantized[name], quantized[f"{prefix}.scale"] = q, fp4.float_to_e8m0(scale).view(E8M0)
            dequant[name] = dequantize_weight(q, scale)
        else:
            quantized[name] = dequant[name] = t
    return quantized, dequant


def write_random_v4_checkpoint(
    root: Path, config: dict[str, Any] | None = None, seed: int = 0, quantized: bool = False, mtp: bool = True
) -> Path:
    """A random DeepSeek-V4 checkpoint (float32, the names transformers' save_pretrained writes,
    and with `mtp` the config's MTP layers as DeepSeek publishes them: mtp.{k}.*) in directory
    `root`: config.json + model.safetensors. The tensors are exactly those the loader reads (the
    model loads itself from a recording RandomSource, V4_INIT); the main model's do not depend
    on `mtp`. quantized: in
    DeepSeek's published format instead (quantize_v4_state_dict: FP8 linears, MXFP4 routed
    experts)."""
    config = dict(config or tiny_v4_config())
    parsed = ModelConfig.from_dict(config)
    # transformers' names, and the MTP layers under DeepSeek's (transformers saves none)
    layers = parsed.num_nextn_predict_layers if mtp else 0
    present = {"model.embed_tokens.weight", *(f"mtp.{k}.enorm.weight" for k in range(layers))}
    source = RandomSource(V4_INIT, seed, present=present, record=True)
    model = DeepseekV4ForCausalLM(parsed, create_reference_backend(), torch.float32)
    model.load_weights(source)
    state = source.tensors
    if quantized:
        state, _ = quantize_v4_state_dict(state)
        config |= {"quantization_config": dict(V4_QUANTIZATION_CONFIG), "expert_dtype": V4_EXPERT_DTYPE}
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def write_mirrored_v4_mtp_checkpoint(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random one-layer DeepSeek-V4 checkpoint (tiny_v4_config(**overrides): its first layer
    type and MoE routing) whose MTP layer mostly drafts what the model then samples (speculative
    tests that need accepted drafts): a copy of layer 0 that reads only the next token's
    embedding (e_proj = I, h_proj = 0, enorm 1, embeddings of unit RMS), with the model's head
    (collapse and norm). At position p on token p + 1 it computes what the model computes at
    position p + 1, except that its window lacks token 0 and its compressed entries pool windows
    one token later."""
    cfg = tiny_v4_config(**{"num_hidden_layers": 1, "num_nextn_predict_layers": 1, **overrides})
    for key in ("layer_types", "mlp_layer_types"):  # the MTP layer: layer 0's kind
        cfg[key] = cfg[key][:1] * 2
    write_random_v4_checkpoint(root, cfg, seed, mtp=True)
    state = load_file(str(root / "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed / embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    for name in [n for n in state if n.startswith("model.layers.0.")]:
        state[name.replace("model.layers.0.", "mtp.0.")] = state[name].clone()
    dm = cfg["hidden_size"]
    state["mtp.0.enorm.weight"] = torch.ones(dm)
    state["mtp.0.e_proj.weight"] = torch.eye(dm)
    state["mtp.0.h_proj.weight"] = torch.zeros(dm, dm)
    state["mtp.0.norm.weight"] = state["model.norm.weight"].clone()
    for part in ("fn", "base", "scale"):
        state[f"mtp.0.hc_head_{part}"] = state[f"model.hc_head.hc_{part}"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    return root


def dflash_tensor_shapes(config: ModelConfig, dflash: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash drafter file (deepinfer.models.dflash), name -> shape."""
    dm, last = config.hidden_size, f"mtp.{dflash.num_layers - 1}"
    block = dflash.block_config(config)
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.0.projection.weight": (dm, len(dflash.target_layer_ids) * dm),
        "mtp.0.project_norm.weight": (dm,),
    }
    for i in range(dflash.num_layers):
        shapes.update(_layer_tensors(block, f"mtp.{i}", 0))
    shapes[f"{last}.norm.weight"] = (dm,)
    shapes[f"{last}.markov_w1.weight"] = (config.vocab_size, dflash.markov_rank)
    shapes[f"{last}.markov_w2.weight"] = (config.vocab_size, dflash.markov_rank)
    shapes[f"{last}.accept_rate.proj.weight"] = (1, dm + dflash.markov_rank)
    return shapes


def random_dflash_state_dict(
    config: ModelConfig, dflash: DFlashConfig, seed: int = 0
) -> dict[str, torch.Tensor]:
    """float32 weights of every dflash_tensor_shapes() tensor (CHECKPOINT_INIT, as random_state_dict)."""
    source = RandomSource(CHECKPOINT_INIT, seed, record=True)
    for name, shape in dflash_tensor_shapes(config, dflash).items():
        source.get(name, shape, torch.float32)
    return source.tensors

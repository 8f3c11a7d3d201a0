"""Tiny random DeepSeek-V4.1 checkpoints in DeepSeek's schema, for the float64 oracle and model tests.

`tiny_v41_config(...)` gives a config.json dict (top level `model_type: deepseek_v41`, the model in
`text_config`, a `quantization_config` and `vision_config` as DeepSeek's loader expects);
`random_v41_tensors(config, seed)` the float32 tensors under DeepSeek's HF names with the shapes
`v41_oracle.expected_tensor_shapes` lists; `write_v41_checkpoint(directory, config, tensors)` writes
config.json + model.safetensors; `write_merging_tokenizer(directory, vocab)` a word-level
tokenizer.json whose tokens fall into groups that Engram's normalisation merges (case, accents,
surrounding spaces), for the compressed vocabulary. `quantize_v41_tensors(tensors)` gives the
published format of float tensors and their dequantised float32 twin: FP8 e4m3 linears with UE8M0
scales per 32 x 32 block, MXFP4 routed experts (deepseek_v41.stored_in_fp8 says which are FP8),
Engram tables as FP8 rows (e4m3, a UE8M0 scale per 32 values of a row: quantize_rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.backend import fp4
from deepinfer.backend.fp8 import MXFP8_BLOCK, dequantize_weight, quantize_weight
from deepinfer.models.deepseek_v41 import stored_in_fp8
from deepinfer.testing.v41_oracle import V41Config, dspark_tensor_shapes, expected_tensor_shapes
from deepinfer.testing.vision_oracle import vision_tensor_shapes

E8M0 = torch.float8_e8m0fnu  # the scales' dtype in DeepSeek's safetensors
# A tiny vision tower: DeepSeek's keys plus the ViT sizes its code fixes (config_vision)
TINY_VISION: dict[str, Any] = {
    "hidden_size": 16, "num_heads": 2, "depth": 2, "intermediate_size": 24, "downsample_ratio": 2,
    "patch_size": 14, "max_image_tokens": 64, "min_pixels": 0, "max_wh_ratio": 8,
}  # fmt: skip
ROW_GROUP = 32  # values of an FP8 Engram row under one UE8M0 scale


def tiny_v41_config(
    *,
    layers: int = 4,
    ratios: list[int] | None = None,
    hidden: int = 32,
    heads: int = 4,
    head_dim: int = 24,
    rope_dim: int = 8,
    window: int = 4,
    index_topk: int = 3,
    index_heads: int = 2,
    index_head_dim: int = 16,
    kv_source_layer_ids: list[int] | None = None,
    index_source_layer_ids: list[int] | None = None,
    index_k_source_layer_ids: list[int] | None = None,
    candidate_source_layer_id: int | None = None,
    candidate_topk_blocks: int = 8,
    candidate_block_size: int = 2,
    engram: bool = False,
    engram_layer_ids: list[int] | None = None,
    hc_shifted: bool = True,
    hc_mult: int = 2,
    yarn: bool = True,
    vocab: int = 64,
    vision: bool = False,
    dspark: int = 0,
    **text_overrides: Any,
) -> dict[str, Any]:
    """A tiny V4.1 config. Default ratios [0, 2, 1, 1, ...]: window layer, C2, then the C1 YOCO half.
    Sharing lists default to "every compressed layer is its own source". vision: with a tiny
    vision tower (TINY_VISION: 2 blocks of width 16, 2 heads, patch 14, d 2); else text only.
    dspark: that many DSpark (DFlash) draft layers (num_nextn_predict_layers; blocks of 4 slots
    conditioned on the first and the last layer, Markov rank 8, their own 3-expert top-2 MoE)."""
    ratios = list(ratios) if ratios is not None else [0, 2] + [1] * (layers - 2)
    if len(ratios) != layers:
        raise ValueError(f"ratios has {len(ratios)} entries for {layers} layers")
    compressed = [i for i, r in enumerate(ratios) if r] or [0]
    own = list(range(compressed[0], layers))
    text: dict[str, Any] = {
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_key_value_heads": 1,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 0,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "qk_rope_head_dim": rope_dim,
        "q_lora_rank": 16,
        "o_lora_rank": 12,
        "o_groups": 2,
        "sliding_window": window,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": (
            {
                "type": "yarn",
                "original_max_position_embeddings": 16,
                "factor": 4.0,
                "beta_fast": 32,
                "beta_slow": 1,
            }
            if yarn
            else None
        ),
        "compress_ratios": ratios,
        "index_topk": index_topk,
        "index_n_heads": index_heads,
        "index_head_dim": index_head_dim,
        "index_source_layer_ids": index_source_layer_ids if index_source_layer_ids is not None else own,
        "kv_source_layer_ids": kv_source_layer_ids if kv_source_layer_ids is not None else own,
        "candidate_source_layer_id": candidate_source_layer_id,
        "candidate_topk_blocks": candidate_topk_blocks,
        "candidate_block_size": candidate_block_size,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 3.0,
        "hc_mult": hc_mult,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "hc_shifted": hc_shifted,
        "use_fp4_sparse_kv": True,
    }
    if index_k_source_layer_ids is not None:
        text["index_k_source_layer_ids"] = index_k_source_layer_ids
    if dspark:
        text |= {
            "num_nextn_predict_layers": dspark,
            "compress_ratios": ratios + [0] * dspark,
            "dspark_block_size": 4,
            "dspark_target_layer_ids": sorted({0, layers - 1}),
            "dspark_target_attn_input": True,
            "dspark_markov_rank": 8,
            "dspark_noise_token_id": 5,
            "dspark_n_routed_experts": 3,
            "dspark_num_experts_per_tok": 2,
        }
    if engram:
        text |= {
            "engram_layer_ids": engram_layer_ids if engram_layer_ids is not None else [0],
            "engram_max_ngram_size": 3,
            "engram_vocab_size": 40,
            "engram_n_heads": 2,
            "engram_head_dim": 8,
            "engram_compressed_vocab_size": vocab,
            "engram_pad_token_id": 2,
        }
    text |= text_overrides
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "pad_token_id": 2,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "image_token_id": vocab - 1,
        "quantization_config": {
            "quant_method": "fp8",
            "expert_dtype": "fp4",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
        },
        **({"vision_config": dict(TINY_VISION)} if vision else {}),
        "text_config": text,
    }


def random_v41_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 tensors for every name the text model reads, scaled so activations stay O(1):
    projections ~ N(0, 1/fan_in), norm weights ~ 1, HC logits of order 1, sinks and biases small."""
    cfg = V41Config.from_dict(config)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    out: dict[str, torch.Tensor] = {}
    shapes = expected_tensor_shapes(cfg) | dspark_tensor_shapes(config)  # the draft layers' (mtp.*) too
    if config.get("vision_config") is not None:  # the tower, and each layer's image routing bias
        shapes |= vision_tensor_shapes(config)
        shapes |= {f"layers.{i}.ffn.gate.bias_vl": (cfg.n_experts,) for i in range(cfg.n_layers)}
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")):
            t = 1.0 + 0.1 * randn(*shape)
        elif name.endswith("_fn"):  # (k, n*H): mixes of order 1 after the RMS normalisation
            t = randn(*shape) * (2.0 / shape[1] ** 0.5)
        elif name.endswith("_base"):
            t = 0.5 * randn(*shape)
        elif name.endswith("_scale"):
            t = 0.5 + torch.rand(*shape, generator=g, dtype=torch.float64)
        elif name.endswith(("attn_sink", "gate.bias")):
            t = 0.3 * randn(*shape)
        elif name.endswith("gate.bias_vl"):  # large enough to route image tokens elsewhere
            t = 2.0 * randn(*shape)
        elif name.startswith("image_") or name.endswith(".bias"):  # image vectors, vision biases
            t = 0.5 * randn(*shape)
        elif name.endswith("embed.weight"):
            t = randn(*shape)
        elif name == "head.weight":
            t = randn(*shape) * (1.0 / shape[1] ** 0.5)
        else:  # a linear layer (out, in)
            t = randn(*shape) * (1.0 / shape[1] ** 0.5)
        out[name] = t.float()
    return out


def write_v41_checkpoint(
    directory: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    """config.json + model.safetensors in `directory` (created); returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


ENGRAM_SPECIALS = ("<bos>", "<eos>", "<｜▁pad▁｜>")  # ids 0, 1, 2 (DeepSeek's Engram pad is id 2)


def merging_tokens(vocab: int) -> list[str]:
    """`vocab` token strings: the three specials, then groups of three that normalise alike:
    "te{j}", "TE{j}", " té{j} " (lowercase, accents stripped, surrounding spaces stripped)."""
    words = [
        ("te{}", "TE{}", " t\u00e9{} ")[i % 3].format(i // 3) for i in range(vocab - len(ENGRAM_SPECIALS))
    ]
    return [*ENGRAM_SPECIALS, *words]


def write_merging_tokenizer(directory: str | Path, vocab: int) -> list[str]:
    """A word-level tokenizer.json of merging_tokens(vocab) in `directory`; returns the tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokens = merging_tokens(vocab)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ENGRAM_SPECIALS])
    tok.save(str(Path(directory) / "tokenizer.json"))
    return tokens


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's FP8 rows (Engram tables): (R, Dh) floats, Dh a multiple of 32 -> (e4m3
    (R, Dh), UE8M0 bytes (R, Dh / 32)): each group of 32 values of a row divided by the smallest
    power of two that brings its largest magnitude within e4m3's 448 (1 for a group of zeros)."""
    r, dh = t.shape
    if dh % ROW_GROUP:
        raise ValueError(f"FP8 rows take one scale per {ROW_GROUP} values; rows of {dh} do not divide")
    groups = t.float().view(r, dh // ROW_GROUP, ROW_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, fp4.pow2_ceil(amax.clamp(min=2.0**-100) / 448.0), torch.ones_like(amax))
    q = (groups / scale[..., None]).to(torch.float8_e4m3fn).view(r, dh)
    return q, fp4.float_to_e8m0(scale)


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 rows (e4m3 (R, Dh), UE8M0 bytes (R, Dh / 32)) -> float32, exactly."""
    s = fp4.e8m0_to_float(scale).repeat_interleave(ROW_GROUP, dim=1)
    return rows.float() * s


def quantize_v41_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(DeepSeek-V4.1's published format, the same weights dequantised to float32) of float
    tensors under DeepSeek's names. Routed experts' w1 / w3 / w2: MXFP4, packed e2m1 in int8 with
    float8_e8m0fnu `.scale` (N, K/32); the linears stored_in_fp8 names: e4m3 with power-of-two
    scales per 32 x 32 block as float8_e8m0fnu `.scale` (ceil(N/32), ceil(K/32)); Engram tables
    (`engram.embed.weight`): FP8 rows, e4m3 with a float8_e8m0fnu `.scale` (R, Dh/32) per 32
    values of each row (quantize_rows); the rest as is."""
    quantized: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        linear = t.dim() == 2 and prefix != name and not prefix.endswith(("embed", "head"))
        if linear and ".ffn.experts." in prefix:
            packed, scale = fp4.quantize_weight(t)
            quantized[name], quantized[f"{prefix}.scale"] = packed.view(torch.int8), scale.view(E8M0)
            dequant[name] = fp4.dequantize_weight(packed, scale)
        elif name.endswith("engram.embed.weight"):
            rows, scale = quantize_rows(t)
            quantized[name], quantized[f"{prefix}.scale"] = rows, scale.view(E8M0)
            dequant[name] = dequantize_rows(rows, scale)
        elif linear and stored_in_fp8(prefix):
            q, scale = quantize_weight(t, MXFP8_BLOCK, ue8m0=True)
            quantized[name], quantized[f"{prefix}.scale"] = q, fp4.float_to_e8m0(scale).view(E8M0)
            dequant[name] = dequantize_weight(q, scale, MXFP8_BLOCK)
        else:
            quantized[name] = dequant[name] = t
    return quantized, dequant

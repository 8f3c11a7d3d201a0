"""DeepSeek-V4.1's config.json, in the schema DeepSeek publishes (model_type "deepseek_v41").

The top level holds `architectures` (["DeepseekV41ForCausalLM"]), `dtype`, the token ids,
`quantization_config`, `vision_config` and `text_config`; the text model's fields are all in
`text_config`. Everything a user can get wrong raises ModelConfigError naming the field, before
any weight is read: layer types other than 0 / 1 / 2, a compress_ratios list of the wrong length,
no C1 layer (the decoder half starts at the first), a sharing topology DeepSeek's loader would
reject (see SharingTopology), an Engram layer in the decoder half, a quantization_config other
than DeepSeek's recipe.

Layer types by compress_ratios[i]: 0 sliding window only; 1 ("C1") the window plus one main KV
entry per token; 2 ("C2") the window plus one main entry per 2 tokens (a per-channel softmax pool,
no overlap). Every compressed layer is sparse: an indexer keeps index_topk main entries per query.
The entries past num_hidden_layers describe the DSpark draft layers (sliding window only,
whatever their entry says).

Float checkpoints (no quantization_config, dtype bfloat16 or float32) are accepted as well as
DeepSeek's FP8 (32 x 32 UE8M0 blocks) + MXFP4 recipe, which is the one quantization_config
DeepSeek's loader accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.models.config import (
    _DTYPES,
    Fp8Config,
    ModelConfig,
    ModelConfigError,
    RopeConfig,
    _check_token_ids,
    _Fields,
    _parse_eos,
    _parse_rope,
    single_kv_head_config,
)
from deepinfer.models.config_vision import VIT_DEPTH, VIT_HEADS, VisionConfig, vit_intermediate

ARCHITECTURE = "DeepseekV41ForCausalLM"
LAYER_RATIOS = (0, 1, 2)
# DeepSeek's only accepted quantization_config (hugging_face/config.py of its engine).
QUANTIZATION = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
# text_config fields with a default in DeepSeek's loader (`.get(key, default)` there).
TEXT_DEFAULTS: dict[str, Any] = {
    "num_nextn_predict_layers": 0,
    "hc_shifted": True,
    "use_fp4_sparse_kv": True,
    "candidate_source_layer_id": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "dspark_target_attn_input": True,
}


@dataclass(frozen=True)
class SharingTopology:
    """Which layer's caches and indices a compressed layer reads (V4.1's cross-layer sharing):
    each map sends layer i to the nearest listed source at or below it (itself before the first
    source, and wherever it is listed).

    kv[i]       whose main compressed KV layer i attends (the consumer computes none);
    index_k[i]  whose index keys its own index queries score;
    index[i]    whose top-k indices it uses (it runs no indexer of its own);
    candidate   the layer whose per-block maxima select the candidate blocks every later
                compressed layer scores inside (None: no two-stage selection).
    """

    kv: tuple[int, ...]
    index_k: tuple[int, ...]
    index: tuple[int, ...]
    candidate: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0


@dataclass(frozen=True)
class EngramConfig:
    """Hashed n-gram embedding tables gated into the residual streams of `layer_ids` (all in the
    encoder half). n-gram sizes 2 .. max_ngram_size, n_heads heads each; each head (layer, n, k)
    a table of its own prime size above vocab_size rows of head_dim values."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int | None
    pad_token_id: int


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark (DFlash) drafter's fields: num_nextn_predict_layers draft blocks over blocks of
    block_size slots, conditioned on the mean streams of target_layer_ids."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    n_routed_experts: int
    num_experts_per_tok: int


@dataclass(frozen=True)
class V41Config:
    """DeepSeek-V4.1's fields beyond ModelConfig's (DeepSeek's text_config names).

    compress_ratios: per layer 0, 1 or 2; n_prefill_layer: the first C1 layer, where the decoder
    ("YOCO consumer") half starts: its KV-source layers compute their main entries from one
    shared hidden state, the first decoder layer's attention input. hc_shifted: each sublayer
    applies the pre-mix the sublayer before it computed (no HC head); else V4's mHC with a head.
    """

    head_dim: int
    rope_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    n_prefill_layer: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sharing: SharingTopology
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hc_shifted: bool
    swiglu_limit: float
    compress_rope: RopeConfig
    use_fp4_sparse_kv: bool
    engram: EngramConfig | None
    dspark: DSparkConfig | None
    image_token_id: int | None
    mtp_compress_ratios: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the vision tower (config_vision), None: text only


def _source_map(f: _Fields, name: str, ids: Any, n: int) -> tuple[int, ...]:
    """Layer -> the nearest id of `ids` at or below it (the layer itself below the first)."""
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise f.error(f"{name!r} must be a non-empty list of layer ids, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise f.error(f"{name!r} holds {bad[0]}, outside the {n} layers")
    if len(set(ids)) != len(ids):
        raise f.error(f"{name!r} lists a layer twice: {ids!r}")
    srt = sorted(ids)
    return tuple(max((s for s in srt if s <= i), default=i) for i in range(n))


def _check_sharing(f: _Fields, topo: SharingTopology, ratios: tuple[int, ...], n_prefill: int) -> None:
    """DeepSeek's fail-fast rules: a compressed consumer's sources are compressed layers of its
    ratio; top-k sharing within index-key sharing within KV sharing; no KV segment across the
    decoder half's first layer."""
    maps = (("kv_source_layer_ids", topo.kv), ("index_k_source_layer_ids", topo.index_k),
            ("index_source_layer_ids", topo.index))  # fmt: skip
    for i, ratio in enumerate(ratios):
        if ratio == 0:  # sliding-window layers share nothing: inside a segment they must be listed
            for name, m in maps:
                if m[i] != i:
                    raise f.error(
                        f"{name}: layer {i} (sliding window only) falls in layer {m[i]}'s segment; a "
                        "sliding-window layer shares nothing, so it must be listed as a source itself"
                    )
            continue
        for name, m in maps:
            if ratios[m[i]] != ratio:
                raise f.error(
                    f"{name}: layer {i} (ratio {ratio}) would read layer {m[i]}'s state, of ratio "
                    f"{ratios[m[i]]}; a source and its consumers must share one compression ratio"
                )
        if topo.index_k[i] != topo.index_k[topo.index[i]]:
            raise f.error(
                f"index_source_layer_ids: layer {i} takes layer {topo.index[i]}'s top-k but scores "
                f"layer {topo.index_k[i]}'s index keys, not its source's ({topo.index_k[topo.index[i]]})"
            )
        if topo.kv[i] != topo.kv[topo.index_k[i]]:
            raise f.error(
                f"index_k_source_layer_ids: layer {i} reads layer {topo.index_k[i]}'s index keys but "
                f"attends layer {topo.kv[i]}'s KV, not theirs ({topo.kv[topo.index_k[i]]})"
            )
    if topo.kv[n_prefill] != n_prefill:
        raise f.error(
            f"kv_source_layer_ids: the decoder half's first layer {n_prefill} must be a KV source "
            f"(it reads layer {topo.kv[n_prefill]}'s); a KV segment may not cross into the decoder half"
        )
    if topo.candidate is not None:
        c = topo.candidate
        if not 0 <= c < len(ratios) or ratios[c] == 0:
            raise f.error(f"candidate_source_layer_id {c} is not a compressed layer")
        if topo.index[c] != c:
            raise f.error(
                f"candidate_source_layer_id {c} takes layer {topo.index[c]}'s top-k; the candidate "
                "source must run its own indexer (list it in index_source_layer_ids)"
            )
        later = {ratios[i] for i in range(c, len(ratios))}
        if len(later) != 1:  # DeepSeek's check covers sliding-window layers too
            raise f.error(
                f"candidate_source_layer_id {c}: every layer from it on must share its ratio, found "
                f"{sorted(later)}"
            )
        blocks, size = topo.candidate_topk_blocks, topo.candidate_block_size
        if blocks % 8 or not 0 < blocks <= 4096:
            raise f.error(f"candidate_topk_blocks must be a multiple of 8 in 8..4096, got {blocks}")
        if not 0 < size <= 16:
            raise f.error(f"candidate_block_size must be in 1..16, got {size}")


def _parse_quantization(raw: dict[str, Any]) -> Fp8Config | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelConfigError("config.json: 'quantization_config' must be an object")
    for key, want in QUANTIZATION.items():
        if q.get(key) != want:
            raise ModelConfigError(
                f"config.json: quantization_config {key} {q.get(key)!r} is not supported for "
                f"deepseek_v41; DeepSeek-V4.1 is published as {QUANTIZATION}"
            )
    return Fp8Config(
        fmt="e4m3", weight_block_size=(32, 32), activation_scheme="dynamic", scale_fmt="ue8m0",
        expert_dtype="fp4",
    )  # fmt: skip


def _parse_engram(f: _Fields, n_prefill: int, n: int) -> EngramConfig | None:
    ids = f.value("engram_layer_ids")
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise f.error(f"'engram_layer_ids' must be a list of layer ids, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < n_prefill]
    if bad:
        raise f.error(
            f"engram_layer_ids: layer {bad[0]} is not in the encoder half (layers 0..{n_prefill - 1}); "
            "Engram layers must precede the first C1 layer"
        )
    pad = f.get_int("engram_pad_token_id", minimum=0)
    return EngramConfig(
        layer_ids=tuple(ids),
        max_ngram_size=f.get_int("engram_max_ngram_size", minimum=2),
        vocab_size=f.get_int("engram_vocab_size"),
        n_heads=f.get_int("engram_n_heads"),
        head_dim=f.get_int("engram_head_dim"),
        compressed_vocab_size=f.get_opt_int("engram_compressed_vocab_size"),
        pad_token_id=pad,
    )


def _parse_dspark(f: _Fields, nextn: int, n: int) -> DSparkConfig | None:
    if nextn == 0:
        return None
    targets = f.value("dspark_target_layer_ids")
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(i, int) and 0 <= i < n for i in targets)
    ):
        raise f.error(f"'dspark_target_layer_ids' must list layer ids in 0..{n - 1}, got {targets!r}")
    if not f.get_bool("dspark_target_attn_input", True):
        raise f.error(
            "dspark_target_attn_input must be true (the drafter reads the layers' attention inputs)"
        )
    return DSparkConfig(
        block_size=f.get_int("dspark_block_size", minimum=2),
        target_layer_ids=tuple(targets),
        markov_rank=f.get_int("dspark_markov_rank"),
        noise_token_id=f.get_int("dspark_noise_token_id", minimum=0),
        n_routed_experts=f.get_int("dspark_n_routed_experts"),
        num_experts_per_tok=f.get_int("dspark_num_experts_per_tok"),
    )


def parse_vision(raw: Any) -> VisionConfig | None:
    """config.json's vision_config (an object, or absent / null: a text-only model)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelConfigError("config.json: 'vision_config' must be an object")
    f = _Fields(raw, {}, "config.json vision_config")
    width = f.get_int("hidden_size", 1024)
    heads = f.get_int("num_heads", VIT_HEADS)
    if width % heads or (width // heads) % 4:
        raise f.error(
            f"hidden_size {width} must split into num_heads {heads} heads of a width divisible by 4 "
            "(the 2D rope rotates half of each head by the row, half by the column)"
        )
    ratio = f.value("max_wh_ratio")
    return VisionConfig(
        width=width,
        depth=f.get_int("depth", VIT_DEPTH),
        heads=heads,
        intermediate=f.get_int("intermediate_size", vit_intermediate(width)),
        patch_size=f.get_int("patch_size", 14),
        downsample_ratio=f.get_int("downsample_ratio", 2),
        max_image_tokens=f.get_int("max_image_tokens", minimum=4),
        min_pixels=f.get_int("min_pixels", 0, minimum=0),
        max_wh_ratio=None if ratio is None else f.get_float("max_wh_ratio", 1.0, positive=True),
    )


def parse_v41(raw: dict[str, Any]) -> ModelConfig:
    """A DeepSeek-V4.1 config.json dict -> ModelConfig with `v41` set. ModelConfig's MLA fields
    describe the single K = V head: kv_lora_rank = v_head_dim = head_dim, qk_rope_head_dim its
    rotated tail."""
    top = _Fields(raw, {})
    arch = raw.get("architectures")
    if arch != [ARCHITECTURE]:
        raise top.error(f"architectures must be [{ARCHITECTURE!r}] for model_type deepseek_v41, got {arch!r}")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise top.error(
            "deepseek_v41 keeps the text model's fields in 'text_config', an object; it is missing"
        )
    f = _Fields(text, TEXT_DEFAULTS, "config.json text_config")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0),
                      ("num_key_value_heads", 1)):  # fmt: skip
        if f.value(key) != want:
            raise f.error(f"{key} {f.value(key)!r} is not supported; DeepSeek-V4.1 has {want!r}")
    for key, want in (
        ("scoring_func", "sqrtsoftplus"),
        ("topk_method", "noaux_tc"),
        ("norm_topk_prob", True),
    ):
        if f.value(key) != want:
            raise f.error(f"{key} {f.value(key)!r} is not supported; DeepSeek-V4.1 routes with {want!r}")
    dtype_name = raw.get("dtype", raw.get("torch_dtype", "bfloat16"))
    if dtype_name not in _DTYPES:
        raise top.error(f"dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")

    n = f.get_int("num_hidden_layers")
    nextn = f.get_int("num_nextn_predict_layers", minimum=0)
    ratios = f.value("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) != n + nextn:
        raise f.error(
            f"compress_ratios must list one ratio per layer and draft layer ({n} + {nextn}), got {ratios!r}"
        )
    bad = sorted({r for r in ratios if isinstance(r, bool) or r not in LAYER_RATIOS})
    if bad:
        raise f.error(f"compress_ratios holds {bad}; DeepSeek-V4.1's layer types are 0, 1 and 2")
    main_ratios = tuple(ratios[:n])
    if 1 not in main_ratios:
        raise f.error("compress_ratios has no C1 layer (ratio 1); the decoder half starts at the first one")
    n_prefill = main_ratios.index(1)

    head_dim, rope_dim = f.get_int("head_dim"), f.get_int("qk_rope_head_dim")
    if rope_dim % 2 or rope_dim > head_dim:
        raise f.error(f"qk_rope_head_dim must be even and <= head_dim ({head_dim}), got {rope_dim}")
    heads, o_groups = f.get_int("num_attention_heads"), f.get_int("o_groups")
    if heads % o_groups:
        raise f.error(f"num_attention_heads ({heads}) must be divisible by o_groups ({o_groups})")
    index_head_dim = f.get_int("index_head_dim")
    if index_head_dim < rope_dim:
        raise f.error(f"index_head_dim ({index_head_dim}) must be >= qk_rope_head_dim ({rope_dim})")
    n_routed, top_k = f.get_int("n_routed_experts"), f.get_int("num_experts_per_tok")
    if top_k > n_routed:
        raise f.error(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts ({n_routed})")

    kv = _source_map(f, "kv_source_layer_ids", f.value("kv_source_layer_ids"), n)
    ik_ids = f.value("index_k_source_layer_ids", f.value("kv_source_layer_ids"))
    candidate = f.get_opt_int("candidate_source_layer_id", minimum=0)
    topo = SharingTopology(
        kv=kv,
        index_k=_source_map(f, "index_k_source_layer_ids", ik_ids, n),
        index=_source_map(f, "index_source_layer_ids", f.value("index_source_layer_ids"), n),
        candidate=candidate,
        candidate_topk_blocks=0 if candidate is None else f.get_int("candidate_topk_blocks"),
        candidate_block_size=0 if candidate is None else f.get_int("candidate_block_size"),
    )
    _check_sharing(f, topo, main_ratios, n_prefill)
    index_topk = f.get_int("index_topk")
    if topo.candidate is not None and topo.candidate_topk_blocks * topo.candidate_block_size < index_topk:
        raise f.error(
            f"candidate_topk_blocks x candidate_block_size ({topo.candidate_topk_blocks} x "
            f"{topo.candidate_block_size}) must cover index_topk ({index_topk})"
        )

    if f.value("compress_rope_theta") is None:
        raise f.error("missing required field 'compress_rope_theta' (the compressed layers' rope base)")
    compress_rope_raw: dict[str, Any] = {"rope_theta": f.get_float("compress_rope_theta", 0.0, positive=True)}
    scaling = f.value("rope_scaling")
    if scaling:  # YaRN on the compressed layers, cos / sin not rescaled (mscale off)
        compress_rope_raw["rope_scaling"] = dict(scaling, type="yarn", attention_factor=1.0)
    main_rope = _parse_rope({"rope_theta": f.get_float("rope_theta", 10000.0, positive=True)}, f)
    v41 = V41Config(
        head_dim=head_dim,
        rope_dim=rope_dim,
        o_groups=o_groups,
        o_lora_rank=f.get_int("o_lora_rank"),
        sliding_window=f.get_int("sliding_window"),
        compress_ratios=main_ratios,
        n_prefill_layer=n_prefill,
        index_n_heads=f.get_int("index_n_heads"),
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        sharing=topo,
        hc_mult=f.get_int("hc_mult"),
        hc_sinkhorn_iters=f.get_int("hc_sinkhorn_iters"),
        hc_eps=f.get_float("hc_eps", 1e-6, positive=True),
        hc_shifted=f.get_bool("hc_shifted", True),
        swiglu_limit=f.get_float("swiglu_limit", 10.0, positive=True),
        compress_rope=_parse_rope(compress_rope_raw, f),
        use_fp4_sparse_kv=f.get_bool("use_fp4_sparse_kv", True),
        engram=_parse_engram(f, n_prefill, n),
        dspark=_parse_dspark(f, nextn, n),
        image_token_id=top.get_token_id("image_token_id"),
        mtp_compress_ratios=(0,) * nextn,  # draft layers are sliding window only
        vision=parse_vision(raw.get("vision_config")),
    )
    inter = f.get_int("moe_intermediate_size")
    cfg = single_kv_head_config(
        f, model_type="deepseek_v41", n=n, heads=heads, head_dim=head_dim, rope_dim=rope_dim,
        inter=inter, n_routed=n_routed, top_k=top_k, nextn=nextn, rope=main_rope, dtype=_DTYPES[dtype_name],
        quantization=_parse_quantization(raw), scoring_func="sqrtsoftplus",
        routed_scaling_factor=f.get_float("routed_scaling_factor", 1.0, positive=True),
        bos_token_id=top.get_token_id("bos_token_id"),
        eos_token_id=_parse_eos(raw.get("eos_token_id")),
        v41=v41,
    )  # fmt: skip
    _check_token_ids(cfg)
    return cfg


def reduce_depth(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """A copy of V4.1 config.json `raw` with `layers` main layers (a reduced-depth model of the
    same shapes, `deepinfer bench --random-config ... --num-hidden-layers N`), its sharing
    topology kept valid: the first k layers of the encoder half and the first layers - k of the
    decoder half (k = half the layers, fewer where the encoder is shorter, more where the
    decoder is), so the model keeps YOCO's two halves (a single layer: the decoder's first). Both
    halves are kept from their start, so every kept layer keeps its KV / index-key / top-k source
    (a source is at or below its consumers, and a decoder layer's source is in the decoder half):
    the `*_source_layer_ids`, `candidate_source_layer_id` (null when dropped), `engram_layer_ids`
    and `dspark_target_layer_ids` lists keep their kept layers, renumbered, and compress_ratios
    its kept layers' entries then the draft layers'. When no drafter target is kept, the draft
    layers go (num_nextn_predict_layers 0). ModelConfigError when `layers` is not in 1..the
    config's own count; the result is parsed, so an invalid reduction cannot pass silently."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelConfigError("config.json: 'text_config', an object; it is missing")
    n, ratios = text.get("num_hidden_layers"), text.get("compress_ratios")
    if not isinstance(n, int) or not isinstance(ratios, list) or 1 not in ratios[:n]:
        parse_v41(raw)  # raises the config's own error
        raise ModelConfigError("config.json: text_config's num_hidden_layers / compress_ratios are invalid")
    if not 1 <= layers <= n:
        raise ModelConfigError(f"num_hidden_layers {layers}: a reduced depth must be in 1..{n}")
    first_c1 = ratios[:n].index(1)
    enc = min(first_c1, layers // 2)
    enc = max(enc, layers - (n - first_c1))  # a short decoder half: more encoder layers
    kept = list(range(enc)) + list(range(first_c1, first_c1 + layers - enc))
    new = {old: i for i, old in enumerate(kept)}

    def renumber(ids: Any) -> Any:
        return [new[i] for i in ids if i in new] if isinstance(ids, list) else ids

    out = dict(text)
    out["num_hidden_layers"] = layers
    nextn = int(text.get("num_nextn_predict_layers", 0) or 0)
    targets = renumber(text.get("dspark_target_layer_ids"))
    if nextn and not targets:
        nextn = 0
        out["num_nextn_predict_layers"] = 0
        out.pop("dspark_target_layer_ids", None)
    elif nextn:
        out["dspark_target_layer_ids"] = targets
    out["compress_ratios"] = [ratios[i] for i in kept] + ratios[n : n + nextn]
    for key in (
        "kv_source_layer_ids",
        "index_k_source_layer_ids",
        "index_source_layer_ids",
        "engram_layer_ids",
    ):
        if key in text:
            out[key] = renumber(text[key])
    if out.get("engram_layer_ids") == []:
        out.pop("engram_layer_ids")
    candidate = text.get("candidate_source_layer_id")
    if candidate is not None:
        out["candidate_source_layer_id"] = new.get(candidate)
    reduced = raw | {"text_config": out}
    parse_v41(reduced)
    return reduced

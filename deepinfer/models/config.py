"""ModelConfig: a frozen view of a DeepSeek-V2 / V3 / V4 `config.json` (DeepSeek's published field names).

Parsing accepts both the published layout (`rope_scaling` with `type`, top-level `rope_theta`) and
the one transformers 5 writes (`rope_parameters` with `rope_type` and `rope_theta` inside).
Everything a user can get wrong raises `ModelConfigError` naming the field: wrong types, sizes
below 1, non-finite or non-positive numbers (`rms_norm_eps` of -1 or NaN), routing that cannot
pick `num_experts_per_tok` experts.

A field config.json omits gets transformers' default for that model type (`HF_DEFAULTS`, the
defaults of transformers' DeepseekV2Config / DeepseekV3Config, compared field by field in
tests/test_hostile_checkpoints.py), so a sparse config.json runs the model transformers (and
vLLM, which reads configs through transformers) would run. transformers is not imported here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deepinfer.models.config_v41 import V41Config

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v4", "deepseek_v41")
# Known DeepSeek generations this version cannot run yet: model_type -> name for the message.
NOT_YET_SUPPORTED = {
    "deepseek_v32": "DeepSeek-V3.2 (sparse attention with a lightning indexer)",
}
# Names DeepSeek never used, refused with the one it did use.
MISNAMED = {"deepseek_v4_1": "deepseek_v41"}
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers' defaults (DeepseekV2Config / DeepseekV3Config, transformers 5) for every field
# deepinfer reads. None: transformers has no usable default; deepinfer then asks for the field
# where it is used (num_experts_per_tok of a MoE model) or reads it as 1 (n_group, topk_group:
# one group is no group limit). DeepSeek-V4 has its own table, V4_DEFAULTS (with its parser, below).
_SHARED_DEFAULTS: dict[str, Any] = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "rope_theta": 10000.0,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": _SHARED_DEFAULTS
    | {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": None,
        "moe_intermediate_size": 1407,
        "first_k_dense_replace": 0,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "deepseek_v3": _SHARED_DEFAULTS
    | {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
    },
}
# Fields transformers' config classes do not have, as their modeling code behaves: V2 scores
# with softmax, V3 with sigmoid and bias-corrected group routing (noaux_tc); both make every
# layer from first_k_dense_replace on MoE (moe_layer_freq 1); V2 rotates interleaved pairs and
# has no MTP layer.
IMPLIED_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "scoring_func": "softmax",
        "moe_layer_freq": 1,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
    },
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
}


class ModelConfigError(ValueError):
    """A config.json that deepinfer cannot run, with the reason."""


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor (DeepSeek's `yarn_get_mscale`)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the qk_rope_head_dim part of q and k.

    kind "default": inv_freq_i = theta^(-2i/R). kind "yarn": DeepSeek's YaRN, interpolating the
    low frequencies by `factor` between the correction dims of beta_fast / beta_slow.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not given
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin factor (transformers' field), rare

    @property
    def cos_sin_factor(self) -> float:
        """Factor on cos and sin: yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        when both mscales are given and non-zero (1 for the published configs, whose two mscales
        are equal), else yarn_get_mscale(factor) (transformers' rule)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Factor on the softmax scale: yarn_get_mscale(factor, mscale_all_dim)^2 if mscale_all_dim is set."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        m = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class Fp8Config:
    """DeepSeek's FP8 checkpoint format: e4m3 weights with one scale per 128x128 block (float32
    `weight_scale_inv`; V4: UE8M0 bytes named `scale`). expert_dtype (DeepSeek-V4's field, at the
    top level of its config.json or in quantization_config): the routed experts' format, "fp8"
    (as the dense weights) or "fp4" (MXFP4, deepinfer.backend.fp4); None: not said (the
    checkpoint's tensors tell)."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None  # "ue8m0": scales are powers of two (V3.1: float32; V4: bytes)
    expert_dtype: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek-V2 / V3 / R1 checkpoint. Field names follow config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # MoE
    n_routed_experts: int = 0  # 0: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # the rest
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    quantization: Fp8Config | None = None
    torch_dtype: torch.dtype = torch.bfloat16
    v4: V4Config | None = None  # DeepSeek-V4's own fields (model_type deepseek_v4), else None
    v41: V41Config | None = None  # DeepSeek-V4.1's own fields (model_type deepseek_v41), else None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale^2 (DeepSeek's MLA softmax_scale)."""
        return float(self.qk_head_dim**-0.5) * self.rope.softmax_scale_factor

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer."""
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises ModelConfigError for unsupported or invalid content."""
        return _parse(raw)

    @staticmethod
    def from_file(path: str | Path) -> ModelConfig:
        """Read `path` (a config.json, or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ModelConfigError(f"no config.json at {p}")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelConfigError(
                f"{p} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                "config.json must be JSON in UTF-8"
            ) from exc
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ModelConfigError(f"{p} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{p} must hold a JSON object")
        return _parse(raw)


# --------------------------------------------------------------------------- parsing

_MISSING = object()


class _Fields:
    """Typed access to the raw dict with messages that name the field. A field the dict omits
    takes `defaults[name]` (transformers' default); one that is null reads as not given."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any], where: str = "config.json") -> None:
        self.raw, self.defaults, self.where = raw, defaults, where

    def value(self, name: str, default: Any = _MISSING) -> Any:
        if name in self.raw:
            return self.raw[name]
        return self.defaults.get(name) if default is _MISSING else default

    def error(self, message: str) -> ModelConfigError:
        return ModelConfigError(f"{self.where}: {message}")

    def get_int(self, name: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self.value(name, default)
        if value is None:
            raise self.error(f"missing required field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{name!r} must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(f"{name!r} must be >= {minimum}, got {value}")
        return value

    def get_opt_int(self, name: str, minimum: int = 1) -> int | None:
        return None if self.value(name) is None else self.get_int(name, minimum=minimum)

    def get_float(
        self, name: str, default: float, positive: bool = False, falsy_is_default: bool = False
    ) -> float:
        value = self.value(name, default)
        if value is None or (falsy_is_default and not value):
            value = default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"{name!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self.error(f"{name!r} must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.error(f"{name!r} must be > 0, got {value!r}")
        return float(value)

    def get_bool(self, name: str, default: bool) -> bool:
        value = self.value(name, default)
        if value is None:
            return False  # transformers tests these fields for truth: null is false
        if not isinstance(value, bool):
            raise self.error(f"{name!r} must be true or false, got {value!r}")
        return value

    def get_choice(self, name: str, default: str, options: tuple[str, ...]) -> str:
        value = self.value(name, default) or default
        if value not in options:
            raise self.error(f"{name!r} is {value!r}; supported: {', '.join(options)}")
        return str(value)

    def get_token_id(self, name: str) -> int | None:
        value = self.value(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(f"{name!r} must be a non-negative integer, got {value!r}")
        return value


def _parse_rope(raw: dict[str, Any], f: _Fields) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError("config.json: 'rope_scaling' / 'rope_parameters' must be an object")
    theta_fields = _Fields(params if "rope_theta" in params else raw, f.defaults)
    theta = theta_fields.get_float("rope_theta", f.defaults["rope_theta"], positive=True)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ("default", "yarn"):
        raise ModelConfigError(f"config.json: rope type {kind!r} is not supported; supported: default, yarn")
    if kind == "default":
        return RopeConfig(theta=theta)
    if params.get("factor") is None:
        raise ModelConfigError("config.json: YaRN rope scaling needs 'factor'")
    if params.get("original_max_position_embeddings") is None:
        raise ModelConfigError("config.json: YaRN rope scaling needs 'original_max_position_embeddings'")
    if params.get("truncate", True) is not True:
        raise ModelConfigError(
            f"config.json: rope 'truncate' {params['truncate']!r} is not supported; supported: true"
        )
    rf = _Fields(params, {}, "config.json rope scaling")
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=rf.get_float("factor", 1.0, positive=True),
        original_max_position_embeddings=rf.get_int("original_max_position_embeddings"),
        # transformers reads a missing or zero beta as its default (`get("beta_fast") or 32`)
        beta_fast=rf.get_float("beta_fast", 32.0, falsy_is_default=True),
        beta_slow=rf.get_float("beta_slow", 1.0, falsy_is_default=True),
        mscale=rf.get_float("mscale", 0.0),
        mscale_all_dim=rf.get_float("mscale_all_dim", 0.0),
        attention_factor=None
        if attention_factor is None
        else rf.get_float("attention_factor", 1.0, positive=True),
    )


def _parse_quantization(raw: dict[str, Any]) -> Fp8Config | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelConfigError("config.json: 'quantization_config' must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(f"config.json: quant_method {method!r} is not supported; supported: fp8")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelConfigError(f"config.json: FP8 format {fmt!r} is not supported; supported: e4m3")
    block = q.get("weight_block_size", [128, 128])
    if not isinstance(block, list) or block != [128, 128]:
        raise ModelConfigError(
            f"config.json: weight_block_size {block!r} is not supported; supported: [128, 128]"
        )
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelConfigError(
            f"config.json: activation_scheme {scheme!r} is not supported; supported: dynamic"
        )
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ModelConfigError(f"config.json: scale_fmt {scale_fmt!r} is not supported; supported: ue8m0")
    expert_dtype = q.get("expert_dtype", raw.get("expert_dtype"))
    if expert_dtype not in (None, "fp8", "fp4"):
        raise ModelConfigError(
            f"config.json: expert_dtype {expert_dtype!r} is not supported; supported: fp8, fp4"
        )
    return Fp8Config(
        fmt=fmt, weight_block_size=(128, 128), activation_scheme=scheme, scale_fmt=scale_fmt,
        expert_dtype=expert_dtype,
    )  # fmt: skip


def _parse_eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return tuple(values)
    raise ModelConfigError(
        f"config.json: 'eos_token_id' must be an integer or a list of integers, each >= 0, got {value!r}"
    )


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "deepseek_v4":
        v4 = _parse_v4(raw)
        _check_token_ids(v4)
        return v4
    if model_type == "deepseek_v41":
        from deepinfer.models.config_v41 import parse_v41

        return parse_v41(raw)
    if model_type in MISNAMED:
        raise ModelConfigError(
            f"model_type {model_type!r} is not DeepSeek's name; DeepSeek-V4.1 configs say "
            f"{MISNAMED[model_type]!r}, with the text model's fields under 'text_config'"
        )
    if model_type in NOT_YET_SUPPORTED:
        raise ModelConfigError(
            f"{NOT_YET_SUPPORTED[model_type]} (model_type {model_type!r}) is not yet supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    f = _Fields(raw, HF_DEFAULTS[model_type] | IMPLIED_DEFAULTS[model_type])
    if f.value("hidden_act") != "silu":
        raise ModelConfigError(
            f"config.json: hidden_act {f.value('hidden_act')!r} is not supported; supported: silu"
        )
    if f.get_bool("attention_bias", False):
        raise ModelConfigError(
            "config.json: attention_bias true is not supported (DeepSeek models have none)"
        )

    d = f.defaults
    quantization = _parse_quantization(raw)
    if quantization is not None and quantization.expert_dtype == "fp4":
        raise ModelConfigError(
            f"config.json: expert_dtype 'fp4' (MXFP4 experts) is supported for deepseek_v4 only, "
            f"not {model_type!r}"
        )
    n_routed = f.get_int("n_routed_experts", minimum=0)
    topk_method = f.get_choice("topk_method", d["topk_method"], TOPK_METHODS)
    scoring = f.get_choice("scoring_func", d["scoring_func"], SCORING_FUNCS)
    # None (V2's default, or null): one group, i.e. no group limit
    n_group = 1 if f.value("n_group") is None else f.get_int("n_group")
    topk_group = 1 if f.value("topk_group") is None else f.get_int("topk_group")
    if n_routed:
        top_k = f.get_int("num_experts_per_tok")
    else:  # dense: unused, but still a number of experts if given
        top_k = 1 if f.value("num_experts_per_tok") is None else f.get_int("num_experts_per_tok")
    dtype_name = raw.get("torch_dtype", raw.get("dtype", "bfloat16")) or "bfloat16"
    if dtype_name not in _DTYPES:
        raise ModelConfigError(f"config.json: torch_dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")

    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=f.get_int("vocab_size"),
        hidden_size=f.get_int("hidden_size"),
        intermediate_size=f.get_int("intermediate_size"),
        num_hidden_layers=f.get_int("num_hidden_layers"),
        num_attention_heads=f.get_int("num_attention_heads"),
        kv_lora_rank=f.get_int("kv_lora_rank"),
        qk_nope_head_dim=f.get_int("qk_nope_head_dim"),
        qk_rope_head_dim=f.get_int("qk_rope_head_dim"),
        v_head_dim=f.get_int("v_head_dim"),
        q_lora_rank=f.get_opt_int("q_lora_rank"),
        n_routed_experts=n_routed,
        n_shared_experts=f.get_int("n_shared_experts", minimum=0),
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.get_int("moe_intermediate_size") if n_routed else 0,
        first_k_dense_replace=f.get_int("first_k_dense_replace", minimum=0),
        moe_layer_freq=f.get_int("moe_layer_freq"),
        topk_method=topk_method,
        scoring_func=scoring,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=f.get_bool("norm_topk_prob", d["norm_topk_prob"]),
        routed_scaling_factor=f.get_float("routed_scaling_factor", d["routed_scaling_factor"], positive=True),
        rms_norm_eps=f.get_float("rms_norm_eps", d["rms_norm_eps"], positive=True),
        max_position_embeddings=f.get_int("max_position_embeddings"),
        rope=_parse_rope(raw, f),
        rope_interleave=f.get_bool("rope_interleave", d["rope_interleave"]),
        tie_word_embeddings=f.get_bool("tie_word_embeddings", d["tie_word_embeddings"]),
        bos_token_id=f.get_token_id("bos_token_id"),
        eos_token_id=_parse_eos(f.value("eos_token_id")),
        num_nextn_predict_layers=f.get_int("num_nextn_predict_layers", minimum=0),
        quantization=quantization,
        torch_dtype=_DTYPES[dtype_name],
    )
    _validate(cfg)
    return cfg


def _check_token_ids(cfg: ModelConfig) -> None:
    """bos_token_id and every eos_token_id inside the vocabulary."""
    for name, ids in (("bos_token_id", (cfg.bos_token_id,)), ("eos_token_id", cfg.eos_token_id)):
        bad = [t for t in ids if t is not None and not 0 <= t < cfg.vocab_size]
        if bad:
            raise ModelConfigError(
                f"config.json: {name!r} {bad[0]} is outside the vocabulary [0, vocab_size={cfg.vocab_size})"
            )


def _validate(cfg: ModelConfig) -> None:
    _check_token_ids(cfg)
    if cfg.qk_rope_head_dim % 2:
        raise ModelConfigError(f"config.json: qk_rope_head_dim must be even, got {cfg.qk_rope_head_dim}")
    if cfg.n_routed_experts == 0:
        return
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds "
            f"n_routed_experts ({cfg.n_routed_experts})"
        )
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        if cfg.n_routed_experts % cfg.n_group:
            raise ModelConfigError(
                f"config.json: n_routed_experts ({cfg.n_routed_experts}) "
                f"is not divisible by n_group ({cfg.n_group})"
            )
        if cfg.topk_group > cfg.n_group:
            raise ModelConfigError(
                f"config.json: topk_group ({cfg.topk_group}) exceeds n_group ({cfg.n_group})"
            )
        if cfg.topk_group * (cfg.n_routed_experts // cfg.n_group) < cfg.num_experts_per_tok:
            raise ModelConfigError(
                "config.json: topk_group groups hold fewer experts than num_experts_per_tok; no valid routing"
            )
    if cfg.topk_method == "noaux_tc" and cfg.n_routed_experts // max(cfg.n_group, 1) < 2:
        raise ModelConfigError(
            "config.json: noaux_tc routing scores groups by their top-2 experts; need >= 2 per group"
        )


# --------------------------------------------------------------------------- DeepSeek-V4

V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")
# transformers' DeepseekV4Config defaults (transformers 5.24) for every field deepinfer reads.
V4_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
_V4_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's fields beyond ModelConfig's (transformers' DeepseekV4Config names).

    compress_ratios: per layer 0 (sliding window only), csa_ratio (CSA: overlapping windows and a
    lightning indexer) or hca_ratio (HCA: every compressed entry visible). hash_layers: per layer,
    whether the MoE routes by the fixed token-id table (tid2eid) instead of the router's top-k.
    mtp_compress_ratios / mtp_hash_layers: the same for each MTP layer (num_nextn_predict_layers),
    from the entries past num_hidden_layers where the config lists them (DeepSeek's
    compress_ratios lists one per MTP layer: 0 for V4-Flash's), else sliding window only and
    routed by top-k.
    """

    head_dim: int
    rope_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    csa_ratio: int
    hca_ratio: int
    hash_layers: tuple[bool, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    compress_rope: RopeConfig
    mtp_compress_ratios: tuple[int, ...] = ()
    mtp_hash_layers: tuple[bool, ...] = ()


def _v4_rope_params(raw: dict[str, Any], f: _Fields) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) rope parameter dicts, as transformers' DeepseekV4Config.__post_init__ builds
    them: nested {"main", "compress"} as saved by transformers, or a flat (YaRN) dict that applies
    to the compressed branches only, with compress_rope_theta; YaRN there has attention_factor 1."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ModelConfigError("config.json: 'rope_scaling' / 'rope_parameters' must be an object")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    main = {"rope_type": "default", "rope_theta": f.get_float("rope_theta", 10000.0, positive=True)}
    compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    compress["rope_theta"] = f.get_float("compress_rope_theta", 160000.0, positive=True)
    compress["rope_type"] = compress.get("rope_type", compress.get("type")) or "default"
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _v4_types(
    f: _Fields, name: str, allowed: tuple[str, ...], n: int, default: list[str], extra: list[str]
) -> list[str]:
    """The n layers' types, then one per MTP layer (len(extra) of them): the config's entries past
    the n-th where it lists them, else `extra`."""
    value = f.value(name)
    types = list(default if value is None else value)
    if not all(isinstance(t, str) for t in types) or len(types) < n:
        raise f.error(f"{name!r} must list one of {', '.join(allowed)} per layer ({n} layers), got {value!r}")
    types = types[:n] + types[n : n + len(extra)] + extra[len(types[n:]) :]
    bad = sorted({t for t in types if t not in allowed})
    if bad:
        raise f.error(f"{name!r} holds {bad}; supported: {', '.join(allowed)}")
    return types


def _parse_v4(raw: dict[str, Any]) -> ModelConfig:
    """A DeepSeek-V4 config.json (transformers' field names, legacy ones folded in as transformers
    does) -> ModelConfig with `v4` set. ModelConfig's MLA fields describe V4's single K = V head:
    kv_lora_rank = v_head_dim = head_dim, qk_rope_head_dim the rotated tail."""
    f = _Fields(raw, V4_DEFAULTS)
    if f.value("hidden_act") != "silu":
        raise f.error(f"hidden_act {f.value('hidden_act')!r} is not supported; supported: silu")
    if f.get_bool("attention_bias", False):
        raise f.error("attention_bias true is not supported (DeepSeek models have none)")
    if f.get_int("num_key_value_heads") != 1:
        got = f.value("num_key_value_heads")
        raise f.error(f"num_key_value_heads must be 1 (one shared K = V head), got {got}")
    n = f.get_int("num_hidden_layers")
    head_dim = f.get_int("head_dim")
    factor = raw.get("partial_rotary_factor")
    if factor is None and raw.get("qk_rope_head_dim") is not None:
        rope_dim = f.get_int("qk_rope_head_dim")
    else:
        fraction = 64 / 512 if factor is None else f.get_float("partial_rotary_factor", 0.125)
        rope_dim = int(head_dim * fraction)
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise f.error(f"the rotated part of head_dim {head_dim} must be even, 2..{head_dim}; got {rope_dim}")

    rates = dict(_V4_COMPRESS_RATES)
    if isinstance(raw.get("compress_rates"), dict):
        rates.update(raw["compress_rates"])
    for legacy, key in (("compress_rate_csa", V4_LAYER_TYPES[1]), ("compress_rate_hca", V4_LAYER_TYPES[2])):
        if raw.get(legacy) is not None:
            rates[key] = raw[legacy]
    rf = _Fields(rates, {}, "config.json compress_rates")
    csa, hca = rf.get_int(V4_LAYER_TYPES[1], minimum=2), rf.get_int(V4_LAYER_TYPES[2], minimum=2)
    if csa == hca:
        raise f.error(f"compress_rates: CSA and HCA need different ratios, both are {csa}")
    by_ratio = {0: V4_LAYER_TYPES[0], csa: V4_LAYER_TYPES[1], hca: V4_LAYER_TYPES[2]}
    if raw.get("layer_types") is None and isinstance(raw.get("compress_ratios"), list):
        default = [by_ratio.get(r, repr(r)) for r in raw["compress_ratios"]]
    else:
        interleave = [V4_LAYER_TYPES[1] if i % 2 else V4_LAYER_TYPES[2] for i in range(max(n - 2, 0))]
        default = [V4_LAYER_TYPES[2]] * min(n, 2) + interleave
    nextn = f.get_int("num_nextn_predict_layers", minimum=0)
    layer_types = _v4_types(f, "layer_types", V4_LAYER_TYPES, n, default, [V4_LAYER_TYPES[0]] * nextn)
    n_hash = raw.get("num_hash_layers")
    n_hash = 3 if n_hash is None else n_hash
    mlp_default = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    mtp_mlp = ["hash_moe" if n + k < n_hash else "moe" for k in range(nextn)]
    mlp_types = _v4_types(f, "mlp_layer_types", V4_MLP_LAYER_TYPES, n, mlp_default, mtp_mlp)
    ratio_of = {V4_LAYER_TYPES[0]: 0, V4_LAYER_TYPES[1]: csa, V4_LAYER_TYPES[2]: hca}

    main, compress = _v4_rope_params(raw, f)
    heads = f.get_int("num_attention_heads")
    o_groups = f.get_int("o_groups")
    if heads % o_groups:
        raise f.error(f"num_attention_heads ({heads}) must be divisible by o_groups ({o_groups})")
    index_head_dim = f.get_int("index_head_dim")
    if index_head_dim < rope_dim:
        raise f.error(f"index_head_dim ({index_head_dim}) must be >= the rotated width ({rope_dim})")
    n_routed, top_k = f.get_int("n_routed_experts"), f.get_int("num_experts_per_tok")
    if top_k > n_routed:
        raise f.error(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts ({n_routed})")
    dtype_name = raw.get("torch_dtype", raw.get("dtype", "bfloat16")) or "bfloat16"
    if dtype_name not in _DTYPES:
        raise f.error(f"torch_dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")
    inter = f.get_int("moe_intermediate_size")
    v4 = V4Config(
        head_dim=head_dim,
        rope_dim=rope_dim,
        o_groups=o_groups,
        o_lora_rank=f.get_int("o_lora_rank"),
        sliding_window=f.get_int("sliding_window"),
        compress_ratios=tuple(ratio_of[t] for t in layer_types[:n]),
        csa_ratio=csa,
        hca_ratio=hca,
        hash_layers=tuple(t == "hash_moe" for t in mlp_types[:n]),
        index_n_heads=f.get_int("index_n_heads"),
        index_head_dim=index_head_dim,
        index_topk=f.get_int("index_topk"),
        hc_mult=f.get_int("hc_mult"),
        hc_sinkhorn_iters=f.get_int("hc_sinkhorn_iters"),
        hc_eps=f.get_float("hc_eps", 1e-6, positive=True),
        swiglu_limit=f.get_float("swiglu_limit", 10.0, positive=True),
        compress_rope=_parse_rope({"rope_parameters": compress}, f),
        mtp_compress_ratios=tuple(ratio_of[t] for t in layer_types[n:]),
        mtp_hash_layers=tuple(t == "hash_moe" for t in mlp_types[n:]),
    )
    return single_kv_head_config(
        f, model_type="deepseek_v4", n=n, heads=heads, head_dim=head_dim, rope_dim=rope_dim, inter=inter,
        n_routed=n_routed, top_k=top_k, nextn=nextn, rope=_parse_rope({"rope_parameters": main}, f),
        dtype=_DTYPES[dtype_name], quantization=_parse_quantization(raw),
        scoring_func=f.get_choice("scoring_func", "sqrtsoftplus", ("softmax", "sigmoid", "sqrtsoftplus")),
        routed_scaling_factor=f.get_float("routed_scaling_factor", 1.5, positive=True),
        bos_token_id=f.get_token_id("bos_token_id"),
        eos_token_id=_parse_eos(f.value("eos_token_id")),
        v4=v4,
    )  # fmt: skip


def single_kv_head_config(
    f: _Fields, *, model_type: str, n: int, heads: int, head_dim: int, rope_dim: int,
    inter: int, n_routed: int, top_k: int, nextn: int, rope: RopeConfig, dtype: torch.dtype, **specific: Any,
) -> ModelConfig:  # fmt: skip
    """ModelConfig of the V4 family (V4, V4.1): the MLA fields describe the single K = V head
    (kv_lora_rank = v_head_dim = head_dim, qk_rope_head_dim the rotated tail), the router is
    noaux_tc with normalised top-k, rope interleaved; `specific` the fields each model reads its
    own way (scoring_func, routed_scaling_factor, token ids, quantization, v4 / v41)."""
    return ModelConfig(
        model_type=model_type,
        vocab_size=f.get_int("vocab_size"),
        hidden_size=f.get_int("hidden_size"),
        intermediate_size=inter,
        num_hidden_layers=n,
        num_attention_heads=heads,
        kv_lora_rank=head_dim,
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=head_dim,
        q_lora_rank=f.get_int("q_lora_rank"),
        n_routed_experts=n_routed,
        n_shared_experts=f.get_int("n_shared_experts", minimum=0),
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        topk_method="noaux_tc",
        norm_topk_prob=True,
        rms_norm_eps=f.get_float("rms_norm_eps", 1e-6, positive=True),
        max_position_embeddings=f.get_int("max_position_embeddings"),
        rope=rope,
        rope_interleave=True,
        tie_word_embeddings=f.get_bool("tie_word_embeddings", False),
        num_nextn_predict_layers=nextn,
        torch_dtype=dtype,
        **specific,
    )

"""ModelConfig parsing: the published configs in model/, both rope layouts, routers, and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.backend.types import RouterConfig
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.moe import router_config
from deepinfer.models.rope import cos_sin_cache, inv_freq
from deepinfer.testing.checkpoints import tiny_config

MODEL_DIR = Path(__file__).resolve().parent.parent / "model"


def _published(name: str) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((MODEL_DIR / name / "config.json").read_text())
    return cfg


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-r1"])
def test_v3_and_r1(name: str) -> None:
    c = ModelConfig.from_file(MODEL_DIR / name)
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (
        "deepseek_v3",
        129280,
        7168,
        61,
    )
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim) == (1536, 512, 128, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
    assert c.first_k_dense_replace == 3 and not c.is_moe_layer(2) and c.is_moe_layer(3)
    assert c.quantization is not None and c.quantization.weight_block_size == (128, 128)
    assert c.num_nextn_predict_layers == 1 and c.eos_token_id == (1,)
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert c.rope.cos_sin_factor == 1.0
    assert router_config(c) == RouterConfig(
        scoring="sigmoid",
        top_k=8,
        num_groups=8,
        topk_groups=4,
        group_score="top2_sum",
        renormalize=True,
        routed_scaling_factor=2.5,
    )


def test_v2_lite() -> None:
    c = ModelConfig.from_file(MODEL_DIR / "deepseek-v2-lite" / "config.json")
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (
        "deepseek_v2",
        102400,
        2048,
        27,
    )
    assert c.q_lora_rank is None and c.n_shared_experts == 2 and c.quantization is None
    assert c.torch_dtype == torch.bfloat16
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert router_config(c) == RouterConfig(scoring="softmax", top_k=6, routed_scaling_factor=1.0)


def test_v2_router_normalises_or_scales() -> None:
    """DeepSeek-V2: norm_topk_prob normalises INSTEAD of scaling; V3 normalises AND scales."""
    v2 = tiny_config(
        model_type="deepseek_v2",
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        norm_topk_prob=True,
        routed_scaling_factor=16.0,
    )
    rc = router_config(ModelConfig.from_dict(v2))
    assert (rc.renormalize, rc.routed_scaling_factor, rc.group_score, rc.num_groups) == (True, 1.0, "max", 4)
    rc = router_config(ModelConfig.from_dict(dict(v2, norm_topk_prob=False)))
    assert (rc.renormalize, rc.routed_scaling_factor) == (False, 16.0)


def test_v3_2_config_is_refused_as_not_yet_supported() -> None:
    with pytest.raises(
        ModelConfigError, match=r"DeepSeek-V3.2 .* is not yet supported; supported model types: "
    ):
        ModelConfig.from_dict({"model_type": "deepseek_v32"})


def test_v4_flash_config_parses() -> None:
    cfg = ModelConfig.from_file(MODEL_DIR / "deepseek-v4-flash")
    assert cfg.v4 is not None and cfg.v4.head_dim == 512 and cfg.num_hidden_layers == 43


def test_parity_configs_parse() -> None:
    for path in sorted((MODEL_DIR / "parity").glob("*.json")):
        ModelConfig.from_file(path)


def test_rope_parameters_and_rope_scaling_are_equivalent() -> None:
    """transformers 5 writes rope_parameters (rope_type, rope_theta inside); published configs write
    rope_scaling (type) and a top-level rope_theta."""
    published = tiny_config()
    tf5 = dict(published)
    del tf5["rope_scaling"], tf5["rope_theta"]
    scaling = published["rope_scaling"]
    tf5["rope_parameters"] = {k: v for k, v in scaling.items() if k != "type"} | {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
    }
    a, b = ModelConfig.from_dict(published), ModelConfig.from_dict(tf5)
    assert a.rope == b.rope and a.softmax_scale == b.softmax_scale


def test_yarn_tables_against_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
    }
    rope |= {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    hf = DeepseekV3Config(rope_parameters=dict(rope), max_position_embeddings=163840)
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    c = ModelConfig.from_dict(
        tiny_config(rope_scaling=rope, qk_rope_head_dim=64, max_position_embeddings=163840)
    )
    torch.testing.assert_close(inv_freq(c.rope, 64), want, rtol=1e-6, atol=0)
    assert c.rope.cos_sin_factor == pytest.approx(attention_factor, rel=1e-12)
    table = cos_sin_cache(c.rope, 64, 100, torch.device("cpu"))
    assert table.shape == (100, 64)
    torch.testing.assert_close(table[7, :32], torch.cos(7 * want.double()).float() * attention_factor)


def test_unsupported_model_type_lists_supported() -> None:
    with pytest.raises(
        ModelConfigError, match=r"unsupported model_type 'mistral'; supported model types: deepseek_v2"
    ):
        ModelConfig.from_dict(tiny_config(model_type="mistral"))
    with pytest.raises(ModelConfigError, match=r"unsupported model_type None"):
        ModelConfig.from_dict({k: v for k, v in tiny_config().items() if k != "model_type"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_size": None}, r"missing required field 'hidden_size'"),
        ({"kv_lora_rank": "512"}, r"'kv_lora_rank' must be an integer, got '512'"),
        ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be >= 1, got 0"),
        ({"q_lora_rank": 1.5}, r"'q_lora_rank' must be an integer"),
        (
            {"topk_method": "random"},
            r"'topk_method' is 'random'; supported: greedy, group_limited_greedy, noaux_tc",
        ),
        ({"scoring_func": "tanh"}, r"'scoring_func' is 'tanh'; supported: softmax, sigmoid"),
        ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' must be true or false"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds n_routed_experts \(8\)"),
        ({"n_group": 3}, r"n_routed_experts \(8\) is not divisible by n_group \(3\)"),
        ({"topk_group": 5}, r"topk_group \(5\) exceeds n_group \(4\)"),
        ({"rope_scaling": {"type": "longrope", "factor": 2}}, r"rope type 'longrope' is not supported"),
        ({"rope_scaling": {"type": "yarn"}}, r"YaRN rope scaling needs 'factor'"),
        (
            {"quantization_config": {"quant_method": "awq"}},
            r"quant_method 'awq' is not supported; supported: fp8",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            r"weight_block_size \[64, 64\] is not supported",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported; supported: silu"),
        ({"eos_token_id": "eos"}, r"'eos_token_id' must be an integer or a list of integers"),
        ({"torch_dtype": "int8"}, r"torch_dtype 'int8'"),
    ],
)
def test_invalid_fields_are_named(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(tiny_config(**edit))


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"no config\.json at"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ModelConfigError, match="is not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_config_is_frozen_and_eos_list() -> None:
    c = ModelConfig.from_dict(tiny_config(eos_token_id=[1, 7]))
    assert c.eos_token_id == (1, 7)
    with pytest.raises(AttributeError):
        c.vocab_size = 3  # type: ignore[misc]


def test_r1_is_the_v3_architecture() -> None:
    v3, r1 = _published("deepseek-v3"), _published("deepseek-r1")
    assert {k for k in v3 if v3[k] != r1.get(k)} == {"transformers_version"}
    assert ModelConfig.from_dict(v3) == ModelConfig.from_dict(r1)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
            "'layer_types' holds",
        ),
        ({"layer_types": ["sliding_attention"]}, "'layer_types' must list one of"),
        ({"mlp_layer_types": ["hash_moe", "dense", "moe"]}, "'mlp_layer_types' holds"),
        ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
        ({"o_groups": 3}, r"num_attention_heads \(4\) must be divisible by o_groups \(3\)"),
        ({"index_head_dim": 4}, r"index_head_dim \(4\) must be >= the rotated width \(8\)"),
        (
            {"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 8}},
            "CSA and HCA need different ratios",
        ),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds n_routed_experts \(4\)"),
    ],
)
def test_v4_config_errors_name_the_field(overrides: dict[str, object], match: str) -> None:
    from deepinfer.testing.checkpoints import tiny_v4_config

    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(tiny_v4_config(**overrides))

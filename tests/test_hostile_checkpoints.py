"""Hostile checkpoints and settings (issues 13 and 16): each is refused with an error naming the
tensor or the field, through the API (`LLM(...)`) and through the command line (`python -m
deepinfer generate` exits with status 2 and a one-line message, no traceback); the weight check's
opt-out; config.json defaults equal to transformers' config classes, field by field; every import
of deepinfer declared in pyproject.toml."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import TINY

from deepinfer.api import LLM, SamplingParams
from deepinfer.config import MAX_BLOCK_SIZE, EngineConfig
from deepinfer.engine.kv_cache import HOST_BYTES_PER_BLOCK, check_kv_pool_fits
from deepinfer.models.config import HF_DEFAULTS, IMPLIED_DEFAULTS, ModelConfig, ModelConfigError
from deepinfer.models.loader import CheckpointError, NonFiniteWeightError, load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
SKIP_ENV = "DEEPINFER_SKIP_WEIGHT_CHECK"


def _deepinfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != SKIP_ENV} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
        cwd=REPO,
    )


def _assert_cli_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --------------------------------------------------------------------------- the checkpoints


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random float32 tiny checkpoint with the shipped tiny tokenizer (vocabulary 978), FP8 too."""
    root = tmp_path_factory.mktemp("hostile")
    ckpt = write_random_checkpoint(root / "float", tiny_config(vocab_size=978), seed=3)
    fp8 = write_random_checkpoint(root / "fp8", tiny_config(vocab_size=978), seed=3, fp8=True)
    for d in (ckpt, fp8):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY / name, d / name)
    return root


def _edit_tensors(root: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = root / "model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))


def _edit_config(root: Path, **fields: Any) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(fields)
    (root / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as JSON's extensions


def _set(name: str, index: tuple[int, ...], value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name][index] = value

    return edit


def _retype(name: str, dtype: torch.dtype) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].to(dtype)

    return edit


def _fp8_nan_byte(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        raw = state[name].view(torch.uint8).clone()
        raw[2, 7] = 0xFF  # S.1111.111: NaN (e4m3fn has no Inf)
        state[name] = raw.view(torch.float8_e4m3fn)

    return edit


O_PROJ = "model.layers.0.self_attn.o_proj.weight"
YARN = tiny_config()["rope_scaling"]
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
SCALE = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"

# (id, fp8 checkpoint?, tensor edit, config edit, words the error must hold)
CASES: list[tuple[str, bool, Any, dict[str, Any], tuple[str, ...]]] = [
    ("nan-weight", False, _set(O_PROJ, (3, 5), math.nan), {}, (O_PROJ, "NaN or Inf", SKIP_ENV)),
    ("inf-norm", False, _set("model.norm.weight", (7,), -math.inf), {}, ("model.norm.weight", "-inf")),
    ("bool-tensor", False, _retype("model.norm.weight", torch.bool), {}, ("model.norm.weight", "bool")),
    ("int-tensor", False, _retype("model.layers.1.mlp.gate.weight", torch.int32), {}, ("mlp.gate", "int32")),
    ("fp8-nan-scale", True, _set(SCALE, (0, 0), math.nan), {}, (SCALE, "NaN or Inf")),
    ("fp8-inf-scale", True, _set(SCALE, (0, 0), math.inf), {}, (SCALE, "NaN or Inf")),
    ("fp8-nan-byte", True, _fp8_nan_byte(EXPERT), {}, (EXPERT, "NaN encoding", "(2, 7)")),
    ("eps-negative", False, None, {"rms_norm_eps": -1}, ("rms_norm_eps", "> 0", "-1")),
    ("eps-nan", False, None, {"rms_norm_eps": math.nan}, ("rms_norm_eps", "finite", "nan")),
    ("scaling-inf", False, None, {"routed_scaling_factor": math.inf}, ("routed_scaling_factor", "finite")),
    ("negative-size", False, None, {"hidden_size": -64}, ("hidden_size", ">= 1", "-64")),
    ("kv-lora-rank-0", False, None, {"kv_lora_rank": 0}, ("kv_lora_rank", ">= 1")),
    ("top-k-too-big", False, None, {"num_experts_per_tok": 9}, ("num_experts_per_tok (9)", "(8)")),
    ("rope-theta", False, None, {"rope_theta": -10000}, ("rope_theta", "> 0")),
    ("yarn-factor", False, None, {"rope_scaling": YARN | {"factor": 0}}, ("rope scaling", "'factor'")),
    ("bos-id", False, None, {"bos_token_id": "<s>"}, ("bos_token_id",)),
    ("too-many-layers", False, None, {"num_hidden_layers": 40}, ("num_hidden_layers=40", "layers.39")),
    ("too-many-experts", False, None, {"n_routed_experts": 4096}, ("n_routed_experts=4096", "holds 8")),
    ("max-positions", False, None, {"max_position_embeddings": 10**14}, ("max_position_embeddings",)),
]  # fmt: skip


@pytest.fixture
def hostile(base: Path, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, tuple[str, ...]]:
    _, fp8, tensor_edit, config_edit, words = request.param
    root = tmp_path / "ckpt"
    shutil.copytree(base / ("fp8" if fp8 else "float"), root)
    if tensor_edit is not None:
        _edit_tensors(root, tensor_edit)
    if config_edit:
        _edit_config(root, **config_edit)
    return root, words


@pytest.mark.parametrize("hostile", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_api_refuses_with_the_name(
    hostile: tuple[Path, tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SKIP_ENV, raising=False)
    root, words = hostile
    with pytest.raises(ValueError) as info:
        LLM(str(root), backend="reference")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("hostile", CASES, ids=[c[0] for c in CASES], indirect=True)
def test_cli_refuses_with_the_name(hostile: tuple[Path, tuple[str, ...]]) -> None:
    root, words = hostile
    r = _deepinfer("generate", "--model", str(root), "--prompt", "Hi", "--backend", "reference")
    _assert_cli_error(r, *words)


def test_the_checkpoint_used_by_the_cases_loads(base: Path) -> None:
    for name in ("float", "fp8"):
        out = LLM(str(base / name), backend="reference").generate(
            "Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 2


def test_a_cast_that_overflows_is_named(base: Path, tmp_path: Path) -> None:
    root = shutil.copytree(base / "float", tmp_path / "ckpt")
    _edit_tensors(root, _set(O_PROJ, (1, 1), 1e6))  # finite in float32, Inf in float16
    with pytest.raises(NonFiniteWeightError, match=rf"{O_PROJ}.*float32 to float16 overflows"):
        LLM(str(root), backend="reference", dtype="float16")
    LLM(str(root), backend="reference", dtype="bfloat16")  # bfloat16 holds it


# --------------------------------------------------------------------------- the opt-out


def test_weight_check_opt_out(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = shutil.copytree(base / "float", tmp_path / "ckpt")
    _edit_tensors(root, _set("lm_head.weight", (5, 0), math.nan))
    backend = create_reference_backend()
    monkeypatch.delenv(SKIP_ENV, raising=False)
    with pytest.raises(NonFiniteWeightError, match=r"'lm_head.weight'.*DEEPINFER_SKIP_WEIGHT_CHECK=1"):
        load_model(root, backend)
    assert torch.isnan(load_model(root, backend, check_weights=False).lm_head).any()
    monkeypatch.setenv(SKIP_ENV, "1")
    LLM(str(root), backend="reference")  # loads: the user vouches for the weights
    assert torch.isnan(load_model(root, backend).lm_head).any()
    with pytest.raises(NonFiniteWeightError):
        load_model(root, backend, check_weights=True)  # the argument wins over the environment
    # the dtype checks cost nothing and stay on
    _edit_tensors(root, _retype("model.norm.weight", torch.int64))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*int64"):
        load_model(root, backend, check_weights=False)


def test_weight_check_opt_out_on_the_command_line(base: Path, tmp_path: Path) -> None:
    root = shutil.copytree(base / "float", tmp_path / "ckpt")
    _edit_tensors(root, _set("lm_head.weight", (5, 0), math.nan))
    args = ("generate", "--model", str(root), "--prompt", "Hi", "--backend", "reference", "--max-tokens", "2")
    _assert_cli_error(_deepinfer(*args), "lm_head.weight", SKIP_ENV)
    r = _deepinfer(*args, env={SKIP_ENV: "1"})
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- engine sizes


@pytest.mark.parametrize(
    ("kwargs", "flags", "words"),
    [
        (
            {"num_gpu_blocks_override": 10**12},
            ("--num-gpu-blocks-override", str(10**12)),
            ("num_gpu_blocks_override=1000000000000", "blocks fit"),
        ),
        ({"block_size": 10**6}, ("--block-size", str(10**6)), ("block_size", "1..1024", "1000000")),
    ],
    ids=["num-blocks", "block-size"],
)
def test_engine_sizes_are_checked_before_allocating(
    kwargs: dict[str, int], flags: tuple[str, ...], words: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as info:
        LLM(str(TINY), backend="reference", **kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)
    r = _deepinfer("generate", "--prompt", "Hi", "--backend", "reference", *flags)
    _assert_cli_error(r, *words)


def test_block_size_bound_and_kv_pool_check() -> None:
    EngineConfig(model="m", block_size=MAX_BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"block_size must be in 1\.\.1024 tokens.*got 1025"):
        EngineConfig(model="m", block_size=MAX_BLOCK_SIZE + 1)
    gib = 2**30
    check_kv_pool_fits(1000, 1024, 64, gib, False, "x=1", host_bytes=gib)
    with pytest.raises(ValueError, match=r"x=1: .*of free device memory.*at most 1048576 blocks fit"):
        check_kv_pool_fits(2**20 + 1, 1024, 64, gib, False, "x=1", host_bytes=gib)
    with pytest.raises(ValueError, match=r"host memory for the block manager"):
        check_kv_pool_fits(gib // HOST_BYTES_PER_BLOCK + 1, 1, 64, 2**50, False, "x=1", host_bytes=gib)
    with pytest.raises(ValueError, match=r"host memory \(the device is the host\)"):
        check_kv_pool_fits(gib // 1024, 1024, 64, gib, True, "x=1", host_bytes=gib)


# --------------------------------------------------------------------------- chat template, output file


@pytest.fixture(scope="module")
def overflowing_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = shutil.copytree(TINY, tmp_path_factory.mktemp("template") / "tiny")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for i in range(10**12) %}{% endfor %}{{ messages[0]['content'] }}"
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


def test_chat_template_that_raises_is_a_value_error(overflowing_template: Path) -> None:
    llm = LLM(str(overflowing_template), backend="reference")
    with pytest.raises(ValueError, match=r"chat template failed \(.*tokenizer_config\.json\): OverflowError"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"chat template failed \(the chat_template argument\): ZeroDivision"
    ):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template="{{ 1 // 0 }}", use_tqdm=False)
    with pytest.raises(ValueError, match=r"chat template \(the chat_template argument\) does not compile"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template="{% for %}", use_tqdm=False)


def test_chat_template_that_raises_on_the_command_line(overflowing_template: Path) -> None:
    r = _deepinfer(
        "generate", "--model", str(overflowing_template), "--prompt", "Hi", "--chat", "--backend", "reference"
    )
    _assert_cli_error(r, "chat template failed", "OverflowError", "Range too big")


def test_unwritable_output_json(tmp_path: Path) -> None:
    common = ("bench", "--backend", "reference", "--num-prompts", "1", "--input-len", "4")
    common += ("--output-len", "2")
    missing = tmp_path / "no" / "such" / "dir" / "out.json"
    _assert_cli_error(_deepinfer(*common, "--output-json", str(missing)), "--output-json", "does not exist")
    _assert_cli_error(_deepinfer(*common, "--output-json", str(tmp_path)), "--output-json", "is a directory")
    if not Path("/proc/version").is_file():
        return
    # passes the early check as root (os.access), fails at the write: still one line
    r = _deepinfer(*common, "--output-json", "/proc/version")
    _assert_cli_error(r, "--output-json /proc/version")


# --------------------------------------------------------------------------- defaults = transformers'


def _hf_classes() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    return {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config}


def _hf_value(hf: Any, name: str) -> Any:
    return hf.rope_parameters["rope_theta"] if name == "rope_theta" else getattr(hf, name)


def _ours(cfg: ModelConfig, name: str) -> Any:
    if name == "rope_theta":
        return cfg.rope.theta
    if name == "eos_token_id":
        return cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id)
    if name in ("hidden_act", "attention_bias"):
        return {"hidden_act": "silu", "attention_bias": False}[name]  # anything else is refused
    return getattr(cfg, name)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_default_table_is_transformers_config_class(model_type: str) -> None:
    cls = _hf_classes()[model_type]
    hf = cls()
    for name, value in HF_DEFAULTS[model_type].items():
        assert _hf_value(hf, name) == value, name
    # the fields transformers' class lacks (its modeling code hard-codes them) are still absent
    for name in IMPLIED_DEFAULTS[model_type]:
        assert not hasattr(hf, name), f"transformers' {cls.__name__} now has {name!r}: move it to HF_DEFAULTS"
    # every field deepinfer reads that transformers' class has is in the table (but torch_dtype:
    # transformers' None means "not given"; deepinfer then runs bfloat16, as vLLM does)
    skip = ("model_type", "rope", "quantization", "torch_dtype")
    read = {f for f in ModelConfig.__dataclass_fields__ if f not in skip}
    for name in read:
        if hasattr(hf, name):
            assert name in HF_DEFAULTS[model_type], name


def _full_config(model_type: str) -> dict[str, Any]:
    """A complete tiny config whose every single omission still describes a runnable router."""
    cfg = tiny_config(model_type=model_type, n_routed_experts=16, n_group=4, topk_group=2)
    if model_type == "deepseek_v2":
        cfg.update(topk_method="group_limited_greedy", scoring_func="softmax", num_nextn_predict_layers=0)
        cfg.pop("rope_interleave", None)
    return cfg


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_an_omitted_field_reads_as_transformers_reads_it(model_type: str) -> None:
    """For each field: drop it from a complete config.json; deepinfer's value equals what
    transformers' config class makes of the same dict."""
    cls = _hf_classes()[model_type]
    full = _full_config(model_type)
    for name in HF_DEFAULTS[model_type]:
        raw = {k: v for k, v in full.items() if k != name}
        hf = cls(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
        want = _hf_value(hf, name)
        if want is None and name == "num_experts_per_tok":  # no default: required for MoE models
            with pytest.raises(ModelConfigError, match=r"missing required field 'num_experts_per_tok'"):
                ModelConfig.from_dict(raw)
            continue
        got = _ours(ModelConfig.from_dict(raw), name)
        if want is None and name in ("n_group", "topk_group"):
            assert got == 1, name  # one group: no group limit
            continue
        assert got == want, (name, got, want)


@pytest.mark.parametrize(
    "drop", [(), ("mscale",), ("mscale_all_dim",), ("mscale", "mscale_all_dim")], ids=str
)
def test_yarn_attention_factor_when_an_mscale_is_omitted(drop: tuple[str, ...]) -> None:
    cls = _hf_classes()["deepseek_v3"]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
    }
    rope |= {"mscale": 0.707, "mscale_all_dim": 1.0}
    rope = {k: v for k, v in rope.items() if k not in drop}
    raw = tiny_config(rope_scaling=None, rope_parameters=dict(rope), max_position_embeddings=163840)
    hf = cls(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures", "rope_scaling")})
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    assert ModelConfig.from_dict(raw).rope.cos_sin_factor == pytest.approx(attention_factor, rel=1e-12)


def test_deepseek_v4_defaults_are_transformers() -> None:
    """A sparse deepseek_v4 config.json reads every field with transformers' DeepseekV4Config
    default, and derives the same layer schedule and rotated width."""
    transformers = pytest.importorskip("transformers")
    from deepinfer.models.config import V4_DEFAULTS

    hf = transformers.DeepseekV4Config()
    for name, value in V4_DEFAULTS.items():
        assert getattr(hf, name) == value, name
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v4"})
    assert cfg.v4 is not None
    ratios = [0 if t == "sliding_attention" else hf.compress_rates[t] for t in hf.layer_types]
    assert list(cfg.v4.compress_ratios) == ratios
    assert list(cfg.v4.hash_layers) == [t == "hash_moe" for t in hf.mlp_layer_types]
    assert cfg.v4.rope_dim == hf.qk_rope_head_dim


# --------------------------------------------------------------------------- declared imports


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files of deepinfer that import it (stdlib and deepinfer excluded)."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "deepinfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "deepinfer":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_import_is_declared() -> None:
    """jinja2 used to arrive only through torch: every module deepinfer imports is a dependency
    of the distribution, or of one of its extras (imported lazily where the extra is optional)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for req in reqs:
            for sep in "<>=!~[; ":
                req = req.split(sep)[0]
            out.add(req.strip().lower().replace("-", "_"))
        return out

    core = names(project["dependencies"])
    extras = set().union(*(names(r) for r in project.get("optional-dependencies", {}).values()))
    assert "jinja2" in core
    distribution = {"pil": "pillow"}  # import names that are not their distribution's
    for module, files in sorted(_third_party_imports().items()):
        dist = distribution.get(module.lower(), module.lower())
        assert dist in core | extras, f"{module} (imported by {sorted(files)}) is not declared"

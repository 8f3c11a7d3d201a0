"""The engine arguments: vLLM's keywords on LLM(...), one definition for LLM,
EngineConfig and the command line, Hugging Face repo ids from the local hub cache, logging."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from tiny_model import TINY

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine.args import UnknownArgumentError, engine_config, resolve_engine_config
from deepinfer.entrypoints.cli import build_parser
from deepinfer.entrypoints.options import llm_kwargs
from deepinfer.log import LOGGER_NAME, configure_logging
from deepinfer.models.hub import hub_cache_dir

REPO = Path(__file__).resolve().parents[1]
SMALL = {"backend": "reference", "max_model_len": 64, "max_num_seqs": 4, "block_size": 16}


def tiny_llm(model: str | Path = TINY, **kw: Any) -> LLM:
    return LLM(str(model), **{**SMALL, "enforce_eager": True, **kw})


def copy_tiny(dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.is_file() and f.name not in skip and f.suffix != ".py":
            shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture
def restore_logger() -> Iterator[None]:
    """Put the "deepinfer" logger's level back after a test that changes it."""
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    yield
    logger.setLevel(level)


# --------------------------------------------------------------------------- keywords


def test_unknown_keyword_names_the_nearest_supported_one() -> None:
    with pytest.raises(
        UnknownArgumentError, match=r"unknown argument 'max_num_seq'.*nearest supported one is 'max_num_seqs'"
    ):
        LLM(str(TINY), max_num_seq=4)
    with pytest.raises(TypeError, match=r"'enforce_eagre'.*'enforce_eager'"):  # also a TypeError, as Python's
        LLM(str(TINY), enforce_eagre=True)
    with pytest.raises(ValueError, match=r"'gpu_memory_utilisation'.*'gpu_memory_utilization'"):
        LLM(str(TINY), gpu_memory_utilisation=0.5)
    # a vLLM argument deepinfer does not have says why, and still names the nearest one
    with pytest.raises(
        ValueError, match=r"vLLM's pipeline_parallel_size is not supported.*nearest supported one is"
    ):
        LLM(str(TINY), pipeline_parallel_size=2)


def test_trust_remote_code() -> None:
    assert tiny_llm(trust_remote_code=False).llm_engine.config.trust_remote_code is False
    with pytest.raises(
        ValueError, match="trust_remote_code=True is not supported: deepinfer never runs code"
    ):
        LLM(str(TINY), trust_remote_code=True)


def test_tensor_parallel_size() -> None:
    tiny_llm(tensor_parallel_size=1)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 is not supported.*enable_expert_parallel=True"
    ):
        LLM(str(TINY), tensor_parallel_size=2)


def test_enable_chunked_prefill() -> None:
    tiny_llm(enable_chunked_prefill=True)
    tiny_llm(enable_chunked_prefill=None)
    with pytest.raises(
        ValueError, match="enable_chunked_prefill=False is not supported: deepinfer always prefills"
    ):
        LLM(str(TINY), enable_chunked_prefill=False)


def test_enforce_eager() -> None:
    assert not tiny_llm(enforce_eager=True).llm_engine.worker.decode_graphs
    assert tiny_llm(enforce_eager=False).llm_engine.worker.decode_graphs  # emulated by the reference backend
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(model="m", enforce_eager="yes")  # type: ignore[arg-type]


def test_quantization_is_checked_against_the_checkpoint(tmp_path: Path) -> None:
    tiny_llm(quantization=None)
    with pytest.raises(ValueError, match=r"quantization='fp8', but .* is not an FP8 checkpoint"):
        LLM(str(TINY), quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported; choose None .* or 'fp8'"):
        LLM(str(TINY), quantization="awq")
    fp8 = copy_tiny(tmp_path / "fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    resolved = resolve_engine_config(
        EngineConfig(model=str(fp8), quantization="fp8")
    )  # an FP8 checkpoint: accepted
    assert resolved.quantization == "fp8"


def test_generation_config(tmp_path: Path) -> None:
    model = copy_tiny(tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 7}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_p": 0.5}))

    auto = tiny_llm(model).llm_engine.default_sampling_params()
    assert (auto.temperature, auto.top_k) == (0.5, 7)
    vllm = tiny_llm(model, generation_config="vllm").llm_engine.default_sampling_params()
    assert (vllm.temperature, vllm.top_k, vllm.top_p) == (1.0, 0, 1.0)  # SamplingParams() defaults
    path = tiny_llm(model, generation_config=str(other)).llm_engine.default_sampling_params()
    assert (path.temperature, path.top_p, path.top_k) == (0.25, 0.5, 0)
    with pytest.raises(
        FileNotFoundError, match=r"generation_config='.*missing': no generation_config.json there"
    ):
        LLM(str(model), generation_config=str(tmp_path / "missing"))


def test_max_logprobs() -> None:
    llm = tiny_llm(max_logprobs=2)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert out[0].outputs[0].logprobs is not None
    with pytest.raises(ValueError, match=r"prompt 0: logprobs=3 is more than max_logprobs=2"):
        llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    unlimited = tiny_llm(max_logprobs=-1)
    unlimited.generate(prompt, SamplingParams(max_tokens=2, logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        EngineConfig(model="m", max_logprobs=-2)


def test_seed() -> None:
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # sampled, no per-request seed

    def tokens(seed: int) -> list[int]:
        return tiny_llm(seed=seed).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    with pytest.raises(ValueError, match="seed must be an integer"):
        EngineConfig(model="m", seed="7")  # type: ignore[arg-type]


def test_tokenizer_must_hold_the_models_vocabulary(tmp_path: Path) -> None:
    same = tmp_path / "same"
    same.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, same / name)
    llm = tiny_llm(tokenizer=str(same))
    assert llm.llm_engine.tokenizer is not None and llm.llm_engine.tokenizer.path == same
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_token_ids

    other = tmp_path / "other"
    other.mkdir()
    tok = json.loads((TINY / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer '.*other' does not hold the model's vocabulary"):
        LLM(str(TINY), tokenizer=str(other))
    with pytest.raises(FileNotFoundError, match=r"tokenizer '.*' has no tokenizer.json"):
        LLM(str(TINY), tokenizer=str(tmp_path))


def test_bad_values_name_the_argument() -> None:
    for kwargs, match in [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"backend": ""}, "backend must be a non-empty string"),
        ({"tokenizer": 3}, "tokenizer must be a non-empty string"),
        ({"speculative_config": "mtp"}, "speculative_config must be a dict"),
        ({"max_prefill_graph_tokens": -1}, "max_prefill_graph_tokens must be an integer >= 0"),
        ({"max_prefill_graph_tokens": 1.5}, "max_prefill_graph_tokens must be an integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine_config(TINY, kwargs)


# --------------------------------------------------------------------------- one definition


def test_the_command_line_options_come_from_engine_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x"])
    kwargs = llm_kwargs(args)
    engine_names = {f.name for f in fields(EngineConfig)} - {"model"}
    assert set(kwargs) == engine_names  # every engine argument, nothing else
    for f in fields(EngineConfig):
        if f.name != "model":
            assert kwargs[f.name] == f.default, f.name  # the same defaults
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()  # type: ignore[union-attr]
    for name in engine_names:
        assert "--" + name.replace("_", "-") in help_text
    args = parser.parse_args(
        ["bench", "--enable-expert-parallel", "--kv-cache-memory-bytes", "1000000", "--batch-invariant",
         "--enforce-eager", "--no-async-scheduling", "-tp", "1", "--speculative-config", '{"method": "mtp"}',
         "--max-logprobs", "5", "--generation-config", "vllm", "--quantization", "fp8"]
    )  # fmt: skip
    kwargs = llm_kwargs(args)
    assert kwargs["enable_expert_parallel"] and kwargs["batch_invariant"] and kwargs["enforce_eager"]
    assert kwargs["kv_cache_memory_bytes"] == 1_000_000 and kwargs["async_scheduling"] is False
    assert kwargs["speculative_config"] == {"method": "mtp"} and kwargs["max_logprobs"] == 5
    assert kwargs["generation_config"] == "vllm" and kwargs["quantization"] == "fp8"
    # the old shortcut still works
    args = parser.parse_args(["generate", "--prompt", "x", "--num-speculative-tokens", "2"])
    assert llm_kwargs(args)["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}


# --------------------------------------------------------------------------- hub ids


def fake_hub_repo(
    cache: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """huggingface_hub's cache layout for `repo_id` holding the tiny model: blobs, a snapshot of
    symlinks to them, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for i, f in enumerate(sorted(p for p in TINY.iterdir() if p.is_file() and p.suffix != ".py")):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    return tmp_path / "hf" / "hub"


def test_a_cached_hub_repo_id_resolves_offline(hf_home: Path) -> None:
    snapshot = fake_hub_repo(hf_home, "deepseek-ai/DeepSeek-Tiny")
    llm = tiny_llm("deepseek-ai/DeepSeek-Tiny")
    assert Path(llm.llm_engine.config.model) == snapshot
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    commit = snapshot.name
    assert Path(tiny_llm("deepseek-ai/DeepSeek-Tiny", revision=commit).llm_engine.config.model) == snapshot
    with pytest.raises(
        FileNotFoundError, match=r"repo 'deepseek-ai/DeepSeek-Tiny' at revision 'v9' is not in"
    ):
        LLM("deepseek-ai/DeepSeek-Tiny", revision="v9")
    # the tokenizer may be a repo id too
    assert tiny_llm(TINY, tokenizer="deepseek-ai/DeepSeek-Tiny").llm_engine.tokenizer is not None


def test_an_uncached_hub_repo_id_is_a_clear_error(hf_home: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        LLM("deepseek-ai/DeepSeek-V2-Lite")
    message = str(info.value)
    assert "'deepseek-ai/DeepSeek-V2-Lite' is not in the hub cache" in message
    assert str(hf_home) in message and "never downloads" in message
    with pytest.raises(FileNotFoundError, match="model directory '/no/such/dir' does not exist"):
        LLM("/no/such/dir")  # a path, not an id


def test_the_command_line_takes_a_hub_repo_id(hf_home: Path, tmp_path: Path) -> None:
    fake_hub_repo(hf_home, "deepseek-ai/DeepSeek-Tiny")
    env = {**os.environ, "HF_HOME": str(hf_home.parent), "DEEPINFER_LOG_LEVEL": "WARNING"}
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer", "generate", "--model", "deepseek-ai/DeepSeek-Tiny",
         "--prompt", "Hi",
         "--max-tokens", "2", "--json", "--backend", "reference", "--enforce-eager"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 2


# --------------------------------------------------------------------------- logging


def test_log_level_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_logger: None
) -> None:
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "INFO")
    tiny_llm()
    err = capsys.readouterr().err
    assert "backend reference: asked for (backend='reference')" in err
    assert "KV cache: " in err and " tokens (" in err
    assert f"weights of {TINY} loaded in " in err
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "warning")
    tiny_llm()
    assert "KV cache" not in capsys.readouterr().err
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "LOUD")
    with pytest.raises(
        ValueError, match="DEEPINFER_LOG_LEVEL='LOUD' is not a log level; choose one of DEBUG"
    ):
        configure_logging()


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "DEEPINFER_LOG_LEVEL"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)


def test_the_library_is_quiet_by_default_and_the_cli_shows_info(tmp_path: Path) -> None:
    code = (
        f"from deepinfer import LLM; LLM({str(TINY)!r}, backend='reference', max_model_len=64, "
        "enforce_eager=True)"
    )
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "INFO" not in r.stderr and "Loading weights" not in r.stderr
    cli = "import sys; from deepinfer.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [
        "generate",
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
        "--backend",
        "reference",
        "--max-model-len",
        "64",
    ]
    r = subprocess.run(
        [sys.executable, "-c", cli, *args], capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "DEEPINFER_LOG_LEVEL"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "INFO" in r.stderr and "KV cache: " in r.stderr and "backend reference" in r.stderr
    assert "Loading weights" in r.stderr  # the progress bar while the weights load
    r = subprocess.run(
        [sys.executable, "-c", cli, *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "DEEPINFER_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    assert r.returncode == 0 and "INFO" not in r.stderr

"""kv_cache_dtype="fp8" for MLA models (FlashMLA's FP8 latent rows, deepinfer.backend.kv_formats_mla)
on the reference backend: the model's logits and greedy tokens against an independent float64
forward whose attention reads the rows the format keeps (deepinfer.testing.oracles.e4m3_rows64),
the KV budget, the argument's checks and the command line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models_util import rel_err
from test_model_float64 import V2_LIKE

from deepinfer import LLM, SamplingParams
from deepinfer.backend.kv_formats_mla import fp8_row_bytes, fp8_tile
from deepinfer.config import EngineConfig
from deepinfer.engine.worker import kv_cache_format
from deepinfer.models.config import ModelConfig
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint
from deepinfer.testing.oracles import e4m3_rows64, reference_forward64
from deepinfer.testing.paged_runner import PagedRunner

TINY = Path(__file__).resolve().parents[1] / "model" / "tiny"
CONFIGS = {"v3": tiny_config(num_nextn_predict_layers=0), "v2": V2_LIKE}
# float32 forward vs float64 over the same quantised rows: test_model_float64's budget. The rows
# are the same: the latent reaches the cache as float32 values, quantised with a power-of-two
# scale (exact) and rounded to nearest even as e4m3_rows64 rounds them.
RTOL = 1e-4
# A greedy pick is checked where the oracle's top-2 margin exceeds this: 100x the float32
# forward's largest logit error over the quantised rows (2e-6 measured on these configs).
MARGIN = 2e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    cfg = CONFIGS[request.param]
    state = random_state_dict(ModelConfig.from_dict(cfg), seed=3, mtp=False)
    return write_checkpoint(tmp_path_factory.mktemp(request.param), cfg, state), cfg, state


def kept_rows(cfg: dict[str, Any]) -> Any:
    return e4m3_rows64(cfg["kv_lora_rank"], fp8_tile(cfg["kv_lora_rank"]))


def test_logits_match_float64_over_fp8_rows(ckpt: tuple[Path, Any, Any]) -> None:
    """A prefill in two chunks, then two decode steps, over an FP8 cache: within float32's budget
    of the float64 forward over the quantised rows, and far from the one over exact rows (the
    quantisation is really there: 1e-2 and more on these configs)."""
    root, cfg, state = ckpt
    backend = create_reference_backend()
    model = load_model(root, backend)
    tokens = [(7 * i + 3) % cfg["vocab_size"] for i in range(27)]
    runner = PagedRunner(model, backend, num_blocks=16, block_size=4, kv_format="fp8")
    assert runner.kv_caches[0].spec.bytes_per_token == fp8_row_bytes(
        cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    )
    chunks = [tokens[:13], tokens[13:25], tokens[25:26], tokens[26:]]
    got = torch.cat([runner.step([(0, c)], all_logits=True) for c in chunks]).double()
    _, want = reference_forward64(state, cfg, tokens, kept_rows(cfg))
    _, exact = reference_forward64(state, cfg, tokens)
    assert rel_err(got, want) <= RTOL
    assert rel_err(got, exact) > 100 * RTOL


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_match_float64_over_fp8_rows(ckpt: tuple[Path, Any, Any]) -> None:
    """The engine (chunked prefill, decode batches, kv_cache_dtype="fp8"): each greedy token is the
    float64 oracle's argmax over the quantised rows wherever its top-2 margin exceeds MARGIN; the
    positions within MARGIN are counted, not skipped: at most one of 36."""
    root, cfg, state = ckpt
    prompts = [
        [(5 * i + 11 * b + 1) % cfg["vocab_size"] for i in range(n)] for b, n in enumerate((3, 17, 30))
    ]
    llm = LLM(
        str(root), backend="reference", dtype="float32", kv_cache_dtype="fp8", block_size=4,
        max_num_batched_tokens=16, max_model_len=64, enforce_eager=True,
    )  # fmt: skip
    outs = greedy(llm, prompts, 12)
    near = 0
    for p, out in zip(prompts, outs):
        _, logits = reference_forward64(state, cfg, p + out[:-1], kept_rows(cfg))
        rows = logits[len(p) - 1 :]
        top2 = rows.topk(2, dim=-1)
        for i, tok in enumerate(out):
            margin = float(top2.values[i, 0] - top2.values[i, 1])
            if margin <= MARGIN:
                near += 1
                continue
            assert tok == int(top2.indices[i, 0]), (
                f"prompt of {len(p)}: token {i} is {tok}, oracle {top2.indices[i, 0]}"
            )
    assert near <= 1, f"{near} of 36 greedy positions within the margin {MARGIN}"


def test_kv_budget_counts_the_fp8_rows(tmp_path: Path) -> None:
    """The same kv_cache_memory_bytes holds 1152 / 656 (1.76x) the blocks at DeepSeek-V3's latent
    widths (512 + 64, bf16 model)."""
    cfg = tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=1, num_nextn_predict_layers=0)
    cfg["first_k_dense_replace"] = 1
    root = write_checkpoint(tmp_path / "ckpt", cfg, random_state_dict(ModelConfig.from_dict(cfg), mtp=False))
    budget = 4 << 20
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(
            str(root), backend="reference", dtype="bfloat16", kv_cache_dtype=dtype, block_size=16,
            kv_cache_memory_bytes=budget, max_model_len=64, max_num_seqs=1024, enforce_eager=True,
        )  # fmt: skip
        worker = llm.llm_engine.worker
        blocks[dtype] = worker.num_blocks
        assert worker.kv_pool_bytes(worker.num_blocks) <= budget < worker.kv_pool_bytes(worker.num_blocks + 1)
        cache = worker.kv_caches[0]
        assert sum(t.numel() * t.element_size() for t in cache.tensors) == worker.kv_pool_bytes(blocks[dtype])
    assert blocks["auto"] == budget // (1152 * 16)
    assert blocks["fp8"] == budget // (656 * 16)
    assert 1.7 < blocks["fp8"] / blocks["auto"] < 1.8


def test_kv_cache_dtype_checks() -> None:
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype='fp8_e5m2' is not supported; choose one of 'auto', 'bf16', 'fp8', 'fp8_e4m3'",
    ):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")
    config = EngineConfig(model="m", kv_cache_dtype="fp8_e4m3")
    v3 = SimpleNamespace(
        config=SimpleNamespace(model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    )
    backend = create_reference_backend()
    assert kv_cache_format(config, v3, backend) == "fp8"  # type: ignore[arg-type]
    assert kv_cache_format(EngineConfig(model="m"), v3, backend) == "auto"  # type: ignore[arg-type]
    v4 = SimpleNamespace(
        config=SimpleNamespace(model_type="deepseek_v4", kv_lora_rank=None, qk_rope_head_dim=64)
    )
    assert kv_cache_format(config, v4, backend) == "auto"  # type: ignore[arg-type]  # V4's own formats
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' is not supported for deepseek_v4"):
        DeepseekV4ForCausalLM.use_kv_cache_dtype(v4, "fp8_e4m3")  # type: ignore[arg-type]
    DeepseekForCausalLM.use_kv_cache_dtype(v3, "fp8_e4m3")  # type: ignore[arg-type]  # MLA: taken
    odd = SimpleNamespace(
        config=SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=192, qk_rope_head_dim=64)
    )
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kv_cache_format(config, odd, backend)  # type: ignore[arg-type]
    plain = dataclasses.replace(
        backend, capabilities=dataclasses.replace(backend.capabilities, supports_fp8_kv_cache=False)
    )
    with pytest.raises(ValueError, match=r"the reference backend cannot keep FP8 latent caches"):
        kv_cache_format(config, v3, plain)  # type: ignore[arg-type]


def test_cli_generate_with_fp8_cache(tmp_path: Path) -> None:
    """`deepinfer generate --kv-cache-dtype fp8` on the shipped tiny model: the tokens of
    LLM(kv_cache_dtype="fp8"); a value outside the choices is refused by the parser."""
    run = [
        sys.executable, "-m", "deepinfer", "generate", "--prompt", "Hello, my name is", "--temperature", "0",
        "--max-tokens", "6", "--ignore-eos", "--json", "--backend", "reference", "--dtype", "float32",
    ]  # fmt: skip
    r = subprocess.run(
        [*run, "--kv-cache-dtype", "fp8"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[0])["token_ids"]
    llm = LLM(str(TINY), backend="reference", dtype="float32", kv_cache_dtype="fp8")
    prompt = llm.get_tokenizer().encode("Hello, my name is")
    assert got == greedy(llm, [prompt], 6)[0]
    bad = subprocess.run(
        [*run, "--kv-cache-dtype", "int8"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert bad.returncode != 0 and "--kv-cache-dtype" in bad.stderr and "fp8_e4m3" in bad.stderr


def test_prefix_caching_and_graphs_keep_the_tokens(ckpt: tuple[Path, Any, Any]) -> None:
    """Over an FP8 cache, prefix caching (blocks of quantised rows shared) and decode graphs give
    the tokens of plain eager steps (float32: the same rows, the same arithmetic)."""
    root, cfg, _ = ckpt
    shared = [(3 * i + 2) % cfg["vocab_size"] for i in range(12)]
    prompts = [[*shared, 5, 6], [*shared, 7], shared]
    args: dict[str, Any] = {
        "backend": "reference",
        "dtype": "float32",
        "kv_cache_dtype": "fp8",
        "block_size": 4,
    }
    plain = greedy(LLM(str(root), enforce_eager=True, **args), prompts, 8)
    llm = LLM(str(root), enable_prefix_caching=True, **args)
    assert greedy(llm, prompts[:1], 8) == plain[:1]
    assert greedy(llm, prompts[1:], 8) == plain[1:]  # their first blocks come from the cache
    assert llm.llm_engine.block_manager.num_prefix_hits > 0

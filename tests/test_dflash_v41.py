"""DeepSeek-V4.1's DSpark drafter (DFlash, speculative_config {"method": "dflash"}): its draft
layers are V4.1 blocks loaded from the checkpoint's mtp.{i}.* (deepseek_v41.V41DFlashDrafter).
Its drafts and confidences equal the float64 oracle (testing.v41_oracle.V41DSparkOracle, no code
shared with the model), on a fresh cache and inside the engine's eager and graph steps (where
the injected rows went through the rings incrementally); greedy outputs equal plain decoding;
missing and extra tensors are errors naming them. The engine runs use kv_cache_dtype "bf16" (the
tiny head_dim 24 is no multiple of the FP8 rows' 32-value scale blocks); the fresh-cache check
also runs the published formats ("auto": FP8 window rows, the draft layers' too) at head_dim 32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.paged_runner import PagedRunner
from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint
from deepinfer.testing.v41_oracle import V41DSparkOracle

CONFIG = tiny_v41_config(dspark=2)  # 4 layers (window, C2, C1, C1), window 4, block 4
PROMPTS = [[5 + (7 * i + 3 * j) % 55 for j in range(n)] for i, n in enumerate([3, 17, 30, 9])]
GREEDY = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(4)]
SEEDED = [
    SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(4)
]
ARGS: dict[str, Any] = {
    "backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 96,
    "kv_cache_dtype": "bf16",
}  # fmt: skip


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return random_v41_tensors(CONFIG, seed=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor]) -> Path:
    return write_v41_checkpoint(tmp_path_factory.mktemp("dflash_v41") / "ckpt", CONFIG, tensors)


@pytest.fixture(scope="module")
def oracle(tensors: dict[str, torch.Tensor]) -> V41DSparkOracle:
    return V41DSparkOracle(CONFIG, tensors)


def run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [r.outputs[0].token_ids for r in outs]


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> tuple[list[list[int]], list[list[int]]]:
    plain = LLM(str(ckpt), enforce_eager=True, **ARGS)
    return run(plain, GREEDY), run(plain, SEEDED)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "auto"])
def test_drafts_equal_the_float64_oracle(tmp_path: Path, kv_cache_dtype: str) -> None:
    """On a fresh cache: a prefill of the context (the injection in the target's forward), then
    the block from the emitted token: drafts, confidences and each slot's logits."""
    config = tiny_v41_config(dspark=2, head_dim=32, index_head_dim=32)
    tensors = random_v41_tensors(config, seed=2)
    root = write_v41_checkpoint(tmp_path / "ckpt", config, tensors)
    oracle = V41DSparkOracle(config, tensors, kv_cache_dtype)
    model = load_model(root, create_reference_backend(), torch.float32, dflash=True)
    assert isinstance(model, DeepseekV41ForCausalLM) and model.dflash is not None
    model.use_kv_cache_dtype(kv_cache_dtype)
    drafter, k = model.dflash, 4
    for tokens in ([7, 3, 9], [11 + (5 * j) % 50 for j in range(13)]):
        runner = PagedRunner(model, create_reference_backend(), num_blocks=16, block_size=4)
        runner.step([(0, tokens[:-1])])
        req = runner.alloc.requests[0]
        start = req.length
        runner.alloc.append_slots(0, drafter.block_size)
        table = torch.tensor([req.blocks], dtype=torch.int32)
        limit = start + drafter.block_size
        logits: list[torch.Tensor] = []
        drafts, conf = drafter.draft(
            torch.tensor([tokens[-1]]), torch.tensor([start]), table, torch.tensor([limit]),
            model.dflash_caches(runner.kv_caches), model.embed_tokens, model.lm_head, k, limit, logits,
        )  # fmt: skip
        want, want_conf, want_logits = oracle.drafts(tokens, k)
        assert drafts[0].tolist() == want
        torch.testing.assert_close(
            conf[0].double(), torch.tensor(want_conf, dtype=torch.float64), rtol=1e-4, atol=1e-5
        )
        for got, ref in zip(logits, want_logits):
            torch.testing.assert_close(got[0].double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_engine_outputs_equal_plain_and_drafts_equal_the_oracle(
    ckpt: Path, expected: Any, oracle: V41DSparkOracle, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:
    """LLM.generate with the drafter: greedy and seeded outputs equal plain decoding's; the
    drafts it proposed after incremental steps (injected rows of rejected drafts rewritten, the
    rings wrapping; in graphs the injection inside the forward graph and the block in the draw
    graph) equal the oracle's over the same tokens."""
    llm = LLM(str(ckpt), speculative_config={"method": "dflash", "num_speculative_tokens": 3},
              enforce_eager=eager, **ARGS)  # fmt: skip
    decoder = llm.llm_engine.speculative
    assert decoder is not None
    seen: dict[tuple[int, ...], list[int]] = {}
    real = decoder._keep_confident

    def record(seq, chain):  # type: ignore[no-untyped-def]
        chain = list(chain)
        if chain:
            seen[tuple(seq.token_ids)] = [d for d, _ in chain]
        real(seq, chain)

    monkeypatch.setattr(decoder, "_keep_confident", record)
    assert (run(llm, GREEDY), run(llm, SEEDED)) == expected
    assert llm.llm_engine.num_draft_tokens > 0
    assert (decoder.num_graph_steps > 0) == (not eager)
    keys = sorted(seen, key=len)
    picked = keys[:: max(1, len(keys) // 6)]
    for tokens in picked:
        assert oracle.drafts(list(tokens), 3)[0][: len(seen[tokens])] == seen[tokens], tokens
    assert len(picked) >= 6 and max(map(len, picked)) > 2 * CONFIG["text_config"]["sliding_window"] + 4


def test_missing_and_extra_draft_tensors_are_named(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    backend = create_reference_backend()
    missing = dict(tensors)
    del missing["mtp.1.markov_w2.weight"]
    root = write_v41_checkpoint(tmp_path / "missing", CONFIG, missing)
    with pytest.raises(Exception, match=r"mtp\.1\.markov_w2\.weight"):
        load_model(root, backend, torch.float32, dflash=True)
    extra = dict(tensors) | {"mtp.1.stray.weight": torch.zeros(2)}
    root = write_v41_checkpoint(tmp_path / "extra", CONFIG, extra)
    with pytest.raises(Exception, match=r"unexpected tensors.*mtp\.1\.stray\.weight"):
        load_model(root, backend, torch.float32, dflash=True)
    # without the drafter asked for, the draft layers' tensors are skipped, the stray one too
    assert load_model(root, backend, torch.float32).dflash is None
    bare = tiny_v41_config()
    root = write_v41_checkpoint(tmp_path / "bare", bare, random_v41_tensors(bare, seed=1))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        load_model(root, backend, torch.float32, dflash=True)


def test_published_kv_formats_in_graphs_equal_plain_decoding(tmp_path: Path) -> None:
    """kv_cache_dtype "auto" (FP8 window rows, the draft layers' rings included; FP4 entries):
    greedy and seeded outputs through verification graphs equal plain decoding's."""
    config = tiny_v41_config(dspark=2, head_dim=32, index_head_dim=32)
    root = write_v41_checkpoint(tmp_path / "ckpt", config, random_v41_tensors(config, seed=3))
    args = ARGS | {"kv_cache_dtype": "auto"}
    plain = LLM(str(root), enforce_eager=True, **args)
    want = run(plain, GREEDY), run(plain, SEEDED)
    llm = LLM(str(root), speculative_config={"method": "dflash", "num_speculative_tokens": 4}, **args)
    assert (run(llm, GREEDY), run(llm, SEEDED)) == want
    decoder = llm.llm_engine.speculative
    assert decoder is not None and decoder.num_graph_steps > 0 and llm.llm_engine.num_draft_tokens > 0


def test_bench_spec_step_dflash_small_run(tmp_path: Path) -> None:
    """bench/bench_spec_step.py --method dflash at a CPU size on a tiny V4.1 config with its draft
    layers (random weights, the FP8 / MXFP4 format): rows whose verified steps replayed graphs,
    the ratio from the two step costs, the JSON written."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_spec_step

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_v41_config(dspark=2, head_dim=32, index_head_dim=32)))
    args = f"--random-config {config} --backend reference --small --num-hidden-layers 4 --fp8"
    args += " --method dflash --block-size 8 --k 3 --repeats 1 --batches 2"
    rows = bench_spec_step.main(["--out", str(tmp_path / "out"), *args.split()])
    assert [(r["method"], r["k"], r["batch"]) for r in rows] == [("dflash", 3, 2)]
    r = rows[0]
    assert r["plain_step_ms"] > 0 and r["spec_step_ms"] > 0 and 0 < r["graph_steps"] <= 1
    assert r["ratio"] == pytest.approx(r["spec_step_ms"] / r["plain_step_ms"], rel=1e-2)
    assert "2 DFlash layers" in r["model"]
    assert json.loads((tmp_path / "out" / "spec_step.json").read_text()) == rows

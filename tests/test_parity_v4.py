"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same tiny random weights (saved
with save_pretrained; configs in model/parity/v4-*.json that cover every layer type: sliding-window
only, CSA with the lightning indexer, HCA; hash-routed and top-k-routed MoE):
  - greedy tokens through the public API (LLM.generate, reference backend, float32) equal
    transformers' generate (its indexer top-k tie-stable: tests/models_util.py
    stable_indexer_topk), for prompts several windows long spanning many compressed entries,
    with whole and chunked prefill, with and without preemption; with small step budgets the
    per-request ring (window and compressor state) is several times shorter than the longest
    prompt, so it wraps many times, chunks crossing its end; decode steps replay (emulated)
    graphs by default, and give the eager engine's tokens;
  - bfloat16 prefill logits within twice transformers' own bfloat16 error of the float32 oracle;
  - config reading (the shipped V4-Flash config, YaRN on the compressed branches) as transformers';
  - prefix caching (repeats served from the cache) gives the same tokens;
  - `deepinfer bench --random-config` at a reduced depth.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import build_hf_v4, parity_config

from deepinfer import LLM, SamplingParams
from deepinfer.models.config import ModelConfig
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.paged_runner import PagedRunner
from deepinfer.testing.transformers_ties import stable_indexer_topk

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
# Prompt lengths: shorter than the window, and many windows long with many compressed entries
# (up to 39 CSA entries at ratio 4, 9 HCA entries at ratio 16), none a multiple of a ratio.
PROMPT_LENS = (3, 21, 45, 70, 150, 131)
MAX_MODEL_LEN = 160
# model/parity/v4-*.json:
#   swa-csa-hca-hash: sliding-window only, CSA, HCA layers; a hash-routed first layer; the indexer
#     keeps 3 of up to 17 entries; two hyper-connection streams
#   hca-csa-swa-routed: compressed layers first, every MoE routed by top-k, the indexer keeping up
#     to 12 entries, three streams, a wider rotated part and four output groups
CONFIGS = ["v4-swa-csa-hca-hash", "v4-hca-csa-swa-routed"]


class Case:
    def __init__(self, name: str, root: Path) -> None:
        fields = parity_config(name)
        hf = build_hf_v4(fields, seed=CONFIGS.index(name))
        hf.save_pretrained(root)
        self.root = root
        rng = random.Random(7)
        self.prompts = [[rng.randrange(1, fields["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]
        self.expected = []
        with torch.no_grad(), stable_indexer_topk():  # ties to the lower entry id, as deepinfer
            for p in self.prompts:
                ids = torch.tensor([p])
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                )  # fmt: skip
                self.expected.append(out[0, len(p) :].tolist())

    def llm(self, **kwargs: Any) -> LLM:
        args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": MAX_MODEL_LEN}
        args |= kwargs
        return LLM(str(self.root), **args)


@pytest.fixture(scope="module", params=CONFIGS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def ring_rows(llm: LLM) -> int:
    """Rows of the per-request ring (window and compressor state)."""
    groups = llm.llm_engine.worker.kv_groups
    assert groups is not None and groups[0].name == "ring"
    return groups[0].ring_blocks * llm.llm_engine.config.block_size


def test_whole_prefill(case: Case) -> None:
    """Each prompt prefilled in one step, all requests decoding together."""
    llm = case.llm(max_num_batched_tokens=256, max_num_seqs=6, num_gpu_blocks_override=240)
    assert greedy(llm, case.prompts) == case.expected
    assert all_blocks_free(llm)


def test_chunked_prefill_across_the_ring(case: Case) -> None:
    """A 7-token step budget: prompts prefilled in chunks that cut compression windows anywhere,
    through a ring of 8 or 16 rows (window and compressor state) that the longest request
    (158 tokens) wraps 10 to 20 times; chunks longer than the ring takes in place (1 token)
    through step scratch."""
    llm = case.llm(max_num_batched_tokens=7, max_num_seqs=4, num_gpu_blocks_override=40)
    assert ring_rows(llm) * 6 <= max(PROMPT_LENS) + NEW_TOKENS
    assert greedy(llm, case.prompts) == case.expected
    assert all_blocks_free(llm)


@pytest.mark.parametrize("budget,preempts", [(40, True), (256, False)])
def test_chunks_several_times_the_ring(case: Case, budget: int, preempts: bool) -> None:
    """Step budgets of 40 and 256 tokens, prompt chunks up to 2.5 to 19 times the ring's 8 or 16
    rows: every chunk's rows go to step scratch and its last ring rows back; with 40 tokens a
    step and 40 blocks of 4 tokens, requests are preempted and recomputed in such chunks too."""
    llm = case.llm(max_num_batched_tokens=budget, max_num_seqs=4, num_gpu_blocks_override=40)
    engine = llm.llm_engine
    ring = engine.worker.inputs.ring
    assert ring is not None and engine.worker.ring_scratch_blocks > 0
    longest: list[int] = [0]
    real = ring.tables

    def spy(rings: Any, spans: Any, columns: Any = None) -> Any:
        longest[0] = max([longest[0], *(e - s for s, e in spans)])
        return real(rings, spans, columns)

    ring.tables = spy  # type: ignore[method-assign]
    assert greedy(llm, case.prompts[::-1]) == case.expected[::-1]
    assert longest[0] >= min(budget, max(PROMPT_LENS)) >= 2 * ring_rows(llm)
    assert (engine.scheduler.num_preemptions > 0) == preempts
    assert all_blocks_free(llm)


def test_chunked_prefill_with_preemption(case: Case) -> None:
    """A 13-token step budget, the longest prompts first, and a pool of 40 blocks of 4 tokens
    (what the longest request alone needs, the entry caches' last partial blocks aside): requests
    are preempted and recomputed, their rings and compressor state rebuilt."""
    llm = case.llm(max_num_batched_tokens=13, max_num_seqs=4, num_gpu_blocks_override=40)
    assert ring_rows(llm) * 4 <= max(PROMPT_LENS) + NEW_TOKENS
    assert greedy(llm, case.prompts[::-1]) == case.expected[::-1]
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    "engine_args,preempts",
    [
        ({"max_num_batched_tokens": 256, "max_num_seqs": 6, "num_gpu_blocks_override": 240}, False),
        ({"max_num_batched_tokens": 13, "max_num_seqs": 4, "num_gpu_blocks_override": 40}, True),
    ],
    ids=["whole-prefill", "chunked-preempting"],
)
def test_decode_graphs_equal_eager(
    case: Case, engine_args: dict[str, Any], preempts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps replayed from graphs (padded to their batch-size buckets, compressed entries
    closing inside them, the ring read through a table as wide as max_model_len) give the eager
    engine's tokens and transformers'. Requests stop at different lengths, so the batch shrinks
    through the buckets; with a 13-token budget and 40 blocks, prefill is chunked and requests
    are preempted and recomputed between graph steps."""
    lengths = [8, 5, 8, 3, 8, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    prompts = [{"prompt_token_ids": p} for p in case.prompts[::-1]]
    outs = {}
    for eager in (True, False):
        llm = case.llm(enforce_eager=eager, **engine_args)
        graphs = llm.llm_engine.worker.decode_graphs
        assert bool(graphs) != eager
        seen: list[tuple[int, int]] = []
        real = graphs.bucket_for

        def spy(batch: Any, real: Any = real, seen: list[tuple[int, int]] = seen) -> int | None:
            bucket: int | None = real(batch)
            if bucket is not None:
                seen.append((len(batch), bucket))
            return bucket

        monkeypatch.setattr(graphs, "bucket_for", spy)
        res = llm.generate(prompts, params[::-1], use_tqdm=False)
        outs[eager] = [list(o.outputs[0].token_ids) for o in res]
        if not eager:
            assert any(b < bucket for b, bucket in seen), f"no padded graph step in {seen}"
        if preempts:
            assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert all_blocks_free(llm)
    assert outs[False] == outs[True]
    assert outs[True] == [e[:n] for e, n in zip(case.expected[::-1], lengths[::-1])]


def test_async_scheduling_off_gives_the_same_tokens(case: Case) -> None:
    """The same chunked run with the host processing each step's tokens before the next step."""
    llm = case.llm(
        max_num_batched_tokens=7, max_num_seqs=4, num_gpu_blocks_override=40, async_scheduling=False
    )
    assert greedy(llm, case.prompts) == case.expected


def test_prefix_caching_gives_transformers_tokens(case: Case) -> None:
    """With prefix caching, chunked by a 7-token budget: each prompt and, once they are cached,
    each prompt again (every full block a hit: the ring's lookback restored, the entries shared or
    copied) give transformers' tokens."""
    llm = case.llm(
        max_num_batched_tokens=7,
        max_num_seqs=4,
        num_gpu_blocks_override=400,
        prefix_ring_blocks=400,
        enable_prefix_caching=True,
    )
    assert greedy(llm, case.prompts) == case.expected
    before = llm.llm_engine.block_manager.num_prefix_hits
    assert greedy(llm, case.prompts) == case.expected
    assert llm.llm_engine.block_manager.num_prefix_hits - before == sum(
        (len(p) - 1) // 4 * 4 for p in case.prompts
    )
    assert all_blocks_free(llm)


def test_flash_config_reads_as_transformers_does() -> None:
    """model/deepseek-v4-flash/config.json (legacy fields: num_hash_layers, qk_rope_head_dim, no
    layer_types) gives the layer schedule and rotated width transformers' DeepseekV4Config gives."""
    path = Path(__file__).resolve().parents[1] / "model" / "deepseek-v4-flash" / "config.json"
    raw = json.loads(path.read_text())
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if not k.startswith("_")})
    assert ours.v4 is not None
    rates = theirs.compress_rates
    want = [0 if t == "sliding_attention" else rates[t] for t in theirs.layer_types]
    assert list(ours.v4.compress_ratios) == want
    assert list(ours.v4.hash_layers) == [t == "hash_moe" for t in theirs.mlp_layer_types]
    assert ours.v4.rope_dim == theirs.qk_rope_head_dim
    assert ours.v4.compress_rope.theta == theirs.rope_parameters["compress"]["rope_theta"]


def test_bench_random_reduced_depth(
    run_deepinfer: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """`deepinfer bench --random-config` builds a DeepSeek-V4 model at a reduced depth and runs it."""
    config = Path(__file__).resolve().parents[1] / "model" / "parity" / f"{CONFIGS[0]}.json"
    out = tmp_path / "bench.json"
    proc = run_deepinfer(
        "bench", "--random-config", str(config), "--num-hidden-layers", "2", "--backend", "reference",
        "--num-prompts", "2", "--random-input-len", "9", "--random-output-len", "3",
        "--output-json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["total_num_tokens"] == 2 * (9 + 3)


def test_bfloat16_as_close_as_transformers(case: Case) -> None:
    """In bfloat16 (norms, sinks, biases and mHC weights in float32, as transformers keeps them)
    the prefill logits stay as close to the float32 oracle as transformers' own bfloat16 model:
    within twice its relative error."""
    prompt = torch.tensor([case.prompts[3]])
    load = transformers.DeepseekV4ForCausalLM.from_pretrained
    with torch.no_grad():
        want = load(case.root, dtype=torch.float32).eval()(prompt).logits[0].double()
        try:
            theirs = load(case.root, dtype=torch.bfloat16).eval()(prompt).logits[0].double()
        except RuntimeError as exc:  # transformers 5.17 (the GPU image's): float32 activations meet
            if "same dtype" not in str(exc):  # a bfloat16 weight inside its own model
                raise
            pytest.skip(f"transformers {transformers.__version__} cannot run DeepseekV4 in bfloat16: {exc}")
    backend = create_reference_backend()
    runner = PagedRunner(load_model(case.root, backend, dtype=torch.bfloat16), backend, num_blocks=32)
    ours = runner.step([(0, case.prompts[3])], all_logits=True).double()

    def rel(a: torch.Tensor) -> float:
        return float((a - want).norm() / want.norm())

    assert rel(ours) <= 2 * rel(theirs), f"bfloat16: ours {rel(ours):.2e}, transformers {rel(theirs):.2e}"


def test_compressed_branch_yarn_matches_transformers() -> None:
    """A published-style flat YaRN rope_scaling applies to the compressed branches only (with
    compress_rope_theta and no cos/sin factor); sliding-only layers keep plain rope: the inverse
    frequencies and factors of transformers' DeepseekV4RotaryEmbedding."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from deepinfer.models.rope import inv_freq

    raw = parity_config(CONFIGS[0]) | {"max_position_embeddings": 1048576}
    raw["rope_scaling"] = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}
    ours = ModelConfig.from_dict(raw)
    drop = ("model_type", "architectures", "dtype")
    rotary = DeepseekV4RotaryEmbedding(
        transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k not in drop})
    )
    assert ours.v4 is not None and ours.v4.compress_rope.kind == "yarn" and ours.rope.kind == "default"
    for kind, rope in (("main", ours.rope), ("compress", ours.v4.compress_rope)):
        want = getattr(rotary, f"{kind}_inv_freq")
        assert torch.allclose(inv_freq(rope, ours.v4.rope_dim), want, rtol=1e-6, atol=0), kind
        assert rope.cos_sin_factor == getattr(rotary, f"{kind}_attention_scaling"), kind


def test_published_names_load(case: Case, tmp_path: Path) -> None:
    """DeepSeek's own tensor names (no `model.` prefix: embed.weight, layers.{i}..., norm.weight,
    hc_head_fn / _base / _scale, head.weight) load into the same model as transformers' names."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(case.root / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        name = name.replace("model.embed_tokens.", "embed.").replace("model.hc_head.hc_", "hc_head_")
        renamed[name.removeprefix("model.")] = t
    assert "embed.weight" in renamed and "hc_head_fn" in renamed and "layers.0.attn.wq_a.weight" in renamed
    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((case.root / "config.json").read_text())
    backend = create_reference_backend()
    logits = []
    for root in (case.root, tmp_path):
        runner = PagedRunner(load_model(root, backend), backend, num_blocks=32)
        logits.append(runner.step([(0, case.prompts[2])], all_logits=True))
    assert torch.equal(logits[0], logits[1])

"""Speculative decoding for DeepSeek-V4 with its MTP layer (speculative_config method "mtp"): the
outputs are plain decoding's, greedy and seeded, for k = 1, 2, 3 drafts, on tiny random configs
with sliding-window, CSA and HCA layers and a hash-routed one, prompts several windows long and
generations crossing several compression boundaries, with chunked prefill and preemption; drafts
rejected right at the ring's edge (a ring of window + k rows, the tightest the engine builds);
the MTP head's drafts after prefill chunks written through step scratch equal those of a ring
long enough to take every step in place; the compressed entries of a step that crosses a
compression boundary with rejected drafts equal plain decoding's; the MTP layer's logits equal
DeepSeek's MTPBlock composed of transformers' V4 decoder layer (transformers has no V4 MTP
module of its own).

Drafts of a random MTP layer are almost never right; `mirrored` checkpoints have an MTP layer
that mostly drafts what the model samples (write_mirrored_v4_mtp_checkpoint), of a compressed
layer type (its own compressor state and entries rolled back too), so that accepted drafts are
exercised as well. Speculative steps replay verification graphs where they serve the batch (the
reference backend re-runs the captured functions); tests/test_v4_spec_graphs.py compares them
with eager steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import build_hf_v4, parity_config

from deepinfer import LLM, SamplingParams
from deepinfer.engine.speculative import EagerStep
from deepinfer.models.config import ModelConfig
from deepinfer.models.deepseek_v4 import WideCache, cache_kinds
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    tiny_v4_config,
    write_mirrored_v4_mtp_checkpoint,
    write_random_v4_checkpoint,
)
from deepinfer.testing.paged_runner import BlockAllocator, PagedRunner, build_batch

WINDOW = 8
# prompts longer than the window; 24 new tokens cross 6 CSA (ratio 4) and 3 HCA (ratio 8) boundaries
PROMPTS = [[2 + (5 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([3, 13, 30, 57])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
ENGINE_ARGS = {
    "whole": {},
    "chunked": {"max_num_batched_tokens": 7},  # prefill chunks of 7 through step scratch, a ring of 12 rows
    # blocks of 2 tokens, entry pools short of what the four requests need at once
    "preempting": {
        "block_size": 2,
        "max_num_batched_tokens": 32,
        "num_gpu_blocks_override": 48,
        "max_num_seqs": 4,
    },
}


def make(ckpt: Path, k: int = 0, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 96}
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLM(str(ckpt), **{**args, **kw})


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_plain: dict[tuple[Path, str], tuple[list[list[int]], list[list[int]]]] = {}


def plain(ckpt: Path, args: str) -> tuple[list[list[int]], list[list[int]]]:
    """Plain decoding's (greedy, seeded) outputs, once per checkpoint and engine arguments."""
    if (ckpt, args) not in _plain:
        llm = make(ckpt, **ENGINE_ARGS[args])
        _plain[(ckpt, args)] = (run(llm, GREEDY), run(llm, SEEDED))
    return _plain[(ckpt, args)]


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding-window (hash-routed), CSA and HCA layers; a random MTP layer, sliding window only
    (as V4-Flash's)."""
    cfg = tiny_v4_config(sliding_window=WINDOW)
    return write_random_v4_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt", cfg, seed=3)


@pytest.fixture(scope="module", params=["compressed_sparse_attention", "heavily_compressed_attention"])
def mirrored(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CSA (hash-routed) or HCA layer and an MTP layer of the same type that mostly drafts
    what the model samples."""
    kind = request.param
    mlp = "hash_moe" if kind == "compressed_sparse_attention" else "moe"
    root = tmp_path_factory.mktemp(kind) / "ckpt"
    return write_mirrored_v4_mtp_checkpoint(
        root, seed=5, sliding_window=WINDOW, layer_types=[kind], mlp_layer_types=[mlp]
    )


@pytest.mark.parametrize("args", list(ENGINE_ARGS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_outputs_equal_plain_decoding(v4: Path, k: int, args: str) -> None:
    """Drafts (all but always rejected) verified over the ring and entry caches: plain
    decoding's tokens, greedy and seeded; every block returned."""
    spec = make(v4, k, **ENGINE_ARGS[args])
    assert (run(spec, GREEDY), run(spec, SEEDED)) == plain(v4, args)
    engine = spec.llm_engine
    assert engine.num_draft_tokens > 0 and engine.speculative is not None
    assert engine.worker.mtp_caches and all_blocks_free(spec)
    if args == "preempting":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("args", ["whole", "preempting"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accepted_drafts(mirrored: Path, k: int, args: str) -> None:
    """The mirrored MTP layer's drafts are mostly accepted, some rejected (its own compressed
    caches rolled back with the model's): plain decoding's tokens, in fewer steps."""
    spec = make(mirrored, k, **ENGINE_ARGS[args])
    assert (run(spec, GREEDY), run(spec, SEEDED)) == plain(mirrored, args)
    engine = spec.llm_engine
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    assert all_blocks_free(spec)
    if args == "preempting":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("args", ["whole", "chunked"])
def test_mtp_drafts_through_step_scratch(mirrored: Path, args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MTP head's pass over a prefill chunk longer than the ring takes in place goes through
    step scratch as the model's forward does: every draft (tokens and confidences) equals that of
    an engine whose ring is long enough for every step to be written in place. Eager steps, so
    that the proposer drafts over host-built spans at every step (tests/test_v4_spec_graphs.py
    covers the verification graphs)."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    def drafts(llm: LLM) -> tuple[list[Any], int]:
        worker = llm.llm_engine.worker
        seen: list[Any] = []
        real = worker.propose

        def spy(*a: Any) -> Any:
            out = real(*a)
            seen.append(out)
            return out

        worker.propose = spy  # type: ignore[method-assign]
        run(llm, GREEDY)
        ring = llm.llm_engine.worker.inputs.ring
        assert ring is not None
        return seen, ring.step_tokens

    k = 3
    with_scratch, step_tokens = drafts(make(mirrored, k, enforce_eager=True, **ENGINE_ARGS[args]))
    assert step_tokens < max(map(len, PROMPTS)) // 2
    real_groups = DeepseekV4ForCausalLM.kv_cache_groups
    monkeypatch.setattr(
        DeepseekV4ForCausalLM, "kv_cache_groups",
        lambda self, bs, backtrack=0, mtp=0: real_groups(self, bs, backtrack + 96, mtp),
    )  # fmt: skip
    in_place, step_tokens = drafts(make(mirrored, k, enforce_eager=True, **ENGINE_ARGS[args]))
    assert step_tokens >= 96  # every step in place
    assert len(with_scratch) >= 5
    for a, b in zip(with_scratch, in_place, strict=True):
        assert [[t for t, _ in d] for d in a] == [[t for t, _ in d] for d in b]
        assert [c for d in a for _, c in d] == pytest.approx([c for d in b for _, c in d], rel=1e-4)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_rejections_at_the_ring_edge(tmp_path: Path, eager: bool) -> None:
    """Window 9, k = 3, 4-token steps: a ring of 12 rows = window + k, the fewest that hold a
    verification step's 1 + k rows beside its first query's window. The row of a step's last
    draft replaces the one just outside that window; drafts are rejected at many offsets in the
    ring (across its wrap too), and the outputs are plain decoding's, in eager steps and in
    verification graphs (chained: their drafts known when the step before is read)."""
    window, k = 9, 3
    ckpt = write_mirrored_v4_mtp_checkpoint(
        tmp_path / "ckpt", seed=5, sliding_window=window, layer_types=["compressed_sparse_attention"]
    )
    want = run(make(ckpt, max_num_batched_tokens=1 + k), GREEDY)
    spec = make(ckpt, k, max_num_batched_tokens=1 + k, enforce_eager=eager)
    engine = spec.llm_engine
    assert engine.worker.kv_groups is not None
    ring = engine.worker.kv_groups[0].ring_blocks * 4
    assert ring == window + k
    decoder = engine.speculative
    assert decoder is not None
    real_process = decoder.process
    seen: list[tuple[int, int, int]] = []  # (first position, drafts, accepted) per verification

    def process(done):  # type: ignore[no-untyped-def]
        if isinstance(done, EagerStep):
            steps = list(zip(done.batch.seqs, done.starts, done.batch.num_draft_tokens))
        else:  # a verification graph step: its requests' progress is counted as it is processed
            steps = [(s, s.num_computed_tokens, nd) for s, nd in zip(done.seqs, done.num_drafts)]
        finished = real_process(done)
        seen.extend((start, nd, s.num_computed_tokens - start - 1) for s, start, nd in steps if nd)
        return finished

    decoder.process = process  # type: ignore[method-assign]
    assert run(spec, GREEDY) == want
    assert (decoder.num_graph_steps > 0) != eager
    rejected = [(start, nd) for start, nd, a in seen if a < nd]
    full = [start for start, nd in rejected if nd == k]  # the last draft's row: start - window
    assert len(full) >= 10 and any(start % ring + k >= ring for start in full), "none wraps the ring"
    assert any(a > 0 for _, _, a in seen)


def test_compressed_entries_after_rejected_drafts(v4: Path) -> None:
    """Steps whose drafts cross compression boundaries (CSA every 4, HCA every 8 positions),
    then roll back: the entries, indexer keys and logits at the verified positions equal those
    of plain decoding, one token per step."""
    backend = create_reference_backend()
    model: Any = load_model(v4, backend)
    prompt, tokens = PROMPTS[2][:21], [7, 8, 9, 10, 11, 12, 13]  # positions 21..27
    # (tokens fed, accepted): 21 [t, w, w, w] a=0; 22 [t, t, t, w] a=2; 25 [t, t, t]
    steps = [([7, 99, 98, 97], 0), ([8, 9, 10, 96], 2), ([11, 12, 13], 2)]
    spec, ref = PagedRunner(model, backend, seed=1), PagedRunner(model, backend, seed=2)
    spec.step([(0, prompt)])
    ref.step([(0, prompt)])
    got, want = [], []
    for fed, accepted in steps:
        logits = spec.step([(0, fed)], all_logits=True)
        got.append(logits[: accepted + 1])
        spec.alloc.requests[0].length -= len(fed) - accepted - 1  # the rejected drafts' rows
    for t in tokens:
        want.append(ref.step([(0, [t])]))
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=1e-5, atol=1e-5)
    end = len(prompt) + len(tokens)

    def rows(runner: PagedRunner, layer: int, kind: str, count: int) -> torch.Tensor:
        first, last, width = model._slices[layer][kind]
        blocks = runner.alloc.requests[0].blocks
        slots = torch.tensor([blocks[w // 4] * 4 + w % 4 for w in range(count)])
        return WideCache(runner.kv_caches[first:last], width).read(backend, slots)

    for layer, ratio in enumerate(model.v4.compress_ratios):
        for kind in ("compressed", "index_keys"):
            if kind in model._slices[layer]:
                a, b = rows(spec, layer, kind, end // ratio), rows(ref, layer, kind, end // ratio)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mtp_layer_loads_and_is_refused_where_unsupported(v4: Path, tmp_path: Path) -> None:
    """DeepSeek's names without the `model.` prefix (embed.weight, layers.{i}, mtp.0) load the
    same MTP layer; an MTP layer of a compression ratio no model layer has is refused."""
    from safetensors.torch import load_file, save_file

    renamed = {}
    for name, t in load_file(v4 / "model.safetensors").items():
        name = name.replace("model.embed_tokens.", "embed.").replace("model.hc_head.hc_", "hc_head_")
        renamed[name.removeprefix("model.")] = t
    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((v4 / "config.json").read_text())
    backend = create_reference_backend()
    logits = []
    for root in (v4, tmp_path):
        model: Any = load_model(root, backend)
        assert model.num_mtp_layers == 1
        logits.append(mtp_logits(model, PROMPTS[3]))
    assert torch.equal(logits[0], logits[1])
    types = ["sliding_attention", "compressed_sparse_attention"]  # the MTP layer's: CSA
    cfg = tiny_v4_config(num_hidden_layers=1, layer_types=types)
    with pytest.raises(NotImplementedError, match="MTP layer of compression ratio 4"):
        write_random_v4_checkpoint(tmp_path / "refused", cfg)


def test_mtp_layer_types_from_the_config() -> None:
    """The MTP layer's type: the entry past num_hidden_layers where the config lists one
    (DeepSeek's compress_ratios, or layer_types), else sliding window only; its routing too."""
    flash = Path(__file__).resolve().parents[1] / "model" / "deepseek-v4-flash" / "config.json"
    v4 = ModelConfig.from_file(flash).v4
    assert v4 is not None and v4.mtp_compress_ratios == (0,) and v4.mtp_hash_layers == (False,)
    raw = {k: v for k, v in tiny_v4_config().items() if k not in ("layer_types", "mlp_layer_types")}
    cfg = ModelConfig.from_dict(raw | {"compress_ratios": [0, 4, 8, 8], "num_hash_layers": 4}).v4
    assert cfg is not None and cfg.compress_ratios == (0, 4, 8) and cfg.mtp_compress_ratios == (8,)
    assert cfg.mtp_hash_layers == (True,)


def mtp_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 0 .. n - 2 (tokens 1 .. n - 1 and the model's streams
    at positions 0 .. n - 2), over fresh caches paged by one block table."""
    backend = model.backend
    runner = PagedRunner(model, backend, num_blocks=32)
    runner.step([(0, tokens)], all_logits=True)
    assert runner.last_hidden is not None
    ratio = model.v4.mtp_compress_ratios[0]
    count = sum(WideCache.count(w, model.v4.head_dim) for _, w in cache_kinds(model.config, ratio))
    caches = backend.kv_cache.allocate(model.kv_cache_spec(32, 4), count)
    device = backend.device.device()
    batch = build_batch(BlockAllocator(32, 4, seed=1), [(0, tokens[1:])], device, all_logits=True)
    with torch.inference_mode():
        streams = model.forward_mtp(batch, runner.last_hidden[:-1], caches)
        out: torch.Tensor = model.compute_mtp_logits(streams)
    return out


@pytest.mark.parametrize(
    "kind,mlp",
    [
        ("sliding_attention", "hash_moe"),
        ("compressed_sparse_attention", "moe"),
        ("heavily_compressed_attention", "moe"),
    ],
)
def test_mtp_logits_match_transformers_decoder_layer(kind: str, mlp: str, tmp_path: Path) -> None:
    """The MTP layer against DeepSeek's MTPBlock (inference/model.py) built from transformers'
    DeepseekV4 modules on the same weights: its block is transformers' decoder layer (saved
    as layer num_hidden_layers of a model one layer deeper), the rest DeepSeek's formula:
    e_proj(enorm(embed(t+1))) + h_proj(hnorm(streams)) -> block -> hc_head -> norm -> head."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    fields = parity_config("v4-swa-csa-hca-hash")
    n, dm, hc = fields["num_hidden_layers"], fields["hidden_size"], fields["hc_mult"]
    deeper = fields | {
        "num_hidden_layers": n + 1,
        "layer_types": [*fields["layer_types"], kind],
        "mlp_layer_types": [*fields["mlp_layer_types"], mlp],
    }
    hf = build_hf_v4(deeper, seed=5)
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(9)
    extra = {  # the MTP layer's own tensors, DeepSeek's names
        "enorm.weight": 1 + 0.3 * torch.randn(dm, generator=gen),
        "hnorm.weight": 1 + 0.3 * torch.randn(dm, generator=gen),
        "norm.weight": 1 + 0.3 * torch.randn(dm, generator=gen),
        "e_proj.weight": torch.randn(dm, dm, generator=gen) / dm**0.5,
        "h_proj.weight": torch.randn(dm, dm, generator=gen) / dm**0.5,
        "hc_head_fn": 0.3 * torch.randn(hc, hc * dm, generator=gen),
        "hc_head_base": 0.5 * torch.randn(hc, generator=gen),
        "hc_head_scale": 0.5 * torch.randn(1, generator=gen),
    }
    state = load_file(tmp_path / "model.safetensors")
    state.update({f"model.layers.{n}.{name}": t for name, t in extra.items()})
    save_file(state, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"num_hidden_layers": n, "num_nextn_predict_layers": 1}  # layer n: the MTP layer's
    (tmp_path / "config.json").write_text(json.dumps(config))

    ids = torch.randint(1, fields["vocab_size"], (1, 40), generator=gen)
    m = hf.model

    def layers(blocks: Any, streams: torch.Tensor, embedded: torch.Tensor, tokens: torch.Tensor) -> Any:
        pos = torch.arange(tokens.shape[1])[None]
        cache = DynamicCache(config=hf.config)
        # the cache positionally: transformers 5.24 names it `cache`, 5.17 `past_key_values`
        mask = create_sliding_window_causal_mask(hf.config, embedded, None, cache, position_ids=pos)
        rope = {
            name: m.rotary_emb(embedded, position_ids=pos, layer_type=name) for name in ("main", "compress")
        }
        for block in blocks:
            streams = block(
                streams, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=tokens,
                cache=cache,
            )  # fmt: skip
        return streams

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fields.get("rms_norm_eps", 1e-6)) * w

    with torch.no_grad():
        embedded = m.embed_tokens(ids)
        expanded = embedded[:, :, None].expand(-1, -1, hc, -1).contiguous()
        streams = layers(m.layers[:n], expanded, embedded, ids)
        e = m.embed_tokens(ids[:, 1:])
        x = (rms(e, extra["enorm.weight"]) @ extra["e_proj.weight"].T)[:, :, None]
        x = x + rms(streams[:, :-1], extra["hnorm.weight"]) @ extra["h_proj.weight"].T
        out = layers(m.layers[n:], x, e, ids[:, 1:])
        head = DeepseekV4HyperHead(hf.config)
        for part in ("fn", "base", "scale"):
            getattr(head, f"hc_{part}").copy_(extra[f"hc_head_{part}"])
        want = hf.lm_head(rms(head(out), extra["norm.weight"]))[0]

    model: Any = load_model(tmp_path, create_reference_backend())
    assert model.num_mtp_layers == 1 and model.v4.mtp_compress_ratios[0] == model.mtp[0].block.ratio
    torch.testing.assert_close(mtp_logits(model, ids[0].tolist()), want, rtol=1e-5, atol=1e-5)

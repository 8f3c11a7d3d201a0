"""DeepSeek-V4's decode step does its index work once per step, not per layer: the torch ops the
model itself issues in one decode forward (not those inside backend ops) are counted on the CPU
with a dispatch trace (tiny random V4, reference backend, three HCA layers and a CSA one as
bench/bench_e2e_v4.py's 4-layer V4-Flash). The entries closing in the step, their state, entry
and index-key slots come from one kv_cache.compressed_entries call per compression ratio (a
kernel of the cuda backend), so the model computes no integer tensor itself but the hash
layers' expert ids; each layer issues only a few elementwise ops of its own (the rope tails
are small.rope_tail calls, the compressors' [kv | gate] one GEMM, which gives the two GEMMs'
tokens)."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepinfer import LLM, SamplingParams, envs
from deepinfer.models.deepseek_v4 import Compressor
from deepinfer.models.forward_batch import ForwardBatch
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint

MODELS = str(Path(__file__).resolve().parents[1] / "deepinfer" / "models")
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty"}
# per layer, the most ops the model's own code may issue (device kernels outside backend ops):
# HCA: the MoE's routed + shared add, and the hash layer's expert-id gather; CSA: its two
# compressors' overlapping windows (two cats each), the indexer's weights (cast, scale) and the
# MoE's add.
BUDGET = {"heavily_compressed_attention": 2, "compressed_sparse_attention": 7}


class ModelOps(TorchDispatchMode):
    """Records (layer, op, result dtype) of every op whose innermost caller outside torch is
    the model code and that computes something (a view, an alias or an empty tensor does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = -1  # the block running (-1: before the first, after the last)
        self.ops: list[tuple[int, str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        site = next(
            (f.filename for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename), ""
        )
        if not site.startswith(MODELS) or name in NO_KERNEL:
            return out
        ins = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name.endswith("_") or any(t.untyped_storage().data_ptr() not in ins for t in outs):
            self.ops.append((self.layer, name, outs[0].dtype if outs else None))
        return out


def test_decode_forward_index_work_is_per_step(tmp_path: Path) -> None:
    types = ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention"]
    raw = tiny_v4_config(
        num_hidden_layers=4, layer_types=types, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        max_position_embeddings=128,
    )  # fmt: skip
    root = write_random_v4_checkpoint(tmp_path / "v4", raw)
    llm = LLM(str(root), backend="reference", dtype="float32", block_size=4, max_model_len=64,
              max_num_batched_tokens=64, max_num_seqs=2)  # fmt: skip
    model = llm.llm_engine.model
    trace = ModelOps()
    hooks = [
        block.register_forward_pre_hook(lambda _m, _a, i=i: setattr(trace, "layer", i))
        for i, block in enumerate(model.layers)
    ]
    kv = model.backend.kv_cache
    entry_calls: list[int] = []
    real_entries, real_forward = kv.compressed_entries, model.forward
    traced: list[list[int]] = []  # the ratios compressed_entries was called for, in the traced step

    def entries(*args: Any, **kwargs: Any) -> Any:
        entry_calls.append(kwargs["ratio"])
        return real_entries(*args, **kwargs)

    def forward(batch: ForwardBatch, caches: Any) -> torch.Tensor:
        if not batch.attn.is_decode_only or traced:
            return real_forward(batch, caches)
        entry_calls.clear()
        trace.layer = -1
        with trace:
            out: torch.Tensor = real_forward(batch, caches)
        traced.append(list(entry_calls))
        return out

    kv.compressed_entries = entries  # type: ignore[method-assign]
    model.forward = forward  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(2, 30))}], params, use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    assert traced, "no decode step ran"
    assert sorted(traced[0]) == [4, 8], "the closing entries once per compression ratio, not per layer"
    integer = [op for op in trace.ops if op[2] is not None and not op[2].is_floating_point]
    # the hash layer's tid2eid[input_ids] alone: no slot or position arithmetic in the model
    assert [(layer, name) for layer, name, _ in integer] == [(0, "index")], integer
    per_layer = Counter(layer for layer, _, _ in trace.ops)
    for i, kind in enumerate(types):
        assert per_layer[i] <= BUDGET[kind], (i, kind, [op for op in trace.ops if op[0] == i])
    # outside the layers: the embedding and the streams' copy of it
    assert per_layer[-1] <= 2, [op for op in trace.ops if op[0] == -1]


def test_compressor_projections_in_one_gemm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compressors' wkv and wgate as one GEMM (Compressor.kv_gate) give the two GEMMs'
    greedy tokens and log-probabilities (float32 rounding); DEEPINFER_MODEL_UNFUSED=compressor
    keeps them apart."""
    root = write_random_v4_checkpoint(tmp_path / "v4", tiny_v4_config(max_position_embeddings=128))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 120 + 2 for i in range(n)]} for j, n in enumerate((19, 7))]
    runs = {}
    for unfused in ("", "compressor"):
        monkeypatch.setenv(envs.MODEL_UNFUSED.name, unfused)
        llm = LLM(str(root), backend="reference", dtype="float32", block_size=4, max_model_len=64)
        compressors = [m for m in llm.llm_engine.model.modules() if isinstance(m, Compressor)]
        assert compressors and all((m.kv_gate is None) == bool(unfused) for m in compressors)
        res = llm.generate(prompts, params, use_tqdm=False)
        runs[unfused] = [
            (
                list(r.outputs[0].token_ids),
                [next(iter(lp.values())).logprob for lp in r.outputs[0].logprobs or []],
            )
            for r in res
        ]
    for (tokens, lps), (tokens_u, lps_u) in zip(runs[""], runs["compressor"]):
        assert tokens == tokens_u
        assert lps and torch.allclose(torch.tensor(lps), torch.tensor(lps_u), atol=1e-5, rtol=0)

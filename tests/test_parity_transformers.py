"""Logit parity with transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM on the same weights.

Each tiny config in model/parity/ is built at random with transformers, saved with save_pretrained
and loaded by deepinfer on the reference backend (float32). The oracle is transformers' forward
over prompt + its own 32 greedy tokens (generate, do_sample=False); deepinfer must match it
  - prefill in one pass (every row),
  - prefill in chunks over the paged cache (every row),
  - 16 batched decode steps (relative error <= 1e-4 per request and step),
and produce the same 32 greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import build_hf_model, max_abs, parity_config, rel_err

from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.paged_runner import PagedRunner

pytest.importorskip("transformers")

CONFIGS = [
    "v2-lite-like",
    "v2-group-limited",
    "v3-qlora-groups",
    "v3-nolora-one-group",
    "v3-no-dense-default-rope",
]
PROMPT_LENS = (5, 12, 19)
NEW_TOKENS = 32
DECODE_LOGIT_STEPS = 16
RTOL = 1e-4


class Case:
    """A saved transformers model, its deepinfer twin and transformers' outputs."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        cfg = parity_config(name)
        hf = build_hf_model(cfg, seed=CONFIGS.index(name))
        hf.save_pretrained(root)
        self.backend = create_reference_backend()
        self.model = load_model(root, self.backend)
        gen = torch.Generator().manual_seed(123)
        self.prompts = {
            rid: torch.randint(2, cfg["vocab_size"], (n,), generator=gen).tolist()
            for rid, n in enumerate(PROMPT_LENS)
        }
        self.generated: dict[int, list[int]] = {}
        self.full_logits: dict[int, torch.Tensor] = {}  # (L + NEW_TOKENS - 1, V) for each request
        with torch.no_grad():
            for rid, p in self.prompts.items():
                ids = torch.tensor([p])
                out = hf.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,  # run all 32 steps; the eos logit is left as it is
                    pad_token_id=0,
                )
                self.generated[rid] = out[0, len(p) :].tolist()
                self.full_logits[rid] = hf(out[:, :-1]).logits[0].float()


@pytest.fixture(scope="module", params=CONFIGS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def _report(record: Any, label: str, errors: list[tuple[float, float]]) -> None:
    worst_rel = max(e[0] for e in errors)
    worst_abs = max(e[1] for e in errors)
    print(f"\n{label}: max rel {worst_rel:.2e}, max abs {worst_abs:.2e}")
    record(label, f"rel={worst_rel:.3e} abs={worst_abs:.3e}")


def test_prefill_one_pass(case: Case, record_property: Any) -> None:
    runner = PagedRunner(case.model, case.backend, num_blocks=64, block_size=4)
    logits = runner.step(list(case.prompts.items()), all_logits=True)
    errors, start = [], 0
    for rid, p in case.prompts.items():
        got, want = logits[start : start + len(p)], case.full_logits[rid][: len(p)]
        start += len(p)
        errors.append((rel_err(got, want), max_abs(got, want)))
        assert errors[-1][0] <= RTOL, f"request {rid}: relative error {errors[-1][0]:.2e}"
    _report(record_property, f"{case.name} prefill_one_pass", errors)


def test_prefill_chunked(case: Case, record_property: Any) -> None:
    """Chunks of 3, 4 and 5 tokens (one size per request), several requests per step, so every
    chunk after the first attends to a cached prefix spread over non-contiguous blocks."""
    runner = PagedRunner(case.model, case.backend, num_blocks=64, block_size=4, seed=7)
    done = dict.fromkeys(case.prompts, 0)
    rows: dict[int, list[torch.Tensor]] = {rid: [] for rid in case.prompts}
    while any(done[r] < len(p) for r, p in case.prompts.items()):
        chunks = []
        for rid, p in case.prompts.items():
            if done[rid] < len(p):
                size = 3 + rid
                chunks.append((rid, p[done[rid] : done[rid] + size]))
                done[rid] += len(chunks[-1][1])
        logits = runner.step(chunks, all_logits=True)
        start = 0
        for rid, toks in chunks:
            rows[rid].append(logits[start : start + len(toks)])
            start += len(toks)
    errors = []
    for rid, p in case.prompts.items():
        got, want = torch.cat(rows[rid]), case.full_logits[rid][: len(p)]
        errors.append((rel_err(got, want), max_abs(got, want)))
        assert errors[-1][0] <= RTOL, f"request {rid}: relative error {errors[-1][0]:.2e}"
    _report(record_property, f"{case.name} prefill_chunked", errors)


def test_decode_and_greedy(case: Case, record_property: Any) -> None:
    """Batched prefill, then greedy decode (one token per request per step) for 32 tokens; the
    first 16 decode steps' logits are compared with transformers'."""
    runner = PagedRunner(case.model, case.backend, num_blocks=64, block_size=4, seed=3)
    logits = runner.step(list(case.prompts.items()))
    tokens = {rid: [int(t)] for rid, t in zip(case.prompts, logits.argmax(-1).tolist())}
    errors = []
    for step in range(1, NEW_TOKENS):
        logits = runner.step([(rid, toks[-1:]) for rid, toks in tokens.items()])
        assert runner.last_batch is not None and runner.last_batch.attn.is_decode_only
        for i, rid in enumerate(tokens):
            if step <= DECODE_LOGIT_STEPS:
                want = case.full_logits[rid][len(case.prompts[rid]) + step - 1]
                errors.append((rel_err(logits[i], want), max_abs(logits[i], want)))
                assert errors[-1][0] <= RTOL, (
                    f"request {rid}, decode step {step}: rel error {errors[-1][0]:.2e}"
                )
            tokens[rid].append(int(logits[i].argmax()))
    _report(record_property, f"{case.name} decode", errors)
    for rid in case.prompts:
        assert tokens[rid] == case.generated[rid], f"request {rid}: greedy tokens differ from transformers"

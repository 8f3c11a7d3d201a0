"""A tiny DeepSeek model end to end on the backend under test: prefill (chunked), decode, greedy.

The model is a random checkpoint written with DeepSeek's tensor names (no transformers needed),
loaded once on the backend under test in each claimed dtype and once on the reference backend in
float64 (the oracle). Both run the same steps over their own paged caches: a two-request prefill
split into chunks (the second chunk attends to the cached prefix), then decode steps with one
token per request (the decode attention op), teacher-forced with the oracle's greedy tokens.

Budget: a whole model is a chain of ops, each allowed the per-op tolerance of its dtype
(deepinfer.testing.tolerances, with the FP8 activation budget for FP8 checkpoints); along the
residual stream their errors add, roughly once per sublayer. The tiny model has 2 layers = 4
sublayers, so logits get MODEL_DEPTH x the per-op budget (measured on the reference backend:
bfloat16 1.3x, float16 0.9x, float32 < 0.01x the per-op budget), elementwise and, for FP8, in
relative L2 per step.

A failure names the first op whose output diverges: both runs again with every op call recorded,
compared call by call with the same budget (deepinfer.testing.op_trace).

Router near-ties are not errors: a token whose expert choice is within ROUTER_MARGIN of flipping
(in the oracle's selection scores) may legitimately pick another expert at lower precision. The
tiny model's only MoE layer is its last layer, so such a flip changes that token's logits alone;
those rows are left out (and must be few). FP8 runs move selection scores further (activation
rounding, ~0.025), so the FP8 model routes every token to all of its 4 experts: no choice, no
tie. Greedy tokens must match the oracle's wherever the oracle's top-2 margin exceeds twice the
budget (closer calls are ties at this precision).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import RouterConfig
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint
from deepinfer.testing.helpers import router_margin
from deepinfer.testing.op_trace import first_divergence, recording
from deepinfer.testing.paged_runner import PagedRunner
from deepinfer.testing.plugin import skip_not_applicable
from deepinfer.testing.tolerances import Tolerance, tolerance

MODEL_DEPTH = 4
ROUTER_MARGIN = 0.05
PROMPTS = {0: [3, 17, 42, 5, 99, 64, 7, 11, 23], 1: [88, 2, 61, 30, 9, 120, 45, 77, 12, 8, 19, 33, 71]}
CHUNK = 5
DECODE_STEPS = 6
BLOCK_SIZE = 4


def _model_tolerance(dtype: torch.dtype, fp8: bool) -> Tolerance:
    t = tolerance(dtype, fp8)
    l2 = None if t.rel_l2 is None else t.rel_l2 * MODEL_DEPTH
    return replace(t, atol=t.atol * MODEL_DEPTH, rtol=t.rtol * MODEL_DEPTH, rel_l2=l2)


def _run(
    model: DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM,
    backend: Backend,
    forced: list[dict[int, int]] | None,
) -> tuple[list[torch.Tensor], list[dict[int, int]]]:
    """Chunked prefill (logits of every row), then DECODE_STEPS decode steps feeding `forced`
    tokens (request -> token), or the greedy tokens when None. -> (float64 CPU logits per step,
    the tokens fed)."""
    runner = PagedRunner(model, backend, num_blocks=32, block_size=BLOCK_SIZE, seed=11)
    out: list[torch.Tensor] = []
    last: dict[int, torch.Tensor] = {}
    for start in range(0, max(map(len, PROMPTS.values())), CHUNK):
        chunks = [(r, p[start : start + CHUNK]) for r, p in PROMPTS.items() if start < len(p)]
        logits = runner.step(chunks, all_logits=True).double().cpu()
        out.append(logits)
        row = 0
        for r, toks in chunks:
            row += len(toks)
            last[r] = logits[row - 1]
    fed: list[dict[int, int]] = []
    for s in range(DECODE_STEPS):
        tokens = forced[s] if forced is not None else {r: int(v.argmax()) for r, v in last.items()}
        fed.append(tokens)
        logits = runner.step([(r, [t]) for r, t in tokens.items()]).double().cpu()
        assert runner.last_batch is not None and runner.last_batch.attn.is_decode_only
        out.append(logits)
        last = {r: logits[i] for i, r in enumerate(tokens)}
    return out, fed


def _check(backend: Backend, dtype: torch.dtype, root: Path, fp8: bool) -> None:
    reference = create_reference_backend()
    margins: list[torch.Tensor] = []  # one (rows,) tensor per step: the oracle's router margins
    route = reference.moe.route

    def recording_route(
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        margins.append(router_margin(logits, config, correction_bias))
        return route(logits, config, correction_bias, hash_ids)

    reference.moe.route = recording_route  # type: ignore[method-assign]
    oracle = load_model(root, reference, dtype=torch.float64)
    assert sum(hasattr(layer.mlp, "router") for layer in oracle.layers) == 1  # only the last layer
    assert hasattr(oracle.layers[-1].mlp, "router")
    expected, fed = _run(oracle, reference, None)
    actual, _ = _run(load_model(root, backend, dtype=dtype), backend, fed)  # teacher-forced
    assert len(margins) == len(expected)
    tol = _model_tolerance(dtype, fp8)
    try:
        _compare(actual, expected, margins, tol, dtype)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; first op whose output diverges: {_first_op(root, backend, dtype, fed, tol)}"
        ) from None


def _compare(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    margins: list[torch.Tensor],
    tol: Tolerance,
    dtype: torch.dtype,
) -> None:
    num_prefill = len(actual) - DECODE_STEPS
    clear_rows = 0
    for i, (a, e, m) in enumerate(zip(actual, expected, margins)):
        what = f"prefill chunk {i}" if i < num_prefill else f"decode step {i - num_prefill}"
        rows = m > ROUTER_MARGIN
        a, e = a[rows], e[rows]
        clear_rows += int(rows.sum())
        if not len(e):
            continue
        _assert_within(a, e, tol, f"{what} logits ({dtype})")
        top2 = e.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (tol.atol + tol.rtol * top2[:, 0].abs())
        agree = a.argmax(-1) == e.argmax(-1)
        assert bool(agree[clear].all()), f"{what}: greedy token differs from the reference"
    total = sum(len(e) for e in expected)
    assert clear_rows >= 0.5 * total, f"only {clear_rows}/{total} rows are clear of router near-ties"


def _first_op(
    root: Path, backend: Backend, dtype: torch.dtype, fed: list[dict[int, int]], tol: Tolerance
) -> str:
    """After a failure: the same steps again on both backends, every op call recorded, and the
    first call whose output leaves the model budget (deepinfer.testing.op_trace)."""
    reference = create_reference_backend()
    oracle = load_model(root, reference, dtype=torch.float64)
    with recording(reference) as expected:
        _run(oracle, reference, fed)
    model = load_model(root, backend, dtype=dtype)
    with recording(backend) as actual:
        _run(model, backend, fed)
    return first_divergence(actual, expected, tol)


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> None:
    err = (actual - expected).abs()
    bound = tol.atol + tol.rtol * expected.abs()
    if (err > bound).any():
        raise AssertionError(
            f"{what}: {int((err > bound).sum())}/{err.numel()} elements outside atol={tol.atol:.3g} "
            f"rtol={tol.rtol:.3g}; max abs error {err.max().item():.3e}"
        )
    if tol.rel_l2 is not None:
        rel = (err.norm() / expected.norm()).item()
        assert rel <= tol.rel_l2, f"{what}: relative L2 error {rel:.3e} > {tol.rel_l2}"


def test_tiny_model(backend: Backend, dtype: torch.dtype, tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "tiny", seed=1)
    _check(backend, dtype, root, fp8=False)


@pytest.mark.usefixtures("fp8")
def test_tiny_model_fp8(backend: Backend, dtype: torch.dtype, tmp_path: Path) -> None:
    if dtype == torch.float64:
        skip_not_applicable("FP8 GEMMs produce float32 or narrower activations, not float64")
    config = tiny_config(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
    root = write_random_checkpoint(tmp_path / "tiny-fp8", config, seed=1, fp8=True)
    _check(backend, dtype, root, fp8=True)

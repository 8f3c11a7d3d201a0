"""A failing model-level case names the first op whose output diverges: planted errors in one op
of a reference backend, the tiny model's logits case run on it in this process, and the op and
call index it names checked against the reference's own trace of the same run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deepinfer.backend import NO_MODIFIERS, BackendOptions, SmallOps
from deepinfer.backend.ops import Backend
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import ReferenceAttention, create_reference_backend
from deepinfer.testing.checkpoints import write_random_checkpoint
from deepinfer.testing.conformance import test_model
from deepinfer.testing.op_trace import OpCall, first_divergence, recording
from deepinfer.testing.tolerances import tolerance


class AttentionScaleDoubled(ReferenceAttention):
    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):  # type: ignore[no-untyped-def]
        return super().prefill(q, cache, meta, scale=2 * scale, v_dim=v_dim, modifiers=modifiers)


class SiluSignFlipped(SmallOps):
    def silu_and_mul(self, x):  # type: ignore[no-untyped-def]
        return -super().silu_and_mul(x)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=1)


def reference_trace(root: Path) -> list[OpCall]:
    """The reference's recorded calls over the case's steps (greedy: the tokens the case feeds)."""
    reference = create_reference_backend()
    model = load_model(root, reference, dtype=torch.float64)
    with recording(reference) as calls:
        test_model._run(model, reference, None)
    return calls


def first_call(calls: list[OpCall], op: str) -> int:
    return next(c.index for c in calls if c.op == op)


@pytest.mark.parametrize(
    "part,planted,op",
    [
        ("attention", AttentionScaleDoubled, "attention.prefill"),
        ("small", SiluSignFlipped, "small.silu_and_mul"),
    ],
    ids=["attention", "silu"],
)
def test_model_failure_names_the_first_divergent_op(root: Path, part: str, planted: type, op: str) -> None:
    ref = create_reference_backend()
    backend: Backend = dataclasses.replace(ref, name="planted", **{part: planted(BackendOptions())})
    index = first_call(reference_trace(root), op)
    with pytest.raises(AssertionError) as exc:
        test_model._check(backend, torch.float32, root, fp8=False)
    msg = str(exc.value)
    assert "logits (torch.float32)" in msg, msg
    assert f"; first op whose output diverges: {op}, call {index} of the run (call 0 of {op})" in msg, msg


def test_the_traces_of_the_reference_agree_with_themselves(root: Path) -> None:
    """Two runs of the reference in float32 against its float64 run: no op leaves the budget, and
    both traces list the same calls."""
    expected = reference_trace(root)
    reference = create_reference_backend()
    model = load_model(root, reference, dtype=torch.float32)
    fed = [{r: int(t) for r, t in step.items()} for step in _fed(root)]
    with recording(reference) as actual:
        test_model._run(model, reference, fed)
    assert [c.op for c in actual] == [c.op for c in expected]
    tol = tolerance(torch.float32)
    assert first_divergence(actual, expected, tol).startswith("every op's output is within the budget over ")
    assert "attention.prefill" in {c.op for c in actual} and "moe.select_experts" in {c.op for c in actual}


def _fed(root: Path) -> list[dict[int, int]]:
    reference = create_reference_backend()
    _, fed = test_model._run(load_model(root, reference, dtype=torch.float64), reference, None)
    return fed


def test_v4_model_failure_names_the_first_divergent_op(tmp_path: Path) -> None:
    """The same for the tiny DeepSeek-V4 model (sliding-window attention, compressed attention,
    mHC, hash and routed MoE): its sliding-window attention's scale doubled."""
    from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint
    from deepinfer.testing.conformance import test_v4_ops

    config = tiny_v4_config(num_experts_per_tok=4, index_topk=16)
    root = write_random_v4_checkpoint(tmp_path / "tiny-v4", config, seed=3)
    trace: list[OpCall] = []
    test_v4_ops._run_v4(create_reference_backend(), root, torch.float64, trace)
    index = first_call(trace, "attention.prefill")
    ref = create_reference_backend()
    backend = dataclasses.replace(ref, name="planted", attention=AttentionScaleDoubled(BackendOptions()))
    with pytest.raises(AssertionError) as exc:
        test_v4_ops._check_v4(backend, root, torch.float32, tolerance(torch.float32))
    msg = str(exc.value)
    assert msg.startswith("step 0 (torch.float32): "), msg
    op = "attention.prefill"
    assert f"; first op whose output diverges: {op}, call {index} of the run (call 0 of {op})" in msg, msg

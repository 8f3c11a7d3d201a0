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

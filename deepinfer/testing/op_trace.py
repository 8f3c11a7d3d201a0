"""Per-op traces of a model run, to name the first op whose output leaves its budget.

A model-level case (the tiny model's logits) that fails says only that the logits are wrong. Run
the same steps again on the backend under test and on the float64 reference with every op they
are called through recorded (`recording`), and compare the two traces call by call
(`first_divergence`): the first call whose output misses the budget is where the error enters,
since every earlier output agreed. Only the calls the model makes are recorded, not the calls ops
make to each other (a backend's fused op and the reference's composite default are one call each),
so both traces list the same ops in the same order.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.testing.tolerances import Tolerance

# the parts whose ops a model computes with (device: streams, sync, memory; nothing to compare)
TRACED_PARTS = ("kv_cache", "attention", "gemm", "moe", "collectives", "small")
ROUTING_OPS = ("moe.route", "moe.select_experts")  # (weights, ids): pairs in any order per row


@dataclass
class OpCall:
    index: int  # its place among the run's recorded calls, from 0
    op: str  # "part.op", e.g. "attention.prefill"
    nth: int  # its place among this op's calls, from 0
    outputs: list[torch.Tensor]  # the tensors it returned, CPU copies (floats in float64)


def _op_names(part: object) -> list[str]:
    names = []
    for name in dir(type(part)):
        if name.startswith("_"):
            continue
        static = inspect.getattr_static(part, name)
        if isinstance(static, (property, staticmethod, classmethod)) or not inspect.isfunction(static):
            continue
        names.append(name)
    return names


def _copies(result: Any) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    out = []
    for t in items:
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu()
            out.append(t.double() if t.is_floating_point() else t.clone())
    return out


@contextmanager
def recording(backend: Backend) -> Iterator[list[OpCall]]:
    """Within the block, every call made to an op of `backend`'s traced parts from outside the
    backend is appended to the yielded list (an instance attribute wraps each op, removed after)."""
    calls: list[OpCall] = []
    counts: dict[str, int] = {}
    depth = [0]
    patched: list[tuple[object, str, Any]] = []

    def wrap(op: str, method: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                result = method(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # a call from the model, not from another op
                calls.append(OpCall(len(calls), op, counts.get(op, 0), _copies(result)))
                counts[op] = counts.get(op, 0) + 1
            return result

        return traced

    for part_name in TRACED_PARTS:
        part = getattr(backend, part_name)
        for name in _op_names(part):
            patched.append((part, name, part.__dict__.get(name)))
            setattr(part, name, wrap(f"{part_name}.{name}", getattr(part, name)))
    try:
        yield calls
    finally:
        for part, name, before in patched:
            if before is None:
                delattr(part, name)
            else:
                setattr(part, name, before)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().argsort(dim=-1)
    return weights.gather(-1, order), ids.long().gather(-1, order)


def _miss(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> tuple[float, tuple[int, ...]]:
    """(the largest error / budget, where): inf where one side is non-finite and the other not."""
    bound = tol.atol + tol.rtol * expected.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    ratio = ((actual - expected).abs() / bound).nan_to_num(float("inf"), posinf=float("inf"))
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    ratio = torch.where(same, 0.0, ratio)
    if ratio.numel() == 0:
        return 0.0, ()
    flat = int(ratio.flatten().argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    return float(ratio.flatten()[flat]), where


def first_divergence(actual: list[OpCall], expected: list[OpCall], tol: Tolerance) -> str:
    """The first call of `actual` whose output misses `tol` around the same call of `expected`
    (the k-th recorded call of both runs), in words."""
    for a, e in zip(actual, expected):
        if a.op != e.op:
            return f"the runs call different ops at call {a.index}: {a.op} here, {e.op} on the reference"
        outs_a, outs_e = a.outputs, e.outputs
        if a.op in ROUTING_OPS and len(outs_a) == len(outs_e) == 2:
            (wa, ia), (we, ie) = _by_expert(*outs_a), _by_expert(*outs_e)
            rows = (ia == ie).all(dim=-1)  # rows whose choice differs: a near tie, or the next op shows it
            outs_a, outs_e = [wa[rows]], [we[rows]]
        for k, (x, y) in enumerate(zip(outs_a, outs_e)):
            if not (x.is_floating_point() and y.is_floating_point()):
                continue
            where = f"{a.op}, call {a.index} of the run (call {a.nth} of {a.op})"
            if len(outs_a) > 1:
                where += f", output {k}"
            if x.shape != y.shape:
                return f"{where}: shape {tuple(x.shape)}, the reference's {tuple(y.shape)}"
            ratio, at = _miss(x, y, tol)
            if ratio > 1:
                return (
                    f"{where}: error {ratio:.3g}x the budget (atol={tol.atol:.3g} rtol={tol.rtol:.3g}), "
                    f"worst at index {at}: {x[at].item():.6g} vs the reference's {y[at].item():.6g}"
                )
    if len(actual) != len(expected):
        return f"no output leaves the budget, but the runs made {len(actual)} and {len(expected)} calls"
    return f"every op's output is within the budget over {len(actual)} calls: the error builds up across ops"

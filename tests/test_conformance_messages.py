"""Conformance failures say where: the worst element's place (request, query row, head for
attention), the count and first place of non-finite mismatches, the case's parameters; and the
run's verdict says whether it is green. (tests/test_conformance_mutations.py checks the same
through whole suite runs with planted bugs.)"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.backend.types import AttentionMetadata
from deepinfer.testing.helpers import attention_locator
from deepinfer.testing.plugin import verdict
from deepinfer.testing.tolerances import assert_bitwise_equal, assert_close, index_locator


def meta() -> AttentionMetadata:
    # request 0: 3 query rows at positions 7..9; request 1: none; request 2: 2 rows at 3..4
    return AttentionMetadata.build(torch.zeros((3, 2), dtype=torch.int32), [10, 4, 5], [3, 0, 2])


def test_worst_element_is_named_by_request_row_and_head() -> None:
    expected = torch.zeros((5, 2, 4), dtype=torch.float64)
    actual = expected.clone()
    actual[3, 1, 2] = 0.5  # request 2, its query row 0, head 1, column 2
    actual[4, 0, 0] = 0.01
    with pytest.raises(AssertionError) as exc:
        assert_close(
            actual,
            expected,
            torch.float32,
            what="decode",
            locate=attention_locator(meta()),
            case="window=4, sinks",
        )
    msg = str(exc.value)
    assert msg.startswith("decode (torch.float32; window=4, sinks): 2/40 elements outside")
    assert (
        "worst at request 2, query row 0 (position 3 of KV length 5), head 1, column 2: 0.5 vs expected 0"
        in msg
    )
    assert "the first at request 2, query row 0 (position 3 of KV length 5), head 1, column 2" in msg


def test_non_finite_mismatches_are_counted_and_placed() -> None:
    expected = torch.zeros((5, 2, 4), dtype=torch.float64)
    expected[0, 0, 0] = float("-inf")
    actual = expected.clone()
    actual[1, 1, :] = float("nan")  # request 0, row 1
    actual[4, 0, 3] = float("inf")
    actual[0, 0, 0] = 0.0  # finite where the reference is -inf
    with pytest.raises(AssertionError) as exc:
        assert_close(actual, expected, torch.bfloat16, what="prefill", locate=attention_locator(meta()))
    msg = str(exc.value)
    assert "4 element(s) NaN where the reference is finite, the first at request 0, query row 1 " in msg
    assert "(position 8 of KV length 10), head 1, column 0" in msg
    assert "1 element(s) inf where the reference is finite, the first at request 2, query row 1" in msg
    assert "1 element(s) differ where the reference is non-finite, the first at request 0, query row 0" in msg


def test_default_locator_and_named_axes() -> None:
    with pytest.raises(AssertionError, match=r"worst at index \(1, 2\): 1 vs expected 0"):
        assert_close(torch.tensor([[0.0, 0, 0], [0, 0, 1]]), torch.zeros(2, 3), torch.float32)
    where = index_locator((2, 3), ("row", "column"))
    with pytest.raises(AssertionError, match="worst at row 1, column 2"):
        assert_close(torch.tensor([[0.0, 0, 0], [0, 0, 1]]), torch.zeros(2, 3), torch.float32, locate=where)
    with pytest.raises(AssertionError, match=r"1/6 elements differ bitwise, the first at index \(0, 1\)"):
        assert_bitwise_equal(torch.tensor([[0.0, 1, 0], [0, 0, 0]]), torch.zeros(2, 3))


def test_within_budget_passes() -> None:
    e = torch.randn(4, 8, dtype=torch.float64)
    e[0, 0] = float("nan")
    assert_close(e + 1e-4, e, torch.float32)


@pytest.mark.parametrize(
    "counts,reasons,green,text",
    [
        (
            (10, 0, 0),
            ["backend 'x' does not claim FP8", "heavy case: run with ..."],
            True,
            "GREEN: 10 passed",
        ),
        ((10, 0, 0), ["not applicable: float64"], True, "1 not applicable"),
        ((10, 1, 0), [], False, "NOT GREEN: 1 failed"),
        ((10, 0, 2), [], False, "2 error(s)"),
        ((10, 0, 0), ["NOT CHECKED: collectives: gloo missing"], False, "1 NOT CHECKED"),
        ((10, 0, 0), ["needs a GPU"], False, "1 unexpected skip(s)"),
        ((0, 0, 0), ["backend 'x' does not claim torch.float16"], False, "nothing passed"),
    ],
)
def test_verdict(counts: tuple[int, int, int], reasons: list[str], green: bool, text: str) -> None:
    ok, line = verdict(*counts, reasons)
    assert ok is green and text in line, line


def test_dtype_restriction_deselects_and_is_named_in_the_verdict(tmp_path: Path) -> None:
    """--deepinfer-dtypes runs the dtype-parametrised cases of the listed dtypes only (the others
    deselected, cases without a dtype kept) and says so in the verdict; a bad list is a usage error."""
    args = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "deepinfer.testing.plugin",
        "--pyargs", "deepinfer.testing.conformance", "-k", "test_gemm and test_linear and not fp8",
    ]  # fmt: skip
    run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=tmp_path)
    res = run([*args, "--deepinfer-dtypes", "float32"])
    assert res.returncode == 0, res.stdout[-2000:]
    assert "(dtypes float32 only: --deepinfer-dtypes)" in res.stdout
    passed = int(re.search(r"(\d+) passed", res.stdout).group(1))  # type: ignore[union-attr]
    full = run(args)
    assert full.returncode == 0, full.stdout[-2000:]
    assert 0 < passed < int(re.search(r"(\d+) passed", full.stdout).group(1))  # type: ignore[union-attr]
    bad = run([*args, "--deepinfer-dtypes", "float8"])
    assert bad.returncode != 0 and "--deepinfer-dtypes 'float8'" in bad.stderr

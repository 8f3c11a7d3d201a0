"""Mutation tests of the conformance suite: the reference backend with one op subtly wrong must
FAIL the suite, and the unmutated reference must pass the same cases.

The mutants live in deepinfer.testing.mutants (shared with ci/mutation_run.py); each run selects
only the cases that concern it (-k): the whole module takes about 20 s on two idle cores.
"""

from __future__ import annotations

import pytest

from deepinfer.testing.mutants import MUTANT_LIST, MUTANTS_BY_NAME, failed_tests, run_suite


def test_the_reference_passes_the_cases_that_catch_the_mutants() -> None:
    code, output = run_suite("reference", " or ".join(f"({m.select})" for m in MUTANT_LIST))
    assert code == 0, output[-6000:]
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert "NOT CHECKED" not in output, output[-3000:]  # the collectives ran in two processes


@pytest.mark.parametrize("name", list(MUTANTS_BY_NAME))
def test_the_mutant_fails(name: str) -> None:
    mutant = MUTANTS_BY_NAME[name]
    code, output = run_suite(f"mutant-{name}", mutant.select)
    assert code == 1, f"mutant {name} was not caught (exit code {code}):\n{output[-6000:]}"
    failed = failed_tests(output)
    assert failed, output[-6000:]
    for test in mutant.caught_by:
        assert any(f"::{test}" in line for line in failed), f"{test} did not fail:\n" + "\n".join(failed)
    assert mutant.message in output, output[-6000:]
    for text in mutant.located:
        assert text in output, f"the failure message does not say {text!r}:\n{output[-6000:]}"

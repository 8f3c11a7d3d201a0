"""Mutation tests of the conformance suite: the reference backend with one op subtly wrong must
FAIL the suite, and the unmutated reference must pass the same cases. Engine mutants (a policy of
the engine broken) must fail the tests docs/policies.md names, which pass unmutated.

The mutants live in deepinfer.testing.mutants (shared with ci/mutation_run.py); each run selects
only the cases that concern it (-k), never the whole suite (docs/mutation.md: what that leaves
out, and the whole-suite runs measured).
"""

from __future__ import annotations

import pytest

from deepinfer.testing.mutants import (
    ENGINE_MUTANT_LIST,
    ENGINE_MUTANTS_BY_NAME,
    MUTANT_LIST,
    MUTANTS_BY_NAME,
    failed_tests,
    run_engine_tests,
    run_suite,
)


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


def test_the_unmutated_engine_passes_the_tests_that_catch_the_engine_mutants() -> None:
    tests = sorted({t for m in ENGINE_MUTANT_LIST for t in m.tests if t.startswith("tests/")})
    code, output = run_engine_tests(None, tuple(tests))
    assert code == 0, output[-6000:]


@pytest.mark.parametrize("name", list(ENGINE_MUTANTS_BY_NAME))
def test_the_engine_mutant_fails(name: str) -> None:
    mutant = ENGINE_MUTANTS_BY_NAME[name]
    code, output = run_engine_tests(name, mutant.tests)
    assert code == 1, f"engine mutant {name} was not caught (exit code {code}):\n{output[-6000:]}"
    failed = failed_tests(output)
    for test in mutant.caught_by:
        assert any(f"::{test}" in line for line in failed), f"{test} did not fail:\n" + "\n".join(failed)

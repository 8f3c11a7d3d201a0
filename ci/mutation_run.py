"""Run mutants (deepinfer.testing.mutants) against the tests that must catch them and print which
cases catch which mutant. Exit code 1 when some mutant is caught by no case (the suite has a blind
spot there), 0 when every mutant fails at least one case.

Backend mutants (the reference backend with one op wrong) run the conformance suite; engine
mutants (a policy of the engine broken) run deepinfer's own tests.

    python ci/mutation_run.py                       # every mutant, each on the cases that concern it
    python ci/mutation_run.py --mutant rms-eps -k rms_norm
    python ci/mutation_run.py -k "" --dtypes bfloat16   # backend mutants on the whole suite, bf16 only
    python ci/mutation_run.py --engine-tests "tests/test_scheduler.py tests/test_kv_cache.py"

Each mutant runs in a fresh pytest process (its cases spawn processes for the collectives).
docs/mutation.md lists what CI runs and the measured survivors.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from deepinfer.testing.mutants import (
    ENGINE_MUTANT_LIST,
    ENGINE_MUTANTS_BY_NAME,
    MUTANT_LIST,
    MUTANTS_BY_NAME,
    failed_case,
    failed_tests,
    run_engine_tests,
    run_suite,
)


def catching_cases(code: int, output: str) -> list[str] | None:
    """The cases that failed, or None when the suite did not run to a verdict (no case selected,
    a usage or collection error): such a run catches nothing."""
    if code not in (0, 1):
        return None
    return sorted({failed_case(line) for line in failed_tests(output)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    names = [*MUTANTS_BY_NAME, *ENGINE_MUTANTS_BY_NAME]
    parser.add_argument("--mutant", action="append", choices=names, help="only this mutant (repeatable)")
    parser.add_argument(
        "-k", dest="select", default=None, help='conformance cases for every backend mutant ("" every '
        "case); default: each mutant's own selection",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", default=None, help="backend mutants: only these dtypes' cases (--deepinfer-dtypes)"
    )
    parser.add_argument(
        "--engine-tests", default=None, help="engine mutants: these pytest arguments instead of each "
        "mutant's own tests (e.g. \"tests/test_scheduler.py\")",
    )  # fmt: skip
    args = parser.parse_args(argv)
    chosen = set(args.mutant or names)
    backend = [m for m in MUTANT_LIST if m.name in chosen]
    engine = [m for m in ENGINE_MUTANT_LIST if m.name in chosen]

    uncaught: list[str] = []
    width = max(len(n) for n in chosen) + 2
    print(f"{'mutant':<{width}}caught by")

    def report(name: str, code: int, output: str, what: str) -> None:
        cases = catching_cases(code, output)
        if not cases:
            uncaught.append(name)
            why = "no case failed" if cases is not None else f"the suite did not run (exit code {code})"
            cases = [f"NOT CAUGHT: {why} ({what})"]
        for i, case in enumerate(cases):
            print(f"{name if i == 0 else '':<{width}}{case}", flush=True)

    for mutant in backend:
        select = mutant.select if args.select is None else args.select
        code, output = run_suite(f"mutant-{mutant.name}", select, args.dtypes)
        report(
            mutant.name, code, output, f"-k {select!r}" + (f", dtypes {args.dtypes}" if args.dtypes else "")
        )
    for engine_mutant in engine:
        tests = engine_mutant.tests if args.engine_tests is None else tuple(shlex.split(args.engine_tests))
        code, output = run_engine_tests(engine_mutant.name, tests)
        report(engine_mutant.name, code, output, " ".join(tests))

    total = len(backend) + len(engine)
    print()
    if uncaught:
        print(f"{len(uncaught)} of {total} mutant(s) caught by no case: {', '.join(uncaught)}")
        return 1
    print(f"all {total} mutant(s) caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())

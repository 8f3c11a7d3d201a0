"""Run mutants of the reference backend (deepinfer.testing.mutants) against the conformance suite
and print which cases catch which mutant. Exit code 1 when some mutant is caught by no case (the
suite has a blind spot there), 0 when every mutant fails at least one case.

    python ci/mutation_run.py                       # every mutant, each on the cases that concern it
    python ci/mutation_run.py --mutant rms-eps -k rms_norm
    python ci/mutation_run.py -k ""                 # every mutant on the whole suite (slow)

Each mutant runs in a fresh pytest process (its cases spawn processes for the collectives).
"""

from __future__ import annotations

import argparse
import sys

from deepinfer.testing.mutants import MUTANT_LIST, MUTANTS_BY_NAME, failed_case, failed_tests, run_suite


def catching_cases(code: int, output: str) -> list[str] | None:
    """The cases that failed, or None when the suite did not run to a verdict (no case selected,
    a usage or collection error): such a run catches nothing."""
    if code not in (0, 1):
        return None
    return sorted({failed_case(line) for line in failed_tests(output)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--mutant", action="append", choices=list(MUTANTS_BY_NAME), help="only this mutant (repeatable)"
    )
    parser.add_argument(
        "-k", dest="select", default=None, help='cases to run for every mutant ("" every case); '
        "default: each mutant's own selection",
    )  # fmt: skip
    args = parser.parse_args(argv)
    mutants = [MUTANTS_BY_NAME[n] for n in args.mutant] if args.mutant else MUTANT_LIST

    uncaught: list[str] = []
    width = max(len(m.name) for m in mutants) + 2
    print(f"{'mutant':<{width}}caught by")
    for mutant in mutants:
        select = mutant.select if args.select is None else args.select
        code, output = run_suite(f"mutant-{mutant.name}", select)
        cases = catching_cases(code, output)
        if not cases:
            uncaught.append(mutant.name)
            why = "no case failed" if cases is not None else f"the suite did not run (exit code {code})"
            cases = [f"NOT CAUGHT: {why} (-k {select!r})"]
        for i, case in enumerate(cases):
            print(f"{mutant.name if i == 0 else '':<{width}}{case}", flush=True)

    print()
    if uncaught:
        print(f"{len(uncaught)} of {len(mutants)} mutant(s) caught by no case: {', '.join(uncaught)}")
        return 1
    print(f"all {len(mutants)} mutant(s) caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSeek-V4 parity fuzzing in CI: tests/fuzz_v4.py's fixed seeds (CI_SEEDS), each a random
valid config with prompts on its window and compression boundaries, run by three engines (whole
prefill, chunked, chunked with preemption) against transformers with a tie-stable indexer top-k.
Other seeds: `python tests/fuzz_v4.py --seeds 1000-1100`; a failure prints the case's JSON for
`python tests/fuzz_v4.py --replay FILE`."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_v4 import CI_SEEDS, make_case, report, run_case

pytest.importorskip("transformers")


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_v4_matches_transformers(seed: int, tmp_path: Path) -> None:
    result = run_case(make_case(seed), tmp_path)
    assert not result.divergences, report(result)

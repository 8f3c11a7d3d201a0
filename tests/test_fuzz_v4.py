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


def test_hca_ratio_above_max_model_len_with_graphs(tmp_path: Path) -> None:
    """An HCA ratio above max_model_len (V4-Flash's 128 with shorter requests) with decode graphs:
    its entries' block tables in a graph step have no column to index unless given one (a crash
    fuzz_v4 found, engine/inputs.py)."""
    case = make_case(0)
    case.config.pop("compress_ratios", None)
    case.config.update(
        layer_types=["sliding_attention", "heavily_compressed_attention"] * 2,
        num_hidden_layers=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    )
    case.config.pop("mlp_layer_types", None)
    case.engines = {"whole": case.engines["whole"]}
    case.engines["whole"]["llm"]["enforce_eager"] = False
    result = run_case(case, tmp_path)
    assert not result.divergences, report(result)

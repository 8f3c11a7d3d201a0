"""bench/bench_e2e_v4.py: its --smoke run on the CPU (tiny V4, reference backend, float32, batches 1
and 2) writes e2e_v4.json with a row per format and batch, and deepinfer's bf16-format tokens
equal transformers' greedy tokens (its indexer top-k made tie-stable, as deepinfer's contract
breaks exact ties); the roofline's cache-byte count on a hand-checked shape."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("e2e_v4")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_e2e_v4.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (out / "e2e_v4.md").read_text().count("| bf16 |") == 2
    doc: dict = json.loads((out / "e2e_v4.json").read_text())
    return doc


def test_rows_fields_and_formats(smoke: dict) -> None:
    rows = {(r["format"], r["batch"]): r for r in smoke["rows"]}
    assert sorted(rows) == [("bf16", 1), ("bf16", 2), ("fp8_fp4", 1), ("fp8_fp4", 2)]
    for (fmt, _), r in rows.items():
        for key in ("deepinfer_tok_s", "roofline_tok_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (fmt, key, r[key])
        if fmt == "bf16":
            assert math.isfinite(r["transformers_tok_s"]) and r["transformers_tok_s"] > 0
        else:
            assert "transformers_tok_s" not in r
        assert r["repeats"] == 3
    assert not smoke["errors"] or set(smoke["errors"]) == {"plot"}, smoke["errors"]


def test_bf16_tokens_equal_transformers_greedy(smoke: dict) -> None:
    """The same weights, float32, transformers' indexer top-k tie-stable: the same greedy tokens."""
    for r in smoke["rows"]:
        if r["format"] == "bf16":
            assert r["greedy_tokens_equal"] is True, r
    assert smoke["info"]["weights_unchanged"] is True


def test_formats_are_what_they_claim(smoke: dict) -> None:
    """fp8_fp4 reads fewer bytes, holds e4m3 linears and packed MXFP4 experts; the bf16 model's
    routed experts are transformers' own tensors."""
    mem, info = smoke["memory"], smoke["info"]
    assert 0 < mem["fp8_fp4_weight_bytes"] < mem["bf16_weight_bytes"]
    assert {"float8_e4m3fn", "uint8"} <= set(info["fp8_fp4_buffer_dtypes"])
    layers = smoke["info"]["reduced_config"]["num_hidden_layers"]
    assert info["bf16_experts_swapped"] == 2 * layers
    b = smoke["roofline_model"]["bytes"]
    assert b["fp8_fp4"]["expert"][0] < b["bf16"]["expert"][0] / 3


def test_cache_bytes_by_hand() -> None:
    """One CSA layer (m = 4, window 8, topk 2, D = 16, Di = 4) at length 13 in float32: window 8
    rows, 2 of 3 entries attended, 3 index keys, the pooled state 8 D + 8 Di; HCA (m = 8) at 13:
    window 8, 1 entry, state 2 D."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_e2e_v4 as v4

    shape = v4.V4Shape(
        ratios=(4,), csa=4, window=8, topk=2, d=16, di=4, heads=2, index_heads=2, experts=8, top_k=2,
        vocab=10, hidden=8, cache_elt=4, dense_params=0.0, expert_params=(1.0,),
    )  # fmt: skip
    assert shape.cache_read(13) == 4 * (8 * 16 + 2 * 16 + 3 * 4 + 8 * 16 + 8 * 4)
    assert shape.cache_write() == 4 * (16 + 4 * 16 + 4 * 4 + 16 / 4 + 4 / 4)
    hca = v4.V4Shape(**{**shape.__dict__, "ratios": (8,)})
    assert hca.cache_read(13) == 4 * (8 * 16 + 1 * 16 + 2 * 16)
    assert shape.hit(1) == pytest.approx(2) and shape.hit(10**6) == pytest.approx(8)

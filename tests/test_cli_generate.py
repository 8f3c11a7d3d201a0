"""`deepinfer generate` and `deepinfer bench` as a user runs them (subprocesses, from another cwd)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deepinfer.engine.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parents[1] / "model" / "tiny"


def deepinfer(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )


def test_generate_with_the_shipped_model(tmp_path: Path) -> None:
    r = deepinfer(
        "generate", "--prompt", "Hello, my name is", "--prompt", "The weather today",
        "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--json", "--backend", "reference",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["prompt"] for rec in records] == ["Hello, my name is", "The weather today"]
    tok = Tokenizer(TINY)
    for rec in records:
        assert len(rec["token_ids"]) == 8 and rec["finish_reason"] == "length"
        assert rec["text"] == tok.decode(rec["token_ids"])


def test_generate_reports_bad_input(tmp_path: Path) -> None:
    r = deepinfer("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = deepinfer("generate", "--prompt", "hi", "--top-p", "1.5", cwd=tmp_path)
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    r = deepinfer("generate", "--prompt", "hi", "--backend", "no-such-backend", cwd=tmp_path)
    assert r.returncode == 2 and "unknown backend 'no-such-backend'" in r.stderr
    assert "reference" in r.stderr and "Traceback" not in r.stderr


def test_generate_with_structured_output(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["red", "green", 7]}))
    common = ["--temperature", "0", "--max-tokens", "40", "--json", "--backend", "reference"]
    r = deepinfer("generate", "--prompt", "Hi", "--json-schema", str(schema), *common, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(json.loads(r.stdout)["text"]) in ("red", "green", 7)
    r = deepinfer("generate", "--prompt", "Hi", "--choice", "yes", "--choice", "no", *common, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] in ("yes", "no")
    r = deepinfer("generate", "--prompt", "Hi", "--regex", "[a-z", *common, cwd=tmp_path)
    assert r.returncode == 2 and "the regex does not compile" in r.stderr and "Traceback" not in r.stderr


def test_bench_random_config(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = deepinfer(
        "bench", "--random-config", "tiny", "--num-prompts", "4", "--input-len", "20", "--output-len", "4",
        "--backend", "reference", "--output-json", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Throughput:" in r.stdout and "requests/s" in r.stdout
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 4 and result["requests_per_s"] > 0 and result["output_tokens_per_s"] > 0

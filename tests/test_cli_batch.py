"""The command line as vLLM users know it: `deepinfer run-batch` (vLLM's batch file format), `generate`
from a file or stdin, `bench` with vLLM's flags and JSON keys, `--version`, and the refusal of a
random-weight model that cannot fit in memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_model import TINY

from deepinfer import __version__
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.cli import main
from deepinfer.models.config import ModelConfig
from deepinfer.reference.backend import ReferenceDevice
from deepinfer.testing.random_model import check_fits, estimate_weight_bytes, random_model

REPO = Path(__file__).resolve().parents[1]
ENGINE = ["--backend", "reference", "--max-model-len", "64", "--max-num-seqs", "8", "--enforce-eager"]


def deepinfer(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args],
        cwd=cwd, input=stdin, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def request(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# --------------------------------------------------------------------------- run-batch


def test_run_batch_serves_completions_and_chat_and_reports_bad_lines(tmp_path: Path) -> None:
    lines = [
        request(
            "c1", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        ),
        "this is not JSON",
        request(
            "chat1", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "temperature": 0,
             "logprobs": True, "top_logprobs": 2},
        ),
        request("bad-url", "/v1/embeddings", {"input": "x"}),
        request("bad-key", "/v1/completions", {"prompt": "x", "frobnicate": 1}),
        request("too-long", "/v1/completions", {"prompt": list(range(5, 100)), "max_tokens": 2}),
        request(
            "ids", "/v1/completions",
            {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "logprobs": 1},
        ),
    ]  # fmt: skip
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = deepinfer("run-batch", "-i", str(src), "-o", str(out), "--model", str(TINY), *ENGINE, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [res["custom_id"] for res in results] == [
        "c1",
        None,
        "chat1",
        "bad-url",
        "bad-key",
        "too-long",
        "ids",
    ]
    by_id = {res["custom_id"]: res for res in results}
    tok = Tokenizer(TINY)

    c1 = by_id["c1"]
    assert c1["error"] is None and c1["id"].startswith("vllm-")
    assert c1["response"]["status_code"] == 200 and c1["response"]["request_id"].startswith("vllm-batch-")
    body = c1["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tok.encode("Hello"))
    assert (
        usage["total_tokens"]
        == usage["prompt_tokens"] + usage["completion_tokens"]
        <= usage["prompt_tokens"] + 5
    )

    chat = by_id["chat1"]["response"]["body"]
    assert by_id["chat1"]["error"] is None and chat["object"] == "chat.completion"
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    content = chat["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) == chat["usage"]["completion_tokens"] <= 4
    assert all(len(entry["top_logprobs"]) <= 2 and entry["logprob"] <= 0 for entry in content)

    ids = by_id["ids"]["response"]["body"]
    assert ids["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}
    logprobs = ids["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 3

    for custom_id, status, words in [
        (None, 400, "line 2: not valid JSON"),
        ("bad-url", 400, "url '/v1/embeddings' is not supported"),
        ("bad-key", 400, "unsupported body keys ['frobnicate']"),
        ("too-long", 400, "more than max_model_len=64"),
    ]:
        res = by_id[custom_id]
        assert res["response"]["status_code"] == status and res["response"]["body"] is None
        assert words in res["error"]["message"], res["error"]
    assert "3 of 7 requests served, 4 failed" in r.stderr


def test_run_batch_chat_without_a_chat_template_is_a_per_line_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in TINY.iterdir():
        if f.is_file() and f.suffix != ".py":
            shutil.copy(f, model / f.name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = request(
        "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    completion = request("plain", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    src.write_text(chat + "\n" + completion + "\n")
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(model), *ENGINE]) == 0
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["response"]["status_code"] == 400 and "has no chat template" in first["error"]["message"]
    assert second["error"] is None and second["response"]["body"]["choices"][0]["text"] is not None

    (model / "chat_template.jinja").write_text(template)  # the positive case: a template file
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(model), *ENGINE]) == 0
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["error"] is None and first["response"]["body"]["object"] == "chat.completion"


def test_run_batch_reports_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o"), *ENGINE]) == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text(request("a", "/v1/completions", {"prompt": "Hi"}) + "\n")
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "no" / "o"), *ENGINE]) == 2
    assert "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- generate


def test_generate_from_a_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "prompts.txt"
    plain.write_text("Hello, my name is\n\nThe weather today\n")
    common = ["--max-tokens", "3", "--temperature", "0", "--ignore-eos", "--json", *ENGINE]
    assert main(["generate", "--prompts-file", str(plain), *common]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello, my name is", "The weather today"]
    assert all(len(r["token_ids"]) == 3 for r in records)

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        '{"prompt": "Hello, my name is"}\n{"prompt_token_ids": [5, 6, 7]}\n"The weather today"\n'
    )
    assert main(["generate", "--prompts-file", str(jsonl), *common]) == 0
    again = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert again[0]["token_ids"] == records[0]["token_ids"]  # greedy: the same prompt, the same tokens
    assert again[2]["token_ids"] == records[1]["token_ids"]
    assert again[1]["prompt"] == {"prompt_token_ids": [5, 6, 7]} and len(again[1]["token_ids"]) == 3

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert main(["generate", "--prompts-file", str(bad), *common]) == 2
    assert (
        "bad.jsonl line 2: a JSON prompt has 'prompt' (text) or 'prompt_token_ids'" in capsys.readouterr().err
    )
    assert main(["generate", *common]) == 2
    assert "give a prompt" in capsys.readouterr().err


def test_generate_from_stdin(tmp_path: Path) -> None:
    common = ["--max-tokens", "2", "--temperature", "0", "--json", *ENGINE]
    r = deepinfer(
        "generate", "--prompt", "-", *common, cwd=tmp_path, stdin="Hello, my name is\nThe weather today\n"
    )
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["prompt"] for line in r.stdout.splitlines()] == [
        "Hello, my name is",
        "The weather today",
    ]
    r = deepinfer(
        "generate", "--prompts-file", "-", *common, cwd=tmp_path, stdin='{"prompt_token_ids": [5, 6]}\n'
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt"] == {"prompt_token_ids": [5, 6]}


# --------------------------------------------------------------------------- bench


def test_bench_takes_vllm_flags_and_writes_vllm_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "3",
            "--num-prompts", "3", "--output-json", str(out), "--backend", "reference",
            "--enforce-eager"]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and result["total_num_tokens"] == 3 * (12 + 3)
    assert result["elapsed_time"] > 0
    assert result["requests_per_second"] == pytest.approx(3 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(45 / result["elapsed_time"])
    with pytest.raises(SystemExit):  # argparse: only the random dataset
        main(["bench", "--dataset-name", "sharegpt"])


# --------------------------------------------------------------------------- --version


def test_version(tmp_path: Path) -> None:
    r = deepinfer("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"deepinfer {__version__}"


# --------------------------------------------------------------------------- random-config memory


def test_weight_estimate_matches_the_built_model() -> None:
    from deepinfer.backend.registry import get_backend

    backend = get_backend("reference")
    model = random_model(TINY / "config.json", backend, torch.float32)
    tensors = [t for t in [*model.buffers(), *model.parameters()] if t.device.type != "meta"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert estimate_weight_bytes(ModelConfig.from_file(TINY / "config.json"), torch.float32) == sum(
        storages.values()
    )


def test_random_config_refuses_a_model_that_cannot_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    need = estimate_weight_bytes(ModelConfig.from_file(TINY / "config.json"), torch.float32)
    built: list[int] = []
    monkeypatch.setattr(
        "deepinfer.models.deepseek.DeepseekForCausalLM.load_weights", lambda *a: built.append(1)
    )
    monkeypatch.setattr(ReferenceDevice, "memory_info", lambda self: (need // 2, 4 * need))
    args = ["bench", "--random-config", "tiny", "--num-prompts", "1", "--backend", "reference"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "random weights for" in err and "do not fit in the" in err and "GiB free of" in err
    assert built == []  # refused before anything was built

    # DeepSeek-V3's 671 B parameters fit on no machine that runs these tests: refused as they are
    monkeypatch.undo()
    assert (
        main(["bench", "--random-config", "deepseek-v3", "--num-prompts", "1", "--backend", "reference"]) == 2
    )
    assert "do not fit" in capsys.readouterr().err


def test_random_config_warns_when_the_weights_fill_the_memory(caplog: pytest.LogCaptureFixture) -> None:
    class Device:
        def memory_info(self) -> tuple[int, int]:
            return (int(need * 1.05), 4 * need)

        def device(self) -> torch.device:
            return torch.device("cpu")

    class Backend:
        name = "fake"
        device = Device()

    config = ModelConfig.from_file(TINY / "config.json")
    need = estimate_weight_bytes(config, torch.float32)
    import logging

    logger = logging.getLogger("deepinfer.testing.random_model")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="deepinfer"):
            assert check_fits(config, torch.float32, Backend(), 0.9, "tiny") == need  # type: ignore[arg-type]
    finally:
        logger.removeHandler(caplog.handler)
    assert "take most of the" in caplog.text and "may run out of memory" in caplog.text

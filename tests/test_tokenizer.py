"""The tokenizer (transformers' AutoTokenizer over the checkpoint, with a direct encode/decode
path), incremental detokenisation (tokenizers' DecodeStream), chat-template errors, stop strings."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tiny_model import TINY
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "naïve café — 日本語 ok 🙂",
    "<｜User｜>hi<｜Assistant｜>",  # special tokens written in the text are matched as tokens
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY)


def test_the_tokenizer_is_transformers_own(tok: Tokenizer) -> None:
    hf = tok.hf_tokenizer
    assert isinstance(hf, PreTrainedTokenizerBase) and hf.is_fast
    assert tok.backend is hf.backend_tokenizer
    ours = (tok.bos_token_id, tok.eos_token_id, tok.vocab_size)
    assert ours == (0, 1, 978) == (hf.bos_token_id, hf.eos_token_id, len(hf))


def test_encode_adds_bos_once_and_round_trips(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "Hello world"
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_equal_transformers(tok: Tokenizer, add_special_tokens: bool) -> None:
    hf = tok.hf_tokenizer
    rng = random.Random(1)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(50)]
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_bos_from_tokenizer_config_is_honoured_once(tmp_path: Path) -> None:
    """transformers 5 ignores tokenizer_config.json's add_bos_token next to a tokenizer.json;
    deepinfer honours it (as transformers 4 did for DeepSeek's LlamaTokenizerFast), and a
    tokenizer.json whose post-processor already adds BOS does not get a second one."""
    fresh = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    ours = Tokenizer(TINY).hf_tokenizer
    assert ours.encode("Hi") == [0, *fresh.encode("Hi")]
    shutil.copy(TINY / "tokenizer_config.json", tmp_path)
    spec = json.loads((TINY / "tokenizer.json").read_text())
    bos = "<｜begin▁of▁sentence｜>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    assert Tokenizer(tmp_path).encode("Hi") == ours.encode("Hi")
    assert AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).encode("Hi") == ours.encode("Hi")
    # add_bos_token false: no BOS, as transformers
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_text((TINY / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    assert Tokenizer(tmp_path).encode("Hi") == fresh.encode("Hi")


def _detokenise(tok: Tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip)
    return [detok.step(t) for t in ids], detok.flush()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenisation_equals_full_decode(tok: Tokenizer, seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    # Multi-byte characters are split across byte tokens; special tokens are skipped or not.
    text = "naïve café — 日本語 ok 🙂 " + " ".join(
        rng.choice(["the", "fox", "über", "ñ", "€5"]) for _ in range(30)
    )
    ids = tok.encode(text, add_special_tokens=False)
    ids.insert(len(ids) // 2, tok.eos_token_id)  # type: ignore[arg-type]
    pieces, rest = _detokenise(tok, ids, skip)
    full = tok.decode(ids, skip)
    assert "".join(pieces) + rest == full and rest == ""
    # No U+FFFD of a character cut in two, only where the text has one (EOS shown inside a character).
    assert "".join(pieces).count("\ufffd") == full.count("\ufffd")
    if skip:
        assert tok.decode(ids) == text
    # Some token completes no character on its own (it is held back, then released) ...
    assert any(p == "" for p in pieces)
    # ... and the text released so far is the decoded prefix whenever that ends in whole characters.
    for k in range(len(ids)):
        prefix = tok.decode(ids[: k + 1], skip)
        if not prefix.endswith("\ufffd"):
            assert "".join(pieces[: k + 1]) == prefix


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenisation_random_tokens(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
        pieces, rest = _detokenise(tok, ids, skip)
        assert "".join(pieces) + rest == tok.decode(ids, skip)


def test_flush_releases_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1, "the emoji must span several byte tokens for this test to check anything"
    pieces, rest = _detokenise(tok, ids[:-1])
    assert "".join(pieces) == "ok " and rest == tok.decode(ids[:-1])[3:] and rest.startswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert [detok.step(t) for t in [*ids[:-1], ids[-1]]][-1] == "🙂" and detok.flush() == ""


def test_find_stop_spanning_and_earliest() -> None:
    assert find_stop("hello world", 5, ("lo w",)) == (3, "lo w")  # starts before the new "world"
    assert find_stop("hello world", 4, ("lo w",)) is None  # ended before the new "orld"
    assert find_stop("hello world", 3, ("hell",)) is None  # ended before the new text
    assert find_stop("abcXYZdefXYZ", 6, ("XYZ", "Zd")) == (5, "Zd")
    assert find_stop("abc", 1, ("zz",)) is None


def test_chat_template_renders_as_transformers(tok: Tokenizer) -> None:
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"},
    ]
    text, ids = tok.apply_chat_template(conv)
    assert text == (
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜><｜User｜>?<｜Assistant｜>"
    )
    fresh = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    assert ids == fresh.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)


def test_chat_template_errors_name_the_problem(tok: Tokenizer) -> None:
    config = r"chat template failed \(.*tokenizer_config\.json\)"
    with pytest.raises(ValueError, match=config + ": unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    # the tiny template concatenates strings: content parts handed on as a list (the "openai"
    # content format) make it fail with a TypeError
    with pytest.raises(ValueError, match=config + ": TypeError: can only concatenate"):
        parts = [{"type": "text", "text": "x"}]
        tok.apply_chat_template([{"role": "user", "content": parts}], content_format="openai")
    with pytest.raises(ValueError, match=r"\(the chat_template argument\) does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    with pytest.raises(ValueError, match=r"messages must be .*message 0 \(user\) has no 'content'"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match=r"messages must be .*non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt, tokenize"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template_kwargs={"tokenize": True, "add_generation_prompt": False},
        )


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer(tmp_path)

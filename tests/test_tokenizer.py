"""Tokenizer wrapper, incremental detokenisation and stop-string search."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop

TINY = Path(__file__).resolve().parents[1] / "model" / "tiny"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY)


def test_encode_adds_bos_once_and_round_trips(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "Hello world"
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tok.eos_token_id is not None and tok.vocab_size == 978


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenisation_equals_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    # Multi-byte characters are split across byte tokens; special tokens are skipped.
    text = "naïve café — 日本語 ok 🙂 " + " ".join(
        rng.choice(["the", "fox", "über", "ñ", "€5"]) for _ in range(30)
    )
    ids = tok.encode(text, add_special_tokens=False)
    ids.insert(len(ids) // 2, tok.eos_token_id)  # type: ignore[arg-type]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # Some token completes no character on its own (it is held back, then released).
    assert any(p == "" for p in pieces)


def test_incremental_detokenisation_random_tokens(tok: Tokenizer) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.step(t) for t in ids) + detok.flush()
    assert text == tok.decode(ids)


def test_find_stop_spanning_and_earliest() -> None:
    assert find_stop("hello world", 5, ("lo w",)) == (3, "lo w")  # starts before the new "world"
    assert find_stop("hello world", 4, ("lo w",)) is None  # ended before the new "orld"
    assert find_stop("hello world", 3, ("hell",)) is None  # ended before the new text
    assert find_stop("abcXYZdefXYZ", 6, ("XYZ", "Zd")) == (5, "Zd")
    assert find_stop("abc", 1, ("zz",)) is None


def test_chat_template_renders_and_rejects_unknown_roles(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "?"},
        ]
    )
    assert text == (
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜><｜User｜>?<｜Assistant｜>"
    )
    with pytest.raises(ValueError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer(tmp_path)

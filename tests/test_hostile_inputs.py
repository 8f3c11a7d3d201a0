"""Hostile inputs (issue 38), one family per section: checkpoint paths and layouts, config.json
values, chat templates, prompts and sampling parameters, structured-output promises, sizes and
re-entrant calls.

Every case checks that the error names the problem (the file, the field, the keyword), and then
that the same LLM serves the same tokens as before (`served`). Checkpoint cases also check,
through a tracer of the files the process opens (Python's "open" audit events and safetensors'
safe_open), that nothing outside the model directory is read; size cases check that the
process's peak RSS stays bounded.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import TINY

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.engine import structured, tokenizer
from deepinfer.engine.structured import check_json_schema, validate_output
from deepinfer.models import loader
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

PROMPT = "The weather today"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
INDEX = "model.safetensors.index.json"

# --------------------------------------------------------------------------- the tracer

_OPENED: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _TRACING and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


_TRACING = False
sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only while _TRACING


@contextmanager
def opened_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths the process opens meanwhile (resolved): Python's open() and safetensors'
    safe_open, which opens files from Rust and raises no audit event."""
    global _TRACING
    real_safe_open = loader.safe_open

    def traced_safe_open(path: str, *args: Any, **kwargs: Any) -> Any:
        _OPENED.append(str(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", traced_safe_open)
    _OPENED.clear()
    seen: list[str] = []
    _TRACING = True
    try:
        yield seen
    finally:
        _TRACING = False
        seen.extend(str(Path(p).resolve()) for p in _OPENED)
        monkeypatch.setattr(loader, "safe_open", real_safe_open)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny checkpoint in two shards with an MTP layer and the tiny tokenizer."""
    root = write_random_checkpoint(
        tmp_path_factory.mktemp("hostile") / "model", tiny_config(vocab_size=978), seed=3, shards=2
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, root / name)
    return root


@pytest.fixture(scope="module")
def llm(base: Path) -> LLM:
    return LLM(str(base), backend="reference", dtype="float32", max_model_len=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def served(llm: LLM, baseline: list[int]) -> None:
    """The LLM still serves the tokens it served before the hostile input."""
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline


@pytest.fixture
def ckpt(base: Path, tmp_path: Path) -> Path:
    """A copy of the base checkpoint to spoil, beside a secret directory it must never read."""
    root = shutil.copytree(base, tmp_path / "model")
    secret = tmp_path / "secret"
    secret.mkdir()
    shard = sorted(root.glob("model-*.safetensors"))[0]
    shutil.copy(shard, secret / shard.name)  # a readable safetensors file outside the model
    (secret / "tokenizer.json").write_text((root / "tokenizer.json").read_text())
    return root


def _secret(root: Path) -> Path:
    return (root.parent / "secret").resolve()


def _index(root: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((root / INDEX).read_text())
    return result


def _point_first_shard_at(root: Path, name: str) -> None:
    index = _index(root)
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (name if v == first else v) for k, v in index["weight_map"].items()}
    (root / INDEX).write_text(json.dumps(index))


def _refused(
    root: Path, monkeypatch: pytest.MonkeyPatch, *words: str, error: type[Exception] = ValueError
) -> str:
    """LLM(root) raises naming every word; nothing in the secret directory was opened."""
    with opened_files(monkeypatch) as seen, pytest.raises(error) as info:
        LLM(str(root), backend="reference", dtype="float32", max_model_len=64)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    secret = str(_secret(root))
    assert not [p for p in seen if p.startswith(secret)], seen
    return message


# --------------------------------------------------------------------------- checkpoint paths


def test_shard_named_by_an_absolute_path(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    outside = next(_secret(ckpt).glob("model-*.safetensors"))
    _point_first_shard_at(ckpt, str(outside))
    _refused(ckpt, monkeypatch, INDEX, str(outside), "outside checkpoint")
    served(llm, baseline)


def test_shard_named_through_dotdot(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    name = f"../secret/{next(_secret(ckpt).glob('model-*.safetensors')).name}"
    _point_first_shard_at(ckpt, name)
    _refused(ckpt, monkeypatch, name, "without '..'")
    served(llm, baseline)


def test_shard_that_is_a_symlink_out(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(_secret(ckpt) / shard.name)
    _refused(ckpt, monkeypatch, shard.name, "is a symlink to", "outside the checkpoint directory")
    served(llm, baseline)


def test_tokenizer_file_that_is_a_symlink_out(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to(_secret(ckpt) / "tokenizer.json")
    _refused(ckpt, monkeypatch, "'tokenizer.json'", "is a symlink to")
    served(llm, baseline)


def test_hub_snapshot_links_into_the_cache_still_load(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, baseline: list[int]
) -> None:
    """huggingface_hub's layout: snapshots/COMMIT/FILE -> ../../blobs/HASH. It loads, serves the
    same tokens, and reads nothing outside the cache."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(base.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with opened_files(monkeypatch) as seen:
        hub = LLM("org/tiny", backend="reference", dtype="float32", max_model_len=64, max_num_seqs=8)
    assert hub.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline
    assert not [p for p in seen if p.startswith(str(base.resolve()))], "read the original, not the cache"


# --------------------------------------------------------------------------- checkpoint layouts


def test_weight_map_that_is_a_list(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    index = _index(ckpt)
    index["weight_map"] = list(index["weight_map"].items())
    (ckpt / INDEX).write_text(json.dumps(index))
    _refused(ckpt, monkeypatch, INDEX, "'weight_map' must be an object", "got list")
    served(llm, baseline)


def test_a_tensor_in_two_shards(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    first, second = sorted(ckpt.glob("model-*.safetensors"))
    name = next(iter(load_file(str(first))))
    state = load_file(str(second))
    state[name] = torch.zeros_like(load_file(str(first))[name])  # the copy the index ignores
    save_file(state, str(second))
    _refused(ckpt, monkeypatch, repr(name), first.name, second.name, "one shard only")
    served(llm, baseline)


def test_a_99_mb_safetensors_header(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, llm: LLM, baseline: list[int]
) -> None:
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    size = 99_000_000
    with open(shard, "wb") as f:  # a sparse file: the header length, "{", then a hole
        f.write(size.to_bytes(8, "little") + b"{")
        f.truncate(8 + size)
    before = peak_rss_bytes()
    _refused(ckpt, monkeypatch, shard.name, "header claims 99 MB")
    assert peak_rss_bytes() - before < 64 * 2**20
    served(llm, baseline)


def test_a_header_longer_than_the_file(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.write_bytes((4096).to_bytes(8, "little") + b"{}")
    _refused(ckpt, monkeypatch, shard.name, "claims 4096 bytes but the file has 10")


# --------------------------------------------------------------------------- config.json values


def _config(root: Path, **fields: Any) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(fields)
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"rope_theta": 0}, ("rope_theta", "> 0")),
        ({"eos_token_id": 10**30}, ("'eos_token_id'", str(10**30), "vocab_size=978")),
        ({"eos_token_id": [1, 978]}, ("'eos_token_id' 978", "vocabulary")),
        ({"bos_token_id": 5000}, ("'bos_token_id' 5000",)),
        ({"num_nextn_predict_layers": 5}, ("num_nextn_predict_layers=5", "holds 1 MTP layer")),
        ({"num_attention_heads": 8}, ("num_attention_heads=8", "q_b_proj", "rows")),
        ({"v_head_dim": 8}, ("num_attention_heads=4", "o_proj", "columns")),
        ({"first_k_dense_replace": 99}, ("layer 1 is a dense layer", "first_k_dense_replace=99", "mlp.gate")),
        ({"first_k_dense_replace": 0}, ("layer 0 is an MoE layer", "first_k_dense_replace=0", "has no")),
        ({"moe_layer_freq": 2}, ("moe_layer_freq=2",)),
        ({"num_hidden_layers": 1}, ("num_hidden_layers=1", "decoder layer model.layers.1")),
        ({"num_nextn_predict_layers": 0}, ("num_nextn_predict_layers=0", "MTP layer model.layers.2")),
        ({"kv_lora_rank": 8}, ("kv_lora_rank=8", "kv_a_proj_with_mqa")),
        ({"q_lora_rank": 8}, ("q_lora_rank=8", "q_a_proj")),
        ({"intermediate_size": 24}, ("intermediate_size=24", "model.layers.0.mlp.gate_proj")),
        ({"moe_intermediate_size": 24}, ("moe_intermediate_size=24", "mlp.shared_experts.gate_proj")),
        ({"n_shared_experts": 2}, ("n_shared_experts=2", "moe_intermediate_size * n_shared_experts")),
    ],
    ids=[
        "rope-theta-0",
        "eos-huge",
        "eos-past-vocab",
        "bos-past-vocab",
        "nextn-5",
        "heads",
        "v-head-dim",
        "first-dense-99",
        "first-dense-0",
        "moe-freq-2",
        "layers-1",
        "nextn-0",
        "kv-lora-rank",
        "q-lora-rank",
        "intermediate-size",
        "moe-intermediate-size",
        "shared-experts",
    ],
)
def test_config_values_are_named(
    ckpt: Path,
    monkeypatch: pytest.MonkeyPatch,
    llm: LLM,
    baseline: list[int],
    fields: dict[str, Any],
    words: tuple[str, ...],
) -> None:
    _config(ckpt, **fields)
    _refused(ckpt, monkeypatch, *words)
    served(llm, baseline)


def test_config_json_that_is_not_utf8(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (ckpt / "config.json").write_bytes(b'{"model_type": "deepseek_v3", "x": "\xff\xfe"}')
    _refused(ckpt, monkeypatch, "config.json is not UTF-8", "0xff", "offset")


DEEP = '{"a": ' * 100_000 + "1" + "}" * 100_000  # past Python's recursion limit


@pytest.mark.parametrize(
    ("file", "content", "words"),
    [
        ("config.json", DEEP, ("config.json is not valid JSON", "recursion")),
        (INDEX, DEEP, (INDEX, "not a valid safetensors index", "recursion")),
        ("drafter_config.json", "\xff", ("drafter_config.json cannot be read as JSON", "utf-8")),
        ("tokenizer_config.json", DEEP, ("tokenizer_config.json is not valid JSON", "recursion")),
    ],
    ids=["config-deep", "index-deep", "drafter-config-not-utf8", "tokenizer-config-deep"],
)
def test_checkpoint_json_files_are_named(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, file: str, content: str, words: tuple[str, ...]
) -> None:
    (ckpt / file).write_bytes(content.encode("latin-1"))
    _refused(ckpt, monkeypatch, *words)


# --------------------------------------------------------------------------- chat templates

LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"


def test_chat_template_that_loops_for_ever(llm: LLM, baseline: list[int]) -> None:
    with pytest.raises(ValueError, match=r"chat template \(the chat_template argument\) ran past its budget"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template=LOOPS, use_tqdm=False)
    served(llm, baseline)


def test_chat_template_file_that_loops_is_named(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").write_text(LOOPS)
    hostile = LLM(str(ckpt), backend="reference", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match=rf"{ckpt / 'chat_template.jinja'}\) ran past its budget"):
        hostile.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ raise_exception.__globals__ }}", ("'__globals__'", "'function'")),
        ("{{ messages.__class__.__mro__ }}", ("'__class__'", "'list'")),
    ],
    ids=["globals", "class"],
)
def test_chat_template_sandbox_refusal_is_named(
    llm: LLM, baseline: list[int], template: str, words: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="stopped by the jinja sandbox") as info:
        llm.chat([{"role": "user", "content": "Hi"}], chat_template=template, use_tqdm=False)
    assert "prompt is empty" not in str(info.value)
    for word in words:
        assert word in str(info.value)
    served(llm, baseline)


def test_chat_template_that_swells_is_stopped(
    llm: LLM, baseline: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A string doubled in a loop: 40 steps would need a TiB; the memory budget (here 32 MiB)
    stops it after a few, and the peak RSS stays within about twice the budget."""
    monkeypatch.setattr(tokenizer, "TEMPLATE_MAX_BYTES", 32 * 2**20)
    swell = "{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}"
    before = peak_rss_bytes()
    # the budget counts from the peak: what the process holds now may be below it
    headroom = before - int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    with pytest.raises(ValueError, match=r"ran past its budget \(more than 32 MiB of host memory"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template=swell + "{{ s.v }}", use_tqdm=False)
    assert peak_rss_bytes() - before < 3 * (headroom + 32 * 2**20)
    monkeypatch.undo()
    served(llm, baseline)


def test_chat_template_output_past_host_memory(
    llm: LLM, baseline: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizers library aborts the process when an allocation fails: a rendered prompt
    too long to encode in the memory available is refused first, naming the template (here
    with 64 MiB available; `'x' * 10**9` meets the same check on any host)."""
    monkeypatch.setattr(tokenizer, "host_memory_info", lambda: (64 * 2**20, 64 * 2**20))
    big = "{{ 'x' * 300000 }}"
    with pytest.raises(ValueError, match=r"template \(the chat_template argument\) rendered a prompt too"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template=big, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0.*300000 characters: encoding it needs about 0.0715 GiB"):
        llm.generate("x" * 300000, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    served(llm, baseline)


# --------------------------------------------------------------------------- prompts and sampling


def _token(llm: LLM, text: str) -> int:
    tok = llm.llm_engine.tokenizer
    assert tok is not None
    (t,) = tok.encode(text, add_special_tokens=False)
    return t


def _late(**fields: Any) -> SamplingParams:
    """SamplingParams with fields set after construction (the constructor would refuse them)."""
    sp = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(sp, name, value)
    return sp


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ("Hi \ud800 there", GREEDY, ("prompt 0", "lone surrogate U+D800 at character 3")),
        (PROMPT, _late(bad_words=["ok", "\udfff"]), ("bad_words[1]", "U+DFFF")),
        (PROMPT, _late(stop=["\ud83d"]), ("stop[0]", "U+D83D")),
        (
            {"prompt": PROMPT, "multi_modal_data": {"image": object()}},
            GREEDY,
            ("prompt 0", "multi_modal_data"),
        ),
        (PROMPT, SamplingParams(n=10**8, max_tokens=2), ("n=100000000", "max_num_seqs=8")),
        (PROMPT, SamplingParams(n=2, best_of=10**8, max_tokens=2), ("best_of=100000000", "max_num_seqs=8")),
        (
            "x " * 200,
            SamplingParams(max_tokens=64, truncate_prompt_tokens=-1),
            ("truncate_prompt_tokens=-1", "max_tokens=64", "max_model_len=64"),
        ),
    ],
    ids=[
        "surrogate-prompt",
        "surrogate-bad-word",
        "surrogate-stop",
        "multi-modal",
        "n-huge",
        "best-of-huge",
        "truncate-no-room",
    ],
)
def test_request_refused_with_the_reason(
    llm: LLM, baseline: list[int], prompt: Any, params: SamplingParams, words: tuple[str, ...]
) -> None:
    before = peak_rss_bytes()
    with pytest.raises(ValueError) as info:
        llm.generate([prompt], params, use_tqdm=False)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert peak_rss_bytes() - before < 64 * 2**20
    served(llm, baseline)


def test_impossible_token_sets_at_add_time(llm: LLM, baseline: list[int]) -> None:
    eos = llm.llm_engine.eos_token_ids
    with pytest.raises(ValueError, match=r"allowed_token_ids leave no token.*min_tokens=2"):
        llm.generate(
            PROMPT, SamplingParams(allowed_token_ids=eos, min_tokens=2, max_tokens=4), use_tqdm=False
        )
    word = _token(llm, "the")
    with pytest.raises(ValueError, match=r"allowed_token_ids leave no token.*bad_words"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[word], bad_words=["the"]), use_tqdm=False)
    digits = StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match=r"none of the allowed tokens can start the output"):
        llm.generate(
            PROMPT, SamplingParams(allowed_token_ids=[word], structured_outputs=digits), use_tqdm=False
        )
    served(llm, baseline)


def test_no_token_left_mid_request_is_a_clear_finish(llm: LLM, baseline: list[int]) -> None:
    """Digits only, and a grammar that needs a letter after the first: the second step has no
    token left; the request finishes with "error", the other request of the call is served."""
    digits = [_token(llm, d) for d in "0123456789"]
    so = StructuredOutputsParams(regex="[0-9]a")
    bad, good = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=digits, structured_outputs=so),
            GREEDY,
        ],
        use_tqdm=False,
    )
    assert bad.outputs[0].finish_reason == "error", bad.outputs[0]
    assert "no token is left to sample after 1 output tokens" in str(bad.outputs[0].error)
    assert len(bad.outputs[0].token_ids) == 1
    assert good.outputs[0].token_ids == baseline and good.outputs[0].error is None
    served(llm, baseline)


def test_seed_minus_one_is_unseeded(llm: LLM) -> None:
    assert SamplingParams(seed=-1).seed is None
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    sp.seed = -1  # set after construction: the request still runs unseeded
    assert sp.for_request().seed is None
    engine = llm.llm_engine
    state = engine.requests._seed_rng.getstate()
    unseeded = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    engine.requests._seed_rng.setstate(state)  # the same draw from the engine's seed stream
    plain = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    (none,) = llm.generate(PROMPT, plain, use_tqdm=False)
    assert unseeded == none.outputs[0].token_ids
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # still a seed of its own


def test_logit_bias_is_clamped(llm: LLM, baseline: list[int]) -> None:
    """3.4e38 on every token would be inf - inf; clamped to 100 it shifts every logit alike,
    so greedy decoding is unchanged."""
    vocab = llm.llm_engine.vocab_size
    sp = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias=dict.fromkeys(range(vocab), 3.4e38)
    )
    assert set(sp.for_request().logit_bias.values()) == {100.0}  # type: ignore[union-attr]
    assert llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids == baseline
    served(llm, baseline)


def test_truncate_minus_one_leaves_room(llm: LLM, baseline: list[int]) -> None:
    tok = llm.llm_engine.tokenizer
    assert tok is not None
    long = "x " * 200
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=-1)
    (out,) = llm.generate(long, sp, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode(long)[-(64 - 5) :]
    assert len(out.outputs[0].token_ids) == 5
    served(llm, baseline)


# --------------------------------------------------------------------------- structured output


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"not": {}}, ("'not'", "at #")),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ("'allOf'",)),
        ({"type": "string", "const": 1}, ("'const' 1", "'string'")),
        ({"type": "object", "required": ["a"], "additionalProperties": False}, ("'required' property 'a'",)),
        (
            {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {}]}}},
            ("'oneOf'", "#/properties/a"),
        ),
        ({"type": "string", "format": "zip-code"}, ("'format' 'zip-code'",)),
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, ("'maxLength'", "pattern")),
        ({"if": {"type": "integer"}, "then": {"minimum": 3}}, ("'if'",)),
        (
            {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5},
            ("'minimum' beside '$ref'",),
        ),
        ({"type": "integer", "minimum": 5, "maximum": 1}, ("'minimum' (5) exceeds 'maximum' (1)",)),
        (False, ("`false`",)),
        ({"type": "array", "uniqueItems": True}, ("'uniqueItems'",)),
        ({"type": "array", "contains": {"const": 5}}, ("'contains'",)),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ("'dependentRequired'",)),
        ({"type": "object", "dependencies": {"a": ["b"]}}, ("'dependencies'",)),
        ({"type": "number", "multipleOf": 0.5}, ("'multipleOf' 0.5",)),
        ({"type": "object", "required": ["a"]}, ("'required' property 'a'", "not in 'properties'")),
    ],
    ids=[
        "not",
        "allOf",
        "const-type",
        "required-closed",
        "oneOf",
        "format",
        "pattern-len",
        "if",
        "ref-sibling",
        "min-max",
        "false",
        "uniqueItems",
        "contains",
        "dependentRequired",
        "dependencies",
        "multipleOf-number",
        "required-unlisted",
    ],
)
def test_schemas_the_grammar_cannot_enforce_are_refused(
    llm: LLM, baseline: list[int], schema: Any, words: tuple[str, ...]
) -> None:
    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(json=json.dumps(schema))
    with pytest.raises(ValueError, match="structured output") as info:
        llm.generate(PROMPT, SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    served(llm, baseline)


@pytest.mark.parametrize(
    ("regex", "words"),
    [
        ("[^\\s\\S]", "grammar admits no output at all"),
        ("a[^\\s\\S]b", "no token is left to sample after 1 output tokens: the structured-output grammar"),
        ("a^b", "does not match the regex 'a^b'"),
    ],
    ids=["empty-at-start", "empty-after-a", "anchors"],
)
def test_regex_that_matches_nothing(llm: LLM, baseline: list[int], regex: str, words: str) -> None:
    """Refused when the request is added where the grammar admits no first token; otherwise the
    completion finishes with "error" naming why, never as a success."""
    pytest.importorskip("xgrammar")
    sp = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex))
    try:
        (out,) = llm.generate(PROMPT, sp, use_tqdm=False)
    except ValueError as exc:
        assert words in str(exc)
    else:
        assert out.outputs[0].finish_reason == "error" and words in str(out.outputs[0].error), out.outputs[0]
    served(llm, baseline)


def test_a_violating_output_is_an_error_not_a_success(
    llm: LLM, baseline: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the up-front check switched off, xgrammar ignores `not` and emits an integer: the
    output check turns that completion into finish_reason "error", naming the violation."""
    pytest.importorskip("xgrammar")
    monkeypatch.setattr(structured, "check_json_schema", lambda schema: None)
    so = StructuredOutputsParams(json={"type": "integer", "not": {"type": "integer"}})
    (out,) = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so), use_tqdm=False
    )
    completion = out.outputs[0]
    if completion.finish_reason == "length":
        pytest.skip("the random model ran out of tokens before the integer ended")
    assert completion.finish_reason == "error", completion
    assert "violates the JSON schema" in str(completion.error)
    served(llm, baseline)


def test_enforced_keywords_still_pass() -> None:
    """What xgrammar does enforce (probed) is not refused."""
    check_json_schema({"type": "integer", "multipleOf": 7})
    check_json_schema({"type": "array", "uniqueItems": False, "items": {"type": "integer"}})
    check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def test_validate_output_directly() -> None:
    assert validate_output(StructuredOutputsParams(regex="[a-z]+"), "abc") is None
    assert "does not match the regex" in str(validate_output(StructuredOutputsParams(regex="[a-z]+"), "ab1"))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert validate_output(StructuredOutputsParams(json=schema), '{"n": 1}') is None
    problem = str(validate_output(StructuredOutputsParams(json=schema), '{"n": "x"}'))
    assert "#/n" in problem and "'x' is not of type 'integer'" in problem
    assert "is not JSON" in str(validate_output(StructuredOutputsParams(json_object=True), "{"))
    assert "none of the choices" in str(validate_output(StructuredOutputsParams(choice=["a"]), "b"))
    check_json_schema(
        {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    )
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="nested too deeply to check"):
        check_json_schema(deep)
    nested = "[" * 100_000 + "]" * 100_000
    assert "nested too deeply" in str(validate_output(StructuredOutputsParams(json_object=True), nested))
    recursive = StructuredOutputsParams(json={"type": "array", "items": {"$ref": "#"}})
    assert "nested too deeply to validate" in str(validate_output(recursive, "[" * 900 + "]" * 900))


# --------------------------------------------------------------------------- re-entrant calls


def test_generate_from_a_signal_handler_is_refused(llm: LLM, baseline: list[int]) -> None:
    """SIGALRM arrives while generate() runs; its handler calls generate() on the same LLM,
    which is refused at once; the outer call finishes with the tokens it would have served."""
    errors: list[str] = []
    inside: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        inside.append(llm._caller is not None)
        try:
            llm.generate(PROMPT, GREEDY, use_tqdm=False)
        except RuntimeError as exc:
            errors.append(str(exc))
        else:
            errors.append("served")
        signal.setitimer(signal.ITIMER_REAL, 0)

    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    (expected,) = llm.generate(PROMPT, long, use_tqdm=False)
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
        (out,) = llm.generate(PROMPT, long, use_tqdm=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert inside and inside[0], "the signal came after generate() returned: make the request longer"
    assert errors and "while another call on the same LLM is running in this thread" in errors[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    served(llm, baseline)


def test_chat_still_calls_generate_inside_its_own_call(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1

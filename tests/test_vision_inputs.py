"""Image inputs around the model (deepinfer.engine.images and the engine): the anyres grid under
max_image_tokens / min_pixels / max_wh_ratio, decoding and modes, normalisation and patching,
the scheduler never cutting a chunk inside an image, prefix-cache keys holding the image content;
bad images finishing only their own request with a clear error; LLM.chat with OpenAI image_url
parts and run-batch lines with images giving the tokens of generate() with the same image."""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.engine.images import (
    ImageInputError,
    ImageSpan,
    ProcessedImage,
    decode_data_url,
    plan_grid,
    process_image,
    split_image_parts,
)
from deepinfer.engine.kv_cache import BlockManager
from deepinfer.engine.scheduler import whole_images
from deepinfer.engine.sequence import Sequence
from deepinfer.models.config_v41 import parse_vision
from deepinfer.models.vision import to_patches
from deepinfer.models.vision_layout import image_token_count
from deepinfer.testing.v41_checkpoint import (
    TINY_VISION,
    merging_tokens,
    random_v41_tensors,
    tiny_v41_config,
    write_merging_tokenizer,
    write_v41_checkpoint,
)

VOCAB = 64
UNIT = 28
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _vision(**kw: Any) -> Any:
    v = parse_vision(dict(TINY_VISION, **kw))
    assert v is not None
    return v


def _picture(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    g = np.random.default_rng(seed)
    return Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").convert(mode)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("h,w", [(28, 28), (50, 90), (280, 28), (1, 1), (10, 3000), (3000, 10), (2000, 1500)])
@pytest.mark.parametrize("budget", [4, 16, 64])
def test_grid_fits_the_budget_and_keeps_the_aspect(h: int, w: int, budget: int) -> None:
    v = _vision(max_image_tokens=budget, max_wh_ratio=None)
    n_h, n_w = plan_grid(w, h, v)
    assert n_h >= 1 and n_w >= 1 and image_token_count(n_h, n_w) <= budget
    if image_token_count(math.ceil(h / UNIT), math.ceil(w / UNIT)) <= budget:  # fits: whole tokens up
        assert (n_h, n_w) == (math.ceil(h / UNIT), math.ceil(w / UNIT))
    else:  # shrunk: the largest grid of the same aspect ratio that fits, by brute force
        r = h / w
        best = max(
            (a * b, a, b)
            for a in range(1, budget)
            for b in range(1, budget)
            if image_token_count(a, b) <= budget and (a == 1 or b == 1 or abs(math.log(a / b / r)) < 0.7)
        )
        assert n_h * n_w >= best[0] // 3, (n_h, n_w, best)


def test_grid_min_pixels_and_max_wh_ratio() -> None:
    v = _vision(max_image_tokens=64, min_pixels=56 * 56, max_wh_ratio=2)
    assert plan_grid(28, 28, v) == (2, 2)  # scaled up to 56 x 56 pixels
    assert plan_grid(112, 28, v) == (2, 3)  # squeezed to 56 x 28, then scaled up to 79 x 40
    ratio_only = _vision(max_image_tokens=64, max_wh_ratio=2)
    assert plan_grid(112, 28, ratio_only) == (1, 2)  # 4:1 squeezed to 2:1
    assert plan_grid(28, 112, ratio_only) == (4, 1)  # tall images are not limited


# --------------------------------------------------------------------------- decoding


def test_process_image_modes_digest_and_patches() -> None:
    v = _vision(max_image_tokens=64)
    rgb = _picture(56, 84, 1)
    got = process_image(rgb, v)
    assert (
        (got.n_h, got.n_w) == (2, 3) and got.pixels.shape == (56, 84, 3) and got.pixels.dtype == torch.uint8
    )
    assert torch.equal(got.pixels, torch.from_numpy(np.asarray(rgb).copy()))  # already whole tokens: kept
    assert process_image(_png(rgb), v).digest == got.digest  # same content, bytes or PIL
    assert process_image(_picture(56, 84, 2), v).digest != got.digest
    for mode in ("L", "RGBA", "P", "CMYK", "1"):
        assert process_image(rgb.convert(mode), v).pixels.shape == (56, 84, 3)
    with pytest.raises(ImageInputError, match="image mode 'F' is not supported"):
        process_image(rgb.convert("F"), v)
    with pytest.raises(ImageInputError, match="does not decode"):
        process_image(b"\x89PNG\r\n\x1a\n not really", v)
    # normalisation and patching: ((x / 255) - 0.5) / 0.5, p x p patches row-major, channel-major
    patches = to_patches(got.pixels, 14, torch.float64)
    x = (got.pixels.double() / 255 - 0.5) / 0.5
    assert patches.shape == (4 * 6, 3 * 14 * 14)
    assert torch.allclose(patches[6 + 2], x[14:28, 28:42].permute(2, 0, 1).reshape(-1), atol=1e-6)  # float32


def test_data_urls() -> None:
    data = _png(_picture(28, 28, 3))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_url(url) == data
    with pytest.raises(ImageInputError, match="offline engine"):
        decode_data_url("https://example.com/cat.png")
    with pytest.raises(ImageInputError, match="base64"):
        decode_data_url("data:image/png;base64,@@@")
    msgs, images = split_image_parts(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
        "<image>",
    )
    assert images == [url] and msgs[0]["content"][1] == {"type": "text", "text": "<image>"}


# --------------------------------------------------------------------------- scheduling, caching


def _seq_with_image(tokens: list[int], start: int, image: ProcessedImage) -> Sequence:
    s = Sequence("r", None, tokens, SamplingParams(temperature=0))
    s.images = [ImageSpan(start, image)]
    return s


def test_chunks_never_end_inside_an_image() -> None:
    img = ProcessedImage(torch.zeros(28, 56, 3, dtype=torch.uint8), 1, 2, b"x")  # a span of 5
    s = _seq_with_image(list(range(12)), 3, img)  # positions 3..7
    assert whole_images(s, 0, 5) == 3  # would end inside: cut before the span
    assert whole_images(s, 0, 8) == 8 and whole_images(s, 0, 3) == 3  # the span whole, or not reached
    assert whole_images(s, 3, 4) == 0  # starts with the span, which does not fit
    assert whole_images(s, 5, 2) == 2  # starts inside it (a prefix-cache hit): not cut


def test_prefix_cache_keys_hold_the_image_content() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a_img = ProcessedImage(torch.zeros(28, 56, 3, dtype=torch.uint8), 1, 2, b"a")
    b_img = ProcessedImage(torch.zeros(28, 56, 3, dtype=torch.uint8), 1, 2, b"b")
    tokens = list(range(13))
    a = _seq_with_image(tokens, 5, a_img)  # positions 5..9: blocks 1 and 2
    assert bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert bm.match_prefix(_seq_with_image(tokens, 5, a_img)) == a.block_table[:3]
    assert bm.match_prefix(_seq_with_image(tokens, 5, b_img)) == a.block_table[:1]  # same ids, other image


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tiny_v41_config(vision=True, vocab=VOCAB, layers=4)
    root = write_v41_checkpoint(tmp_path_factory.mktemp("vl"), raw, random_v41_tensors(raw, seed=2))
    write_merging_tokenizer(root, VOCAB)
    return root


def _llm(root: Path, **kw: Any) -> LLM:
    return LLM(
        str(root), backend="reference", dtype="float32", block_size=4, max_model_len=128,
        kv_cache_dtype="bf16", **kw,
    )  # fmt: skip


def test_bad_images_fail_their_request_only(vl_dir: Path) -> None:
    llm = _llm(
        vl_dir, limit_mm_per_prompt={"image": 1}, max_num_batched_tokens=16, enable_chunked_prefill=True
    )
    good = {"prompt_token_ids": [5, VOCAB - 1, 7], "multi_modal_data": {"image": _picture(56, 56, 1)}}
    big = _picture(28, 28 * 7, 2)  # 1 x 7 tokens: a span of 10 fits; 3 x 5 (a span of 20) does not
    prompts = [
        good,
        {"prompt_token_ids": [5, VOCAB - 1, 7], "multi_modal_data": {"image": b"not an image"}},
        {
            "prompt_token_ids": [5, VOCAB - 1, 7],
            "multi_modal_data": {"image": _picture(56, 56, 1).convert("I")},
        },
        {"prompt_token_ids": [VOCAB - 1, VOCAB - 1], "multi_modal_data": {"image": [big, big]}},
        {"prompt_token_ids": [VOCAB - 1, 9], "multi_modal_data": {"image": _picture(84, 140, 3)}},
        {"prompt_token_ids": [5, 9], "multi_modal_data": {"image": _picture(56, 56, 1)}},  # no placeholder
        {"prompt_token_ids": [8, 21, 40]},
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    errors = [o.outputs[0].error for o in outs]
    assert errors[0] is None and errors[6] is None
    for i, words in [(1, "does not decode"), (2, "image mode 'I'"), (3, "limit_mm_per_prompt"),
                     (4, "max_num_batched_tokens=16"), (5, "placeholders")]:  # fmt: skip
        assert outs[i].outputs[0].finish_reason == "error" and errors[i] is not None
        assert f"prompt {i}: " in errors[i] and words in errors[i], errors[i]
        assert outs[i].outputs[0].token_ids == []
    alone = llm.generate([good, prompts[6]], GREEDY, use_tqdm=False)  # the served ones are unchanged
    assert [list(o.outputs[0].token_ids) for o in alone] == [
        list(outs[0].outputs[0].token_ids),
        list(outs[6].outputs[0].token_ids),
    ]


TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_chat_image_url_parts_and_run_batch_lines(vl_dir: Path, tmp_path: Path) -> None:
    """chat() with an image_url data URL: the tokens of generate() with the placeholder and
    the same image; a remote URL: a clear error for that conversation; run-batch: the same."""
    from deepinfer.entrypoints.run_batch import run_batch

    llm = _llm(vl_dir)
    words = merging_tokens(VOCAB)
    placeholder = words[VOCAB - 1]
    image = _picture(56, 84, 5)
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    content = [
        {"type": "text", "text": f"{words[5]} {words[8]}"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    conv = [{"role": "user", "content": content}]
    remote = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}
    ]
    outs = llm.chat([conv, remote], GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    ids = llm.get_tokenizer().encode(f"{words[5]} {words[8]}\n{placeholder} ", add_special_tokens=True)
    assert VOCAB - 1 in ids
    want = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids and outs[0].outputs[0].error is None
    text = {"prompt": f"{words[5]} {words[8]}\n{placeholder} ", "multi_modal_data": {"image": image}}
    assert llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert "offline engine" in (outs[1].outputs[0].error or "")
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": conv, "max_tokens": 4, "temperature": 0, "chat_template": TEMPLATE}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": remote, "max_tokens": 4, "chat_template": TEMPLATE}},
    ]  # fmt: skip
    results = run_batch(llm, "\n".join(json.dumps(line) for line in lines), "vl", use_tqdm=False)
    body = results[0]["response"]["body"]
    assert results[0]["error"] is None and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == len(want[0].prompt_token_ids)
    assert results[1]["response"]["status_code"] == 400 and "offline engine" in results[1]["error"]["message"]

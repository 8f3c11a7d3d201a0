"""Images end to end on a tiny random DeepSeek-V4.1 vision-language checkpoint: greedy tokens of
LLM.generate with multi_modal_data (reference backend, float32) equal the float64 V4.1 oracle's
fed with the float64 vision oracle's spans (deepinfer.testing.v41_oracle / vision_oracle: no code
shared with the model), for images of several sizes and aspect ratios, two images in one prompt,
text-only prompts in the same batch, whole and chunked prefill (a step budget that would cut
spans), with and without Engram. Then what could hide a wrong answer: the image routing bias and
the image content change the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.engine.images import process_image
from deepinfer.models.config_v41 import parse_vision
from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint
from deepinfer.testing.v41_oracle import V41Oracle
from deepinfer.testing.vision_oracle import VisionOracle

NEW = 6
VOCAB = 64
PLACEHOLDER = VOCAB - 1  # tiny_v41_config's image_token_id
UNIT = 28  # patch 14 x downsample 2: one aligned token
START, IMAGE, NEWLINE, END = VOCAB, VOCAB + 2, VOCAB + 3, VOCAB + 4


def _picture(h: int, w: int, seed: int) -> Image.Image:
    g = np.random.default_rng(seed)
    return Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _pixels(image: Image.Image, raw: dict[str, Any]) -> torch.Tensor:
    """The pixels the tower sees: the image itself where it is sized in whole aligned tokens (the
    processor keeps it), else the processor's resize (tests/test_vision_inputs.py checks that)."""
    if image.height % UNIT == 0 and image.width % UNIT == 0:
        return torch.from_numpy(np.asarray(image).copy())
    v = parse_vision(raw["vision_config"])
    assert v is not None
    return process_image(image, v).pixels


def _expected_prompt(
    parts: list[Any], raw: dict[str, Any]
) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """Text ids and images -> the prompt ids the engine should build (each image: start, rows of
    image ids closed by newline, end) and each image's start position and pixels."""
    ids: list[int] = []
    starts = []
    for part in parts:
        if isinstance(part, Image.Image):
            pixels = _pixels(part, raw)
            n_h, n_w = pixels.shape[0] // UNIT, pixels.shape[1] // UNIT
            starts.append((len(ids), pixels))
            ids += [START, *(([IMAGE] * n_w + [NEWLINE]) * n_h), END]
        else:
            ids += part
    return ids, starts


class Case:
    def __init__(self, root: Path, engram: bool) -> None:
        extra = {"engram_compressed_vocab_size": None} if engram else {}  # identity ids, no tokenizer
        raw = tiny_v41_config(vision=True, vocab=VOCAB, engram=engram, layers=4, window=4, **extra)
        self.raw, self.tensors = raw, random_v41_tensors(raw, seed=11 if engram else 5)
        self.root = write_v41_checkpoint(root, raw, self.tensors)
        self.text = V41Oracle(raw, self.tensors)
        self.vision = VisionOracle(raw, self.tensors)

    def expected(
        self, parts: list[Any], tensors: dict[str, torch.Tensor] | None = None
    ) -> tuple[list[int], list[int]]:
        ids, starts = _expected_prompt(parts, self.raw)
        vision = self.vision if tensors is None else VisionOracle(self.raw, tensors)
        text = self.text if tensors is None else V41Oracle(self.raw, tensors)
        images = [(s, vision.span(pixels)) for s, pixels in starts]
        return ids, text.greedy(ids, NEW, images=images)

    def llm(self, **kwargs: Any) -> LLM:
        args = {"backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 128}
        # head_dim 24: no whole 32-value scale blocks for V4.1's quantised rows, so unquantised
        return LLM(str(self.root), **(args | {"kv_cache_dtype": "bf16"} | kwargs))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "engram"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(tmp_path_factory.mktemp("vl"), request.param)


def _request(parts: list[Any]) -> dict[str, Any]:
    """The user's request: text ids with one placeholder per image, the images."""
    ids = [t for p in parts for t in ([PLACEHOLDER] if isinstance(p, Image.Image) else p)]
    images = [p for p in parts if isinstance(p, Image.Image)]
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}


PROMPTS = [
    [[5, 9], _picture(56, 56, 1), [17, 30, 4]],  # a square image, 2 x 2 tokens
    [[8, 21, 40, 3, 11]],  # text only, in the same batch
    [[12], _picture(28, 112, 2), [6], _picture(84, 28, 3), [44, 2]],  # two images: 1 x 4 and 3 x 1
    [_picture(28, 28, 4), [33]],  # an image first, one token
    [[7], _picture(45, 100, 6), [19]],  # resized by the processor to 2 x 4 tokens (56 x 112)
]


@pytest.mark.parametrize("budget", [None, 12], ids=["whole", "chunked"])
def test_generate_with_images_matches_the_oracles(case: Case, budget: int | None) -> None:
    """budget 12: steps of at most 12 tokens; each image span (4 to 12 positions) is computed in
    one step, the text around them chunked anywhere."""
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget, "enable_chunked_prefill": True}
    llm = case.llm(**kwargs)
    model, encoded = llm.llm_engine.model, []
    encode = model.encode_images

    def counting(images: list[torch.Tensor]) -> list[torch.Tensor]:
        encoded.extend(tuple(im.shape) for im in images)
        return encode(images)

    model.encode_images = counting  # type: ignore[method-assign]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([_request(p) for p in PROMPTS], sp, use_tqdm=False)
    # each image through the tower once, whole: no chunk ended inside a span
    assert sorted(encoded) == sorted(
        tuple(_pixels(p, case.raw).shape) for ps in PROMPTS for p in ps if isinstance(p, Image.Image)
    )
    for parts, out in zip(PROMPTS, outs):
        ids, want = case.expected(parts)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(ids)} positions"


def test_image_bias_and_content_change_the_tokens(case: Case) -> None:
    """The parity above could not miss the image routing bias or the pixels: the oracle with the
    text bias for image tokens, or with another image, gives other tokens for some prompt."""
    no_vl = {k: v for k, v in case.tensors.items() if not k.endswith("gate.bias_vl")}
    parts = [PROMPTS[0], PROMPTS[2]]
    assert [case.expected(p, no_vl)[1] for p in parts] != [case.expected(p)[1] for p in parts]
    other = [[5, 9], _picture(56, 56, 99), [17, 30, 4]]
    assert case.expected(other)[1] != case.expected(PROMPTS[0])[1]


def test_preemption_recomputes_the_images(case: Case) -> None:
    """Few KV blocks for the batch: requests are preempted and recomputed (their images encoded
    again); the tokens do not change."""
    llm = case.llm(
        max_num_batched_tokens=16, enable_chunked_prefill=True, num_gpu_blocks_override=14, max_model_len=48
    )
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([_request(p) for p in PROMPTS], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [case.expected(p)[1] for p in PROMPTS]
    assert llm.llm_engine.scheduler.num_preemptions > 0

"""Image inputs of a vision-language model (DeepSeek-V4.1-Flash): decoding, "anyres" resizing,
the prompt's image spans (reference deepseek-v4.1.md, section 1.12).

A request's images come as vLLM takes them (`{"prompt": ..., "multi_modal_data": {"image":
PIL.Image | [PIL.Image, ...]}}`; encoded bytes and `data:image/...;base64,` URLs are accepted
too, the latter from chat's image_url parts). Each image is decoded with Pillow, converted to
RGB and resized on host threads (a pool shared by the engine: Pillow releases the GIL while it
decodes and resizes) to a grid of n_h x n_w aligned tokens, (n_h p d) x (n_w p d) pixels:

  1. wider than max_wh_ratio: the width is squeezed to height * max_wh_ratio first;
  2. fewer than min_pixels: scaled up, aspect ratio kept;
  3. n_w = ceil(w / (p d)), n_h = ceil(h / (p d)); where the span n_h (n_w + 1) + 2 exceeds
     max_image_tokens, the largest grid of the image's aspect ratio that fits:
     n_w = floor(sqrt((max - 2) / r + 1/4) - 1/2), n_h = floor(n_w r), r = h / w, at least 1
     each (DeepSeek's solve; here in whole aligned tokens, so no patch row is padded).
Normalisation ((x / 255 - 0.5) / 0.5) and patching run on the device (models.vision.to_patches)
from the uint8 pixels, a quarter of the float bytes to copy.

In the prompt each image placeholder (config.json's image_token_id, one per image, in order)
becomes the image's span `[start] + ([image] * n_w + [newline]) * n_h + [end]` of the learned
image ids past the vocabulary (models.vision_layout); the model replaces those positions' input
embeddings by the span the vision tower computes. Anything wrong with one image (not an image,
an unsupported mode, more images than limit_mm_per_prompt, a span longer than a step's token
budget) is an ImageInputError for its request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.models.config_vision import VisionConfig
from deepinfer.models.vision_layout import ImageTokenIds, image_token_count, image_token_layout

# Pillow modes converted to RGB without losing what they hold (alpha is dropped); others (16-bit
# and float greyscale "I", "I;16", "F", ...) would be clipped, so they are refused
SUPPORTED_MODES = ("RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr")


class ImageInputError(ValueError):
    """One request's image cannot be served (its request finishes with this error)."""


@dataclass(frozen=True)
class ProcessedImage:
    """One resized image: pixels (h, w, 3) uint8 with h = n_h p d and w = n_w p d; digest: a
    sha256 of the decoded image (mode, size, pixels), what prefix caching keys its span by."""

    pixels: torch.Tensor
    n_h: int
    n_w: int
    digest: bytes

    @property
    def num_tokens(self) -> int:
        return image_token_count(self.n_h, self.n_w)


@dataclass(frozen=True)
class ImageSpan:
    """An image's place in its request's prompt: positions [start, start + length)."""

    start: int
    image: ProcessedImage

    @property
    def length(self) -> int:
        return self.image.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.length


def plan_grid(width: int, height: int, v: VisionConfig) -> tuple[int, int]:
    """(n_h, n_w) aligned tokens of a width x height image (the module's rules 1-3)."""
    w, h = float(width), float(height)
    if v.max_wh_ratio is not None and w > h * v.max_wh_ratio:
        w = h * v.max_wh_ratio
    if 0 < w * h < v.min_pixels:
        scale = math.sqrt(v.min_pixels / (w * h))
        w, h = w * scale, h * scale
    unit = v.patch_size * v.downsample_ratio
    n_w, n_h = max(1, math.ceil(w / unit)), max(1, math.ceil(h / unit))
    budget = v.max_image_tokens
    if image_token_count(n_h, n_w) <= budget:
        return n_h, n_w
    r = h / w
    n_w = max(1, math.floor(math.sqrt((budget - 2) / r + 0.25) - 0.5))
    n_h = max(1, math.floor(n_w * r))
    while image_token_count(n_h, n_w) > budget:  # an extreme aspect ratio: shrink the long side
        if n_h >= n_w and n_h > 1:
            n_h -= 1
        elif n_w > 1:
            n_w -= 1
        else:
            break
    return n_h, n_w


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; any other URL is an ImageInputError
    (an offline engine fetches nothing)."""
    if not url.startswith("data:"):
        raise ImageInputError(
            f"image URL {url[:60]!r}: only data: URLs (data:image/...;base64,...) are accepted; deepinfer "
            "is an offline engine and fetches nothing (download the image and pass it as a data URL or a "
            "PIL.Image)"
        )
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ImageInputError(f"image URL {url[:40]!r}...: expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"image data URL: the base64 payload does not decode: {exc}") from exc


def open_image(item: Any) -> Any:
    """A PIL.Image from a PIL.Image, encoded bytes, or a data URL (decoded, not yet converted)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, str):
        item = decode_data_url(item)
    if isinstance(item, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(item))
            image.load()
        except (
            UnidentifiedImageError,
            Image.DecompressionBombError,
            OSError,
            ValueError,
            SyntaxError,
        ) as exc:
            raise ImageInputError(f"the image does not decode (corrupt or not an image): {exc}") from exc
        return image
    raise ImageInputError(
        f"an image must be a PIL.Image, encoded image bytes or a data:image URL, got {type(item).__name__}"
    )


def process_image(item: Any, v: VisionConfig) -> ProcessedImage:
    """Decode, check, convert to RGB and resize one image (module docstring)."""
    from PIL import Image

    image = open_image(item)
    if image.mode not in SUPPORTED_MODES:
        raise ImageInputError(
            f"image mode {image.mode!r} is not supported; supported: {', '.join(SUPPORTED_MODES)} "
            "(convert it first, e.g. image.convert('RGB'))"
        )
    if image.width < 1 or image.height < 1:
        raise ImageInputError(f"the image is empty ({image.width}x{image.height})")
    try:
        rgb = image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise ImageInputError(f"the image does not decode (corrupt or truncated): {exc}") from exc
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).digest()
    n_h, n_w = plan_grid(rgb.width, rgb.height, v)
    unit = v.patch_size * v.downsample_ratio
    resized = rgb.resize((n_w * unit, n_h * unit), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(n_h * unit, n_w * unit, 3)
    return ProcessedImage(pixels, n_h, n_w, digest)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="images")
        return _POOL


def process_images(items: list[Any], v: VisionConfig) -> list[ProcessedImage | ImageInputError]:
    """process_image of each item on the host threads; a failing image gives its error."""

    def one(item: Any) -> ProcessedImage | ImageInputError:
        try:
            return process_image(item, v)
        except ImageInputError as exc:
            return exc

    if len(items) <= 1:
        return [one(item) for item in items]
    return list(_pool().map(one, items))


def image_items(multi_modal_data: Any, limit: int | None) -> list[Any]:
    """The images of a prompt's multi_modal_data ({"image": one or a list}), at most `limit`."""
    if not isinstance(multi_modal_data, dict):
        raise ImageInputError(
            f"multi_modal_data must be a dict like {{'image': ...}}, got {type(multi_modal_data).__name__}"
        )
    other = sorted(str(k) for k, val in multi_modal_data.items() if k != "image" and val is not None)
    if other:
        raise ImageInputError(
            f"multi_modal_data: {', '.join(map(repr, other))} not supported; images only ('image')"
        )
    images = multi_modal_data.get("image")
    items = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if limit is not None and len(items) > limit:
        raise ImageInputError(
            f"{len(items)} images in one prompt, more than limit_mm_per_prompt={{'image': {limit}}}"
        )
    return items


def expand_prompt(
    ids: list[int], images: list[ProcessedImage], placeholder: int, layout_ids: ImageTokenIds
) -> tuple[list[int], list[ImageSpan]]:
    """The prompt ids with each placeholder replaced by its image's span, and the spans."""
    where = [i for i, t in enumerate(ids) if t == placeholder]
    if len(where) != len(images):
        raise ImageInputError(
            f"the prompt has {len(where)} image placeholders (token id {placeholder}) for {len(images)} "
            "images: put one placeholder per image where it belongs (chat's image_url parts add them)"
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    prev = 0
    for i, image in zip(where, images):
        out += ids[prev:i]
        spans.append(ImageSpan(len(out), image))
        out += image_token_layout(image.n_h, image.n_w, layout_ids)
        prev = i + 1
    return out + ids[prev:], spans


@dataclass(frozen=True)
class ImageSetup:
    """What the engine's requests need to take images: the model's vision_config, its
    placeholder id (config.json image_token_id), the span's ids, limit_mm_per_prompt's image
    count (None: no limit) and the longest span a step computes (max_num_batched_tokens:
    chunked prefill never splits an image)."""

    vision: VisionConfig
    placeholder: int
    ids: ImageTokenIds
    limit: int | None
    max_span: int

    def prefetch(self, prompts: list[Any]) -> dict[int, ProcessedImage | ImageInputError]:
        """Every image of a call's prompts processed at once on the host threads, by id(item)
        (expand's `done`): the requests' images are decoded and resized in parallel."""
        items = []
        for prompt in prompts:
            mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            images = mm.get("image") if isinstance(mm, dict) else None
            items += list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
        return dict(zip(map(id, items), process_images(items, self.vision)))

    def expand(
        self,
        ids: list[int],
        multi_modal_data: Any,
        done: dict[int, ProcessedImage | ImageInputError] | None = None,
    ) -> tuple[list[int], list[ImageSpan]]:
        """A prompt's ids and multi_modal_data -> the expanded ids and the image spans
        (ImageInputError naming the first image that cannot be served); done: images already
        processed (prefetch)."""
        items = image_items(multi_modal_data, self.limit)
        if not items:
            return ids, []
        images: list[ProcessedImage] = []
        done = done or {}
        todo = [item for item in items if id(item) not in done]
        done = done | dict(zip(map(id, todo), process_images(todo, self.vision)))
        for i, got in enumerate(done[id(item)] for item in items):
            if isinstance(got, ImageInputError):
                raise ImageInputError(f"image {i}: {got}") from got
            if got.num_tokens > self.max_span:
                raise ImageInputError(
                    f"image {i}: its {got.n_h}x{got.n_w} grid takes {got.num_tokens} prompt positions, more "
                    f"than max_num_batched_tokens={self.max_span} (an image is computed in one step); raise "
                    "max_num_batched_tokens or lower vision_config max_image_tokens"
                )
            images.append(got)
        return expand_prompt(ids, images, self.placeholder, self.ids)


def image_setup(model_config: Any, config: Any) -> ImageSetup | None:
    """The ImageSetup of a model (models.config.ModelConfig) under engine arguments `config`
    (EngineConfig: limit_mm_per_prompt, max_num_batched_tokens); None without a vision tower."""
    v41 = getattr(model_config, "v41", None)
    vision = getattr(v41, "vision", None)
    if v41 is None or vision is None:
        return None
    if v41.image_token_id is None:
        raise ValueError("config.json has a vision_config but no image_token_id (the image placeholder)")
    limits = config.limit_mm_per_prompt or {}
    return ImageSetup(
        vision, v41.image_token_id, vision.token_ids(model_config.vocab_size), limits.get("image"),
        config.max_num_batched_tokens,
    )  # fmt: skip


def split_image_parts(messages: list[Any], placeholder: str) -> tuple[list[Any], list[Any]]:
    """A chat conversation's OpenAI image parts ({"type": "image_url", "image_url": {"url":
    ...}}, the url also given directly) -> text parts holding the placeholder token's text
    (one per image, where the image was), and the images' URLs in order (new message dicts;
    the caller's are left alone). Other parts pass unchanged."""
    out: list[Any] = []
    images: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(
                        "an image_url part needs {'image_url': {'url': 'data:image/...;base64,...'}}"
                    )
                images.append(url)
                parts.append({"type": "text", "text": placeholder})
            else:
                parts.append(part)
        out.append(dict(message, content=parts))
    return out, images


def chat_prompt(
    tokenizer: Any, setup: ImageSetup | None, messages: list[Any], **template: Any
) -> dict[str, Any]:
    """One conversation rendered by the tokenizer's chat template (Tokenizer.apply_chat_template
    with `template`'s arguments) as a prompt dict; its image parts become placeholders and its
    multi_modal_data (a model without a vision tower leaves them to the template's checks)."""
    images: list[Any] = []
    if setup is not None:
        placeholder = tokenizer.hf_tokenizer.convert_ids_to_tokens(setup.placeholder)
        messages, images = split_image_parts(messages, placeholder)
    text, ids = tokenizer.apply_chat_template(messages, **template)
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt

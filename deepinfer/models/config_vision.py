"""DeepSeek-V4.1's vision_config (reference deepseek-v4.1.md, sections 1.1 and 1.12).

DeepSeek's config.json holds the processor's and aligner's fields: `hidden_size` (the ViT width,
1024), `downsample_ratio` (d: the aligner concatenates d x d neighbouring patches),
`patch_size` (14), `max_image_tokens`, `min_pixels`, `max_wh_ratio`. The ViT's depth (32), heads
(16) and SwiGLU width (1024 * 2.7 rounded up to a multiple of 128: 2816) are constants in
DeepSeek's code; here they are read from the optional keys `depth`, `num_heads` and
`intermediate_size` with those defaults, so tiny test towers use the same code. Parsed by
config_v41.parse_vision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.models.vision_layout import ImageTokenIds

# DeepSeek's ViT constants (models/vision_encoder/vit.py of its engine)
VIT_DEPTH, VIT_HEADS, VIT_MLP_RATIO, VIT_MULTIPLE_OF = 32, 16, 2.7, 128
NORM_EPS, ROPE_THETA = 1e-6, 10000.0
# The image ids sit past the text vocabulary: vocab_size + offset (DeepSeek's ImageTokenOffset)
START, PAD, IMAGE, NEWLINE, END = 0, 1, 2, 3, 4
NUM_IMAGE_IDS = 5  # ids vocab_size .. vocab_size + 4
PIXEL_MEAN = PIXEL_STD = 0.5  # the processor's normalisation, every channel


def vit_intermediate(width: int) -> int:
    """DeepSeek's SwiGLU width: int(width * 2.7) rounded up to a multiple of 128."""
    return VIT_MULTIPLE_OF * math.ceil(int(width * VIT_MLP_RATIO) / VIT_MULTIPLE_OF)


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's and processor's fields. width / heads / depth / intermediate: the ViT;
    patch_size p, downsample_ratio d: an image of (n_h p d) x (n_w p d) pixels gives
    (n_h d) x (n_w d) patches and n_h x n_w aligned tokens; max_image_tokens bounds an image's
    prompt positions (its layout's n_h (n_w + 1) + 2); min_pixels: smaller images are scaled up;
    max_wh_ratio: wider images are squeezed to this width / height first (None: no limit)."""

    width: int
    depth: int
    heads: int
    intermediate: int
    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None
    norm_eps: float = NORM_EPS
    rope_theta: float = ROPE_THETA

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def token_ids(self, vocab_size: int) -> ImageTokenIds:
        """The learned image vectors' ids: vocab_size + DeepSeek's offsets."""
        return ImageTokenIds(
            start=vocab_size + START,
            end=vocab_size + END,
            newline=vocab_size + NEWLINE,
            image=vocab_size + IMAGE,
        )

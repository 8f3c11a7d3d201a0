"""Token layout of one image in a V4.1 prompt (reference deepseek-v4.1.md, section 1.12).

An image of ``n_h x n_w`` aligned tokens (patch grid divided by the aligner's ``d``) occupies
``[start] + ([image] * n_w + [newline]) * n_h + [end]`` positions of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageTokenIds:
    """Ids of the learned image vectors (``vocab_size + offset`` in the checkpoint)."""

    start: int
    end: int
    newline: int
    image: int


def aligned_grid(height: int, width: int, patch: int, downsample: int) -> tuple[int, int]:
    """(n_h, n_w) aligned tokens of a ``height x width`` image that the processor has already resized."""
    step = patch * downsample
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(
            f"image of {height}x{width} pixels is not a positive multiple of patch*downsample = {step}"
        )
    return height // step, width // step


def image_token_layout(n_h: int, n_w: int, ids: ImageTokenIds) -> list[int]:
    """Prompt ids of one image: start, n_h rows of n_w image ids each closed by newline, end."""
    if n_h <= 0 or n_w <= 0:
        raise ValueError(f"image grid must be positive, got {n_h}x{n_w}")
    return [ids.start, *(([ids.image] * n_w + [ids.newline]) * n_h), ids.end]


def image_token_count(n_h: int, n_w: int) -> int:
    """Prompt positions taken by one image: n_h * (n_w + 1) + 2."""
    return n_h * (n_w + 1) + 2

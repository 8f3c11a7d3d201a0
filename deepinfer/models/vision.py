"""DeepSeek-V4.1's vision tower (reference deepseek-v4.1.md, section 1.12), over the backend
contract: ViT -> aligner -> the image's span of prompt embeddings.

Symbols: P patches of all images in the call, W ViT width, Hv heads of Dv = W / Hv, I the
SwiGLU width, p patch size, d downsample ratio, H the text model's hidden size.

ViT: patch embedding (a biased Linear over each patch's 3 x p x p pixels, channel-major), then
`depth` pre-norm blocks x += wo(attn(norm1 x)); x += w2(swiglu(w1(norm2 x))) and a final RMSNorm.
Attention: biased wqkv, the 2D rope on q and k, bidirectional inside each image
(attention.varlen_attention, one segment per image), softmax scale Dv^-0.5. The rope rotates
the pairs (i, i + Dv/2) of each head (not interleaved): the first Dv/4 pairs by the patch's row,
the next Dv/4 by its column, frequencies theta^(-4i / Dv).
Aligner: each d x d block of neighbouring patches concatenated channel-major (feature c * d^2 +
i * d + j of patch (i, j) of the block, as torch's unfold orders them) -> Linear(W d^2 -> H) ->
GELU (erf) -> Linear(H -> H), both biased.
Span: `[start] + ([image] * n_w + [newline]) * n_h + [end]` (models.vision_layout), the start /
newline / end rows the learned vectors image_start / image_newline / image_end.

Tensor names are DeepSeek's (hugging_face/names.py of its engine), with or without `model.`:
vision.patch_embed.proj.{weight,bias}, vision.blocks.{i}.{norm1,norm2}.weight,
vision.blocks.{i}.attn.{wqkv,wo}.{weight,bias}, vision.blocks.{i}.mlp.w1.weight ([gate | up],
(2I, W)), vision.blocks.{i}.mlp.w2.weight, vision.norm.weight, aligner.{w1,w2}.{weight,bias},
image_start, image_end, image_newline. Float weights only (FP8 vision linears are refused).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.backend.ops import Backend
from deepinfer.models.config_vision import PIXEL_MEAN, PIXEL_STD, VisionConfig
from deepinfer.models.layers import RMSNorm
from deepinfer.models.weights import WeightSource


def _placeholder() -> torch.Tensor:
    return torch.empty(0, device="meta")


def to_patches(pixels: torch.Tensor, patch: int, dtype: torch.dtype) -> torch.Tensor:
    """One resized image, uint8 (h, w, 3) with h and w multiples of `patch`, on any device ->
    its normalised patches (h/p * w/p, 3 p p) in `dtype`, row-major over the patch grid, each
    patch channel-major: ((x / 255) - mean) / std."""
    h, w, _ = pixels.shape
    x = (pixels.permute(2, 0, 1).float() / 255.0 - PIXEL_MEAN) / PIXEL_STD  # (3, h, w)
    x = x.view(3, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return x.reshape((h // patch) * (w // patch), 3 * patch * patch).to(dtype)


def rope_table(
    grids: Sequence[tuple[int, int]], head_dim: int, theta: float, device: torch.device
) -> torch.Tensor:
    """(P, Dv) float32 rows [cos(r f) | cos(c f) | sin(r f) | sin(c f)] of every patch (row r,
    column c of its image's grid), f the Dv/4 frequencies theta^(-4i / Dv): small.rope's
    cos_sin_cache with one row per patch (positions arange(P))."""
    quarter = head_dim // 4
    freqs = theta ** (-torch.arange(quarter, dtype=torch.float32, device=device) / quarter)  # (Dv/4,)
    rows, cols = [], []
    for gh, gw in grids:
        rows.append(torch.arange(gh, device=device).repeat_interleave(gw))
        cols.append(torch.arange(gw, device=device).repeat(gh))
    r = torch.cat(rows).float()[:, None] * freqs  # (P, Dv/4)
    c = torch.cat(cols).float()[:, None] * freqs
    return torch.cat([r.cos(), c.cos(), r.sin(), c.sin()], dim=-1)


class BiasedLinear(nn.Module):
    """y = x W^T + b (gemm.linear with its bias), float weights."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, backend: Backend, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.backend, self.shape, self.has_bias = backend, (out_features, in_features), bias
        self.register_buffer("weight", _placeholder())
        self.register_buffer("bias", _placeholder() if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.backend.gemm.linear(x, self.weight, self.bias)
        return y

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        if reader.has(f"{prefix}.scale"):  # DeepSeek-V4.1's FP8 scale name
            raise ValueError(f"{prefix}: FP8 vision-tower weights are not supported (float weights only)")
        self.weight = reader.get(f"{prefix}.weight", self.shape, dtype)
        if self.has_bias:
            self.bias = reader.get(f"{prefix}.bias", (self.shape[0],), dtype)


class VisionBlock(nn.Module):
    def __init__(self, backend: Backend, v: VisionConfig) -> None:
        super().__init__()
        self.backend, self.heads, self.head_dim = backend, v.heads, v.head_dim
        self.norm1 = RMSNorm(backend, v.width, v.norm_eps)
        self.norm2 = RMSNorm(backend, v.width, v.norm_eps)
        self.wqkv = BiasedLinear(backend, v.width, 3 * v.width)
        self.wo = BiasedLinear(backend, v.width, v.width)
        self.w1 = BiasedLinear(backend, v.width, 2 * v.intermediate, bias=False)
        self.w2 = BiasedLinear(backend, v.intermediate, v.width, bias=False)

    def forward(
        self, x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, longest: int
    ) -> torch.Tensor:
        small, n = self.backend.small, x.shape[0]
        qkv = self.wqkv(self.norm1(x)).view(n, 3, self.heads, self.head_dim)  # (P, 3, Hv, Dv)
        q = small.rope(qkv[:, 0], positions, table, False)
        k = small.rope(qkv[:, 1], positions, table, False)
        a = self.backend.attention.varlen_attention(q, k, qkv[:, 2], cu, longest, scale=self.head_dim**-0.5)
        y, x = self.norm2.add(self.wo(a.reshape(n, -1)), x)  # (norm2(x + attn), x + attn)
        out: torch.Tensor = x + self.w2(small.silu_and_mul(self.w1(y)))
        return out

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.norm1.load(reader, f"{prefix}.norm1.weight", torch.float32)
        self.norm2.load(reader, f"{prefix}.norm2.weight", torch.float32)
        self.wqkv.load(reader, f"{prefix}.attn.wqkv", dtype)
        self.wo.load(reader, f"{prefix}.attn.wo", dtype)
        self.w1.load(reader, f"{prefix}.mlp.w1", dtype)
        self.w2.load(reader, f"{prefix}.mlp.w2", dtype)


class VisionModel(nn.Module):
    """The ViT, the aligner and the image vectors. encode(images) -> each image's span rows."""

    image_start: torch.Tensor  # (H,)
    image_end: torch.Tensor
    image_newline: torch.Tensor

    def __init__(self, backend: Backend, v: VisionConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.backend, self.config, self.hidden, self.dtype = backend, v, hidden_size, dtype
        p, d = v.patch_size, v.downsample_ratio
        self.patch_embed = BiasedLinear(backend, 3 * p * p, v.width)
        self.blocks = nn.ModuleList(VisionBlock(backend, v) for _ in range(v.depth))
        self.norm = RMSNorm(backend, v.width, v.norm_eps)
        self.w1 = BiasedLinear(backend, v.width * d * d, hidden_size)
        self.w2 = BiasedLinear(backend, hidden_size, hidden_size)
        for name in ("image_start", "image_end", "image_newline"):
            self.register_buffer(name, _placeholder())  # (H,)

    def tower(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """patches (P, 3 p p) of the images in order, grids their (rows, columns) of patches ->
        the ViT's output (P, W)."""
        dev = patches.device
        lens = [gh * gw for gh, gw in grids]
        if sum(lens) != patches.shape[0]:
            raise ValueError(f"{patches.shape[0]} patches for grids {list(grids)} ({sum(lens)} patches)")
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(dev)
        table = rope_table(grids, self.config.head_dim, self.config.rope_theta, dev)
        positions = torch.arange(patches.shape[0], device=dev)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, table, positions, cu, max(lens, default=0))
        y: torch.Tensor = self.norm(x)
        return y

    def align(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's ViT output (gh gw, W) -> its aligned tokens (gh/d * gw/d, H)."""
        d, (gh, gw) = self.config.downsample_ratio, grid
        if gh % d or gw % d:
            raise ValueError(f"patch grid {gh}x{gw} is not a multiple of downsample_ratio {d}")
        x = features.view(gh // d, d, gw // d, d, -1).permute(0, 2, 4, 1, 3)  # (n_h, n_w, W, d, d)
        x = self.w1(x.reshape((gh // d) * (gw // d), -1))
        x = nn.functional.gelu(x.float()).to(x.dtype)
        y: torch.Tensor = self.w2(x)
        return y

    def encode(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Resized uint8 images (h, w, 3), h and w multiples of p d (vision_processor) -> each
        image's span (n_h (n_w + 1) + 2, H) in the model's dtype: start, n_h rows of n_w aligned
        tokens each closed by newline, end. All images' ViT runs in one pass."""
        if not images:
            return []
        p, dev = self.config.patch_size, self.patch_embed.weight.device
        grids = [(im.shape[0] // p, im.shape[1] // p) for im in images]
        patches = torch.cat([to_patches(im.to(dev), p, self.dtype) for im in images])
        features = torch.split(self.tower(patches, grids), [gh * gw for gh, gw in grids])
        d, out = self.config.downsample_ratio, []
        for f, (gh, gw) in zip(features, grids):
            tokens = self.align(f, (gh, gw)).view(gh // d, gw // d, -1)
            newline = self.image_newline.to(tokens.dtype).expand(gh // d, 1, -1)
            body = torch.cat([tokens, newline], dim=1).reshape(-1, tokens.shape[-1])
            ends = (self.image_start.to(body.dtype)[None], body, self.image_end.to(body.dtype)[None])
            out.append(torch.cat(ends))
        return out

    def load(self, reader: WeightSource, root: str) -> None:
        dtype = self.dtype
        self.patch_embed.load(reader, f"{root}vision.patch_embed.proj", dtype)
        for i, block in enumerate(self.blocks):
            assert isinstance(block, VisionBlock)
            block.load(reader, f"{root}vision.blocks.{i}", dtype)
        self.norm.load(reader, f"{root}vision.norm.weight", torch.float32)
        self.w1.load(reader, f"{root}aligner.w1", dtype)
        self.w2.load(reader, f"{root}aligner.w2", dtype)
        for name in ("image_start", "image_end", "image_newline"):
            setattr(self, name, reader.get(f"{root}{name}", (self.hidden,), dtype))

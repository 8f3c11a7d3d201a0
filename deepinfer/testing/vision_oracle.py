"""Float64 oracle of DeepSeek-V4.1's vision tower (reference deepseek-v4.1.md, section 1.12),
written from the published description in plain PyTorch, one image at a time, sharing no code
with deepinfer.models (so the model can be checked against it).

- `VisionOracle(config, tensors)`: `config` the config.json dict (its `vision_config` and
  `text_config.hidden_size`), `tensors` DeepSeek's names (vision.*, aligner.*, image_*) -> float
  tensors; every name and shape is checked up front (`vision_tensor_shapes`).
- `oracle.span(pixels)`: one resized uint8 image (h, w, 3) -> its prompt span (n_h (n_w + 1) + 2,
  H) float64: [image_start, n_h rows of n_w aligned tokens each followed by image_newline,
  image_end].
- `oracle.vit(pixels)`: the ViT's output (gh gw, W) for one image.

The math: pixels / 255, then (x - 0.5) / 0.5; p x p patches row-major, each flattened channel,
row, column; patch embedding x W^T + b; per block, with RMSNorm(eps 1e-6) weights:
  q, k, v = split(norm1(x) Wqkv^T + b), heads of Dv; q, k rotated (non-interleaved halves:
  channel i pairs with i + Dv/2), angle of pair i = row * f_i for i < Dv/4, col * f_{i - Dv/4}
  after, f_j = 10000^(-j / (Dv/4)); full softmax(q k^T / sqrt(Dv)) over the image's patches;
  x = x + attn Wo^T + b; x = x + (silu(g) * u) W2^T with [g | u] = norm2(x) W1^T;
final RMSNorm; each d x d block of patches (block row i, column j) concatenated as
feature[c * d * d + di * d + dj]; Linear + bias, GELU(erf), Linear + bias.
"""

from __future__ import annotations

import math
from typing import Any

import torch

F64 = torch.float64


def vision_dims(config: dict[str, Any]) -> dict[str, int]:
    """width, depth, heads, inter, patch, down, hidden of a config.json dict (DeepSeek's
    constants where vision_config does not say: depth 32, 16 heads, SwiGLU 128 * ceil(int(2.7 W) / 128))."""
    v = config["vision_config"]
    width = int(v.get("hidden_size", 1024))
    return {
        "width": width,
        "depth": int(v.get("depth", 32)),
        "heads": int(v.get("num_heads", 16)),
        "inter": int(v.get("intermediate_size", 128 * math.ceil(int(width * 2.7) / 128))),
        "patch": int(v.get("patch_size", 14)),
        "down": int(v.get("downsample_ratio", 2)),
        "hidden": int(config["text_config"]["hidden_size"]),
    }


def vision_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DeepSeek's names and shapes of the vision tower's tensors."""
    m = vision_dims(config)
    w, i, p, d, h = m["width"], m["inter"], m["patch"], m["down"], m["hidden"]
    out: dict[str, tuple[int, ...]] = {
        "vision.patch_embed.proj.weight": (w, 3 * p * p),
        "vision.patch_embed.proj.bias": (w,),
    }
    for b in range(m["depth"]):
        out[f"vision.blocks.{b}.norm1.weight"] = (w,)
        out[f"vision.blocks.{b}.norm2.weight"] = (w,)
        out[f"vision.blocks.{b}.attn.wqkv.weight"] = (3 * w, w)
        out[f"vision.blocks.{b}.attn.wqkv.bias"] = (3 * w,)
        out[f"vision.blocks.{b}.attn.wo.weight"] = (w, w)
        out[f"vision.blocks.{b}.attn.wo.bias"] = (w,)
        out[f"vision.blocks.{b}.mlp.w1.weight"] = (2 * i, w)
        out[f"vision.blocks.{b}.mlp.w2.weight"] = (w, i)
    out["vision.norm.weight"] = (w,)
    out["aligner.w1.weight"] = (h, w * d * d)
    out["aligner.w1.bias"] = (h,)
    out["aligner.w2.weight"] = (h, h)
    out["aligner.w2.bias"] = (h,)
    for name in ("image_start", "image_end", "image_newline"):
        out[name] = (h,)
    return out


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


class VisionOracle:
    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.m = vision_dims(config)
        want = vision_tensor_shapes(config)
        self.t: dict[str, torch.Tensor] = {}
        for name, shape in want.items():
            t = tensors.get(name, tensors.get(f"model.{name}"))
            if t is None:
                raise KeyError(f"vision oracle: tensor {name!r} missing")
            if tuple(t.shape) != shape:
                raise ValueError(f"vision oracle: {name} has shape {tuple(t.shape)}, expected {shape}")
            self.t[name] = t.to(F64)

    def _angles(self, gh: int, gw: int) -> torch.Tensor:
        """(gh gw, Dv/2) rotation angle of each pair of each patch."""
        dv = self.m["width"] // self.m["heads"]
        q = dv // 4
        f = torch.tensor([10000.0 ** (-j / q) for j in range(q)], dtype=F64)
        rows = torch.tensor([r for r in range(gh) for _ in range(gw)], dtype=F64)
        cols = torch.tensor([c for _ in range(gh) for c in range(gw)], dtype=F64)
        return torch.cat([rows[:, None] * f, cols[:, None] * f], dim=1)

    def vit(self, pixels: torch.Tensor) -> torch.Tensor:
        m, t = self.m, self.t
        p, w, nh = m["patch"], m["width"], m["heads"]
        dv = w // nh
        h_px, w_px, _ = pixels.shape
        gh, gw = h_px // p, w_px // p
        img = (pixels.to(F64) / 255.0 - 0.5) / 0.5  # (h, w, 3)
        patches = torch.stack(
            [
                img[r * p : (r + 1) * p, c * p : (c + 1) * p, :].permute(2, 0, 1).reshape(-1)
                for r in range(gh)
                for c in range(gw)
            ]
        )  # (n, 3 p p): channel, row, column
        x = patches @ t["vision.patch_embed.proj.weight"].T + t["vision.patch_embed.proj.bias"]
        ang = self._angles(gh, gw)
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # (n, 1, Dv/2)

        def rot(z: torch.Tensor) -> torch.Tensor:
            a, b = z[..., : dv // 2], z[..., dv // 2 :]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

        n = x.shape[0]
        for b in range(m["depth"]):
            pre = f"vision.blocks.{b}"
            y = _rms(x, t[f"{pre}.norm1.weight"])
            qkv = y @ t[f"{pre}.attn.wqkv.weight"].T + t[f"{pre}.attn.wqkv.bias"]
            q, k, v = (qkv[:, i * w : (i + 1) * w].reshape(n, nh, dv) for i in range(3))
            q, k = rot(q), rot(k)
            heads = []
            for h in range(nh):
                s = q[:, h] @ k[:, h].T / math.sqrt(dv)
                e = torch.exp(s - s.max(dim=1, keepdim=True).values)
                heads.append((e / e.sum(dim=1, keepdim=True)) @ v[:, h])
            a = torch.cat(heads, dim=1)
            x = x + a @ t[f"{pre}.attn.wo.weight"].T + t[f"{pre}.attn.wo.bias"]
            gu = _rms(x, t[f"{pre}.norm2.weight"]) @ t[f"{pre}.mlp.w1.weight"].T
            g, u = gu[:, : m["inter"]], gu[:, m["inter"] :]
            x = x + (g * torch.sigmoid(g) * u) @ t[f"{pre}.mlp.w2.weight"].T
        return _rms(x, t["vision.norm.weight"])

    def span(self, pixels: torch.Tensor) -> torch.Tensor:
        m, t = self.m, self.t
        p, d = m["patch"], m["down"]
        gh, gw = pixels.shape[0] // p, pixels.shape[1] // p
        feats = self.vit(pixels).reshape(gh, gw, -1)
        rows: list[torch.Tensor | None] = []
        for i in range(gh // d):
            for j in range(gw // d):
                block = feats[i * d : (i + 1) * d, j * d : (j + 1) * d, :]  # (d, d, W)
                rows.append(block.permute(2, 0, 1).reshape(-1))  # c * d * d + di * d + dj
            rows.append(None)  # the row's newline
        tokens = torch.stack([r for r in rows if r is not None])
        z = tokens @ t["aligner.w1.weight"].T + t["aligner.w1.bias"]
        z = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
        z = z @ t["aligner.w2.weight"].T + t["aligner.w2.bias"]
        out, it = [t["image_start"]], iter(z)
        for r in rows:
            out.append(t["image_newline"] if r is None else next(it))
        out.append(t["image_end"])
        return torch.stack(out)

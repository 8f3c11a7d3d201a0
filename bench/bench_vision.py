"""Throughput of DeepSeek-V4.1's vision tower (deepinfer.models.vision) at full size with random
weights: ViT width 1024, depth 32, 16 heads, SwiGLU 2816, patch 14, aligner d = 2 into the text
hidden size (--hidden, default 7168: model/deepseek-v4.1-flash's text_config, itself an
estimate), bf16, on one backend.

For each batch of N images (default 1, 8, 32) of --size x --size pixels (resized by the
processor's anyres rule under max_image_tokens 4096: 1024 -> a 37 x 37 token grid, 74 x 74
patches of 14), the median over --iters runs of VisionModel.encode (patching, ViT, aligner,
spans; the uint8 pixels already on the device) -> images/s, the FLOPs an image takes (the
linears, 2 per multiply-add, and the attention's q.k and p.v over the image's patches), the
achieved TFLOP/s, and that as a share of the bf16 matmul rate (8192^3 torch.matmul) measured in
the same run. Results: --out/vision.json and the printed lines.

    python3 bench/bench_vision.py --out /tmp/vision                    # cuda, the H200 run
    python3 bench/bench_vision.py --backend reference --smoke          # a tiny CPU check
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import BackendOptions
from deepinfer.engine.images import plan_grid
from deepinfer.models.config_v41 import parse_vision
from deepinfer.models.config_vision import VisionConfig
from deepinfer.models.vision import VisionModel
from deepinfer.testing.weights import BENCH_INIT, RandomSource


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn: Any, dev: torch.device, iters: int) -> float:
    fn()  # warm-up (Triton compiles on the first call)
    sync(dev)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def matmul_tflops(dev: torch.device, n: int, dtype: torch.dtype) -> float:
    x = torch.randn((n, n), device=dev, dtype=dtype)
    y = torch.randn((n, n), device=dev, dtype=dtype)
    ms = median_ms(lambda: x @ y, dev, 20)
    return 2 * n**3 / ms / 1e9


def image_flops(v: VisionConfig, hidden: int, gh: int, gw: int) -> float:
    """FLOPs of one image of gh x gw patches (2 per multiply-add)."""
    p, d, w, i = v.patch_size, v.downsample_ratio, v.width, v.intermediate
    n = gh * gw
    per_patch_layer = 2 * w * (3 * w + w + 2 * i + i) + 4 * n * w  # linears, then q.k and p.v
    tokens = n // (d * d)
    aligner = 2 * tokens * (w * d * d * hidden + hidden * hidden)
    return n * (2 * 3 * p * p * w + v.depth * per_patch_layer) + aligner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels (square images)")
    ap.add_argument("--hidden", type=int, default=7168, help="the text model's hidden size (aligner output)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a 2-block width-64 tower, small images (CPU check)")
    args = ap.parse_args()

    backend = get_backend(args.backend, BackendOptions())
    dev = backend.device.device()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    raw: dict[str, Any] = {"hidden_size": 1024, "downsample_ratio": 2, "patch_size": 14}
    raw["max_image_tokens"] = 4096
    if args.smoke:
        raw |= {"hidden_size": 64, "num_heads": 4, "depth": 2}
        args.size, args.hidden, args.iters = min(args.size, 112), 64, 1
    v = parse_vision(raw)
    assert v is not None
    model = VisionModel(backend, v, args.hidden, dtype)
    model.load(RandomSource(BENCH_INIT, 0, dev), "")
    n_h, n_w = plan_grid(args.size, args.size, v)
    unit = v.patch_size * v.downsample_ratio
    gh, gw = n_h * v.downsample_ratio, n_w * v.downsample_ratio
    log(
        f"vision tower: width {v.width}, depth {v.depth}, {v.heads} heads, SwiGLU {v.intermediate}, "
        f"{dtype}, backend {backend.name}; {args.size}x{args.size} images -> {n_h}x{n_w} tokens "
        f"({n_h * unit}x{n_w * unit} pixels, {gh * gw} patches)"
    )
    mm = matmul_tflops(dev, 256 if args.smoke else 8192, dtype)
    log(f"{str(dtype).replace('torch.', '')} matmul: {mm:.1f} TFLOP/s")
    flops = image_flops(v, args.hidden, gh, gw)
    g = torch.Generator(device="cpu").manual_seed(0)
    results = []
    for n in [int(b) for b in args.batches.split(",")]:
        images = [
            torch.randint(0, 256, (n_h * unit, n_w * unit, 3), generator=g, dtype=torch.uint8).to(dev)
            for _ in range(n)
        ]
        with torch.inference_mode():
            ms = median_ms(lambda images=images: model.encode(images), dev, args.iters)
        rate = n / ms * 1e3
        tflops = n * flops / ms / 1e9
        results.append({"images": n, "ms": ms, "images_per_s": rate, "tflops": tflops, "share": tflops / mm})
        log(
            f"{n:3d} images: {ms:9.2f} ms, {rate:8.2f} images/s, {tflops:6.1f} TFLOP/s "
            f"= {100 * tflops / mm:5.1f}% of the matmul rate ({flops / 1e12:.2f} TFLOP an image)"
        )
        del images
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"matmul_tflops": mm, "image_tflop": flops / 1e12, "grid": [n_h, n_w], "results": results}
        (args.out / "vision.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

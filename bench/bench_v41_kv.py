"""Decode of a reduced-depth DeepSeek-V4.1-Flash in its published format (FP8 32x32 linears,
MXFP4 routed experts, random weights; KV caches in kv_cache_dtype --kv-cache-dtype, default auto:
FP8 window rings, FP4 main entries and index keys), at each batch of --batches: decode tok/s, the
KV bytes per token of each cache kind against the published formats, and the fraction of the
roofline (bytes a decode step reads and writes / the copy rate measured in the same run).

Model: model/deepseek-v4.1-flash/config.json cut to --layers layers (testing.random_model's
reduced_config: the first layers of each YOCO half), its Engram layers dropped (the shipped
tables do not fit one GPU), built by testing.random_model as `deepinfer bench --random-config`
builds it. One engine (max_num_seqs = the largest batch), decode graphs on.

Workload per batch B: B random prompts of --input-len tokens, greedy, EOS ignored; one generate
of 1 new token (the prefill) and one of --output-len new tokens, each after a warm-up of the same
shape; decode time = the difference, decode tok/s = B (N - 1) / decode time.

KV bytes per token (per cache kind, summed over the layers that hold one; a C2 row stands for 2
tokens): window rings (every layer, bounded by the ring), main entries (KV-source layers), index
keys (index-key sources), C2 state (model dtype, ring-bounded), each against the published row
sizes (reference notes 1.13: 528 B FP8 window rows, 288 B FP4 main rows, 68 B index keys).

Roofline of a decode step of B requests at cache length L (mean over the decode steps):
  weights = every weight tensor but the routed experts and the embedding, read whole; plus
            hit(B) = E (1 - (1 - K/E)^B) routed experts per MoE layer (uniform routing), plus B
            embedding rows
  kv_read = B x per layer: min(L, window) window rows; a compressed layer min(topk, L/m) entry
            rows of its KV source; an index-source layer L/m index keys of its key source
  kv_write = B x per layer one window row; per KV source 1/m entry rows and index keys, C2 its
            state row (2D values)
  bound_s = (weights + kv_read + kv_write) / copy rate;  fraction = bound_s / measured step time

    python bench/bench_v41_kv.py --out DIR                  # H200 (bench/run_v41_h200.sh)
    python bench/bench_v41_kv.py --smoke --out /tmp/v41kv   # the logic on the CPU, tiny V4.1 (FP8)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as e2e  # measure_copy, free_memory

from deepinfer import LLM, SamplingParams
from deepinfer.backend.kv_formats_v41 import bytes_per_entry_v41
from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import BackendOptions
from deepinfer.engine.args import engine_config, resolve_engine_config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.testing.random_model import random_model

REPO = Path(__file__).resolve().parents[1]
FLASH = REPO / "model" / "deepseek-v4.1-flash" / "config.json"
PUBLISHED = {"window": 528, "main": 288, "index": 68}  # bytes a row (notes 1.13)


def write_config(out: Path, smoke: bool) -> Path:
    if smoke:
        from deepinfer.testing.v41_checkpoint import tiny_v41_config

        raw = tiny_v41_config(layers=4, head_dim=32, index_head_dim=32)  # FP8 + MXFP4 as published
    else:
        raw = json.loads(FLASH.read_text())
        raw["text_config"]["engram_layer_ids"] = []
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out / "config.json"


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.device.type == "meta" else t.numel() * t.element_size()


def weight_bytes(model: Any) -> tuple[int, list[int], int, int]:
    """(bytes read whole, per MoE layer the bytes of one routed expert, experts per layer, bytes of
    one embedding row)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    experts, per_expert = 0, []
    for block in model.layers:
        f = block.ffn
        e = int(f.w13.shape[0])
        routed = sum(tensor_bytes(x) for x in (f.w13, f.w2, f.w13_scale, f.w2_scale))
        per_expert.append(routed // e)
        experts = e
        total -= routed
    emb = model.embed_tokens
    total -= (
        tensor_bytes(emb)
        if emb.untyped_storage().data_ptr() != model.lm_head.untyped_storage().data_ptr()
        else 0
    )
    return total, per_expert, experts, emb.shape[1] * emb.element_size()


def kv_per_token(model: Any, worker: Any) -> dict[str, dict[str, Any]]:
    """Per cache kind: the layers holding one, bytes a row, bytes per token over them."""
    v41, d, di = model.v41, model.v41.head_dim, model.v41.index_head_dim
    spec = model.kv_cache_spec(1, worker.block_size)
    fmt = model.kv_cache_dtype
    rows = {g.name: g.cache_spec(spec).bytes_per_token for g in worker.kv_groups}
    out: dict[str, dict[str, Any]] = {}
    layers = range(len(model.layers))  # compress_ratios also lists the draft layers
    window = rows["ring"] if model.formats["window"] is not None else d * spec.dtype.itemsize
    out["window"] = {"layers": len(layers), "row_bytes": window, "published": PUBLISHED["window"]}
    for m in (1, 2):
        kv = [i for i in layers if v41.compress_ratios[i] == m and v41.sharing.kv[i] == i]
        keys = [i for i in layers if v41.compress_ratios[i] == m and v41.sharing.index_k[i] == i]
        if kv:
            out[f"main/C{m}"] = {
                "layers": len(kv), "row_bytes": bytes_per_entry_v41("main", d, fmt), "per": m,
                "published": PUBLISHED["main"],
            }  # fmt: skip
        if keys:
            out[f"index/C{m}"] = {
                "layers": len(keys), "row_bytes": bytes_per_entry_v41("index", di, fmt), "per": m,
                "published": PUBLISHED["index"],
            }  # fmt: skip
    state = [i for i in layers if v41.compress_ratios[i] == 2 and v41.sharing.kv[i] == i]
    if state:
        out["c2_state"] = {"layers": len(state), "row_bytes": 2 * d * model.dtype.itemsize, "published": None}
    for v in out.values():
        v["bytes_per_token"] = v["layers"] * v["row_bytes"] / v.get("per", 1)
    return out


def step_bytes(model: Any, batch: int, length: float, weights: tuple[int, list[int], int, int]) -> float:
    """Bytes a decode step of `batch` requests at cache length `length` reads and writes."""
    v41, d, di = model.v41, model.v41.head_dim, model.v41.index_head_dim
    fmt = model.kv_cache_dtype
    whole, per_expert, e, emb_row = weights
    k = model.config.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** batch)
    total = whole + sum(hit * b for b in per_expert) + batch * emb_row
    win, main, key = (
        bytes_per_entry_v41(kind, w, fmt) for kind, w in (("window", d), ("main", d), ("index", di))
    )
    if model.formats["window"] is None:
        win = main = d * model.dtype.itemsize
        key = di * model.dtype.itemsize
    per_req = 0.0
    for i, m in enumerate(v41.compress_ratios[: len(model.layers)]):
        per_req += min(length, v41.sliding_window) * win + win
        if m:
            per_req += min(v41.index_topk, length / m) * main
            if v41.sharing.index[i] == i:
                per_req += length / m * key
            if v41.sharing.kv[i] == i:
                per_req += main / m + key / m + (2 * d * model.dtype.itemsize if m == 2 else 0)
    return total + batch * per_req


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny V4.1 on the reference backend (CPU)")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.smoke:
        a.input_len, a.output_len, batches = 9, 4, [1, 2]
    config_file = write_config(Path(tempfile.mkdtemp()) / "v41", a.smoke)
    kwargs = {
        "backend": "reference" if a.smoke else "cuda", "kv_cache_dtype": a.kv_cache_dtype,
        "max_num_seqs": max(batches), "max_model_len": a.input_len + a.output_len + 8,
    }  # fmt: skip
    kwargs["quantization"] = "fp8"
    config = resolve_engine_config(engine_config(config_file.parent, kwargs, "bench_v41_kv"), config_file)
    backend = get_backend(config.backend, BackendOptions(max_model_len=config.max_model_len))
    dev = backend.device.device()
    copy = e2e.measure_copy(dev, a.smoke) if not a.smoke else {"gbs": float("nan")}
    start = time.perf_counter()
    model = random_model(
        config_file,
        backend,
        config.torch_dtype,
        fp8=True,
        num_hidden_layers=None if a.smoke else a.layers,
    )
    llm = LLM.from_engine(LLMEngine(config, model=model, backend=backend))
    engine = llm.llm_engine
    ratios = model.v41.compress_ratios[: len(model.layers)]
    print(f"built in {time.perf_counter() - start:.1f} s: {len(model.layers)} layers, ratios {ratios}, "
          f"kv_cache_dtype {model.kv_cache_dtype}")  # fmt: skip
    kv = kv_per_token(model, engine.worker)
    print("KV bytes per token (this run vs the published row formats; window and C2 state: held for the")
    print("last ring positions only, whatever the length):")
    for kind, v in kv.items():
        pub = "-" if v["published"] is None else f"{v['published']} B"
        print(f"  {kind:10s} {v['layers']:3d} layers x {v['row_bytes']:5d} B a row (published {pub})"
              f" / {v.get('per', 1)} tokens = {v['bytes_per_token']:9.1f} B/token")  # fmt: skip
    print(f"  total {sum(v['bytes_per_token'] for v in kv.values()):.1f} B/token")
    weights = weight_bytes(model)
    rows = []
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [
            {"prompt_token_ids": torch.randint(2, vocab, (a.input_len,), generator=gen).tolist()}
            for _ in range(b)
        ]
        times = {}
        for n in (1, a.output_len):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up: graphs captured, kernels compiled
            backend.device.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            backend.device.synchronize()
            times[n] = time.perf_counter() - t0
        steps = a.output_len - 1
        step_s = (times[a.output_len] - times[1]) / steps
        mean_len = a.input_len + 1 + steps / 2
        moved = step_bytes(model, b, mean_len, weights)
        bound = moved / (copy["gbs"] * 1e9)
        row = {
            "batch": b, "decode_tok_s": b / step_s, "step_ms": step_s * 1e3, "bytes_per_step": moved,
            "roofline_step_ms": bound * 1e3, "roofline_fraction": bound / step_s, "prefill_s": times[1],
        }  # fmt: skip
        rows.append(row)
        print(f"batch {b:3d}: decode {row['decode_tok_s']:9.1f} tok/s, step {row['step_ms']:.2f} ms, "
              f"{moved / 1e9:.3f} GB a step, roofline {row['roofline_step_ms']:.2f} ms at "
              f"{copy['gbs']:.0f} GB/s copy = {row['roofline_fraction']:.2f} of it")  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    result = {
        "rows": rows,
        "kv_per_token": kv,
        "copy": copy,
        "layers": len(model.layers),
        "args": vars(a) | {"out": str(a.out)},
    }
    (a.out / "v41_kv.json").write_text(json.dumps(result, indent=1))
    e2e.free_memory(dev)


if __name__ == "__main__":
    main()

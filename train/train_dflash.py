"""Train the DFlash (DSpark) drafter (deepinfer.models.dflash) of a trained model, by
self-distillation, on one GPU in minutes (or one CPU core, slowly).

    python train/train_dflash.py --model model/tiny --out model/tiny --device cuda --minutes 1.5
    python train/train_dflash.py --model DIR --out DIR --toy          # seconds on the CPU (tests)

Data as train/train_drafter.py's (the same corpus, held-out rule and tokenizer): random windows,
the frozen model run over them with deepinfer's own model code (the reference backend, on
--device, in float32), keeping its residual streams entering target_layer_ids (the trunks KV
injection reads) and its greedy token at every position g_p (what it would decode). A block
anchored at t (the last position the target computed) holds x_{t+1} and B - 1 noise tokens at
t+1 .. t+B; slot s learns g_{t+1+s}, its Markov term fed prev_s = x_{t+1} (s = 0) or g_{t+s} (the
previous slot's target: its draft when that draft is accepted). Every block of a window attends
the window's injected context up to its anchor and its own slots: block_forward, the math of
deepinfer.testing.dflash_oracle.dflash_block (the dense forward the engine's paged forward is
checked against in tests/test_dflash.py) batched over windows, in bfloat16 on a GPU.

Loss = mean over slots of the cross-entropy against g + conf_weight * the confidence head's binary
cross-entropy: c_s against "draft s equals g" on the blocks whose drafts before s all did (c_s is
the chance draft s is accepted given the ones before it were). Embedding and LM head are the
model's, frozen. AdamW, linear warm-up then cosine decay to lr / 10 over the budget. Writes
OUT/dflash/config.json, OUT/dflash/model.safetensors (bfloat16) and OUT/dflash/train_log.json
(loss curve, held-out acceptance per slot, mean accepted length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_drafter import corpus, sample_windows

from deepinfer.models.dflash import DFlashConfig, read_config, save_dflash
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import DEVICE_ENV, create_reference_backend
from deepinfer.testing.checkpoints import dflash_tensor_shapes
from deepinfer.testing.dflash_oracle import _context, _ffn, _head, _kv, _query, _slots
from deepinfer.testing.oracles import _rms, _softmax_scale
from deepinfer.testing.paged_runner import BlockAllocator, build_batch


@dataclass(frozen=True)
class Preset:
    num_layers: int = 2
    block_size: int = 5
    target_layer_ids: tuple[int, ...] = (1, 2, 3)
    markov_rank: int = 64
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # the model's: its experts can start the drafter's
    init_from_target: bool = True  # start from the model's last layers (init_from_target)
    windows: int = 32  # windows the model runs over per refresh
    window: int = 512  # tokens per window (the model's training length)
    anchors: int = 192  # blocks per window per step
    reuse: int = 3  # drafter steps per model run (each on other anchors of the same windows)
    lr: float = 3e-3
    warmup: int = 50  # steps of linear warm-up
    conf_weight: float = 0.5
    max_files: int | None = None
    eval_windows: int = 32
    toy_steps: int = 0  # > 0: a fixed number of steps instead of the time budget


FULL = Preset()
TOY = Preset(
    num_layers=1, block_size=3, target_layer_ids=(0, 1), markov_rank=4, n_routed_experts=2,
    num_experts_per_tok=1, moe_intermediate_size=16, windows=2, window=48, anchors=8, reuse=2,
    lr=1e-2, warmup=2, max_files=6, eval_windows=2, toy_steps=20, init_from_target=False,
)  # fmt: skip

NOISE_TOKEN = 2  # <｜User｜>: never in the corpus (documents are BOS + code + EOS)


@torch.no_grad()
def target_outputs(
    model: Any, windows: torch.Tensor, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model over windows (W, L) -> (trunks (W, L, n, Dm) float32, greedy (W, L))."""
    w, n = windows.shape
    block = 64
    alloc = BlockAllocator(w * -(-n // block), block)
    spec = model.kv_cache_spec(w * -(-n // block), block)
    caches = model.backend.kv_cache.allocate(spec, model.config.num_hidden_layers)
    batch = build_batch(alloc, [(i, windows[i].tolist()) for i in range(w)], windows.device, all_logits=True)
    hidden, trunks = model.forward_trunks(batch, caches, layer_ids)
    greedy = model.compute_logits(hidden).argmax(dim=-1)
    return trunks.float().reshape(w, n, len(layer_ids), -1).clone(), greedy.reshape(w, n).clone()


def init_weights(model: Any, config: DFlashConfig, seed: int) -> dict[str, torch.nn.Parameter]:
    """Matrices ~ N(0, 1/fan_in), norms 1, the Markov up-projection and the confidence head 0."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in dflash_tensor_shapes(model.config, config).items():
        if len(shape) == 1:
            t = torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.ones(shape)
        elif name.endswith(("markov_w2.weight", "accept_rate.proj.weight")):
            t = torch.zeros(shape)
        elif name.endswith("markov_w1.weight"):
            t = torch.randn(shape, generator=gen) * 0.1
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t * 0.5
        params[name] = torch.nn.Parameter(t)
    for n, p in params.items():
        if n.endswith("e_score_correction_bias"):
            p.requires_grad_(False)  # selection only: no gradient reaches it
    return params


@torch.no_grad()
def init_from_target(params: dict[str, torch.nn.Parameter], model: Any, config: DFlashConfig) -> None:
    """Start the drafter as the model's last L layers: draft layer i takes layer n - L + i's
    attention, norms and its first E experts (gate rows, biases; the shared expert), the head's
    norm is the model's, and u starts as the model's normalised attention input of the last
    target layer (projection = identity on that trunk, project_norm = that layer's input norm),
    so the last draft layer's injected rows start as that layer's own cache rows."""
    from deepinfer.testing.checkpoints import tensor_shapes

    n, layers = model.config.num_hidden_layers, config.num_layers
    state = load_target_tensors(model, tensor_shapes(model.config, mtp=False))
    dm = model.config.hidden_size
    last = config.target_layer_ids[-1]
    proj = torch.zeros_like(params["mtp.0.projection.weight"])
    j = len(config.target_layer_ids) - 1
    proj[:, j * dm : (j + 1) * dm] = torch.eye(dm)
    params["mtp.0.projection.weight"].copy_(proj)
    params["mtp.0.project_norm.weight"].copy_(state[f"model.layers.{last}.input_layernorm.weight"])
    params[f"mtp.{layers - 1}.norm.weight"].copy_(state["model.norm.weight"])
    for i in range(layers):
        src = f"model.layers.{n - layers + i}"
        for name, p in params.items():
            if not name.startswith(f"mtp.{i}."):
                continue
            theirs = src + name[len(f"mtp.{i}") :]
            if name.endswith(("gate.weight", "gate.e_score_correction_bias")):
                p.copy_(state[theirs][: p.shape[0]])
            elif theirs in state and tuple(state[theirs].shape) == tuple(p.shape):
                p.copy_(state[theirs])


def load_target_tensors(model: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The model's own tensors, float32, read from its checkpoint (the loaded model keeps them fused)."""
    from deepinfer.models.loader import CheckpointReader

    root = Path(model.source_dir)
    out = {}
    with CheckpointReader(root, torch.device("cpu"), False, "reference", False) as reader:
        for name, shape in shapes.items():
            if reader.has(name):
                out[name] = reader.get(name, shape, torch.float32)
    return out


def block_forward(
    w: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    trunks: torch.Tensor,
    anchors: torch.Tensor,
    tokens: torch.Tensor,
    prev: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dflash_block over many windows at once: trunks (W, L, n, Dm), anchors (W, N), tokens (W, N),
    prev (W, N, B) -> (logits (W, N, B, V), the confidence head's logits z / T (W, N, B): c =
    sigmoid of them). Attention splits the keys into the window's context (visible up to the
    anchor) and the block's own B slots, the two parts sharing one softmax: the same weights as
    dflash_block's mask over [context | all blocks], without its (N B)^2 scores."""
    nw, ctx = trunks.shape[:2]
    n, b, layers = anchors.shape[1], dcfg["block_size"], dcfg["num_layers"]
    dev, eps = trunks.device, cfg.get("rms_norm_eps", 1e-6)
    heads = cfg["num_attention_heads"]

    u = _context(w, trunks, eps)  # (W L, Dm)
    pos, x = _slots(embed, anchors, tokens, dcfg)  # (W N B,), (W N B, Dm)
    ctx_pos = torch.arange(ctx, device=dev)
    hidden_ctx = (ctx_pos[None, None, :] > anchors[..., None])[:, :, None, None, :]  # (W, N, 1, 1, L)
    scale = _softmax_scale(cfg)
    for i in range(layers):
        p = f"mtp.{i}"
        a = f"{p}.self_attn"
        hn = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = _query(w, a, hn, pos, cfg).view(nw, n, b, heads, -1)
        k_ctx, v_ctx = _kv(w, a, u, ctx_pos.repeat(nw), cfg)  # (W L, H, D), (W L, H, Vh)
        k_blk, v_blk = _kv(w, a, hn, pos, cfg)  # (W N B, H, D), (W N B, H, Vh)
        k_ctx, v_ctx = k_ctx.view(nw, ctx, heads, -1), v_ctx.view(nw, ctx, heads, -1)
        k_blk, v_blk = k_blk.view(nw, n, b, heads, -1), v_blk.view(nw, n, b, heads, -1)
        s_ctx = torch.einsum("wnqhd,wkhd->wnhqk", q, k_ctx) * scale  # (W, N, H, B, L)
        s_blk = torch.einsum("wnqhd,wnkhd->wnhqk", q, k_blk) * scale  # (W, N, H, B, B)
        probs = torch.cat([s_ctx.masked_fill(hidden_ctx, float("-inf")), s_blk], dim=-1).softmax(-1)
        probs = probs.to(v_ctx.dtype)
        o = torch.einsum("wnhqk,wkhd->wnqhd", probs[..., :ctx], v_ctx) + torch.einsum(
            "wnhqk,wnkhd->wnqhd", probs[..., ctx:], v_blk
        )
        x = _ffn(w, p, x + o.reshape(x.shape[0], -1) @ w[f"{a}.o_proj.weight"].T, cfg, dcfg)
    logits, z = _head(w, cfg, dcfg, lm_head, x, prev.reshape(-1))
    return logits.view(nw, n, b, -1), z.view(nw, n, b)


def block_losses(
    params: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    anchors: torch.Tensor,
    conf_weight: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """data: (windows (W, L), trunks, greedy); anchors (W, N) -> (loss, stats: per-slot
    cross-entropy, the confidence loss, per-slot acceptance (drafts 0..s all equal g); tensors,
    so a step need not wait for the device). The forward runs in `dtype` (the parameters cast,
    their gradients float32), the losses in float32."""
    windows, trunks, greedy = data
    b = dcfg["block_size"]
    slots = torch.arange(b, device=anchors.device)
    target = torch.gather(greedy, 1, (anchors[..., None] + 1 + slots).flatten(1)).view(*anchors.shape, b)
    token = torch.gather(windows, 1, anchors + 1)  # (W, N): x_{t+1}
    prev = torch.cat([token[..., None], target[..., :-1]], dim=-1)  # (W, N, B)
    w = {k: v.to(dtype) for k, v in params.items()}
    logits, z = block_forward(
        w, cfg, dcfg, embed.to(dtype), lm_head.to(dtype), trunks.to(dtype), anchors, token, prev
    )
    logits, z, target = (
        logits.reshape(-1, b, logits.shape[-1]),
        z.reshape(-1, b).float(),
        target.reshape(-1, b),
    )
    ce = (
        F.cross_entropy(logits.flatten(0, 1).float(), target.reshape(-1), reduction="none")
        .view(-1, b)
        .mean(0)
    )
    right = (logits.argmax(-1) == target).float()  # (W N, B)
    before = torch.cat([torch.ones_like(right[:, :1]), right[:, :-1].cumprod(1)], dim=1)
    bce = F.binary_cross_entropy_with_logits(z, right, reduction="none")
    bce = (bce * before).sum() / before.sum().clamp(min=1)
    loss = ce.mean() + conf_weight * bce
    return loss, {"ce": ce.detach(), "bce": bce.detach(), "accept": right.cumprod(1).mean(0)}


def rounded(stats: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: [round(x, 4) for x in v.tolist()] if v.dim() else round(float(v), 4) for k, v in stats.items()}


def random_anchors(
    w: int, n: int, length: int, b: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """(W, N) anchors t with t + 1 + B - 1 inside the window (and some context before)."""
    return torch.randint(4, length - b - 1, (w, n), generator=gen).to(device)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the trained model's directory")
    ap.add_argument(
        "--out", type=Path, required=True, help="where OUT/dflash/ goes (the model dir to attach)"
    )
    ap.add_argument(
        "--minutes",
        type=float,
        default=12.0,
        help="budget for training: CPU minutes of this process on the CPU, wall-clock minutes on a GPU",
    )
    ap.add_argument("--wall-minutes", type=float, default=60.0, help="and at most this wall-clock time")
    ap.add_argument(
        "--until", type=float, default=None, help="and stop training by this Unix time (a job's deadline)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--toy", action="store_true", help="tiny drafter, few files, fixed steps")
    ap.add_argument("--steps", type=int, default=None, help="fixed optimizer steps instead of the budget")
    ap.add_argument("--windows", type=int, default=None, help="windows per model run (the preset's)")
    ap.add_argument("--anchors", type=int, default=None, help="blocks per window per step (the preset's)")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the drafter's forward (default: bfloat16 on a GPU, float32 on the CPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--evaluate",
        type=Path,
        default=None,
        help="only print the held-out figures of DIR/dflash/ (on this preset's held-out blocks)",
    )
    args = ap.parse_args(argv)

    t0 = time.time()
    p = TOY if args.toy else FULL
    p = replace(p, windows=args.windows or p.windows, anchors=args.anchors or p.anchors)
    steps = args.steps or p.toy_steps or None
    os.environ[DEVICE_ENV] = args.device
    backend = create_reference_backend()
    device = backend.device.device()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = load_model(args.model, backend, dtype=torch.float32, check_weights=False)
    cfg = json.loads((args.model / "config.json").read_text())
    embed, lm_head = model.embed_tokens.float(), model.lm_head.float()
    train_ids, held_ids, corpus_hash = corpus(args.model / "tokenizer.json", p.max_files)
    print(f"corpus: {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens", flush=True)

    config = DFlashConfig(
        num_layers=p.num_layers, block_size=p.block_size, target_layer_ids=p.target_layer_ids,
        markov_rank=p.markov_rank, noise_token_id=NOISE_TOKEN, n_routed_experts=p.n_routed_experts,
        num_experts_per_tok=p.num_experts_per_tok, moe_intermediate_size=p.moe_intermediate_size,
    )  # fmt: skip
    if args.evaluate is not None:
        from safetensors.torch import load_file

        config = read_config(args.evaluate)
        p = replace(p, block_size=config.block_size, target_layer_ids=tuple(config.target_layer_ids))
    dcfg = config.to_dict()
    params = init_weights(model, config, args.seed)
    if args.evaluate is not None:
        saved = load_file(str(args.evaluate / "dflash" / "model.safetensors"))
        params = {n: torch.nn.Parameter(saved[n].float(), q.requires_grad) for n, q in params.items()}
    elif p.init_from_target:
        model.source_dir = args.model
        init_from_target(params, model, config)
    params = {n: torch.nn.Parameter(q.detach().to(device), q.requires_grad) for n, q in params.items()}
    trainable = [q for q in params.values() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=p.lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_params = sum(q.numel() for q in params.values())
    print(f"drafter: {n_params} parameters, B={p.block_size}, {p.num_layers} layers on {device}", flush=True)

    def batch(stream: torch.Tensor, count: int, length: int) -> tuple[torch.Tensor, ...]:
        windows = sample_windows(stream, count, length, gen).to(device)
        return (windows, *target_outputs(model, windows, p.target_layer_ids))

    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    fixed = (params, cfg, dcfg, embed, lm_head)
    length = min(p.window, held_ids.numel() - 1)
    eval_data = batch(held_ids, p.eval_windows, length)
    eval_anchors = random_anchors(p.eval_windows, p.anchors, length, p.block_size, gen, device)
    with torch.no_grad():
        loss0, held0 = block_losses(*fixed, eval_data, eval_anchors, p.conf_weight, dtype)
    loss_before = float(loss0)
    if args.evaluate is not None:
        accept = rounded(held0)["accept"]
        result = {"accept_by_slot": accept, "mean_accepted_length": round(1.0 + sum(accept), 4)}
        result.update(blocks=eval_anchors.numel(), loss=round(loss_before, 4))
        print(f"held-out ({args.evaluate}/dflash): {json.dumps(result)}", flush=True)
        return {"held_out": result}

    # the budget counts this process' CPU time on the CPU (one thread: a core's work, whatever
    # else the machine runs), wall-clock time on an accelerator; both capped by wall-clock time
    on_cpu = device.type == "cpu"
    start, cpu0, step, curve = time.time(), time.process_time(), 0, []
    budget_s, wall_s = args.minutes * 60, args.wall_minutes * 60
    if args.until is not None:
        wall_s = max(1.0, min(wall_s, args.until - start))
    log_every = 1 if steps else 10
    data = eval_data
    while True:
        spent = (time.process_time() - cpu0) if on_cpu else (time.time() - start)
        frac = step / steps if steps else max(spent / budget_s, (time.time() - start) / wall_s)
        if frac >= 1.0:
            break
        warm = min(1.0, (step + 1) / p.warmup)
        lr = p.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        if step % p.reuse == 0:
            data = batch(train_ids, p.windows, p.window)
        anchors = random_anchors(p.windows, p.anchors, p.window, p.block_size, gen, device)
        loss, stats = block_losses(*fixed, data, anchors, p.conf_weight, dtype)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if step % log_every == 0:
            curve.append({"step": step, "loss": round(float(loss.detach()), 4), **rounded(stats)})
        if step % 50 == 0 or steps:
            print(
                f"step {step} loss {float(loss.detach()):.4f} accept {rounded(stats)['accept']} "
                f"({time.process_time() - cpu0:.0f} s CPU, {time.time() - start:.0f} s)",
                flush=True,
            )
        step += 1
    train_s = time.time() - start

    with torch.no_grad():
        loss_after, held = block_losses(*fixed, eval_data, eval_anchors, p.conf_weight, dtype)
    accept = rounded(held)["accept"]
    held_out = {
        "accept_by_slot": accept,  # teacher-forced: drafts 0..s all equal g
        "mean_accepted_length": round(1.0 + sum(accept), 4),
        "blocks": eval_anchors.numel(),
        "accept_by_slot_before": rounded(held0)["accept"],
        "loss_before": round(loss_before, 4),
        "loss_after": round(float(loss_after), 4),
    }
    print(f"held-out: {json.dumps(held_out)}", flush=True)
    tensors = {n: q.detach().cpu().to(torch.bfloat16) for n, q in params.items()}
    out = save_dflash(args.out, config, tensors)
    log = {
        "preset": asdict(p),
        "dflash": dcfg,
        "parameters": n_params,
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(time.process_time() - cpu0, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "corpus_sha256": corpus_hash,
        "curve": curve,
        "held_out": held_out,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


if __name__ == "__main__":
    main()

"""Train the DFlash (DSpark) drafter (deepinfer.models.dflash) of a trained model, by
self-distillation, on one CPU core in minutes.

    python train/train_dflash.py --model model/tiny --out model/tiny --minutes 12
    python train/train_dflash.py --model DIR --out DIR --toy          # seconds (tests)

Data as train/train_drafter.py's (the same corpus, held-out rule and tokenizer): random windows,
the frozen model run over them with deepinfer's own model code (the reference backend), keeping
its residual streams entering target_layer_ids (the trunks KV injection reads) and its greedy
token at every position g_p (what it would decode). A block anchored at t (the last position the
target computed) holds x_{t+1} and B - 1 noise tokens at t+1 .. t+B; slot s learns g_{t+1+s}, its
Markov term fed prev_s = x_{t+1} (s = 0) or g_{t+s} (the previous slot's target: its draft when
that draft is accepted). Every block of a window attends the window's injected context up to its
anchor and its own slots (deepinfer.testing.dflash_oracle.dflash_block, the dense forward, run in
float32 with autograd: the engine's paged forward is checked against it in tests/test_dflash.py).

Loss = mean over slots of the cross-entropy against g + conf_weight * the confidence head's binary
cross-entropy: c_s against "draft s equals g" on the blocks whose drafts before s all did (c_s is
the chance draft s is accepted given the ones before it were). Embedding and LM head are the
model's, frozen. Writes OUT/dflash/config.json, OUT/dflash/model.safetensors (bfloat16) and
OUT/dflash/train_log.json (loss curve, held-out acceptance per slot, mean accepted length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_drafter import corpus, sample_windows

from deepinfer.models.dflash import DFlashConfig, save_dflash
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import DEVICE_ENV, create_reference_backend
from deepinfer.testing.checkpoints import dflash_tensor_shapes
from deepinfer.testing.dflash_oracle import dflash_block
from deepinfer.testing.paged_runner import BlockAllocator, build_batch


@dataclass(frozen=True)
class Preset:
    num_layers: int = 2
    block_size: int = 5
    target_layer_ids: tuple[int, ...] = (1, 2, 3)
    markov_rank: int = 16
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # the model's: its experts can start the drafter's
    init_from_target: bool = True  # start from the model's last layers (init_from_target)
    windows: int = 8  # windows the model runs over per refresh
    window: int = 160  # tokens per window
    anchors: int = 24  # blocks per window per step
    reuse: int = 4  # drafter steps per model run
    lr: float = 3e-3
    conf_weight: float = 0.5
    max_files: int | None = None
    eval_windows: int = 8
    toy_steps: int = 0  # > 0: a fixed number of steps instead of the time budget


FULL = Preset()
TOY = Preset(
    num_layers=1, block_size=3, target_layer_ids=(0, 1), markov_rank=4, n_routed_experts=2,
    num_experts_per_tok=1, moe_intermediate_size=16, windows=2, window=48, anchors=8, reuse=2,
    lr=1e-2, max_files=6, eval_windows=2, toy_steps=20, init_from_target=False,
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


def block_losses(
    params: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    anchors: torch.Tensor,
    conf_weight: float,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """data: (windows (W, L), trunks, greedy); anchors (W, N) -> (loss, stats)."""
    windows, trunks, greedy = data
    b = dcfg["block_size"]
    ces, bces, rights = [], [], []
    slots = torch.arange(b)
    for wi in range(windows.shape[0]):
        t = anchors[wi]
        target = greedy[wi][t[:, None] + 1 + slots]  # (N, B): g_{t+1+s}
        token = windows[wi][t + 1]
        prev = torch.cat([token[:, None], target[:, :-1]], dim=1)
        logits, c = dflash_block(params, cfg, dcfg, embed, lm_head, trunks[wi], t, token, prev)
        ces.append(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        )
        right = (logits.argmax(-1) == target).float()  # (N, B)
        before = torch.cat([torch.ones_like(right[:, :1]), right[:, :-1].cumprod(1)], dim=1)
        bce = F.binary_cross_entropy(c.clamp(1e-6, 1 - 1e-6), right, reduction="none")
        bces.append((bce * before).sum() / before.sum().clamp(min=1))
        rights.append(right.cumprod(1))
    ce = torch.cat(ces).reshape(-1, b).mean(0)  # (B,)
    bce = torch.stack(bces).mean()
    accept = torch.cat(rights).mean(0)
    loss = ce.mean() + conf_weight * bce
    stats = {
        "ce": [round(float(v), 4) for v in ce.detach()],
        "bce": round(float(bce.detach()), 4),
        "accept": [round(float(v), 4) for v in accept],
    }
    return loss, stats


def random_anchors(w: int, n: int, length: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """(W, N) anchors t with t + 1 + B - 1 inside the window (and some context before)."""
    return torch.randint(4, length - b - 1, (w, n), generator=gen)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the trained model's directory")
    ap.add_argument(
        "--out", type=Path, required=True, help="where OUT/dflash/ goes (the model dir to attach)"
    )
    ap.add_argument(
        "--minutes", type=float, default=12.0, help="budget for training, in CPU minutes of this process"
    )
    ap.add_argument("--wall-minutes", type=float, default=60.0, help="and at most this wall-clock time")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--toy", action="store_true", help="tiny drafter, few files, fixed steps")
    ap.add_argument("--steps", type=int, default=None, help="fixed optimizer steps instead of the budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.time()
    p = TOY if args.toy else FULL
    steps = args.steps or p.toy_steps or None
    os.environ[DEVICE_ENV] = args.device
    backend = create_reference_backend()
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
    dcfg = config.to_dict()
    params = init_weights(model, config, args.seed)
    if p.init_from_target:
        model.source_dir = args.model
        init_from_target(params, model, config)
    trainable = [q for q in params.values() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=p.lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_params = sum(q.numel() for q in params.values())
    print(f"drafter: {n_params} parameters, B={p.block_size}, {p.num_layers} layers", flush=True)

    length = min(p.window, held_ids.numel() - 1)
    eval_windows = sample_windows(held_ids, p.eval_windows, length, gen)
    eval_data = (eval_windows, *target_outputs(model, eval_windows, p.target_layer_ids))
    eval_anchors = random_anchors(p.eval_windows, p.anchors, length, p.block_size, gen)
    with torch.no_grad():
        loss_before = float(
            block_losses(params, cfg, dcfg, embed, lm_head, eval_data, eval_anchors, p.conf_weight)[0]
        )

    # the budget counts this process' CPU time (one thread: a core's work, whatever else the
    # machine runs), capped by wall-clock time
    budget_s, wall_s = args.minutes * 60, args.wall_minutes * 60
    start, cpu0, step, curve = time.time(), time.process_time(), 0, []
    data = eval_data
    while True:
        frac = (
            step / steps
            if steps
            else max((time.process_time() - cpu0) / budget_s, (time.time() - start) / wall_s)
        )
        if frac >= 1.0:
            break
        lr = p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        if step % p.reuse == 0:
            windows = sample_windows(train_ids, p.windows, p.window, gen)
            data = (windows, *target_outputs(model, windows, p.target_layer_ids))
        anchors = random_anchors(p.windows, p.anchors, p.window, p.block_size, gen)
        loss, stats = block_losses(params, cfg, dcfg, embed, lm_head, data, anchors, p.conf_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        curve.append({"step": step, "loss": round(float(loss.detach()), 4), **stats})
        if step % 25 == 0 or steps:
            cpu = time.process_time() - cpu0
            print(
                f"step {step} loss {curve[-1]['loss']:.4f} accept {stats['accept']} ({cpu:.0f} s CPU)",
                flush=True,
            )
        step += 1

    with torch.no_grad():
        loss_after, held = block_losses(
            params, cfg, dcfg, embed, lm_head, eval_data, eval_anchors, p.conf_weight
        )
    held = {
        "accept_by_slot": held["accept"],  # teacher-forced: drafts 0..s all equal g
        "mean_accepted_length": round(1.0 + sum(held["accept"]), 4),
        "loss_before": round(loss_before, 4),
        "loss_after": round(float(loss_after), 4),
    }
    print(f"held-out: {json.dumps(held)}", flush=True)
    tensors = {n: q.detach().to(torch.bfloat16) for n, q in params.items()}
    out = save_dflash(args.out, config, tensors)
    log = {
        "preset": asdict(p),
        "dflash": dcfg,
        "parameters": n_params,
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "train_cpu_seconds": round(time.process_time() - cpu0, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "corpus_sha256": corpus_hash,
        "curve": curve,
        "held_out": held,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


if __name__ == "__main__":
    main()

"""Train the block drafter (deepinfer.models.drafter) of a trained model, by self-distillation.

    python train/train_drafter.py --model model/tiny --out model/tiny --minutes 5 --device cuda
    python train/train_drafter.py --model DIR --out DIR --toy --device cpu     # seconds (CI)

The model is frozen and run with deepinfer's own model code (the reference backend, on --device)
over random windows of the same corpus train/train_tiny.py trains on (the Python standard
library's source, the same held-out files kept out: its stdlib_files and token_stream), tokenised
with the model's tokenizer.json. At each anchor position t of a window, with the model's final
hidden state h_t and the next token x_{t+1}, the drafter predicts the model's own greedy tokens
g_{t+1} .. g_{t+k} (g_p = argmax of the model's logits at p: what it would decode), the
transition at block position i fed x_{t+1+i}, the token the model's prediction there follows.

Loss = mean over block positions of the cross-entropy against g, + the confidence head's
binary cross-entropy against "the drafter's greedy drafts 0..i all equal g" (what verification
would accept). The model's embedding and LM head are shared, frozen.

Writes OUT/drafter_config.json, OUT/drafter.safetensors (float32) and OUT/drafter_train_log.json
(loss curve, held-out acceptance per block position, mean accepted length per step). With OUT
the model directory, the loader attaches the drafter: speculative_config={"method": "dspark"}.
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

from deepinfer.models.drafter import BlockDrafter, DrafterConfig
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import DEVICE_ENV, create_reference_backend
from deepinfer.testing.paged_runner import PagedRunner


@dataclass(frozen=True)
class Preset:
    draft_hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 2
    block_size: int = 5
    markov_rank: int = 64
    windows: int = 64  # windows the model runs over per step
    window: int = 256  # tokens per window
    anchors: int = 4096  # anchor positions the drafter trains on per step (sampled from the windows)
    reuse: int = 2  # drafter steps per model run (each on other anchors of the same windows)
    lr: float = 2e-3
    conf_weight: float = 0.5
    max_files: int | None = None
    eval_windows: int = 64
    toy_steps: int = 0  # > 0: a fixed number of steps instead of the time budget


FULL = Preset()
TOY = Preset(
    draft_hidden_size=32,
    intermediate_size=64,
    markov_rank=8,
    windows=4,
    window=48,
    anchors=128,
    reuse=5,
    lr=1e-2,
    max_files=6,
    eval_windows=4,
    toy_steps=30,
)


def corpus(tokenizer_file: Path, max_files: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train stream, held-out stream, corpus hash): train_tiny's files and held-out rule, this
    model's tokenizer."""
    from tokenizers import Tokenizer
    from train_tiny import stdlib_files, token_stream

    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found: the drafter trains on the model's own tokens")
    tok = Tokenizer.from_file(str(tokenizer_file))
    train_files, held_files, corpus_hash = stdlib_files(max_files)
    return (
        token_stream(tok, [t for _, t in train_files]),
        token_stream(tok, [t for _, t in held_files]),
        corpus_hash,
    )


@torch.no_grad()
def target_outputs(runner_args: tuple[Any, Any], windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model over windows (W, L) -> (hidden (W, L, Dm) float32, greedy (W, L) int64)."""
    model, backend = runner_args
    w, n = windows.shape
    block = 64
    runner = PagedRunner(model, backend, num_blocks=w * -(-n // block), block_size=block)
    logits = runner.step([(i, windows[i].tolist()) for i in range(w)], all_logits=True)  # (W L, V)
    assert runner.last_hidden is not None
    hidden = runner.last_hidden.float().reshape(w, n, -1).clone()
    return hidden, logits.argmax(dim=-1).reshape(w, n).clone()


def anchor_batch(
    hidden: torch.Tensor,
    greedy: torch.Tensor,
    windows: torch.Tensor,
    k: int,
    count: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`count` random anchors t of the windows -> (h_t (N, Dm), x_{t+1} (N,), prev (N, k) =
    x_{t+1..t+k}, targets (N, k) = g_{t+1..t+k})."""
    w, n = windows.shape
    span = n - k - 1  # anchors 0 .. span-1 keep t + k inside the window
    if span < 1:
        raise ValueError(f"windows of {n} tokens are too short for blocks of {k}")
    flat = torch.randint(0, w * span, (count,), generator=gen)
    wi, t = (flat // span).to(windows.device), (flat % span).to(windows.device)
    offsets = torch.arange(1, k + 1, device=windows.device)
    pos = t[:, None] + offsets  # (N, k)
    return hidden[wi, t], windows[wi, t + 1], windows[wi[:, None], pos], greedy[wi[:, None], pos]


def losses(
    drafter: BlockDrafter,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    batch: tuple[torch.Tensor, ...],
    conf_weight: float,
) -> tuple[torch.Tensor, dict[str, Any]]:
    h, x, prev, target = batch
    logits, conf = drafter.forward_train(h, x, prev, embed, lm_head)  # (N, k, V), (N, k)
    k = prev.shape[1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    ce_pos = ce.reshape(-1, k).mean(dim=0)  # (k,)
    accepted = (logits.argmax(dim=-1) == target).float().cumprod(dim=1)  # (N, k): drafts 0..i right
    bce = F.binary_cross_entropy_with_logits(conf, accepted)
    loss = ce_pos.mean() + conf_weight * bce
    stats = {
        "ce": [round(float(v), 4) for v in ce_pos.detach()],
        "bce": round(float(bce.detach()), 4),
        "accept": [round(float(v), 4) for v in accepted.mean(dim=0)],
    }
    return loss, stats


def sample_windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if stream.numel() <= length:
        raise ValueError(f"the token stream ({stream.numel()} tokens) is shorter than one window ({length})")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the trained model's directory")
    ap.add_argument(
        "--out", type=Path, required=True, help="where the drafter goes (the model directory to attach it)"
    )
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget for training")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--toy", action="store_true", help="tiny drafter, few files, fixed steps: a CPU smoke run"
    )
    ap.add_argument("--steps", type=int, default=None, help="fixed optimizer steps instead of the budget")
    ap.add_argument("--block-size", type=int, default=None, help="k, the most drafts per pass (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.time()
    p = TOY if args.toy else FULL
    k = args.block_size or p.block_size
    steps = args.steps or p.toy_steps or None
    os.environ[DEVICE_ENV] = args.device  # the reference backend runs on this device
    backend = create_reference_backend()
    device = backend.device.device()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = load_model(args.model, backend, check_weights=False)
    target = (model, backend)
    embed, lm_head = model.embed_tokens.float(), model.lm_head.float()  # frozen, shared
    train_ids, held_ids, corpus_hash = corpus(args.model / "tokenizer.json", p.max_files)
    if int(max(train_ids.max(), held_ids.max())) >= model.config.vocab_size:
        raise ValueError(
            f"{args.model}/tokenizer.json has ids past the model's vocab_size {model.config.vocab_size}"
        )
    print(f"corpus: {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens", flush=True)

    config = DrafterConfig(
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        draft_hidden_size=p.draft_hidden_size,
        intermediate_size=p.intermediate_size,
        num_layers=p.num_layers,
        block_size=k,
        markov_rank=p.markov_rank,
        rms_norm_eps=float(model.config.rms_norm_eps),
    )
    drafter = BlockDrafter(config, backend, seed=args.seed).to(device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_params = sum(q.numel() for q in drafter.parameters())
    print(f"drafter: {n_params} parameters, k={k}", flush=True)

    # a fixed held-out batch: the loss before and after training, on the same anchors
    eval_windows = sample_windows(held_ids, p.eval_windows, min(p.window, held_ids.numel() - 1), gen).to(
        device
    )
    eval_batch = anchor_batch(*target_outputs(target, eval_windows), eval_windows, k, p.anchors, gen)
    with torch.no_grad():
        loss_before = float(losses(drafter, embed, lm_head, eval_batch, p.conf_weight)[0])

    budget_s = args.minutes * 60
    start, step, curve = time.time(), 0, []
    while True:
        frac = step / steps if steps else (time.time() - start) / budget_s
        if frac >= 1.0:
            break
        lr = p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        if step % p.reuse == 0:
            windows = sample_windows(train_ids, p.windows, p.window, gen).to(device)
            hidden, greedy = target_outputs(target, windows)
        batch = anchor_batch(hidden, greedy, windows, k, p.anchors, gen)
        loss, stats = losses(drafter, embed, lm_head, batch, p.conf_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        curve.append({"step": step, "loss": round(float(loss.detach()), 4), **stats})
        if step % 50 == 0 or steps:
            elapsed = time.time() - t0
            print(
                f"step {step} loss {curve[-1]['loss']:.4f} accept {stats['accept']} ({elapsed:.0f} s)",
                flush=True,
            )
        step += 1

    drafter.eval()
    with torch.no_grad():
        loss_after = float(losses(drafter, embed, lm_head, eval_batch, p.conf_weight)[0])
    held = evaluate(drafter, target, embed, lm_head, held_ids, p, k, gen)
    held.update(loss_before=round(loss_before, 4), loss_after=round(loss_after, 4))
    print(f"held-out: {json.dumps(held)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    drafter.save(args.out)
    log = {
        "preset": asdict(p),
        "drafter": asdict(config),
        "parameters": n_params,
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "device": args.device,
        "corpus_sha256": corpus_hash,
        "curve": curve,
        "held_out": held,
    }
    (args.out / "drafter_train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


@torch.no_grad()
def evaluate(
    drafter: BlockDrafter,
    target: tuple[Any, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    held_ids: torch.Tensor,
    p: Preset,
    k: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    """Held-out, the drafter run as the engine runs it (greedy, its own drafts fed to the
    transition): per block position, how often drafts 0..i all equal the model's greedy tokens
    (teacher-forced on the corpus), the mean accepted length per step (1 + their sum: the
    verification step samples one token of its own) and the mean confidence."""
    device = embed.device
    windows = sample_windows(held_ids, p.eval_windows, min(p.window, held_ids.numel() - 1), gen).to(device)
    hidden, greedy = target_outputs(target, windows)
    h, x, _, want = anchor_batch(hidden, greedy, windows, k, p.anchors, gen)
    drafts, conf = drafter.draft(h, x, embed, lm_head, k)
    accepted = (drafts == want).float().cumprod(dim=1).mean(dim=0)  # (k,)
    return {
        "accept_by_position": [round(float(v), 4) for v in accepted],
        "mean_accepted_length": round(1.0 + float(accepted.sum()), 4),
        "mean_confidence": [round(float(v), 4) for v in conf.mean(dim=0)],
    }


if __name__ == "__main__":
    main()

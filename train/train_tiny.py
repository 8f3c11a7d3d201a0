"""Train model/tiny: a DeepSeek-V3 in miniature on the Python standard library's own source.

    python train/train_tiny.py --out DIR --minutes 5 --device cuda      # the shipped model (H200)
    python train/train_tiny.py --out DIR --toy                          # seconds on a CPU (CI)

Corpus: every *.py under sysconfig.get_paths()["stdlib"] (sorted relative paths), site-packages
and dist-packages excluded, test suites included (they are Python code too, and double the
data); files that are not UTF-8 are skipped. A file is held out when sha256(its relative path)
% 20 == 0 (about 5%): held-out files are used neither for the tokenizer nor for training.
Python's version and a hash of the file list are recorded, since the corpus is whatever Python
runs the script.

Tokenizer: byte-level BPE (`tokenizers`) trained on the training files, with DeepSeek's special
tokens (BOS, EOS, User, Assistant: ids 0..3) and chat template. Each file is one document:
BOS + tokens + EOS, documents concatenated into one stream; training draws random windows.

Model (train/twin.py, a twin of deepinfer's model code): MLA with q_lora, one dense first layer,
group-limited sigmoid routing with V3's auxiliary-loss-free correction bias
(bias += u * sign(mean load - load) after every step), a shared expert, one MTP layer trained
jointly (loss = main + lambda * MTP). The wall-clock budget covers everything: the optimizer runs
for a number of steps fixed after timing the first ones, so the cosine schedule ends on time.

Writes DIR/config.json, model.safetensors (or shards of at most --shard-mib MiB with
model.safetensors.index.json), tokenizer.json, tokenizer_config.json, generation_config.json and
train_log.json (loss curve, held-out perplexity of the model and of a unigram baseline on the
same tokens, MTP held-out accuracy, parameter count, tokens seen, wall time, Python, corpus hash).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "model" / "tiny"))
# DeepSeek's special tokens and chat template: the same as the random test model's tokenizer
from make_tiny import BOS, CHAT_TEMPLATE, EOS, train_tokenizer
from twin import Twin, TwinConfig, checkpoint_tensors

HELD_OUT_MODULUS = 20
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
MIB = 1 << 20


@dataclass(frozen=True)
class Preset:
    model: TwinConfig
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    mtp_lambda: float = 0.3  # V3's MTP loss weight for most of its training
    bias_update_speed: float = 1e-3  # V3's u
    max_files: int | None = None  # None: the whole corpus
    max_eval_tokens: int = 1 << 20
    timing_steps: int = 20  # warm-up steps, then as many timed to fix the schedule's length
    toy_steps: int = 60


FULL = Preset(model=TwinConfig())
TOY = Preset(
    model=TwinConfig(
        vocab_size=384,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        max_position_embeddings=256,
    ),
    seq_len=64,
    batch_size=8,
    lr=5e-3,
    warmup_steps=5,
    max_files=24,
    max_eval_tokens=4096,
    timing_steps=3,
)


# --------------------------------------------------------------------------- corpus


def held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def stdlib_files(max_files: int | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """(train [(relative path, text)], held-out [...], sha256 of the sorted relative paths used).
    max_files (the toy preset): stop after that many training files (and an eighth as many
    held-out ones), taken in the same sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        base = Path(dirpath).relative_to(root)
        rels += [(base / f).as_posix() for f in filenames if f.endswith(".py")]
    train: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    n_held = None if max_files is None else max(2, max_files // 8)
    for rel in sorted(rels):
        part, limit = (held, n_held) if held_out(rel) else (train, max_files)
        if limit is not None and len(part) >= limit:
            if len(train) >= (max_files or 0) and len(held) >= (n_held or 0):
                break
            continue
        try:
            part.append((rel, (root / rel).read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not train or not held:
        raise RuntimeError(f"no Python sources found under {root} (train {len(train)}, held-out {len(held)})")
    listing = "\n".join(sorted(rel for rel, _ in train + held))
    return train, held, hashlib.sha256(listing.encode()).hexdigest()


def token_stream(tok: Any, texts: Sequence[str]) -> torch.Tensor:
    """BOS + tokens + EOS per document, concatenated: (N,) int64."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.int64)


# --------------------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def losses(
    model: Twin, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """window (B, S + 2) -> (main CE, MTP CE, main logits (B, S, V), MTP logits (B, S, V)).
    Main: tokens 0..S-1 predict 1..S. MTP: (h_i, token i+1) predicts token i+2, i = 0..S-1."""
    s = window.shape[1] - 2
    hidden = model(window[:, :s])
    logits = model.lm_head(hidden).float()
    mtp_logits = model.lm_head(model.mtp_forward(hidden, window[:, 1 : s + 1])).float()
    v = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, v), window[:, 1 : s + 1].reshape(-1))
    mtp = F.cross_entropy(mtp_logits.reshape(-1, v), window[:, 2:].reshape(-1))
    return main, mtp, logits, mtp_logits


def lr_at(step: int, total: int, p: Preset) -> float:
    if step < p.warmup_steps:
        return p.lr * (step + 1) / p.warmup_steps
    progress = min(1.0, (step - p.warmup_steps) / max(1, total - p.warmup_steps))
    return p.lr * (p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(
    model: Twin, stream: torch.Tensor, p: Preset, autocast: Any, max_tokens: int
) -> dict[str, float]:
    """Held-out figures over the first max_tokens of `stream`, in non-overlapping (S + 2)-token windows."""
    s = p.seq_len
    n = min(stream.numel(), max(max_tokens, s + 2)) // (s + 2)
    if n == 0:
        raise RuntimeError(f"held-out stream of {stream.numel()} tokens is shorter than one window ({s + 2})")
    windows = stream[: n * (s + 2)].view(n, s + 2)
    model.eval()
    main_sum = mtp_sum = main_hits = mtp_hits = 0.0
    for chunk in torch.split(windows, p.batch_size):
        with autocast():
            main, mtp, logits, mtp_logits = losses(model, chunk)
        rows = chunk.shape[0] * s
        main_sum += float(main) * rows
        mtp_sum += float(mtp) * rows
        main_hits += float((logits.argmax(-1) == chunk[:, 1 : s + 1]).sum())
        mtp_hits += float((mtp_logits.argmax(-1) == chunk[:, 2:]).sum())
    model.train()
    rows = n * s
    return {
        "tokens": rows,
        "loss": main_sum / rows,
        "perplexity": math.exp(main_sum / rows),
        "top1_accuracy": main_hits / rows,
        "mtp_loss": mtp_sum / rows,
        "mtp_top1_accuracy": mtp_hits / rows,
    }


def unigram_perplexity(train: torch.Tensor, held: torch.Tensor, vocab: int, p: Preset) -> float:
    """Add-one unigram model of the training stream, scored on the held-out targets evaluate() scores."""
    s = p.seq_len
    n = min(held.numel(), p.max_eval_tokens) // (s + 2)
    targets = held[: n * (s + 2)].view(n, s + 2)[:, 1 : s + 1].reshape(-1)
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(float(-logp[targets].mean()))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the checkpoint and train_log.json")
    ap.add_argument(
        "--minutes", type=float, default=5.0, help="wall-clock budget, tokenizer and evaluation included"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--toy", action="store_true", help="tiny dims and corpus: a CPU smoke run")
    ap.add_argument("--steps", type=int, default=None, help="fixed optimizer steps instead of the budget")
    ap.add_argument(
        "--max-epochs", type=float, default=4.0, help="at most this many passes over the training tokens"
    )
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default=None,
                    help="weights on disk (default: bfloat16, float32 with --toy)")  # fmt: skip
    ap.add_argument("--shard-mib", type=float, default=15.0, help="largest safetensors file")
    args = ap.parse_args(argv)
    # The toy model's ops are too small to gain from CPU threads; on a busy machine the threads'
    # contention makes each step 10-20x slower. The caller's setting is restored afterwards.
    threads = torch.get_num_threads()
    if args.toy:
        torch.set_num_threads(1)
    try:
        return train(args)
    finally:
        torch.set_num_threads(threads)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run (see the module docstring); returns what train_log.json holds."""
    t0 = time.time()
    budget_s = args.minutes * 60
    preset = TOY if args.toy else FULL
    if args.batch_size is not None:
        preset = replace(preset, batch_size=args.batch_size)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    save_dtype = args.save_dtype or ("float32" if args.toy else "bfloat16")
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    train_files, held_files, corpus_hash = stdlib_files(preset.max_files)
    tok = train_tokenizer([t for _, t in train_files], preset.model.vocab_size)
    train_ids = token_stream(tok, [t for _, t in train_files])
    held_ids = token_stream(tok, [t for _, t in held_files])
    cfg = replace(
        preset.model,
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
    )
    print(
        f"corpus: {len(train_files)} train files ({train_ids.numel()} tokens), {len(held_files)} held-out "
        f"({held_ids.numel()} tokens), vocab {cfg.vocab_size}, {time.time() - t0:.1f}s",
        flush=True,
    )

    gen = torch.Generator().manual_seed(args.seed)
    model = Twin(cfg)
    model.init_weights(gen)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": preset.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=preset.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    use_bf16 = device.type == "cuda"

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    train_dev = train_ids.to(device)
    held_dev = held_ids.to(device)
    s = preset.seq_len
    if train_dev.numel() < s + 3:
        raise RuntimeError(f"training stream of {train_dev.numel()} tokens is shorter than one window")
    offsets = torch.arange(s + 2, device=device)
    data_gen = torch.Generator(device=device).manual_seed(args.seed)

    # Budget: what is left after setup, minus a reserve for the final evaluation and saving.
    reserve_s = min(25.0, 0.1 * budget_s)
    curve: list[dict[str, float]] = []
    # The toy preset runs a fixed number of steps; the full one fills the budget unless --steps.
    fixed_steps = args.steps or (preset.toy_steps if args.toy else None)
    total_steps = fixed_steps or 10**9
    timing_t0 = 0.0
    tokens_seen = 0
    step = 0
    while step < total_steps:
        starts = torch.randint(
            0, train_dev.numel() - s - 2, (preset.batch_size, 1), device=device, generator=data_gen
        )
        window = train_dev[starts + offsets]  # (B, S + 2)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total_steps, preset)
        with autocast():
            main_loss, mtp_loss, _, _ = losses(model, window)
            loss = main_loss + preset.mtp_lambda * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(preset.bias_update_speed)
        tokens_seen += preset.batch_size * s
        step += 1
        if fixed_steps is None and step == preset.timing_steps:
            _sync(device)
            timing_t0 = time.time()
        elif fixed_steps is None and step == 2 * preset.timing_steps:
            # Fix the schedule's length from the step time measured after warm-up and the time left.
            _sync(device)
            per_step = (time.time() - timing_t0) / preset.timing_steps
            left = budget_s - (time.time() - t0) - reserve_s
            total_steps = max(step + 1, step + int(left / per_step))
            # At most --max-epochs passes over the training tokens: this corpus is small, and a
            # 12 M model memorises it (H200, Python 3.12's 2.6 M tokens, 46 passes: training loss
            # 0.13, held-out loss from 3.27 after 5 passes up to 6.1).
            total_steps = min(
                total_steps, max(step + 1, int(args.max_epochs * train_ids.numel() / (preset.batch_size * s)))
            )
            print(f"{per_step * 1e3:.1f} ms/step: {total_steps} steps in the budget", flush=True)
        elif (
            fixed_steps is None and step > 2 * preset.timing_steps and time.time() - t0 > budget_s - reserve_s
        ):
            print(f"budget reached at step {step} of {total_steps}", flush=True)
            break
        every = max(1, total_steps // 50)  # 50 points on the curve, a held-out loss on every fifth
        if step == 1 or step % every == 0 or step == total_steps:
            entry = {"step": step, "loss": main_loss.item(), "mtp_loss": mtp_loss.item(),
                     "lr": opt.param_groups[0]["lr"], "seconds": time.time() - t0}  # fmt: skip
            if step % (5 * every) == 0 or step == total_steps:
                # A slice of the held-out stream, so that overfitting shows in the curve.
                quick = evaluate(model, held_dev, preset, autocast, preset.max_eval_tokens // 8)
                entry["held_out_loss"] = quick["loss"]
            curve.append(entry)
            print(json.dumps(entry), flush=True)

    held = evaluate(model, held_dev, preset, autocast, preset.max_eval_tokens)
    unigram = unigram_perplexity(train_ids, held_ids, cfg.vocab_size, preset)
    print(f"held-out: {json.dumps(held)}; unigram perplexity {unigram:.2f}", flush=True)

    write_checkpoint(model, out, save_dtype, args.shard_mib)
    write_tokenizer(tok, out, cfg)
    bias = [m.e_score_correction_bias.float().cpu() for m in model.moe_layers()]
    log = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "seed": args.seed,
        "preset": "toy" if args.toy else "full",
        "corpus": {
            "root": sysconfig.get_paths()["stdlib"],
            "rule": f"*.py, sorted, site-packages, dist-packages and non-UTF-8 files skipped, held out when "
            f"sha256(relative path) % {HELD_OUT_MODULUS} == 0",
            "sha256_of_file_list": corpus_hash,
            "train_files": len(train_files),
            "held_out_files": len(held_files),
            "train_tokens": train_ids.numel(),
            "held_out_tokens": held_ids.numel(),
        },
        "model": asdict(cfg),
        "parameters": n_params,
        "hyperparameters": {k: v for k, v in asdict(preset).items() if k != "model"},
        "steps": step,
        "tokens_seen": tokens_seen,
        "loss_curve": curve,
        "held_out": {**held, "unigram_perplexity": unigram},
        "router_bias_abs_max": [float(b.abs().max()) for b in bias],
        "save_dtype": save_dtype,
        "wall_seconds": time.time() - t0,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"wrote {out} in {log['wall_seconds']:.0f}s: {n_params} parameters, {step} steps", flush=True)
    return log


# --------------------------------------------------------------------------- checkpoint


def write_checkpoint(model: Twin, out: Path, dtype: str, shard_mib: float) -> None:
    """config.json + model.safetensors, or shards of at most shard_mib MiB and their index."""
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in checkpoint_tensors(model).items()}
    (out / "config.json").write_text(json.dumps(model.c.hf_config(dtype), indent=2) + "\n")
    limit = int(shard_mib * MIB) - 64 * 1024  # room for the safetensors header
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if nbytes > limit:
            raise ValueError(
                f"tensor {name} ({nbytes / MIB:.1f} MiB) exceeds the shard limit {shard_mib} MiB"
            )
        if size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer(tok: Any, out: Path, cfg: TwinConfig) -> None:
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
    # Sampling defaults for code: a low temperature with nucleus sampling keeps identifiers consistent.
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "do_sample": True,
        "temperature": 0.4,
        "top_p": 0.95,
        "top_k": 50,
        "repetition_penalty": 1.05,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


if __name__ == "__main__":
    main()

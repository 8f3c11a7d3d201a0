"""A DSpark-style block drafter: k draft tokens in one pass from the model's last hidden state,
with a confidence for each.

Given the model's final hidden state h (Dm) at position t and the token x (sampled from it) at
t + 1, the drafter proposes tokens t + 2 .. t + 1 + k:

  z   = in_proj([hnorm(h) ; enorm(embed(x))])            (2Dm -> D)   one vector per request
  u_i = z + pos[i]                   i = 0 .. k-1        (k, D)       parallel block positions
  u_i = u_i + mlp_l(norm_l(u_i))     for each layer l                 (no mixing across positions)
  o_i = out_norm(out_proj(u_i))                          (D -> Dm)    in the model's output space
  logits_i = lm_head(o_i) + markov_up(markov_down[prev_i])           low-rank transition, rank r
  conf_i   = sigmoid(conf([norm(u_i) ; markov_down[prev_i] ; max log-softmax(logits_i)]))

prev_0 = x and prev_i = argmax logits_{i-1} (the greedy draft before it): the only sequential
part is k cheap rank-r lookups. embed and lm_head are the model's own (frozen, not stored here).
conf_i is trained to predict that drafts 0..i are ALL accepted (the chance that verifying the
prefix up to i pays off), so the scheduler can compare drafts of different requests directly.

Symbols: B requests, k block positions, D drafter width, Dm model width, V vocab, r rank.
Weights live in drafter.safetensors beside the model, the shape in drafter_config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepinfer.backend.ops import Backend

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int  # Dm: the model's width
    vocab_size: int  # V: the model's vocabulary
    draft_hidden_size: int = 256  # D
    intermediate_size: int = 512  # each layer's gated MLP
    num_layers: int = 2
    block_size: int = 5  # k: most drafts per pass
    markov_rank: int = 64  # r
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "rms_norm_eps":
                if not isinstance(value, float) or not 0 < value < 1:
                    raise ValueError(f"drafter config: rms_norm_eps must be in (0, 1), got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"drafter config: {name} must be a positive integer, got {value!r}")

    @classmethod
    def from_file(cls, path: Path) -> DrafterConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} cannot be read as JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown drafter config keys {sorted(unknown)}")
        if "rms_norm_eps" in data and isinstance(data["rms_norm_eps"], int):
            data["rms_norm_eps"] = float(data["rms_norm_eps"])
        try:
            return cls(**data)
        except TypeError as exc:  # a required key missing
            raise ValueError(f"{path}: {exc}") from exc


class BlockDrafter(nn.Module):
    """The drafter's weights (trainable parameters) and its forward over the backend's ops."""

    def __init__(self, config: DrafterConfig, backend: Backend, seed: int = 0) -> None:
        super().__init__()
        self.config, self.backend = config, backend
        c, dm, d = config, config.hidden_size, config.draft_hidden_size
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, fan_in: int | None = None) -> nn.Parameter:
            scale = 1.0 / math.sqrt(fan_in if fan_in is not None else shape[-1])
            return nn.Parameter(torch.randn(shape, generator=g) * scale)

        def ones(n: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(n))

        self.hnorm, self.enorm = ones(dm), ones(dm)
        self.in_proj = w(d, 2 * dm)  # (D, 2Dm)
        self.pos = w(c.block_size, d, fan_in=1)  # (k, D)
        self.pos.data.mul_(0.1)
        self.norms = nn.ParameterList(ones(d) for _ in range(c.num_layers))
        self.gate_up = nn.ParameterList(w(2 * c.intermediate_size, d) for _ in range(c.num_layers))
        self.down = nn.ParameterList(
            nn.Parameter(w(d, c.intermediate_size).data * 0.5) for _ in range(c.num_layers)
        )
        self.out_proj = w(dm, d)  # (Dm, D)
        self.out_norm = ones(dm)
        self.markov_down = w(c.vocab_size, c.markov_rank, fan_in=1)  # (V, r): the previous token
        self.markov_down.data.mul_(0.1)
        self.markov_up = nn.Parameter(torch.zeros(c.vocab_size, c.markov_rank))  # (V, r): starts at 0
        self.conf_norm = ones(d)
        self.conf_proj = nn.Parameter(torch.zeros(1, d + c.markov_rank + 1))  # (1, D + r + 1)
        self.conf_bias = nn.Parameter(torch.zeros(1))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.backend.small.rms_norm(x, weight, self.config.rms_norm_eps)

    def block_states(
        self, hidden: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor, k: int
    ) -> torch.Tensor:
        """hidden (B, Dm) at position t, tokens (B,) at t + 1 -> u (B, k, D) for positions 0..k-1."""
        small, gemm = self.backend.small, self.backend.gemm
        e = nn.functional.embedding(tokens, embed)  # (B, Dm)
        x = torch.cat([self._norm(hidden, self.hnorm), self._norm(e, self.enorm)], dim=-1)
        z = gemm.linear(x, self.in_proj.to(x.dtype))  # (B, D)
        b = z.shape[0]
        u = (z[:, None, :] + self.pos[:k].to(z.dtype)).reshape(b * k, -1)  # (B k, D)
        for norm, gate_up, down in zip(self.norms, self.gate_up, self.down):
            h = small.silu_and_mul(gemm.linear(self._norm(u, norm), gate_up.to(u.dtype)))  # (Bk, I)
            u = u + gemm.linear(h, down.to(u.dtype))
        return u.reshape(b, k, -1)

    def base_logits(self, u: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """u (..., D) -> logits (..., V) float32 through the model's LM head, before the transition."""
        shape = u.shape[:-1]
        u2 = u.reshape(-1, u.shape[-1])
        o = self._norm(self.backend.gemm.linear(u2, self.out_proj.to(u2.dtype)), self.out_norm)  # (N, Dm)
        logits = self.backend.gemm.linear(o.to(lm_head.dtype), lm_head).float()  # (N, V)
        return logits.reshape(*shape, -1)

    def transition(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev (...) token ids -> (markov_down[prev] (..., r), logit offsets (..., V) float32)."""
        low = nn.functional.embedding(prev, self.markov_down)  # (..., r)
        shape = low.shape[:-1]
        bias = self.backend.gemm.linear(low.reshape(-1, low.shape[-1]).float(), self.markov_up.float())
        return low, bias.reshape(*shape, -1)

    def confidence_logits(self, u: torch.Tensor, low: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """u (..., D), low (..., r), logits (..., V) -> (...) float32 logits of P(accepted up to here)."""
        top = torch.log_softmax(logits, dim=-1).max(dim=-1).values  # (...)
        feats = torch.cat([self._norm(u, self.conf_norm).float(), low.float(), top[..., None]], dim=-1)
        shape = feats.shape[:-1]
        out = self.backend.gemm.linear(feats.reshape(-1, feats.shape[-1]), self.conf_proj.float())
        return (out + self.conf_bias.float()).reshape(shape)

    def forward_train(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        prev: torch.Tensor,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: hidden (B, Dm), tokens (B,), prev (B, k) the token before each block
        position (prev[:, 0] = tokens) -> (logits (B, k, V), confidence logits (B, k)), float32."""
        k = prev.shape[1]
        u = self.block_states(hidden, tokens, embed, k)
        low, bias = self.transition(prev)
        logits = self.base_logits(u, lm_head) + bias
        return logits, self.confidence_logits(u, low, logits.detach())

    @torch.inference_mode()
    def draft(
        self, hidden: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy block: hidden (B, Dm), tokens (B,) -> (drafts (B, k) int64, confidences (B, k)
        float32 in [0, 1], made non-increasing along the block: a prefix is no likelier than a
        shorter one)."""
        if not 1 <= k <= self.block_size:
            raise ValueError(f"the drafter proposes 1..{self.block_size} tokens per pass, not {k}")
        u = self.block_states(hidden, tokens, embed, k)  # (B, k, D)
        base = self.base_logits(u, lm_head)  # (B, k, V)
        prev, drafts, lows, rows = tokens, [], [], []
        for i in range(k):  # the sequential part: a rank-r lookup per position
            low, bias = self.transition(prev)
            logits = base[:, i] + bias
            prev = logits.argmax(dim=-1)
            drafts.append(prev)
            lows.append(low)
            rows.append(logits)
        # the confidences of every position in one pass (they do not feed the chain)
        conf = torch.sigmoid(self.confidence_logits(u, torch.stack(lows, 1), torch.stack(rows, 1)))  # (B, k)
        return torch.stack(drafts, dim=1), conf.cummin(dim=1).values

    # ------------------------------------------------------------------ files

    def save(self, directory: str | Path) -> None:
        """drafter_config.json + drafter.safetensors (float32) into `directory`."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        tensors = {n: p.detach().float().cpu().contiguous() for n, p in self.named_parameters()}
        save_file(tensors, str(d / WEIGHTS_FILE))


def has_drafter(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def load_drafter(
    directory: str | Path, backend: Backend, model_config: Any, dtype: torch.dtype
) -> BlockDrafter:
    """The drafter saved in `directory`, checked against the model it drafts for (hidden_size,
    vocab_size) and tensor by tensor; ValueError naming what does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from deepinfer.models.hub import checkpoint_file

    d = Path(directory)
    config = DrafterConfig.from_file(checkpoint_file(d, CONFIG_FILE))
    for name in ("hidden_size", "vocab_size"):
        if getattr(config, name) != getattr(model_config, name):
            raise ValueError(
                f"{d / CONFIG_FILE}: {name}={getattr(config, name)} does not match the model's "
                f"{getattr(model_config, name)}: the drafter was trained for another model"
            )
    if not (d / WEIGHTS_FILE).is_file():
        raise ValueError(f"{d} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(checkpoint_file(d, WEIGHTS_FILE)))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{d / WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
    drafter = BlockDrafter(config, backend)
    expected = dict(drafter.named_parameters())
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{d / WEIGHTS_FILE}: missing tensors {missing}, unexpected tensors {unexpected}")
    with torch.no_grad():
        for name, p in expected.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"{d / WEIGHTS_FILE}: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
                )
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{d / WEIGHTS_FILE}: {name} holds non-finite or non-float values")
            p.copy_(t)
    return drafter.to(device=backend.device.device(), dtype=dtype).eval().requires_grad_(False)

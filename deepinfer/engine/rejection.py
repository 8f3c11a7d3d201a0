"""Speculative verification that is exact in distribution: rejection sampling.

Request b verifies w drafts d_0 .. d_{w-1} with 1 + w rows of target logits: row j gives p_j, the
distribution plain sampling draws from at that position (the backend's sampling_probs: temperature,
top-k, top-p, min-p, after the logits processors the caller ran). Draft j came from the drafter's
proposal q_j. Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the token is drawn from normalize(max(p_j - q_j, 0)); after w accepted drafts the bonus
token is drawn from p_w. Then every emitted token follows p exactly, whatever q is (Leviathan et
al. 2023, Chen et al. 2023).

A deterministic drafter (greedy: every drafter the engine ships) has q_j = one-hot(d_j): acceptance
is p_j(d_j) and the residual is p_j without d_j. The exponential race that plain sampling runs at
row j (noise of (seed, position), argmax p_j / noise) is such a sampler: its winner equals d_j with
probability p_j(d_j), and otherwise is a draw from p_j without d_j. So for q one-hot this module
draws every row with plain sampling's own noise and accepts while the winner equals the draft:
seeded speculative decoding then emits the tokens plain decoding emits, token for token, and greedy
rows (p one-hot at the argmax) accept exactly the drafts equal to the argmax.

For a sampled drafter (q given), the uniforms are a pure function of (request seed, position, case)
(uniforms: the backend's exponential_noise with a seed salted by the case), case ACCEPT for the
acceptance test and RESIDUAL for the residual's race; the bonus row uses plain sampling's noise. So
seeded runs reproduce whatever shares the batch. Everything here composes contract ops
(SmallOps.sampling_probs, exponential_noise) and torch tensor ops: device only, graph-safe.
"""

from __future__ import annotations

import torch

from deepinfer.backend.ops import SmallOps

ACCEPT, RESIDUAL = 1, 2  # the cases of uniforms


def case_seeds(seeds: torch.Tensor, case: int) -> torch.Tensor:
    """(B,) int64 seeds for a case's draws: case 0 is the seed itself (plain sampling's noise),
    others flip bits of its high half (the noise hash mixes both halves)."""
    salt = (case * 0x9E37_79B1) & 0x7FFF_FFFF  # < 2**31: the shifted salt fits int64
    return seeds if case == 0 else seeds ^ (salt << 32)


def uniforms(small: SmallOps, seeds: torch.Tensor, positions: torch.Tensor, case: int) -> torch.Tensor:
    """(B, n) float32 uniforms in (0, 1), a pure function of (seeds[b], positions[b, j], case):
    seeds (B,) int64, positions (B, n) int64 >= 0."""
    b, n = positions.shape
    s = case_seeds(seeds, case)[:, None].expand(b, n).reshape(-1)
    noise = small.exponential_noise(s, positions.reshape(-1), 1)  # (B n, 1): -log(u)
    return torch.exp(-noise).view(b, n)


def race(
    small: SmallOps, probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, case: int
) -> torch.Tensor:
    """A draw from each row of probs (B, n, V) (any non-negative weights, not all zero) by the
    exponential race with the noise of (seeds[b], positions[b, j], case) -> (B, n) int64. Case 0
    is plain sampling's draw (Sampler.draw) at that position."""
    b, n, v = probs.shape
    s = case_seeds(seeds, case)[:, None].expand(b, n).reshape(-1)
    noise = small.exponential_noise(s, positions.reshape(-1), v).view(b, n, v)
    return (probs / noise).argmax(dim=-1)


def rejection_verify(
    small: SmallOps,
    probs: torch.Tensor,
    drafts: torch.Tensor,
    valid: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts by rejection sampling.

    probs (B, q, V) float32: the target's processed distribution at each row (q = 1 + w; a greedy
    row one-hot at its argmax); drafts (B, w) int64; valid (B, w) bool (False: padding, never
    accepted); seeds (B,) int64; positions (B, q) int64: the position row j samples;
    draft_probs (B, w, V) float32 the drafter's proposals q_j, or None for a deterministic drafter
    (q_j one-hot at d_j) -> (tokens (B, q), accepted (B,)): with a = accepted[b], tokens[b, :a]
    are the accepted drafts and tokens[b, a] the token drawn after them (residual or bonus)."""
    w = probs.shape[1] - 1
    plain = race(small, probs, seeds, positions, 0)  # (B, q): plain sampling's draws
    if draft_probs is None:  # q one-hot: the race is the rejection sampler (module docstring)
        accept = (plain[:, :w] == drafts) & valid
        tokens = plain
    else:
        p_d = probs[:, :w].gather(2, drafts[..., None])[..., 0]  # (B, w)
        q_d = draft_probs.gather(2, drafts[..., None])[..., 0]
        u = uniforms(small, seeds, positions[:, :w], ACCEPT)
        accept = (u * q_d < p_d) & valid  # u < min(1, p/q) for u in (0, 1)
        residual = (probs[:, :w] - draft_probs).clamp(min=0)  # (B, w, V)
        # p == q leaves no residual (and no rejection but by rounding): draw from p then
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, probs[:, :w], residual)
        redrawn = race(small, residual, seeds, positions[:, :w], RESIDUAL)  # (B, w)
        tokens = torch.cat([torch.where(accept, drafts, redrawn), plain[:, w:]], dim=1)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,)
    return tokens, accepted


def target_probs(
    small: SmallOps,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution plain sampling draws each row of logits (S, V) float32 from (rows with
    temperature 0: one-hot at the argmax, as the draw takes it) -> (S, V) float32."""
    probs = small.sampling_probs(logits, temperature, top_k, top_p, min_p)
    onehot = torch.zeros_like(probs).scatter_(1, small.argmax(logits)[:, None], 1.0)
    return torch.where((temperature <= 0)[:, None], onehot, probs)

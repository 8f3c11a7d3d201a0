"""Reference small ops: rms_norm, add_rms_norm, rope, silu_and_mul, token bitmask, sampling."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual summed in float32 and stored in x's dtype; (rms_norm(h), h)."""
    h = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(h, weight, eps), h


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    half = x.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # (T, 1, R/2)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# Columns per chunk of argmax_rows' first reduction (at most; a power of two dividing the vocab).
ARGMAX_CHUNK = 1024


def argmax_rows(logits: torch.Tensor, out: torch.Tensor) -> None:
    """out (S,) int64 = logits (S, V).argmax(-1), the first maximum of each row, in two reductions
    (chunks of C columns, then the chunks' maxima): torch reduces a single row of a 100k vocabulary
    in one thread block (23 us of a 2.1 ms V2-Lite decode step on an H200). Rows whose width has
    no power-of-two divisor of at least 64 take torch's argmax as it is."""
    rows, vocab = logits.shape
    chunk = ARGMAX_CHUNK
    while chunk >= 64 and vocab % chunk:
        chunk //= 2
    if chunk < 64 or vocab == chunk:
        out.copy_(logits.argmax(dim=-1))
        return
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)  # (S, V / C): first maxima
    best = values.argmax(dim=-1, keepdim=True)  # (S, 1): the first chunk holding the row's maximum
    torch.add(within.gather(1, best).squeeze(1), best.squeeze(1), alpha=chunk, out=out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(V/32)) int32 -> (B, V) bool allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[..., None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = bitmask_to_bool(bitmask, logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))


_MASK32 = 0xFFFFFFFF
_MIX = 0x045D9F3B  # below 2**31: a 32-bit value times it stays below 2**63, exact in int64


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of uint32 values held in int64."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) seeds, (B,) offsets -> (B, V) float32 Exp(1) draws, a pure function of the three.

    key  = mix32(mix32(seed_lo ^ mix32(seed_hi)) ^ offset_lo)    (lo / hi: the 32-bit halves)
    bits = mix32(key ^ mix32(v))                                  for token id v
    u    = ((bits >> 8) + 0.5) / 2**24                            in (0, 1), exact in float32
    noise = -log(u)
    """
    s, o = seeds.long(), offsets.long()
    key = mix32(mix32((s & _MASK32) ^ mix32((s >> 32) & _MASK32)) ^ (o & _MASK32))  # (B,)
    tok = mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device))  # (V,)
    bits = mix32(key[:, None] ^ tok[None, :])  # (B, V)
    u = ((bits >> 8).float() + 0.5) * (1.0 / 16777216.0)
    return -torch.log(u)


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, then top-p, then min-p. logits (B, V) float32."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution `sample` draws from: softmax(filter_logits(logits / T)) (B, V) float32;
    rows with temperature <= 0 (greedy) are filtered at T = 1 (sample takes their argmax)."""
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    return torch.softmax(filter_logits(scaled, top_k, top_p, min_p), dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    logits = logits.float()
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    sampled = (probs / exp_noise).argmax(dim=-1)  # the exponential race: a draw from probs
    return torch.where(temperature <= 0, logits.argmax(dim=-1), sampled)

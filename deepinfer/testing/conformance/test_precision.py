"""Precision-sensitive cases: a scale off by 1% passes bfloat16's elementwise budget (2.5e-2) on
random inputs, so a backend that claims only bfloat16 would ship it. These cases catch it in every
dtype.

Attention (the softmax scale): inputs built so that the softmax mass moves fast with the scale.
Softmax is shift-invariant, so a scale error shows only through logit DIFFERENCES, and the mass
moves fastest where a key holds half of it: dP/dlog(scale) = P (1 - P) * (logit gap).
- `many_keys`: in each request one key of logit ln(n - 1) against n - 1 keys of logit 0 (n about
  a thousand: a gap of 7 at P = 1/2), its value +A against -A for the others, so the output
  A (2P - 1) is near 0 and moves by 2A * P(1 - P) * 7 * 1% = 0.07 (A = 2) for a 1% scale error:
  2.7 times the bfloat16 budget there (measured on the reference: 2.73 to 2.77), while rounding
  P (or even the logits, a 2^-5 step at 7) to bfloat16 moves it by about 0.016 at most.
- `sinks`: one key of logit 40 against a sink of 40 (sinks are not scaled: an absolute
  reference), so 1% more scale gives the key 60% of the mass instead of 50% (4.2 times the
  bfloat16 budget, measured).
Each attention case checks its own power too: the float64 reference with the scale times 1.01
must miss the bfloat16 budget by a factor of 1.5 or more.

Elementwise ops (rms_norm and its weight, add_rms_norm, rope, silu_and_mul): the least-squares
scale between the output and the float64 reference must be within half a percent of 1
(tolerances.assert_unscaled): unbiased rounding averages out over thousands of elements, a weight
or a factor off by 1% does not.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionModifiers
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import small as ref_small
from deepinfer.testing.helpers import attention_locator, make_paged_batch, oracle, randn
from deepinfer.testing.tolerances import assert_close, assert_unscaled, tolerance

D, V_DIM = 20, 16  # K width and V width: column 16 (outside V) carries every logit
HEAD_GAIN = (1.0, 1.0625)  # q's column 16 per head: two operating points near P = 1/2
AMP = 2.0  # |value| of the probed key and of the others (opposite signs)
SINK_LOGIT = 40.0
POWER = 1.5  # a 1% scale error must miss the bfloat16 budget by this factor


def _softmax_scale(gen: torch.Generator) -> float:
    """A scale that is not D^-0.5 (models do not pass it): D^-0.5 times a factor in [1.2, 2]."""
    return float(D**-0.5 * (1.2 + 0.8 * float(torch.rand((), generator=gen))))


def _probe_rows(
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    dtype: torch.dtype,
    gen: torch.Generator,
    sinks: bool,
) -> tuple[list[torch.Tensor], list[int]]:
    """Per request, (n, D) K rows: one probed key (at a position every query row sees) whose
    column 16 is gap / scale, every other key 0 there; values +-AMP with per-column signs.
    -> (rows, the probed key's position per request)."""
    rows, where = [], []
    for n, q in zip(seq_lens, query_lens):
        gap = SINK_LOGIT if sinks else math.log(n - 1)
        k = torch.zeros((n, D))
        sign = torch.where(torch.rand(V_DIM, generator=gen) < 0.5, -1.0, 1.0)
        k[:, :V_DIM] = -AMP * sign + 0.05 * torch.randn((n, V_DIM), generator=gen)
        k[:, V_DIM + 1 :] = torch.randn((n, D - V_DIM - 1), generator=gen)  # q is 0 there
        a = int(torch.randint(0, n - q + 1, (), generator=gen))
        k[a, :V_DIM] = AMP * sign
        k[a, V_DIM] = gap / scale
        rows.append(k.to(dtype))
        where.append(a)
    return rows, where


def _power(wrong: torch.Tensor, expected: torch.Tensor) -> float:
    """How far `wrong` misses the bfloat16 budget around `expected`: max of error / bound."""
    tol = tolerance(torch.bfloat16)
    return float(((wrong - expected).abs() / (tol.atol + tol.rtol * expected.abs())).max())


# name: (seq_lens, query_lens, decode, sinks)
SCALE_CASES = {
    "decode_many_keys": ((1025, 700), (1, 1), True, False),
    "prefill_many_keys": ((1025, 300), (4, 3), False, False),
    "decode_sinks": ((9, 33), (1, 1), True, True),
    "prefill_sinks": ((12, 20), (3, 20), False, True),
}


@pytest.mark.parametrize("name", list(SCALE_CASES))
def test_attention_scale_precision(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str
) -> None:
    """A 1% error in the softmax scale fails here in every dtype, bfloat16 included."""
    seq_lens, query_lens, decode, with_sinks = SCALE_CASES[name]
    seq, qlen = list(seq_lens), list(query_lens)
    scale = _softmax_scale(gen)
    rows, probed = _probe_rows(seq, qlen, scale, dtype, gen, with_sinks)
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=64, head_dim=D, dtype=dtype, gen=gen,
        rope_dim=D - V_DIM, kv_rows=rows,
    )  # fmt: skip
    dev = backend.device.device()
    q = torch.zeros((batch.num_tokens, len(HEAD_GAIN), D))
    q[:, :, V_DIM] = torch.tensor(HEAD_GAIN)
    q = q.to(dtype).to(dev)
    sinks = None
    if with_sinks:  # the probed key's own logit per head (of the first request), from the stored rows
        k0 = float(oracle(rows[0])[probed[0], V_DIM])
        sinks = torch.tensor([scale * g * k0 for g in HEAD_GAIN], dtype=torch.float32)
    op = backend.attention.decode if decode else backend.attention.prefill
    out = op(
        q, batch.cache, batch.meta, scale=scale, v_dim=V_DIM,
        modifiers=AttentionModifiers(sinks=None if sinks is None else sinks.to(dev)),
    )  # fmt: skip

    def reference(s: float) -> torch.Tensor:
        mods = AttentionModifiers(sinks=None if sinks is None else oracle(sinks))
        return ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, s, V_DIM, mods)

    expected = reference(scale)
    power = _power(reference(scale * 1.01), expected)
    assert power >= POWER, (
        f"the case lost its power: a 1% scale error misses the bf16 budget by only {power:.2f}x"
    )
    what = "decode" if decode else "prefill"
    case = (
        f"{name}: scale-sensitive inputs (a 1% scale error moves the output {power:.1f}x the bfloat16 "
        f"budget), seq_lens {seq}, query_lens {qlen}, probed keys at {probed}, scale={scale:.4g}"
        + (f", sinks {[round(float(v), 3) for v in sinks]}" if sinks is not None else ", no sinks")
    )
    assert_close(out, expected, dtype, what=what, locate=attention_locator(batch.meta), case=case)


def _rope_cache(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


SCALE_OPS = ["rms_norm", "add_rms_norm", "rope_interleaved", "rope_half", "silu_and_mul"]


@pytest.mark.parametrize("op", SCALE_OPS)
def test_small_op_scale_precision(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, op: str
) -> None:
    """The output is not the reference times a constant (a weight, a norm or a factor off by 1%),
    whatever the dtype: the least-squares scale over about 30,000 elements is within half a percent
    of 1 (and each element within the dtype's budget)."""
    dev = backend.device.device()
    if op in ("rms_norm", "add_rms_norm"):
        x = randn((64, 512), dtype, dev, gen, 2.0)
        w = (1 + randn((512,), torch.float32, "cpu", gen, 0.2)).to(dtype).to(dev)
        if op == "rms_norm":
            outs = [backend.small.rms_norm(x, w, 1e-6)]
            refs = [ref_small.rms_norm(oracle(x), oracle(w), 1e-6)]
        else:
            res = randn((64, 512), dtype, dev, gen)
            outs = list(backend.small.add_rms_norm(x, res, w, 1e-6))
            refs = list(ref_small.add_rms_norm(oracle(x), oracle(res), oracle(w), 1e-6))
        case = "x (64, 512), weight 1 + N(0, 0.2^2), eps 1e-6"
    elif op.startswith("rope"):
        interleaved = op == "rope_interleaved"
        x = randn((64, 8, 64), dtype, dev, gen)
        table = _rope_cache(4096, 64)
        positions = torch.randint(0, 4096, (64,), generator=gen)
        outs = [backend.small.rope(x, positions.to(dev), table.to(dev), interleaved)]
        refs = [ref_small.rope(oracle(x), positions, table.double(), interleaved)]
        case = f"x (64, 8, 64), positions below 4096, {'interleaved' if interleaved else 'half'} pairs"
    else:
        x = randn((64, 1024), dtype, dev, gen, 2.0)
        outs = [backend.small.silu_and_mul(x)]
        refs = [ref_small.silu_and_mul(oracle(x))]
        case = "x (64, 2 x 512)"
    for i, (out, ref) in enumerate(zip(outs, refs)):
        what = op if len(outs) == 1 else f"{op} {('y', 'h')[i]}"
        assert out.dtype == dtype, f"{what} returned {out.dtype}, expected {dtype}"
        assert_close(out, ref, dtype, what=what, case=case)
        assert_unscaled(out, ref, dtype, what=what, case=case)

"""FP8 latent caches (KVCacheSpec.kv_format "fp8", deepinfer.backend.kv_formats_mla: FlashMLA's
656-byte rows for 512 + 64), for backends that claim Capabilities.supports_fp8_kv_cache: the
layout's size, what write_kv / write_mla_kv keep of each row, and decode / prefill /
mla_decode_and_uv reading the rows, all against float64.

Tolerances, from the format (not loosened until green):
- rows: a latent value x of a tile with scale s (a power of two, amax / 448 <= s < 2 amax / 448)
  is rounded to the nearest e4m3 value: |error| <= 2^-4 |x| (half a step of the 3-bit mantissa,
  FP8_REL) in e4m3's normal range, <= 2^-10 s below it (half the subnormal step 2^-9 s,
  FP8_SUBNORMAL); a rope value is rounded to bfloat16, <= 2^-8 |x|. Rounding toward zero, or a
  scale that is not the tile's, exceeds these bounds. write_mla_kv quantises its own rms_norm /
  rope output, which may sit a rounding of the dtype away from float64 (and then across a
  rounding midpoint, or a power of two that doubles s): that rounding is added, s taken doubled.
- attention: the reference runs over the rows the format keeps, computed in float64 from its
  definition (deepinfer.testing.oracles.e4m3_rows64). write_kv stores exactly those rows (x / s is
  exact for a power of two, and e4m3 rounding to nearest even is the format's), so the attention
  keeps the dtype's own budget: only its arithmetic differs from float64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.backend.kv_formats_mla import fp8_row_bytes, fp8_tile
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import KVCacheSpec
from deepinfer.testing.conformance.test_attention import (
    DECODE_CASES,
    PREFILL_CASES,
    UV_CASES,
    Case,
    run_case,
    run_uv_case,
)
from deepinfer.testing.conformance.test_memory import mla_rows, rope_table
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import FP8_REL, FP8_SUBNORMAL

BF16_REL = 2.0**-8  # bfloat16: half a step of its 8 significant bits


@pytest.fixture(autouse=True)
def _claims_fp8_cache(backend: Backend) -> None:
    if not backend.capabilities.supports_fp8_kv_cache:
        pytest.skip(f"backend {backend.name!r} does not claim FP8 KV caches")


def check_rows(got: torch.Tensor, want: torch.Tensor, latent: int, extra_rel: float, what: str) -> None:
    """got (n, C + R) read back vs want float64: the bounds of the module docstring, with
    extra_rel of input rounding on top (write_mla_kv)."""
    got, want = got.double().cpu(), want.double()
    n, tile = want.shape[0], fp8_tile(latent)
    tiles = want[:, :latent].reshape(n, latent // tile, tile)
    scale = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0)))
    if extra_rel:
        scale = 2 * scale  # the input's rounding may lift amax past a power of two
    lat_bound = (FP8_REL * (1 + extra_rel) + extra_rel) * tiles.abs() + FP8_SUBNORMAL * scale
    rope_bound = (BF16_REL * (1 + extra_rel) + extra_rel) * want[:, latent:].abs()
    bound = torch.cat([lat_bound.reshape(n, latent), rope_bound], dim=-1)
    err = (got - want).abs()
    bad = ~(err <= bound)
    if bad.any():
        row, col = divmod(int(torch.argmax((err - bound).nan_to_num(float("inf")))), err.shape[1])
        part = "latent" if col < latent else "rope part"
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} values past the format's rounding bound; worst at "
            f"row {row}, column {col} ({part}): {got[row, col].item():.6g} vs float64 "
            f"{want[row, col].item():.6g} (bound {bound[row, col].item():.3g})"
        )


SPECS = [  # (num_blocks, block_size, latent_dim, rope_dim)
    (5, 16, 512, 64),  # DeepSeek-V3: 656-byte rows
    (4, 64, 256, 64),  # two tiles
    (6, 3, 24, 8),  # one tile narrower than 128 (the tiny test configs)
    (4, 5, 128, 0),  # no rope part
]


@pytest.mark.parametrize("spec_args", SPECS, ids=lambda s: "x".join(map(str, s)))
def test_fp8_rows_write_read_copy(
    backend: Backend,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    spec_args: tuple[int, ...],
) -> None:
    nb, bs, latent, rope = spec_args
    spec = KVCacheSpec(nb, bs, latent, rope, dtype, "fp8")
    assert spec.bytes_per_token == fp8_row_bytes(latent, rope)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    stored_bytes = sum(t.numel() * t.element_size() for t in cache.tensors)
    assert stored_bytes == nb * bs * spec.bytes_per_token, (
        f"an FP8 latent cache of {nb} blocks of {bs} must take {spec.bytes_per_token} bytes a token "
        f"(the KV budget counts them); its tensors take {stored_bytes / (nb * bs):.1f}"
    )
    assert all(t.shape[0] == nb for t in cache.tensors), (
        "the block index must be every tensor's first dimension"
    )
    all_slots = torch.arange(nb * bs, device=device)
    assert not backend.kv_cache.read_kv(cache, all_slots).any(), "a new cache is zero-filled"

    # tiles of very different magnitudes (scales far apart), zeros, padding slots
    n = nb * bs // 2 + 1
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::4] = -1
    mag = torch.exp2(torch.randint(-12, 8, (n, spec.head_dim), generator=gen).double())
    kv = (randn((n, spec.head_dim), torch.float32, "cpu", gen) * mag).to(dtype)
    kv[1, : min(latent, 128)] = 0  # an all-zero tile
    backend.kv_cache.write_kv(cache, kv.to(device), slots.to(device))
    keep = slots >= 0
    got = backend.kv_cache.read_kv(cache, slots[keep].to(device))
    assert got.shape == (int(keep.sum()), spec.head_dim) and got.is_floating_point()
    check_rows(got, oracle(kv[keep]), latent, 0.0, "write_kv/read_kv of FP8 rows")
    unwritten = torch.ones(nb * bs, dtype=torch.bool)
    unwritten[slots[keep]] = False
    assert not backend.kv_cache.read_kv(cache, all_slots[unwritten.to(device)]).any(), (
        "padding rows were written"
    )

    perm = torch.randperm(nb, generator=gen)
    src, dst = perm[:2], perm[2:4]
    before = backend.kv_cache.read_kv(cache, all_slots).cpu().view(nb, bs, -1)
    backend.kv_cache.copy_blocks(cache, src.to(device), dst.to(device))
    before[dst] = before[src].clone()
    after = backend.kv_cache.read_kv(cache, all_slots).cpu().view(nb, bs, -1)
    assert torch.equal(after, before), "copy_blocks of FP8 rows"


@pytest.mark.parametrize("spec_args", [(4, 16, 512, 64), (3, 4, 24, 8)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_fp8_write_mla_kv(
    backend: Backend,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    spec_args: tuple[int, ...],
    interleaved: bool,
) -> None:
    """The norm + rope + quantised store, kv a column slice of a wider buffer, padding slots."""
    nb, bs, latent, rope = spec_args
    spec = KVCacheSpec(nb, bs, latent, rope, dtype, "fp8")
    cache = backend.kv_cache.allocate(spec, 1)[0]
    n = nb * bs // 2 + 1
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[:: max(1, n // 3)] = -1
    wide = randn((n, spec.head_dim + 3), dtype, "cpu", gen, 2.0)
    kv = wide[:, 1 : 1 + spec.head_dim]
    w = (1 + randn((latent,), torch.float32, "cpu", gen, 0.2)).to(dtype)
    table = rope_table(700, rope)
    positions = torch.randint(0, 700, (n,), generator=gen)
    backend.kv_cache.write_mla_kv(
        cache, kv.to(device), w.to(device), 1e-6, positions.to(device), table.to(device), interleaved,
        slots.to(device),
    )  # fmt: skip
    keep = slots >= 0
    got = backend.kv_cache.read_kv(cache, slots[keep].to(device))
    want = mla_rows(oracle(kv), oracle(w), positions, table.double(), latent, interleaved)[keep]
    # the norm and rope run in the dtype: their rounding (and float32 arithmetic) before quantising
    extra = torch.finfo(dtype).eps + 16 * torch.finfo(torch.float32).eps
    check_rows(got, want, latent, extra, "write_mla_kv of FP8 rows vs the float64 norm + rope")


def _fp8(case: Case) -> Case:
    return dataclasses.replace(case, kv_format="fp8")


# Cases of test_attention.py whose widths the format holds (latent a multiple of 128, or one tile
# of a multiple of 4). The light ones run always (the Triton interpreter walks 576-wide tiles
# slowly); the rest are heavy (the GPU's conformance run takes --deepinfer-heavy).
FP8_DECODE = ["small_dims", "v_lt_latent", "block_boundaries", "small_poison_sinks"]
FP8_DECODE_HEAVY = [
    "bs64_poison", "bs64", "single", "empty_batch", "window", "sinks", "topk", "many_heads", "bs1",
    "v_lt_latent_mla", "topk_edge_mla", "q_transposed_mla", "heads_1_mla", "shared_prefix", "table_view_mla",
    "long_sinks", "bs128_poison_window_sinks", "aligned_mla_heads_16", "aligned_mla_heads_128",
]  # fmt: skip
FP8_PREFILL = ["small_dims", "chunked", "fresh_and_decode"]
FP8_PREFILL_HEAVY = [
    "fresh", "bs64", "empty_request", "empty_batch", "decode_rows", "window", "sinks", "topk",
    "v_lt_latent_mla", "q_transposed_mla", "shared_prefix_mla", "empty_request_no_kv_mla", "table_view_mla",
    "long_sinks", "bs64_poison", "aligned_mla_heads_16", "aligned_mla_heads_128_chunk",
]  # fmt: skip
FP8_UV = ["nine_requests", "empty_batch"]
FP8_UV_HEAVY = ["one_request_heads_16", "aligned_mla_heads_16", "bs64_poison"]


# rows never written hold NaN (the FP8 store of a NaN row): they must not reach the output
DECODE_CASES = {
    **DECODE_CASES,
    "small_poison_sinks": Case((1, 9, 16, 17), block_size=8, head_dim=20, v_dim=16, sinks=True, poison=True),
}


def _cases(light: list[str], heavy: list[str]) -> list[object]:
    return [*light, *(pytest.param(n, marks=pytest.mark.heavy) for n in heavy)]


@pytest.mark.parametrize("name", _cases(FP8_DECODE, FP8_DECODE_HEAVY))
def test_fp8_decode(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    case = _fp8(DECODE_CASES[name])
    case = dataclasses.replace(case, query_lens=(1,) * len(case.seq_lens))
    run_case(backend, case, dtype, gen, decode=True)


@pytest.mark.parametrize("name", _cases(FP8_PREFILL, FP8_PREFILL_HEAVY))
def test_fp8_prefill(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    run_case(backend, _fp8(PREFILL_CASES[name]), dtype, gen, decode=False)


@pytest.mark.parametrize("name", _cases(FP8_UV, FP8_UV_HEAVY))
def test_fp8_mla_decode_and_uv(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    case, vh = UV_CASES[name]
    run_uv_case(backend, _fp8(case), vh, dtype, gen)


def test_fp8_spec_refuses_widths_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="kv_lora_rank"):
        KVCacheSpec(2, 4, 192, 64, torch.bfloat16, "fp8")  # past 128, not a multiple of it
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        KVCacheSpec(2, 4, 128, 7, torch.bfloat16, "fp8")
    with pytest.raises(ValueError, match="kv_format"):
        KVCacheSpec(2, 4, 128, 64, torch.bfloat16, "int8")

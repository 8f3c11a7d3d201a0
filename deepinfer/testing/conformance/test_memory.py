"""Device ops (device handle, sync, memory info, streams, events, pinned buffers, graphs) and the
KV-cache part (the layout's allocate / write / read / copy, MLA's fused cache write)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.host import HostEvent, HostStream
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import Event, KVCacheSpec, Stream
from deepinfer.reference import small as ref_small
from deepinfer.testing.helpers import oracle, randn, slot_locator, writer_rows
from deepinfer.testing.tolerances import TOLERANCES, assert_bitwise_equal, assert_close

SPECS = [  # (num_blocks, block_size, latent_dim, rope_dim)
    (5, 16, 512, 64),  # MLA absorbed: K 576 wide
    (4, 64, 512, 0),  # K = V latent
    (7, 3, 9, 4),  # small odd sizes
    (6, 1, 8, 4),  # one token per block
]


def test_device_basics(backend: Backend) -> None:
    dev = backend.device.device()
    assert isinstance(dev, torch.device)
    backend.device.synchronize()
    free, total = backend.device.memory_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 <= free <= total and total > 0


def test_streams_events_and_pinned_buffers(backend: Backend, device: torch.device) -> None:
    stream = backend.device.new_stream()
    event = backend.device.new_event()
    assert isinstance(stream, Stream), f"new_stream returned {type(stream).__name__}, not a Stream"
    assert isinstance(event, Event), f"new_event returned {type(event).__name__}, not an Event"
    if device.type != "cpu":  # the host stand-ins say "done" before an asynchronous device is
        stand_ins = (type(s).__name__ for s in (stream, event) if isinstance(s, HostStream | HostEvent))
        assert not list(stand_ins), (
            f"backend on {device.type} returns host stand-ins for streams/events: they report work as "
            "finished before the device has run it; override new_stream / new_event / stream_context"
        )
    x = torch.arange(10, dtype=torch.float32, device=device)
    with backend.device.stream_context(stream):
        y = x * 2
        event.record()
    event.synchronize()
    backend.device.synchronize()
    assert event.query() is True
    assert torch.equal(y.cpu(), torch.arange(10, dtype=torch.float32) * 2)
    host = backend.device.pinned_empty((3, 5), torch.bfloat16)
    assert host.shape == (3, 5) and host.dtype == torch.bfloat16 and host.device.type == "cpu"
    if device.type != "cpu":
        assert host.is_pinned(), "pinned_empty must return page-locked memory on an asynchronous device"


def test_async_copy_ordered_by_event(backend: Backend, device: torch.device) -> None:
    """What the engine relies on: a device-to-host copy into a pinned buffer, queued with
    non_blocking=True after a computation, is complete once an event recorded after it is
    synchronized (an event that reports completion early lets the host read stale values)."""
    host = backend.device.pinned_empty((1 << 16,), torch.float32)
    for value in (1.0, 2.0, 3.0):
        src = torch.full((1 << 16,), value, device=device) * 2  # queued work, then the copy
        host.copy_(src, non_blocking=True)
        event = backend.device.new_event()
        event.record()
        event.synchronize()
        assert bool((host == 2 * value).all()), (
            f"after event.synchronize() the pinned buffer holds {host[0].item()} instead of {2 * value}: "
            "the event does not order the host after the copy"
        )


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1,), torch.int64),
        ((3, 5), torch.int64),
        ((7,), torch.uint8),
        ((1000,), torch.float32),
        ((1 << 15,), torch.int32),
    ],
    ids=["one_token", "tokens", "odd_bytes", "floats", "128KiB"],
)
def test_to_host_and_to_device(
    backend: Backend, device: torch.device, gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """to_host / to_device, queued after work that writes the source and ordered by an event, as
    the engine uses them (the sampled tokens out, the step inputs in): the bytes arrive whole,
    whatever the size (odd byte counts and large buffers included)."""
    values = torch.randint(0, 100, shape, generator=gen).to(dtype)
    host = backend.device.pinned_empty(shape, dtype)
    back = backend.device.pinned_empty(shape, dtype)
    for step in range(3):
        src = values.to(device) + step  # queued work, then the copy out
        backend.device.to_host(src, host)
        event = backend.device.new_event()
        event.record()
        event.synchronize()
        assert torch.equal(host, values + step), f"to_host, step {step}: the pinned buffer holds other values"
        dst = torch.zeros(shape, dtype=dtype, device=device)
        backend.device.to_device(host, dst)
        backend.device.to_host(dst * 1, back)  # the device's copy, computed on, comes back
        event = backend.device.new_event()
        event.record()
        event.synchronize()
        assert torch.equal(back, values + step), (
            f"to_device, step {step}: the device tensor holds other values"
        )


@pytest.mark.parametrize("spec_args", SPECS, ids=lambda s: "x".join(map(str, s)))
def test_allocate_write_read_copy(
    backend: Backend,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    spec_args: tuple[int, ...],
) -> None:
    nb, bs, latent, rope = spec_args
    spec = KVCacheSpec(nb, bs, latent, rope, dtype)
    caches = backend.kv_cache.allocate(spec, 2)
    assert len(caches) == 2
    all_slots = torch.arange(nb * bs, device=device)
    for c in caches:
        assert c.spec == spec
        assert all(t.shape[0] == nb for t in c.tensors), (
            "every cache tensor must have the block index as its first dimension (the contract's "
            f"layout rule, which copy_blocks relies on); got shapes {[tuple(t.shape) for t in c.tensors]}"
        )
        stored = backend.kv_cache.read_kv(c, all_slots)
        assert stored.shape == (nb * bs, spec.head_dim) and stored.dtype == dtype
        assert not stored.any(), "a new cache is zero-filled"

    # write a random set of slots (float32 input, cast to the cache dtype), with padding rows
    n = nb * bs // 2 + 1
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::4] = -1
    kv = randn((n, spec.head_dim), torch.float32, "cpu", gen)
    backend.kv_cache.write_kv(caches[0], kv.to(device), slots.to(device))
    expected = torch.zeros((nb * bs, spec.head_dim), dtype=dtype)
    keep = slots >= 0
    expected[slots[keep]] = kv[keep].to(dtype)
    assert_bitwise_equal(
        backend.kv_cache.read_kv(caches[0], all_slots), expected, what="write_kv/read_kv",
        locate=slot_locator(all_slots, bs, writer_rows(slots, nb * bs)),
    )  # fmt: skip
    assert not backend.kv_cache.read_kv(caches[1], all_slots).any(), "write_kv touched another layer"

    # copy blocks: src -> dst, every tensor of the cache; other blocks untouched
    perm = torch.randperm(nb, generator=gen)
    src, dst = perm[:2], perm[2:4]
    backend.kv_cache.copy_blocks(caches[0], src.to(device), dst.to(device))
    after = expected.view(nb, bs, -1).clone()
    after[dst] = after[src]
    assert_bitwise_equal(
        backend.kv_cache.read_kv(caches[0], all_slots), after.view(nb * bs, -1),
        what=f"copy_blocks {src.tolist()} -> {dst.tolist()}", locate=slot_locator(all_slots, bs),
    )  # fmt: skip


def test_write_kv_empty(backend: Backend, device: torch.device) -> None:
    dt = backend.capabilities.dtypes[0]
    cache = backend.kv_cache.allocate(KVCacheSpec(2, 4, 8, 0, dt), 1)[0]
    backend.kv_cache.write_kv(
        cache, torch.empty((0, 8), dtype=dt, device=device), torch.empty(0, dtype=torch.long, device=device)
    )
    assert not backend.kv_cache.read_kv(cache, torch.arange(8, device=device)).any()


def test_write_kv_strided_rows_and_padding(
    backend: Backend, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """K rows as a column slice of wider rows (as the K row sits inside the kv_a output), in
    another float dtype, with padding (-1) first, last and in a run; then an all-padding step."""
    nb, bs, latent, rope = 4, 6, 12, 4
    spec = KVCacheSpec(nb, bs, latent, rope, dtype)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    all_slots = torch.arange(nb * bs, device=device)
    wide = randn((9, spec.head_dim + 5), torch.float32, "cpu", gen)
    kv = wide[:, 2 : 2 + spec.head_dim]
    slots = torch.tensor([-1, 7, 0, -1, -1, 23, 6, 11, -1])
    backend.kv_cache.write_kv(cache, kv.to(device), slots.to(device))
    expected = torch.zeros((nb * bs, spec.head_dim), dtype=dtype)
    keep = slots >= 0
    expected[slots[keep]] = kv[keep].to(dtype)
    where = slot_locator(all_slots, bs, writer_rows(slots, nb * bs))
    assert_bitwise_equal(
        backend.kv_cache.read_kv(cache, all_slots), expected, what="write_kv (strided rows)", locate=where
    )
    backend.kv_cache.write_kv(
        cache, randn((3, spec.head_dim), dtype, device, gen), torch.full((3,), -1, device=device)
    )
    assert_bitwise_equal(
        backend.kv_cache.read_kv(cache, all_slots), expected, what="write_kv (all padding)", locate=where
    )
    # slot_mapping a strided view (one column of a (T, 2) table)
    table = torch.tensor([[3, 1], [-1, 2], [5, 19]])
    rows = randn((3, spec.head_dim), dtype, "cpu", gen)
    backend.kv_cache.write_kv(cache, rows.to(device), table.to(device)[:, 1])
    expected[table[:, 1]] = rows
    assert_bitwise_equal(
        backend.kv_cache.read_kv(cache, all_slots), expected, what="write_kv (strided slots)",
        locate=slot_locator(all_slots, bs, writer_rows(table[:, 1], nb * bs)),
    )  # fmt: skip


def test_copy_blocks_fork(backend: Backend, device: torch.device, gen: torch.Generator) -> None:
    """One source block copied to several destinations (forking a sequence), and an empty copy."""
    dt = backend.capabilities.dtypes[0]
    nb, bs = 7, 5
    spec = KVCacheSpec(nb, bs, 8, 4, dt)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    all_slots = torch.arange(nb * bs, device=device)
    kv = randn((nb * bs, spec.head_dim), dt, "cpu", gen)
    backend.kv_cache.write_kv(cache, kv.to(device), all_slots)
    src, dst = torch.tensor([2, 2, 5, 2]), torch.tensor([0, 3, 6, 4])
    backend.kv_cache.copy_blocks(cache, src.to(device), dst.to(device))
    after = kv.view(nb, bs, -1).clone()
    after[dst] = after[src]
    where = slot_locator(all_slots, bs)
    assert_bitwise_equal(
        backend.kv_cache.read_kv(cache, all_slots), after.view(nb * bs, -1),
        what=f"copy_blocks {src.tolist()} -> {dst.tolist()}", locate=where,
    )  # fmt: skip
    empty = torch.empty(0, dtype=torch.int64, device=device)
    backend.kv_cache.copy_blocks(cache, empty, empty)
    assert_bitwise_equal(
        backend.kv_cache.read_kv(cache, all_slots), after.view(nb * bs, -1), what="empty copy", locate=where
    )


def test_capture_graph(backend: Backend, device: torch.device) -> None:
    x = torch.ones(8, device=device)
    out = torch.zeros(8, device=device)

    def step() -> None:
        out.copy_(x * 3)

    runner = backend.device.capture_graph(step)
    if not backend.capabilities.supports_graphs:
        assert runner is None, "a backend without graphs returns None from capture_graph"
        return
    assert runner is not None
    x.fill_(2.0)
    runner.replay()
    backend.device.synchronize()
    assert torch.equal(out.cpu(), torch.full((8,), 6.0))


def rope_table(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    """(P, R) float32 rows [cos | sin] of p * base^(-2i/R)."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


def mla_rows(
    kv: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    latent: int,
    interleaved: bool,
) -> torch.Tensor:
    """The contract's composition on the CPU, in the inputs' dtypes: [rms_norm | rope] (T, C + R)."""
    normed = ref_small.rms_norm(kv[:, :latent], w, 1e-6)
    k_pe = ref_small.rope(kv[:, None, latent:], positions, table, interleaved)[:, 0]
    return torch.cat([normed, k_pe], dim=-1)


MLA_SPECS = [  # (num_blocks, block_size, latent_dim, rope_dim)
    (4, 16, 512, 64),  # DeepSeek MLA: 512 latent + 64 rope
    (5, 3, 9, 4),  # small odd sizes
    (3, 4, 33, 6),
    (3, 8, 16, 0),  # K = V latent: no rope part
]


@pytest.mark.parametrize("spec_args", MLA_SPECS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("kv_dtype", ["cache", "float32"], ids=["kv_as_cache", "kv_f32"])
def test_write_mla_kv(
    backend: Backend,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    spec_args: tuple[int, ...],
    interleaved: bool,
    kv_dtype: str,
) -> None:
    """Stored rows = [rms_norm(kv[:, :C]) * w | rope(kv[:, C:])] cast to the cache dtype, with kv a
    column slice of a wider buffer, padding slots (-1) anywhere, and every other slot untouched."""
    nb, bs, latent, rope = spec_args
    kv_dt = dtype if kv_dtype == "cache" else torch.float32
    spec = KVCacheSpec(nb, bs, latent, rope, dtype)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    all_slots = torch.arange(nb * bs)
    before = randn((nb * bs, spec.head_dim), dtype, "cpu", gen)  # old contents must survive
    backend.kv_cache.write_kv(cache, before.to(device), all_slots.to(device))

    n = nb * bs // 2 + 1
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[:: max(1, n // 3)] = -1
    slots[-1] = -1
    wide = randn((n, spec.head_dim + 3), kv_dt, "cpu", gen, 2.0)
    kv = wide[:, 1 : 1 + spec.head_dim]  # (T, C + R) inside the wider projection output
    w = (1 + randn((latent,), torch.float32, "cpu", gen, 0.2)).to(kv_dt)
    table = rope_table(700, rope)  # (P, 0) without a rope part
    positions = torch.randint(0, 700, (n,), generator=gen)
    backend.kv_cache.write_mla_kv(
        cache, kv.to(device), w.to(device), 1e-6, positions.to(device), table.to(device), interleaved,
        slots.to(device),
    )  # fmt: skip
    stored = backend.kv_cache.read_kv(cache, all_slots.to(device)).cpu()
    keep = slots >= 0
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert_bitwise_equal(
        stored[untouched], before[untouched], what="slots not written (padding rows skipped)",
        locate=slot_locator(all_slots[untouched], bs),
    )  # fmt: skip

    got = stored[slots[keep]]
    written = slot_locator(slots[keep], bs, keep.nonzero().flatten().tolist())  # row -> slot, input row
    coarse = max((dtype, kv_dt), key=lambda d: TOLERANCES[d].rtol)
    expected = mla_rows(oracle(kv), oracle(w), positions, table.double(), latent, interleaved)
    assert_close(
        got, expected[keep], coarse, what="write_mla_kv rows vs the float64 reference", locate=written
    )
    # the contract: "rms_norm and rope as the small ops define them". So a fused write is the
    # backend's own composition in the same dtypes (kv's, then the cache's), a rounding apart at
    # most, plus float32 differences inside the norm and rope (summation order, FMA)
    small = backend.small
    kvd, wd = kv.to(device), w.to(device)
    k_pe = kvd[:, latent:]
    if rope:
        k_pe = small.rope(k_pe[:, None], positions.to(device), table.to(device), interleaved)[:, 0]
    composed = torch.cat([small.rms_norm(kvd[:, :latent], wd, 1e-6), k_pe.to(kv_dt)], dim=-1)
    same = composed.cpu()[keep].to(dtype).double()
    budget = torch.finfo(coarse).eps + 16 * torch.finfo(torch.float32).eps
    err = (got.double() - same).abs()
    if not (err <= budget * same.abs().clamp(min=1.0)).all():
        row, col = divmod(int(torch.argmax(err - budget * same.abs().clamp(min=1.0))), err.shape[1])
        part = "latent (rms_norm)" if col < latent else "rope part"
        raise AssertionError(
            f"write_mla_kv differs from this backend's own small.rms_norm + small.rope in {kv_dt} -> "
            f"{dtype} by {err.max().item():.3e}; worst at {written((row, col))} ({part}), "
            f"spec {spec_args}, {'interleaved' if interleaved else 'half'} rope"
        )


def test_write_mla_kv_empty_and_all_padding(
    backend: Backend, device: torch.device, gen: torch.Generator
) -> None:
    dt = backend.capabilities.dtypes[0]
    spec = KVCacheSpec(2, 4, 8, 4, dt)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    table = rope_table(16, 4).to(device)
    w = torch.ones(8, dtype=dt, device=device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    backend.kv_cache.write_mla_kv(
        cache, torch.empty((0, 12), dtype=dt, device=device), w, 1e-6, empty, table, True, empty
    )
    rows = randn((3, 12), dt, device, gen)
    pad = torch.full((3,), -1, device=device)
    backend.kv_cache.write_mla_kv(cache, rows, w, 1e-6, torch.zeros_like(pad), table, False, pad)
    assert not backend.kv_cache.read_kv(cache, torch.arange(8, device=device)).any()

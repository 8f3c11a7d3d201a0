"""Input builders shared by the conformance tests: random tensors, paged KV caches, metadata.

Every builder draws from an explicit torch.Generator (CPU) so that a failure reproduces with
the same seed; tensors are generated in float32 on the CPU, cast to the dtype under test and
moved to the backend's device. `oracle(t)` gives the float64 CPU copy the reference runs on.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.backend.kv_formats_mla import fp8_tile
from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import BackendRegistry
from deepinfer.backend.types import AttentionMetadata, KVCacheSpec, PagedKVCache, RouterConfig
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import memory as ref_memory
from deepinfer.reference import moe as ref_moe
from deepinfer.testing.oracles import e4m3_rows64
from deepinfer.testing.tolerances import Locator


def registry_with(plugins: Sequence[str] = ()) -> BackendRegistry:
    """The registry of the installed entry points plus `plugins`: each "MODULE" or
    "MODULE:ATTRIBUTE" names a plugin (a module or object implementing the deepinfer_backends
    hook) that is not installed, e.g. a backend under development or one built inside a test.
    A plugin that fails to import or to register raises ValueError naming it."""
    registry = BackendRegistry.discover()
    for spec in plugins:
        module, _, attr = spec.partition(":")
        try:
            plugin: object = importlib.import_module(module)
            for part in filter(None, attr.split(".")):
                plugin = getattr(plugin, part)
            registry.register_plugin(plugin, spec)
        except Exception as exc:
            raise ValueError(f"backend plugin {spec!r}: {type(exc).__name__}: {exc}") from exc
    return registry


def randn(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    scale: float = 1.0,
) -> torch.Tensor:
    """Normal(0, scale^2) values in `dtype` on `device`."""
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def oracle(t: torch.Tensor) -> torch.Tensor:
    """The float64 CPU copy of a float tensor (other dtypes: a CPU copy) for the reference."""
    t = t.detach().cpu()
    return t.double() if t.is_floating_point() and t.dtype.itemsize > 1 else t.clone()


def router_margin(logits: torch.Tensor, config: RouterConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """(T,) how far each token's expert choice is from changing: the smallest gap, in float64
    selection scores (scores + bias), at the group cut (topk_groups) and at the expert cut (top_k);
    inf where every expert is chosen."""
    sel = ref_moe.scores_of(logits.double(), config.scoring)
    if bias is not None:
        sel = sel + bias.double()
    gaps = []
    if config.num_groups > 1:
        groups = sel.view(sel.shape[0], config.num_groups, sel.shape[1] // config.num_groups)
        if config.group_score == "top2_sum":
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = groups.amax(-1)
        g = group_scores.sort(dim=-1, descending=True).values
        if config.topk_groups < config.num_groups:
            gaps.append(g[:, config.topk_groups - 1] - g[:, config.topk_groups])
        keep = group_scores.topk(config.topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        sel = groups.masked_fill(mask[..., None], float("-inf")).view_as(sel)
    s = sel.sort(dim=-1, descending=True).values
    if config.top_k < s.shape[1]:
        gaps.append(s[:, config.top_k - 1] - s[:, config.top_k])
    else:  # every expert is chosen
        gaps.append(torch.full_like(s[:, 0], float("inf")))
    return torch.stack(gaps).amin(0).cpu()


def quantized_weight(
    shape: tuple[int, ...],
    device: torch.device | str,
    gen: torch.Generator,
    scale: float = 1.0,
    block: int = ref_gemm.FP8_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (N, K) or (E, N, K) FP8 e4m3 weight in DeepSeek's format with its block scales:
    float32 per 128 x 128 block, or with block 32 V4.1's (UE8M0: powers of two)."""
    w = torch.randn(shape, generator=gen) * scale
    ue8m0 = block != ref_gemm.FP8_BLOCK
    if w.dim() == 2:
        q, s = ref_gemm.quantize_weight(w, block, ue8m0)
    else:
        pairs = [ref_gemm.quantize_weight(w[e], block, ue8m0) for e in range(w.shape[0])]
        q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return q.to(device), s.to(device)


def mxfp4_weight(
    shape: tuple[int, int, int], device: torch.device | str, gen: torch.Generator, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (E, N, K) MXFP4 weight (deepinfer.backend.fp4's layout): uniform e2m1 codes (RMS
    2.93) packed two a byte, (E, N, K/2) uint8, and UE8M0 scale bytes (E, N, ceil(K/32)) spread
    over 2^-2 .. 2^2 around the one that gives the values an RMS of about `scale`."""
    e, n, k = shape
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen).to(torch.uint8)
    base = 127 + round(math.log2(scale / 2.93))
    scales = torch.randint(base - 2, base + 3, (e, n, -(-k // 32)), generator=gen).to(torch.uint8)
    return packed.to(device), scales.to(device)


@dataclass
class PagedBatch:
    """A ragged step over a paged cache, built twice: on the backend and as the reference's oracle.

    cache / meta:          the backend's cache (its own layout, filled through its write_kv) and
                           metadata on its device.
    ref_cache / ref_meta:  the reference layout in float64 on the CPU with the same K rows.
    kv:                    per request, the (seq_len, D) K rows written, in the cache dtype.
    """

    cache: PagedKVCache
    meta: AttentionMetadata
    ref_cache: PagedKVCache
    ref_meta: AttentionMetadata
    kv: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens


def random_block_tables(
    seq_lens: list[int], block_size: int, gen: torch.Generator, spare_blocks: int = 3
) -> tuple[torch.Tensor, int]:
    """(B, MB) int32 block tables drawing distinct blocks in a random order, and the pool size.
    Unused entries are 0 (block 0 is a real block, as in a live pool)."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max([*needed, 1])
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    return table, num_blocks


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) int64 cache slots of absolute `positions` of one request."""
    pos = positions.long()
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def make_paged_batch(
    backend: Backend,
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    kv_scale: float = 1.0,
    rope_dim: int = 0,
    shared_blocks: int = 0,
    poison_unwritten: bool = False,
    kv_rows: Sequence[torch.Tensor] | None = None,
    kv_format: str = "auto",
) -> PagedBatch:
    """Fill a fresh cache (one layer) with random K rows for every cached position of every
    request, through the backend's own kv_cache.write_kv, and build the metadata of the step.

    shared_blocks: every request starts with request 0's first `shared_blocks` blocks (a cached
    common prefix: the same block ids in several tables, holding the same rows).
    poison_unwritten: every slot is first written with NaN, so the rows no request has reached
    (past each KV length, and unused blocks) hold NaN: an op must never let them reach its output.
    kv_rows: per request, the (seq_len, D) K rows to write (cast to `dtype`) instead of random ones.
    kv_format "fp8": the backend's cache keeps FP8 latent rows; the reference cache holds, in
    float64, what the format keeps of each row (deepinfer.testing.oracles.e4m3_rows64)."""
    device = backend.device.device()
    table, num_blocks = random_block_tables(seq_lens, block_size, gen)
    if shared_blocks:
        if seq_lens[0] < shared_blocks * block_size:
            raise ValueError("request 0 must fill the shared blocks")
        for b in range(1, len(seq_lens)):
            n = min(shared_blocks, math.ceil(seq_lens[b] / block_size))
            table[b, :n] = table[0, :n]
    spec = KVCacheSpec(num_blocks, block_size, head_dim - rope_dim, rope_dim, dtype, kv_format)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    kept = e4m3_rows64(spec.latent_dim, fp8_tile(spec.latent_dim)) if spec.is_fp8 else (lambda x: x)
    ref_spec = KVCacheSpec(num_blocks, block_size, head_dim - rope_dim, rope_dim, torch.float64)
    ref_cache = ref_memory.allocate_kv_cache(ref_spec, 1, torch.device("cpu"))[0]
    if poison_unwritten:
        every = torch.arange(num_blocks * block_size)
        nan_rows = torch.full((every.numel(), head_dim), float("nan"), dtype=dtype)
        backend.kv_cache.write_kv(cache, nan_rows.to(device), every.to(device))
    kv: list[torch.Tensor] = []
    for b, n in enumerate(seq_lens):
        if kv_rows is not None:
            rows = kv_rows[b].to(dtype).cpu()
        else:
            rows = randn((n, head_dim), dtype, "cpu", gen, kv_scale)
        if b and shared_blocks:
            m = min(n, shared_blocks * block_size)
            rows[:m] = kv[0][:m]
        slots = slots_of(table[b], torch.arange(n), block_size)
        if n:
            backend.kv_cache.write_kv(cache, rows.to(device), slots.to(device))
            ref_memory.write_kv(ref_cache, kept(oracle(rows)), slots)
        kv.append(rows)
    meta = AttentionMetadata.build(table.to(device), seq_lens, query_lens)
    ref_meta = AttentionMetadata.build(table, seq_lens, query_lens)
    return PagedBatch(cache, meta, ref_cache, ref_meta, kv)


def topk_indices_for(
    seq_lens: list[int], query_lens: list[int], k: int, gen: torch.Generator, pad: int = 2
) -> torch.Tensor:
    """(T, k + pad) int32 random distinct visible-or-not positions per query row, -1 padded.
    Some entries point past the row's causal limit: the op must intersect them away."""
    rows = []
    for kv_len, n in zip(seq_lens, query_lens):
        for _ in range(n):
            pick = torch.randperm(kv_len, generator=gen)[:k].to(torch.int32)
            row = torch.full((k + pad,), -1, dtype=torch.int32)
            row[: pick.numel()] = pick
            rows.append(row[torch.randperm(k + pad, generator=gen)])
    if not rows:
        return torch.empty((0, k + pad), dtype=torch.int32)
    return torch.stack(rows)


def seed_from(text: str, base: int = 0) -> int:
    """A stable 63-bit seed from a string (a test's node id), offset by `base`."""
    h = 1469598103934665603
    for ch in text.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 63)
    return (h + base) % (1 << 63)


def request_rows(meta: AttentionMetadata, b: int) -> slice:
    """The query rows of request b in a ragged step."""
    start = sum(meta.query_lens_host[:b])
    return slice(start, start + meta.query_lens_host[b])


def writer_rows(slot_mapping: torch.Tensor, num_slots: int) -> list[int | None]:
    """Per cache slot, the input row a write with `slot_mapping` (-1: padding) put there, or None."""
    rows: list[int | None] = [None] * num_slots
    for i, s in enumerate(slot_mapping.cpu().tolist()):
        if s >= 0:
            rows[s] = i
    return rows


def slot_locator(
    slots: torch.Tensor | Sequence[int], block_size: int, input_rows: Sequence[int | None] | None = None
) -> Locator:
    """Names element (i, c) of rows read back from a paged cache at `slots` (row i holds slot
    slots[i]) by its place in the cache: "slot 37 (block 4, offset 5), column 2", and with
    `input_rows` (per read-back row) the row of the op's input that wrote it ("; input row 3",
    or "; not written"). Not an index into a filtered set of rows."""
    slot_list = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]

    def locate(index: tuple[int, ...]) -> str:
        s = slot_list[index[0]]
        text = f"slot {s} (block {s // block_size}, offset {s % block_size}"
        if input_rows is not None:
            row = input_rows[index[0]]
            text += "; not written" if row is None else f"; input row {row}"
        return text + ")" + (f", column {index[1]}" if len(index) > 1 else "")

    return locate


def attention_locator(meta: AttentionMetadata) -> Locator:
    """Names an element of an attention output (T, H, Dv) by request, query row (and its absolute
    position), head and column: where a kernel went wrong, not only by how much."""
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)

    def locate(index: tuple[int, ...]) -> str:
        t, rest = index[0], index[1:]
        b = max(i for i in range(len(meta.query_lens_host)) if starts[i] <= t)
        row = t - starts[b]
        pos = meta.seq_lens_host[b] - meta.query_lens_host[b] + row
        text = f"request {b}, query row {row} (position {pos} of KV length {meta.seq_lens_host[b]})"
        if len(rest) == 2:
            text += f", head {rest[0]}, column {rest[1]}"
        elif rest:
            text += f", index {rest}"
        return text

    return locate

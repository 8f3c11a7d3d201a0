"""The template backend: the contract's required ops in plain PyTorch, everything else defaulted.

It passes `deepinfer conformance --backend template` as generated. To port a device, rename the
package, then replace the ops in this order (re-run the suite after each step; every default not
overridden keeps working, and the composite defaults go through the ops you replace):

  1. TemplateDevice          the device itself: device(), synchronize(), memory_info(), then the
                             real-accelerator checklist of docs/porting.md (streams, events, pinned
                             memory, graphs). Nothing else works until this is right.
  2. TemplateAttention       paged MLA attention: most of a decode step's time. decode() first (one
                             query per request), then prefill(); keep the edge rules written below.
  3. TemplateGemm.linear     every projection of the model; then fp8_gemm / quantize_fp8 (and set
                             supports_fp8) if the device has FP8 matmuls.
  4. GemmOps.grouped_gemm    the experts (MoeOps.experts calls it by default): one grouped kernel
                             instead of one linear per expert.
  5. KVCacheOps.write_mla_kv one fused norm + rope + store per layer per step (the default is three
                             ops and a host sync in write_kv).
  6. SmallOps.add_rms_norm, rms_norm, rope, silu_and_mul; MoeOps.route, permute, unpermute.
  7. capture_graph (and supports_graphs) once every op of a decode step is free of host syncs.
docs/porting.md has the table of every defaulted op: what it calls, when to override it.
"""

from __future__ import annotations

import torch

from deepinfer.backend import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    AttentionOps,
    Backend,
    BackendOptions,
    Capabilities,
    CollectiveOps,
    DeviceOps,
    GemmOps,
    KVCacheOps,
    MoeOps,
    PagedKVCache,
    SmallOps,
    host_memory_info,
)

# REPLACE: your torch device type ("cuda", "npu", "xpu", "privateuseone", ...). On anything but
# "cpu" the contract's stream / event / pinned-memory defaults switch to torch's device-generic
# torch.Stream, torch.Event and pin_memory=True: check them (docs/porting.md, the checklist).
DEVICE_TYPE = "cpu"


class TemplateDevice(DeviceOps):
    """1. REPLACE FIRST: the device handle, synchronisation and memory figures."""

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        index = None if DEVICE_TYPE == "cpu" else options.device_index  # rank-local device index
        self._device = torch.device(DEVICE_TYPE, index)

    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes: the engine sizes the KV pool from `free`."""
        if self._device.type == "cpu":
            return host_memory_info()
        free, total = torch.get_device_module(self._device).mem_get_info(self._device)
        return int(free), int(total)

    # Left to the contract's defaults (override for a real device, docs/porting.md's checklist):
    # new_stream, stream_context, new_event, pinned_empty, capture_graph (None: no graphs),
    # peak_memory_bytes / reset_peak_memory (None: the engine then measures with memory_info).


class TemplateAttention(AttentionOps):
    """2. Paged latent attention in plain PyTorch: gather each request's pages, mask, softmax in
    float32. decode() is the contract's default (the one-token check, then prefill)."""

    def prefill(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
    ) -> torch.Tensor:
        (pages,) = cache.tensors  # the contract's default layout: (NB, BS, D), D = latent + rope
        bs = cache.spec.block_size
        out = torch.zeros((q.shape[0], q.shape[1], v_dim), dtype=q.dtype, device=q.device)
        # The metadata's DEVICE tensors are the truth: the host copies may be upper bounds (graphs).
        seq_lens = meta.seq_lens.tolist()
        starts = meta.query_start_loc.tolist()
        for b, kv_len in enumerate(seq_lens):
            s, e = starts[b], starts[b + 1]
            n = e - s
            if n == 0:
                continue
            # Only this request's first kv_len rows: rows past it may hold anything, NaN included,
            # and must not reach the output even through a zero weight (0 * NaN = NaN).
            table = meta.block_tables[b, : -(-kv_len // bs)].long()
            k = pages[table].reshape(-1, pages.shape[-1])[:kv_len].float()  # (L, D); V = k[:, :v_dim]
            pos = torch.arange(kv_len - n, kv_len, device=q.device)  # each query row's position
            j = torch.arange(kv_len, device=q.device)
            visible = j[None, :] <= pos[:, None]  # causal
            if modifiers.window is not None:  # the last `window` positions, the row's own included
                visible &= pos[:, None] - j[None, :] < modifiers.window
            if modifiers.topk_indices is not None:
                # Top-k ids are a SET: repeats count once, -1 (any id < 0) is unused, ids >= kv_len
                # are ignored: each valid id marks one column, invalid ones a spare column.
                ids = modifiers.topk_indices[s:e].long()
                ids = torch.where((ids >= 0) & (ids < kv_len), ids, kv_len)
                listed = torch.zeros((n, kv_len + 1), dtype=torch.bool, device=q.device)
                listed.scatter_(1, ids, True)
                visible &= listed[:, :kv_len]
            scores = torch.einsum("nhd,ld->nhl", q[s:e].float(), k) * scale
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            if modifiers.sinks is not None:  # a per-head logit in the denominator, with no value
                sink = modifiers.sinks.float()[None, :, None].expand(n, -1, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :kv_len]
            else:
                probs = torch.softmax(scores, dim=-1)
            # Edge rule: a row that sees no key outputs zeros (softmax over nothing is 0/0 = NaN).
            probs = torch.nan_to_num(probs, nan=0.0)
            out[s:e] = torch.einsum("nhl,lv->nhv", probs, k[:, :v_dim]).to(q.dtype)
        return out


class TemplateGemm(GemmOps):
    """3. linear is required; batched_linear, grouped_gemm and the FP8 ops are defaulted (the
    grouped ones call this linear once per group: 4. replace grouped_gemm with one kernel)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)  # float32 accumulation
        return y if bias is None else y + bias


class TemplateCollectives(CollectiveOps):
    """All collectives default to torch.distributed; only the process-group backend is yours."""

    @property
    def dist_backend(self) -> str:
        return "gloo"  # REPLACE: "nccl", "hccl", or the torch.distributed backend your device registers


CAPABILITIES = Capabilities(
    # REPLACE: claim exactly what the device computes correctly; the suite tests every claim
    # (each dtype, FP8, batch invariance, graphs) and skips what is not claimed.
    dtypes=(torch.float32, torch.bfloat16),
    supports_fp8=False,
    supports_batch_invariant=False,
    supports_graphs=False,
)


def create_backend(options: BackendOptions) -> Backend:
    from deepinfer_template.plugin import NAME

    return Backend(
        name=NAME,
        options=options,
        capabilities=CAPABILITIES,
        device=TemplateDevice(options),
        kv_cache=KVCacheOps(options),  # 5. the default layout; override write_mla_kv for speed
        attention=TemplateAttention(options),
        gemm=TemplateGemm(options),
        moe=MoeOps(options),  # 6. route / permute / unpermute; experts follow grouped_gemm
        collectives=TemplateCollectives(options),
        small=SmallOps(options),  # 6. add_rms_norm, rms_norm, rope, silu_and_mul, sampling
    )

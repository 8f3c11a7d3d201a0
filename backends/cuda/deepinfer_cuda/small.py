"""The small-ops part: norms, rope, activations, DeepSeek-V4's mHC and pooling ops, DeepSeek-V4.1's
Engram lookup and gate, the token bitmask, the greedy draw and the sampling noise."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend.ops import SmallOps
from deepinfer.backend.types import BackendOptions, PendingRows
from deepinfer_cuda.kernels import engram as engram_k
from deepinfer_cuda.kernels import small as small_k
from deepinfer_cuda.kernels import v4 as v4_k


class CudaSmall(SmallOps):
    """Triton rms_norm, rope, silu_and_mul (and DeepSeek-V4's clamped one, compressor pooling and
    mHC ops), bitmask and the sampling noise; sampling stays in torch (sort-based top-k / top-p over the
    vocabulary, already a handful of device kernels)."""

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.v4_step = self.fused and env.cuda_v4_step  # rope_tail's and compressor_pool's kernels
        self.argmax_kernel = self.fused and env.cuda_argmax
        self.pdl = env.cuda_pdl
        self._fetches: torch.cuda.Stream | None = None  # engram_prefetch's side stream, made at first use

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return small_k.rms_norm(x, weight, eps, pdl=self.pdl)[0]

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One launch (kernels/small.argmax) where fused; else the contract's two reductions."""
        if self.argmax_kernel and logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1]:
            return small_k.argmax(logits, out)
        return super().argmax(logits, out)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: the sum in float32, normalised before its rounding to x's dtype."""
        y, h = small_k.rms_norm(x, weight, eps, residual, pdl=self.pdl)
        assert h is not None
        return y, h

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        return small_k.rope(x, positions, cos_sin_cache, interleaved)

    def rope_tail(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """One launch (kernels/small.py: the head channels copied, the tail rotated); unfused or
        DEEPINFER_CUDA_V4_STEP=0: the contract's rope and cat."""
        if not self.v4_step:
            return super().rope_tail(x, positions, cos_sin_cache, inverse)
        return small_k.rope_tail(x, positions, cos_sin_cache, inverse)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return small_k.silu_and_mul(x)

    def clamped_silu_and_mul(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        return small_k.clamped_silu_and_mul(x, limit)

    def gated_pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return small_k.gated_pool(kv, gate)

    def compressor_pool(
        self, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, present: torch.Tensor
    ) -> torch.Tensor:
        """gated_pool's launch, the bias added and the absent slots masked in it; unfused or
        DEEPINFER_CUDA_V4_STEP=0: the contract's."""
        if not self.v4_step:
            return super().compressor_pool(kv, gate, bias, present)
        return small_k.gated_pool(kv, gate, bias, present)

    def hc_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch (kernels/v4.py: split mix product, then Sinkhorn in registers)."""
        if not self.fused:
            return super().hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return v4_k.hc_pre(
            streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant=self.batch_invariant
        )

    def hc_mixes(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hc_pre's kernels without the collapse (the same bits of pre, post and comb)."""
        if not self.fused:
            return super().hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return v4_k.hc_mixes(
            streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant=self.batch_invariant
        )

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().hc_collapse(streams, pre)
        return v4_k.hc_collapse(streams, pre)

    def hc_post(
        self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        if not self.fused:
            return super().hc_post(y, streams, post, comb)
        return v4_k.hc_post(y, streams, post, comb)

    def hc_head(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        if not self.fused:
            return super().hc_head(streams, fn, base, scale, norm_eps, hc_eps)
        return v4_k.hc_head(streams, fn, base, scale, norm_eps, hc_eps, batch_invariant=self.batch_invariant)

    def engram_lookup(
        self,
        ngram_ids: torch.Tensor,
        multipliers: torch.Tensor,
        sizes: torch.Tensor,
        table: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One launch (kernels/engram.py: the hash and the row copy per (token, head), FP8 rows
        dequantised in it); a table in pinned host memory is read through its mapped address, so
        it always takes the kernel."""
        if not self.fused and table.device == ngram_ids.device:
            return super().engram_lookup(ngram_ids, multipliers, sizes, table, scales=scales, dtype=dtype)
        return engram_k.engram_lookup(ngram_ids, multipliers, sizes, table, scales, dtype)

    def engram_prefetch(
        self,
        ngram_ids: torch.Tensor,
        multipliers: torch.Tensor,
        sizes: torch.Tensor,
        table: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> PendingRows:
        """engram_lookup on a side stream forked from the current one (the ids and all work
        queued before are ready there), an event recorded after it for engram_wait to join: the
        lookup's reads over the bus overlap the layers queued after it. Inside a CUDA graph
        capture the fork (wait_stream) and the join (wait_event) are the graph's edges, so a
        replay runs the lookups beside those layers too. record_stream keeps the rows' memory
        (allocated on the side stream) from reuse before the current stream's work after the
        join. Under the interpreter (CPU tensors, no streams): the contract's synchronous default."""
        if not ngram_ids.is_cuda:
            return super().engram_prefetch(ngram_ids, multipliers, sizes, table, scales=scales, dtype=dtype)
        current = torch.cuda.current_stream(ngram_ids.device)
        if self._fetches is None:
            self._fetches = torch.cuda.Stream(ngram_ids.device)  # type: ignore[no-untyped-call]
        side = self._fetches
        side.wait_stream(current)
        with torch.cuda.stream(side):
            rows = self.engram_lookup(ngram_ids, multipliers, sizes, table, scales=scales, dtype=dtype)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
        rows.record_stream(current)
        return PendingRows(rows, ready)

    def engram_wait(self, pending: PendingRows) -> torch.Tensor:
        """The current stream waits for the prefetch's event (none under the interpreter)."""
        if isinstance(pending.ready, torch.cuda.Event):
            torch.cuda.current_stream(pending.rows.device).wait_event(pending.ready)
        return pending.rows

    def engram_gate(
        self, streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """One launch (kernels/engram.py: both norms, the gate and the update per (token, stream))."""
        if not self.fused:
            return super().engram_gate(streams, kv, weight, eps)
        return engram_k.engram_gate(streams, kv, weight, eps)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        small_k.apply_token_bitmask(logits, bitmask)

    def exponential_noise(self, seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """One Triton kernel (the reference's hash, bit for bit; -log within float32 rounding)."""
        if not self.fused:  # the contract's default (the reference hash in torch ops)
            return super().exponential_noise(seeds, offsets, vocab_size)
        return small_k.exponential_noise(seeds, offsets, vocab_size)

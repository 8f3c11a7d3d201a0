"""Device, memory, streams, events and NPU graphs; the KV-cache part (AscendKVCache).

Graphs: torch.npu.NPUGraph captures `fn`; every FIA call issued during the capture is wrapped in
graph_task_group_begin / graph_task_group_end and issued through the op's `.out` form, so that
before each replay its per-step host arguments (actual_seq_qlen / actual_seq_kvlen, read from the
metadata's device tensors that the caller refreshed in place) are re-issued between
graph_task_update_begin / graph_task_update_end, as vllm-ascend does. Only the fused paged MLA
attention path can be captured; block tables, positions and every other input must be updated
in place by the caller (static addresses), as with CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.backend.ops import DeviceOps, GraphRunner, KVCacheOps
from deepinfer.backend.types import BackendOptions, Event, KVCacheSpec, PagedKVCache, Stream
from deepinfer_ascend import kv_cache
from deepinfer_ascend.attention import AscendAttention


class AscendDevice(DeviceOps):
    def __init__(
        self, options: BackendOptions, tnpu: Any, ns: Any, device: torch.device, attention: AscendAttention
    ) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._ns = ns  # torch.npu
        self._device = device
        self._attention = attention

    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        self._ns.synchronize()

    def memory_info(self) -> tuple[int, int]:
        free, total = self._ns.mem_get_info(self._device)
        return int(free), int(total)

    def new_stream(self) -> Stream:
        stream: Stream = self._ns.Stream()
        return stream

    def stream_context(self, stream: Stream) -> AbstractContextManager[object]:
        ctx: AbstractContextManager[object] = self._ns.stream(stream)
        return ctx

    def new_event(self) -> Event:
        event: Event = self._ns.Event()
        return event

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        pin = self._device.type != "cpu"  # a CPU stand-in device has nothing to pin for
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def capture_graph(
        self, fn: Callable[[], object], share_with: GraphRunner | None = None
    ) -> GraphRunner | None:
        pool = share_with.pool if isinstance(share_with, AscendGraph) else None
        return AscendGraph(self._ns, self._attention, fn, pool)

    def is_capturing(self) -> bool:
        return self._attention.issuer is not None  # set by AscendGraph while it captures


class AscendKVCache(KVCacheOps):
    """The backend's own latent / rope layout (see kv_cache.py). write_mla_kv is the contract's
    composition (this backend's npu_rms_norm, npu_rotary_mul, then write_kv), copy_blocks the
    contract's default (the block index is first in every tensor)."""

    def __init__(self, options: BackendOptions, tnpu: Any, device: torch.device) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._device = device

    def allocate(self, spec: KVCacheSpec, num_layers: int) -> list[PagedKVCache]:
        return kv_cache.allocate(spec, num_layers, self._device)

    def write_kv(self, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv_cache.write(self._tnpu, cache, kv, slot_mapping)

    def read_kv(self, cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
        return kv_cache.read(cache, slots)


@dataclass
class _Task:
    """One captured FIA launch whose host arguments are refreshed before every replay."""

    op: Any
    kwargs: dict[str, Any]
    refresh: Callable[[], dict[str, Any]] | None
    handle: Any
    out: list[torch.Tensor]


class AscendGraph(GraphRunner):
    """An NPUGraph of `fn` with in-graph updates of the attention lengths (see module doc)."""

    def __init__(
        self, ns: Any, attention: AscendAttention, fn: Callable[[], object], pool: Any = None
    ) -> None:
        self._ns = ns
        self._graph = ns.NPUGraph()
        self._tasks: list[_Task] = []
        self.pool = pool if pool is not None else ns.graph_pool_handle()  # shared by later captures
        attention.issuer = self._issue
        try:
            with ns.graph(self._graph, pool=self.pool):
                fn()
        finally:
            attention.issuer = None

    def _issue(
        self, op: Any, kwargs: dict[str, Any], refresh: Callable[[], dict[str, Any]] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kwargs.get("input_layout") != "TND":
            raise NotImplementedError("graph capture of FIA is implemented for the TND layout only")
        q, v = kwargs["query"], kwargs["value"]
        out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse_shape = (q.shape[0], q.shape[1], 1) if kwargs.get("return_softmax_lse") else (1,)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        stream = self._ns.current_stream()
        self._ns.graph_task_group_begin(stream)
        op.out(**kwargs, out=[out, lse])
        handle = self._ns.graph_task_group_end(stream)
        self._tasks.append(_Task(op, kwargs, refresh, handle, [out, lse]))
        return out, lse

    def replay(self) -> None:
        stream = self._ns.current_stream()
        for task in self._tasks:
            if task.refresh is None:
                continue
            self._ns.graph_task_update_begin(stream, task.handle)
            task.op.out(**{**task.kwargs, **task.refresh()}, out=task.out)
            self._ns.graph_task_update_end(stream)
        self._graph.replay()

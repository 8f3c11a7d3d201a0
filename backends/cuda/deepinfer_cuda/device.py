"""The device part: torch.cuda streams, events, pinned buffers, synchronisation, memory info and
CUDA graphs; under the Triton interpreter (CPU tensors) the host stand-ins and RerunGraph."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from deepinfer import envs
from deepinfer.backend.host import HostEvent, HostStream, host_memory_info
from deepinfer.backend.ops import DeviceOps, GraphRunner, RerunGraph
from deepinfer.backend.types import BackendOptions, Event, Stream
from deepinfer_cuda.kernels import small as small_k


class CudaGraphRunner(GraphRunner):
    """A captured CUDA graph; replay() re-runs it on the same buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaDevice(DeviceOps):
    graph_lengths_on_device = True  # the kernels read lengths on the device (host ones: bounds)

    def __init__(self, options: BackendOptions, device: torch.device, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self._device = device
        self._is_cuda = device.type == "cuda"
        # to_host / to_device by small.copy_words
        self.kernel_copies = not env.cuda_unfused and env.cuda_kernel_copies

    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        if self._is_cuda:
            torch.cuda.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        if not self._is_cuda:
            return host_memory_info()
        free, total = torch.cuda.mem_get_info(self._device)
        return int(free), int(total)

    def new_stream(self) -> Stream:
        if not self._is_cuda:
            return HostStream()
        stream: Stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        return stream

    def stream_context(self, stream: Stream) -> AbstractContextManager[object]:
        if not self._is_cuda:
            return nullcontext(stream)
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def new_event(self) -> Event:
        if not self._is_cuda:
            return HostEvent()
        event: Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return event

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._is_cuda)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Up to small.COPY_MAX_BYTES: a Triton kernel writes the pinned buffer through its
        mapped address (kernels/small.copy_words), where a copy-engine transfer after the draw's
        graph waited about 6 us to start on an H200; larger or odd-sized: the contract's copy."""
        if not (self.kernel_copies and small_k.copy_words(src, dst)):
            super().to_host(src, dst)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """As to_host: a kernel reads the pinned buffer (the step's inputs) through its mapped
        address."""
        if not (self.kernel_copies and small_k.copy_words(src, dst)):
            super().to_device(src, dst)

    def capture_graph(
        self, fn: Callable[[], object], share_with: GraphRunner | None = None
    ) -> GraphRunner | None:
        """Runs `fn` once eagerly on a side stream (compiles kernels, warms the allocator),
        then captures it into a CUDA graph, in share_with's memory pool or a new one. On the
        interpreter (no graphs on the CPU) the contract's stand-in, RerunGraph."""
        if not self._is_cuda:
            return RerunGraph(fn)
        if isinstance(share_with, CudaGraphRunner):
            pool = share_with.graph.pool()
        else:  # a new pool: one whose graphs were all freed must not be captured into again
            pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self._device).wait_stream(side)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return CudaGraphRunner(graph)

    def is_capturing(self) -> bool:
        return self._is_cuda and torch.cuda.is_current_stream_capturing()

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self._device)) if self._is_cuda else None

    def reset_peak_memory(self) -> None:
        if self._is_cuda:
            torch.cuda.reset_peak_memory_stats(self._device)

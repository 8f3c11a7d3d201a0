"""The simulated `torch.npu` namespace: devices, memory, streams, events and NPU graphs.

Graphs are simulated faithfully enough to catch stale per-step arguments: while an NPUGraph
captures, every aten op is recorded (a TorchDispatchMode) with the tensors it read and wrote;
replay re-runs the recorded ops on those same tensors (static addresses), with host arguments
(Python ints such as FIA's actual_seq_* lists) baked in as captured. Ops issued between
graph_task_group_begin / _end form a task group; graph_task_update_begin / _end replace that
group's recorded ops with the ones issued in between (the update). Host syncs (.item(),
.tolist(), nonzero, synchronize) during capture are errors, as on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .state import STATE, SimError, check

_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.equal.default,
}


# --------------------------------------------------------------------------- devices, memory


def is_available() -> bool:
    return STATE.device_count > 0


def device_count() -> int:
    return STATE.device_count


def set_device(index: int | torch.device) -> None:
    i = index.index if isinstance(index, torch.device) else index
    check(
        i is not None and 0 <= i < STATE.device_count, "torch.npu.set_device", "invalid device index", str(i)
    )
    STATE.current_device = int(i or 0)


def current_device() -> int:
    return STATE.current_device


def get_device_name(index: int | None = None) -> str:
    return f"Ascend (simulated SoC {STATE.soc_version})"


def synchronize(device: Any = None) -> None:
    if _CAPTURE.graph is not None:
        raise SimError("torch.npu.synchronize: not allowed while an NPUGraph is capturing")


def mem_get_info(device: Any = None) -> tuple[int, int]:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"], info["MemTotal"]


def empty_cache() -> None:
    pass


# --------------------------------------------------------------------------- streams, events


class Stream:
    """Work on the simulated device is synchronous, so streams only keep the API."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_stream(self, other: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


_DEFAULT_STREAM = Stream()
_CURRENT: list[Stream] = [_DEFAULT_STREAM]


def current_stream(device: Any = None) -> Stream:
    return _CURRENT[-1]


@contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    if s is None:
        yield None
        return
    _CURRENT.append(s)
    try:
        yield s
    finally:
        _CURRENT.pop()


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        return 0.0


# --------------------------------------------------------------------------- graphs

Op = tuple[Any, tuple[Any, ...], dict[str, Any], Any]


@dataclass
class _Segment:
    ops: list[Op] = field(default_factory=list)
    is_group: bool = False


@dataclass
class TaskGroupHandle:
    graph: NPUGraph
    segment: _Segment


class _Recorder(TorchDispatchMode):
    def __init__(self, sink: list[Op], what: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink
        self.what = what

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _CAPTURE.internal:
            return func(*args, **kwargs)
        if func in _SYNC_OPS:
            raise SimError(f"{self.what}: {func} needs a host sync, which an NPU graph cannot capture")
        out = func(*args, **kwargs)
        self.sink.append((func, args, kwargs, out))
        return out


@dataclass
class _CaptureState:
    graph: NPUGraph | None = None
    mode: _Recorder | None = None
    internal: bool = False  # the simulation's own argument checks run unrecorded


_CAPTURE = _CaptureState()


@contextmanager
def unrecorded() -> Iterator[None]:
    """Run the simulation's argument checks without recording them (they may read the host)."""
    prev = _CAPTURE.internal
    _CAPTURE.internal = True
    try:
        yield
    finally:
        _CAPTURE.internal = prev


def capturing() -> bool:
    return _CAPTURE.graph is not None


class NPUGraph:
    def __init__(self) -> None:
        self._segments: list[_Segment] = []
        self._captured = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if _CAPTURE.graph is not None:
            raise SimError("NPUGraph.capture_begin: another graph is already capturing")
        self._segments = [_Segment()]
        _CAPTURE.graph = self
        _CAPTURE.mode = _Recorder(self._segments[-1].ops, "NPUGraph capture")
        _CAPTURE.mode.__enter__()  # type: ignore[no-untyped-call]

    def capture_end(self) -> None:
        if _CAPTURE.graph is not self or _CAPTURE.mode is None:
            raise SimError("NPUGraph.capture_end: this graph is not capturing")
        _CAPTURE.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        _CAPTURE.graph, _CAPTURE.mode = None, None
        self._captured = True

    def _new_segment(self, is_group: bool) -> _Segment:
        seg = _Segment(is_group=is_group)
        self._segments.append(seg)
        assert _CAPTURE.mode is not None
        _CAPTURE.mode.sink = seg.ops
        return seg

    def replay(self) -> None:
        if not self._captured:
            raise SimError("NPUGraph.replay: nothing captured")
        if _CAPTURE.graph is not None:
            raise SimError("NPUGraph.replay: cannot replay while a graph is capturing")
        for seg in self._segments:
            for func, args, kwargs, out in seg.ops:
                new = func(*args, **kwargs)
                _write_back(out, new)

    def reset(self) -> None:
        self._segments, self._captured = [], False


def _write_back(old: Any, new: Any) -> None:
    """Put a re-run op's results into the tensors recorded at capture (static addresses)."""
    olds, _ = tree_flatten(old)
    news, _ = tree_flatten(new)
    for o, n in zip(olds, news):
        fresh = isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o is not n
        if fresh and o.shape == n.shape and o.data_ptr() != n.data_ptr():
            o.copy_(n)


@contextmanager
def graph(g: NPUGraph, pool: Any = None, stream: Stream | None = None, **kwargs: Any) -> Iterator[NPUGraph]:
    g.capture_begin(pool=pool)
    try:
        yield g
    finally:
        g.capture_end()


def graph_pool_handle() -> tuple[int, int]:
    return (0, 0)


def graph_task_group_begin(stream: Stream) -> None:
    g = _CAPTURE.graph
    check(g is not None, "torch.npu.graph_task_group_begin", "must be called while an NPUGraph captures")
    assert g is not None
    if g._segments[-1].is_group:
        raise SimError("torch.npu.graph_task_group_begin: task groups do not nest")
    g._new_segment(is_group=True)


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    g = _CAPTURE.graph
    check(g is not None, "torch.npu.graph_task_group_end", "must be called while an NPUGraph captures")
    assert g is not None
    seg = g._segments[-1]
    check(seg.is_group, "torch.npu.graph_task_group_end", "no task group is open")
    g._new_segment(is_group=False)
    return TaskGroupHandle(g, seg)


_UPDATE: list[tuple[TaskGroupHandle, list[Op], _Recorder]] = []


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    check(
        isinstance(handle, TaskGroupHandle), "torch.npu.graph_task_update_begin", "needs a task group handle"
    )
    check(_CAPTURE.graph is None, "torch.npu.graph_task_update_begin", "not allowed while a graph captures")
    check(not _UPDATE, "torch.npu.graph_task_update_begin", "updates do not nest")
    ops: list[Op] = []
    mode = _Recorder(ops, "graph task update")
    mode.__enter__()  # type: ignore[no-untyped-call]
    _UPDATE.append((handle, ops, mode))


def graph_task_update_end(stream: Stream) -> None:
    check(bool(_UPDATE), "torch.npu.graph_task_update_end", "no update is open")
    handle, ops, mode = _UPDATE.pop()
    mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    handle.segment.ops[:] = ops

"""Host stand-ins of the contract: streams and events for devices whose work is synchronous (the
CPU), and the host's memory figures. DeviceOps' defaults use them on the CPU only; on any other
device they would be WRONG (an event that says "done" before the device has finished lets the
host read a buffer that is still being written), which is why the defaults switch to torch's
device-generic torch.Stream / torch.Event there (see DeviceOps).
"""

from __future__ import annotations

import os
from typing import Any


class HostStream:
    """Stream stand-in for devices whose work is synchronous: nothing to wait for."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any, /) -> None:
        pass

    def wait_event(self, event: Any, /) -> None:
        pass


class HostEvent:
    """Event stand-in for synchronous devices: always complete."""

    def record(self, stream: Any = None, /) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def host_memory_info() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo (sysconf as a fallback): the
    memory_info of a backend whose device is the CPU."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total

"""The MoE exchanges of one forward, counted, so that a rank whose step fails part-way can run
the exchanges it still owes the other ranks and leave none of them waiting.

An exchange is one dispatch_combine or fixed_exchange call (deepinfer.parallel.expert_parallel);
a forward makes the same number of them on every rank, an idle forward (no tokens) included. A
graph replay makes a whole forward's exchanges inside the graph, unseen from the host on a
device (the runner says so: replayed()); where a replay reruns the captured function (the
reference backend) they are logged one by one, and a replay can stop part-way, as an eager
forward can. Once started, an
exchange runs all its collectives even when this rank's experts raise: the error is raised after
the results went back. So a rank whose forward raised is between two exchanges (`open` is False)
unless a collective itself failed, and it can complete the forward with exchanges of no tokens.

The log is per thread (a forward runs on the thread that called generate) and only while
log_exchanges() is active: outside one, dispatch_combine logs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ExchangeLog:
    """The exchanges of the forward in progress on this thread."""

    def __init__(self) -> None:
        self.done = 0  # exchanges completed
        self.open = False  # inside an exchange whose collectives are part-way
        self.whole = False  # a graph replay completed: every exchange of the forward ran
        self._empty: Callable[[], object] | None = None  # one more exchange of no tokens, like the last

    def started(self) -> None:
        self.open = True

    def finished(self, empty: Callable[[], object]) -> None:
        """An exchange completed; `empty` runs one of the same shapes with no tokens of this rank."""
        self.open = False
        self.done += 1
        self._empty = empty

    def replayed(self) -> None:
        """A graph replay of a whole forward completed (its exchanges ran inside it)."""
        self.whole = True

    def complete(self, total: int) -> None:
        """Run the exchanges this forward still owes, up to `total`, with no tokens of this rank
        (its experts return zeros to the others: the step is lost anyway)."""
        if self.whole:
            return
        if self.open:
            raise RuntimeError("an exchange is part-way: its collectives cannot be completed")
        if self.done > total:
            raise RuntimeError(f"the forward made {self.done} MoE exchanges, more than the {total} expected")
        if self.done < total and self._empty is None:
            raise RuntimeError("no exchange completed in this forward: their shapes are unknown")
        for _ in range(total - self.done):
            assert self._empty is not None
            self._empty()


_local = threading.local()


def current_log() -> ExchangeLog | None:
    """The log of this thread's forward, if one is being logged."""
    log: ExchangeLog | None = getattr(_local, "log", None)
    return log


@contextmanager
def log_exchanges() -> Iterator[ExchangeLog]:
    """Log the exchanges made on this thread inside the block."""
    log, outer = ExchangeLog(), current_log()
    _local.log = log
    try:
        yield log
    finally:
        _local.log = outer

"""Expert-parallel ranks keep in step, and learn of a failure on any rank within a bounded time.

The MoE exchanges run on the default torch.distributed group. Before them, every generate call
and every step of it begins with a status exchange over a small gloo group the engine makes at
its first call (the control group: on the CPU whatever the device's backend, with
distributed_timeout_s as its timeout; torch.distributed.new_group, so the ranks' engines must
start their first calls in the same order). Each rank adds one record (an all_reduce of one row
per rank): where it is (call and step numbers), whether it has requests left, the rows its step
asks for (its decode batch size when a graph serves it, EAGER, or DRAFTS for an eager step with
drafts: the ranks then agree on one graph bucket, or on eager forwards, and on whether every
rank runs the drafter's exchanges too, at no extra exchange), and whether it failed, with its
error.

- A rank that cannot start a call (its requests were refused) says so at the call's exchange:
  every rank raises, nothing of the call runs, and the ranks go on serving.
- A rank whose step raises first runs the MoE exchanges it still owes the others, with no tokens
  (deepinfer.parallel.exchanges), then reports its error at the next step exchange: every rank
  raises there, naming it. The call's requests are dropped on every rank; the ranks go on serving.
  A rank that fails while planning its step (before the exchange) reports at that exchange.
- What cannot be settled that way breaks the group: a rank that does not join an exchange within
  the timeout (it called generate fewer times, it is stuck, or one step took longer than the
  timeout), a failed collective (a rank exited), a failure part-way through a MoE exchange,
  ranks whose records disagree. The rank that sees it first writes why to the default group's
  store and closes its control group, so that a rank waiting on it fails at once and reads why;
  from then on every call on every rank raises RuntimeError with that reason.

A rank left waiting inside a MoE exchange (its peer failed part-way through one, or hangs) is
bounded by the default group's own timeout: init_process_group(timeout=...).
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from deepinfer.parallel.exchanges import ExchangeLog, log_exchanges

T = TypeVar("T")

CALL, STEP = 1, 2  # the kinds of exchange
EAGER = -1  # the rows of a step that needs eager forwards (prefill, mixed, no graph fits)
# the rows of an eager step with drafts: its drafter's forwards may make MoE exchanges too (the
# MTP head's layers), which every rank then makes (deepinfer.engine.llm_engine)
DRAFTS = -2
RECORD_BYTES = 1024  # one rank's record: 7 int64 fields, then its error as UTF-8
_FIELDS = 7  # kind, call, step, busy, rows, failed, error length
_MESSAGE_BYTES = RECORD_BYTES - 8 * _FIELDS
# The ranks' engines start their first calls in the same order (each makes its control group
# then), so the n-th engine to do so on each rank shares its store keys with the n-th of the others.
_first_calls = itertools.count()


def describe(exc: BaseException) -> str:
    """ "TypeName: message", the message's first line (less gloo's "[file:line] "), at most 300
    characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass(frozen=True)
class Status:
    """One rank's record at one exchange."""

    rank: int
    kind: int
    call: int
    step: int
    busy: bool
    error: str | None  # why it failed; None if it did not
    rows: int = 0  # the rows its step asks for: a decode batch size, 0 (no forward) or EAGER

    def where(self) -> str:
        if self.kind == CALL:
            return f"the start of generate call {self.call}"
        if self.kind == STEP:
            return f"step {self.step} of generate call {self.call}"
        return "no exchange"

    def encode(self) -> torch.Tensor:
        """-> (RECORD_BYTES,) uint8."""
        message = (self.error or "").encode()[:_MESSAGE_BYTES]
        failed = int(self.error is not None)
        fields = [self.kind, self.call, self.step, int(self.busy), self.rows, failed, len(message)]
        record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        record[: 8 * _FIELDS].view(torch.int64)[:] = torch.tensor(fields, dtype=torch.int64)
        if message:
            record[8 * _FIELDS : 8 * _FIELDS + len(message)] = torch.tensor(list(message), dtype=torch.uint8)
        return record

    @classmethod
    def decode(cls, rank: int, record: torch.Tensor) -> Status:
        kind, call, step, busy, rows, failed, n = record[: 8 * _FIELDS].view(torch.int64).tolist()
        message = bytes(record[8 * _FIELDS : 8 * _FIELDS + n].tolist()).decode(errors="replace")
        return cls(rank, kind, call, step, bool(busy), message if failed else None, rows)


class RankSync:
    """This rank's side of the status exchanges of one expert-parallel engine (see the module)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.calls = 0  # generate calls begun on this rank
        self.steps = 0  # step exchanges of the current call
        self.exchanges_per_forward: int | None = None  # MoE exchanges in one forward, once seen
        self.broken: str | None = None  # why the group cannot be used any more
        self.timeout_s = 0.0
        self._group: Any = None  # the control group, made at the first call
        self._keys = ""  # the prefix of this engine's keys in the default group's store

    # ------------------------------------------------------------------ the exchanges

    def start_call(self, timeout_s: float, error: BaseException | None = None) -> bool:
        """The exchange that starts a generate call. `error`: why this rank cannot take part (its
        requests were refused); the other ranks then raise RuntimeError naming this rank and the
        error, and this returns False (the caller raises `error`). True when every rank starts.
        RuntimeError if the group is broken, or breaks (a rank does not come within timeout_s)."""
        self.calls += 1
        self.steps = 0
        if not self._keys:
            self._keys = f"deepinfer/expert_parallel/{next(_first_calls)}/"
        self._store_set(f"calls/{self.rank}", str(self.calls))
        try:
            self._connect(timeout_s)
            refused = None if error is None else f"could not start it: {describe(error)}"
            statuses = self._exchange(CALL, error=refused)
        except RuntimeError as exc:
            if error is None:
                raise
            error.add_note(f"expert parallelism: {exc}")
            return False
        if error is not None:
            return False
        self._raise_failures(statuses, "; nothing of this call ran")
        return True

    def start_step(self, busy: bool, plan: Callable[[], int] | None = None) -> list[int] | None:
        """The exchange before each step: None when no rank has requests left (`busy` is this
        rank's), else the rows every rank's step asks for, in rank order. plan(), called first,
        plans this rank's step -> its rows; without it a busy rank asks for EAGER, an idle one
        for 0. If plan raises, this rank reports the error at this exchange (the others raise
        there, naming it) and the error propagates. RuntimeError naming the rank(s) whose last
        step failed, or if the group is broken, or breaks."""
        self.steps += 1
        rows = EAGER if busy else 0
        if plan is not None:
            try:
                rows = plan()
            except BaseException as exc:
                self._report(exc, f"step {self.steps} of generate call {self.calls}")
                raise
        statuses = self._exchange(STEP, busy=busy, rows=rows)
        self._raise_failures(statuses, "; every rank dropped the requests of this call")
        return [s.rows for s in statuses] if any(s.busy for s in statuses) else None

    def run_forward(
        self, forward: Callable[[], T], idle: Callable[[], object], total: int | None = None
    ) -> T:
        """forward(): a step, or idle(), a forward with no tokens; either makes the same MoE
        exchanges as every other rank's forward (`total` of them: exchanges_per_forward unless
        the step makes more, a drafter's); a step that made none (its tokens were still in
        flight: async scheduling) runs idle() after it. If either raises, this rank runs the
        exchanges it still owes the others (all of them by idle() if it made none), then reports
        the error at the step exchange the others wait at: they raise there, naming this rank,
        and the error propagates here. If that cannot be done the group is broken and
        RuntimeError says why."""
        with log_exchanges() as log:
            try:
                result = forward()
                if self.exchanges_per_forward and log.done == 0 and not log.whole:
                    idle()
            except BaseException as exc:
                failure = self._fail(exc, log, idle, total)
                if failure is exc:
                    raise
                raise failure from exc
            if self.exchanges_per_forward is None:
                assert not log.whole, "the first forward (counting the exchanges) runs eagerly"
                self.exchanges_per_forward = log.done
            elif not log.whole and log.done != (total or self.exchanges_per_forward):  # the others would wait
                try:
                    self._settle(log, idle, total)
                except BaseException as exc:
                    raise self._break(f"rank {self.rank}: {describe(exc)}") from exc
        return result

    # ------------------------------------------------------------------ failures

    def _settle(self, log: ExchangeLog, idle: Callable[[], object], total: int | None = None) -> None:
        """Run the MoE exchanges this forward still owes the other ranks."""
        if log.open:
            raise RuntimeError("it stopped part-way through a MoE exchange")
        if log.whole:  # a graph replay ran them all
            return
        if log.done == 0:
            idle()
        elif self.exchanges_per_forward is None:
            raise RuntimeError("how many MoE exchanges a forward makes is not known yet")
        else:
            log.complete(total or self.exchanges_per_forward)

    def _fail(
        self, exc: BaseException, log: ExchangeLog, idle: Callable[[], object], total: int | None = None
    ) -> BaseException:
        """This rank's forward raised exc: settle with the others -> the exception to raise."""
        where = f"step {self.steps} of generate call {self.calls}"
        if log.open:  # a collective failed (a rank exited?), or this rank stopped inside one
            reason = f"the MoE exchange at {where} failed (did a rank exit?): {describe(exc)}"
            return self._break(self._notice() or reason)
        try:
            self._settle(log, idle, total)
        except BaseException as owed:
            return self._break(
                f"rank {self.rank} raised at {where} ({describe(exc)}) and could not run the MoE "
                f"exchanges it owed the other ranks: {describe(owed)}"
            )
        self.steps += 1
        return self._report(exc, where)

    def _report(self, exc: BaseException, where: str) -> BaseException:
        """Report this rank's error at the step exchange the others are at (they raise there,
        naming it) -> exc, with a note saying how that went."""
        try:
            self._exchange(STEP, error=f"raised {describe(exc)} (at {where})")
        except RuntimeError as sync_exc:
            exc.add_note(f"expert parallelism: {sync_exc}")
        else:
            exc.add_note(f"expert parallelism: every rank raised at step {self.steps} of this call")
        return exc

    def _raise_failures(self, statuses: list[Status], outcome: str) -> None:
        failed = [s for s in statuses if s.error is not None]
        if failed:
            causes = "; ".join(f"rank {s.rank} {s.error}" for s in failed)
            raise RuntimeError(f"generate failed on another expert-parallel rank: {causes}{outcome}")

    def _break(self, reason: str) -> RuntimeError:
        """Mark the group broken (first reason wins), tell the other ranks, -> the error to raise."""
        if self.broken is None:
            self.broken = reason
            self._store_compare_set("broken", f"{self.rank}\n{reason}")
            if self._group is not None:  # ranks waiting on this one fail at once
                with contextlib.suppress(Exception):  # already unusable: nothing more to release
                    dist.destroy_process_group(self._group)
                self._group = None
        return RuntimeError(
            f"the expert-parallel group is broken: {self.broken}. This LLM refuses every further call "
            "on every rank; make new ones (or restart the processes)"
        )

    def _diagnose(self, exc: BaseException, kind: int) -> str:
        """Why the exchange of `kind` failed with exc (a timeout, or a closed connection)."""
        notice = self._notice()
        if notice is not None:
            return notice
        where = Status(self.rank, kind, self.calls, self.steps, False, None).where()
        made = {r: int(self._store_get(f"calls/{r}") or 0) for r in range(self.world_size)}
        behind = [r for r, n in made.items() if n < self.calls]
        if behind:
            counts = ", ".join(f"rank {r} has made {made[r]} call{'s' * (made[r] != 1)}" for r in behind)
            return (
                f"{_ranks(behind)} did not call generate a {_nth(self.calls)} time within "
                f"distributed_timeout_s={self.timeout_s:g} s ({counts}; rank {self.rank} waited): "
                "every expert-parallel rank must call generate the same number of times"
            )
        others = _ranks([r for r in range(self.world_size) if r != self.rank])
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return (
                f"{others} did not reach {where} within distributed_timeout_s={self.timeout_s:g} s "
                f"(rank {self.rank} waited): a rank is stuck, or one step took longer than that"
            )
        return f"the status exchange at {where} with {others} failed (did a rank exit?): {describe(exc)}"

    # ------------------------------------------------------------------ the control group

    def _connect(self, timeout_s: float) -> None:
        if self.broken is not None:
            raise self._break(self.broken)
        notice = self._notice()  # another rank gave up on this one
        if notice is not None:
            raise self._break(notice)
        if self._group is None:
            self.timeout_s = timeout_s
            try:
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            except Exception as exc:  # a rank did not come (gloo's "Wait timeout")
                raise self._break(self._diagnose(exc, CALL)) from exc

    def _exchange(
        self, kind: int, busy: bool = False, error: str | None = None, rows: int = 0
    ) -> list[Status]:
        """Every rank's record at this exchange (all_reduce of one row per rank)."""
        if self.broken is not None or self._group is None:
            raise self._break(self.broken or "the control group was never made")
        records = torch.zeros((self.world_size, RECORD_BYTES), dtype=torch.uint8)
        records[self.rank] = Status(self.rank, kind, self.calls, self.steps, busy, error, rows).encode()
        try:
            dist.all_reduce(records, group=self._group)
        except Exception as exc:  # timed out, or a rank closed its side
            raise self._break(self._diagnose(exc, kind)) from exc
        statuses = [Status.decode(r, records[r]) for r in range(self.world_size)]
        if any((s.kind, s.call, s.step) != (kind, self.calls, self.steps) for s in statuses):
            where = "; ".join(f"rank {s.rank} is at {s.where()}" for s in statuses)
            raise self._break(f"the ranks are out of step: {where}")
        return statuses

    # ------------------------------------------------------------------ the store (best effort)

    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # no default group (or a torch without it): no diagnostics
            return None

    def _store_set(self, key: str, value: str) -> None:
        store = self._store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(self._keys + key, value)

    def _store_compare_set(self, key: str, value: str) -> None:
        store = self._store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.compare_set(self._keys + key, "", value)  # the first writer wins

    def _store_get(self, key: str) -> str | None:
        store = self._store()
        if store is None:
            return None
        try:
            if not store.check([self._keys + key]):
                return None
            value: bytes = store.get(self._keys + key)
            return value.decode()
        except Exception:
            return None

    def _notice(self) -> str | None:
        """Why another rank broke the group, if one did."""
        value = self._store_get("broken")
        if value is None:
            return None
        rank, _, reason = value.partition("\n")
        return reason if rank == str(self.rank) else f"{reason} (rank {rank} gave up)"

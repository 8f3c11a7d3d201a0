"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens) and a request limit (max_num_seqs).
Running requests go first, decodes before prompts still being prefilled; a prompt longer than
what is left of the budget (or than max_tokens_per_request, where one is set) is prefilled in
chunks over several steps (chunked prefill). Waiting
requests are admitted in arrival order while budget, request slots and KV blocks last, reusing
their cached prefix blocks (prefix caching) except blocks at prompt positions whose
log-probabilities are still to be computed (prompt_logprobs). When a running request needs a KV
block and none is free, the running request of lowest priority (one still prefilling before one
decoding, then the most recently admitted) is preempted: its blocks are freed and it goes back
to the front of the queue, to be recomputed (prompt + tokens generated so far) later. Nothing is
lost and, since the recompute reproduces the same cache and a request's random generator only
advances when it samples, outputs do not change.

The scheduler is the one writer of a request's progress (num_computed_tokens): on admission,
preemption, after a step launched (advance) and as a verification step's tokens are accepted
(advance_token).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.kv_cache import BlockManager, GroupedBlockManager, StepCopies
from deepinfer.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes its next num_new_tokens[i] tokens, the last
    num_draft_tokens[i] of them its speculative draft (seq.draft, verified this step). copies:
    the cache rows the step copies around its forward (prefix caching of several cache groups)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: StepCopies = field(default_factory=StepCopies)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


def whole_images(seq: Sequence, start: int, n: int) -> int:
    """The tokens of seq to compute from position `start`, at most n, cut before an image span
    the chunk would end inside (chunked prefill never splits an image: its vision tower output is
    computed in one step). 0 when the chunk would start with an image that does not fit. A chunk
    starting inside a span (a prefix-cache hit ending there) is not cut."""
    end = start + n
    for span in seq.images:
        if start <= span.start < end < span.end:
            return span.start - start
    return n


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager | GroupedBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_tokens_per_request: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_tokens_per_request = max_tokens_per_request  # None: the step's budget only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # Running requests: decodes first (stable sort keeps arrival order within each kind).
        self.running.sort(key=lambda s: s.is_prefilling)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.num_tokens >= seq.max_total_tokens:  # its last token is
                i += 1  # pending (async): it finishes once the host reads that token
                continue
            limit = min(budget, self.max_tokens_per_request or budget)
            if seq.num_uncomputed_tokens + len(seq.draft) > limit:
                seq.draft = []  # no room to verify it this step
            n = min(seq.num_uncomputed_tokens + len(seq.draft), limit)
            if seq.images:
                n = whole_images(seq, seq.num_computed_tokens, n)
                if n == 0:  # the next image does not fit what is left of this step's budget
                    i += 1
                    continue
            while not bm.allocate(seq, n):
                victim = self.running.pop()  # lowest priority, not yet scheduled this step
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                batch.num_draft_tokens.append(len(seq.draft))
                budget -= n
                i += 1

        # Waiting requests, in arrival order, unless this step already had to preempt.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            # cached blocks must not hide a prompt position's logits: only those done
            most = seq.prompt_logprob_pos - 1 if seq.wants_prompt_logprobs else None
            hit = bm.match(seq, most)
            num_cached = hit.num_tokens
            n = min(seq.num_tokens - num_cached, budget, self.max_tokens_per_request or budget)
            if seq.images:
                n = whole_images(seq, num_cached, n)
            if n == 0 or not bm.admit(seq, n, hit):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:  # the first admission (vLLM's num_cached_tokens)
                seq.num_cached_tokens = num_cached
                seq.metrics.first_scheduled_time = time.time()
            if num_cached and logger.isEnabledFor(logging.DEBUG):
                logger.debug("request %s: %d prompt tokens from the prefix cache", seq.request_id, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.num_draft_tokens.append(0)
            budget -= n
        batch.copies = bm.step_copies(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens)
        if batch.seqs and logger.isEnabledFor(logging.DEBUG):
            decodes = sum(1 for n in batch.num_new_tokens if n == 1)
            logger.debug(
                "step: %d requests (%d decode, %d prefill), %d tokens of a %d budget, %d drafts; "
                "%d running, %d waiting, %d free KV blocks%s",
                len(batch.seqs), decodes, len(batch.seqs) - decodes, sum(batch.num_new_tokens),
                self.max_num_batched_tokens, sum(batch.num_draft_tokens), len(self.running),
                len(self.waiting), bm.num_free_blocks,
                f", {len(batch.preempted)} preempted" if batch.preempted else "",
            )  # fmt: skip
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug(
            "request %s preempted (KV blocks ran out): its %d tokens are recomputed once admitted again",
            seq.request_id, seq.num_tokens,
        )  # fmt: skip

    def advance(self, batch: ScheduledBatch) -> None:
        """After the step launched: the scheduled tokens are in the cache (a draft's only once it
        is accepted, see advance_token)."""
        for seq, n, nd in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens):
            seq.num_computed_tokens += n - nd
            self.block_manager.cache_full_blocks(seq)

    def advance_token(self, seq: Sequence) -> None:
        """One more of seq's tokens is in the cache: a verification graph step's row of its last
        token (read back from the device), or a draft that was sampled (its cache row, written
        this step, now holds a real token)."""
        seq.num_computed_tokens += 1
        self.block_manager.cache_full_blocks(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's next num_tokens positions past its computed ones, taken now where the
        pool has them (a drafter writes cache rows ahead of the scheduled tokens); False, taking
        none, where it runs short."""
        return self.block_manager.allocate(seq, num_tokens)

    def finish(self, seq: Sequence) -> None:
        """seq is done: drop it (from the queue too, when it was preempted while its last token
        was still pending) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.time()
        self.block_manager.free_sequence(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every request (e.g. after an error in a step) and free their blocks."""
        dropped = list(self.running) + list(self.waiting)
        now = time.time()
        for seq in dropped:
            self.block_manager.free_sequence(seq)
            seq.status = SequenceStatus.FINISHED
            seq.metrics.finished_time = now
        self.running.clear()
        self.waiting.clear()
        return dropped

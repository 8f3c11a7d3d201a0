"""Speculative decoding: verify last step's drafts, draft anew (the checkpoint's MTP head, chained,
or the block drafter of deepinfer.models.drafter, k tokens in one pass).

A request that carries k draft tokens gets 1 + k logits rows: the token after its last one is
sampled from the first as usual; while the token just sampled equals the next draft, that draft
was right and the token after it is sampled from the next row (once the previous one is
appended, so penalties, grammars and the request's noise offsets see the same history as in
plain decoding). Sampling first and comparing after is exact: the emitted tokens follow the
model's distribution whatever the drafts. Then the drafter proposes the next ones.

Confidence. Each draft j of a request comes with a confidence c_j: the chance that drafts
0..j are all accepted (the MTP head: the product of its probabilities of drafts 0..j; the
block drafter: its confidence head, trained for exactly that). A request keeps its drafts up to
the first whose confidence is below the threshold (min_draft_confidence).

Confidence scheduling (confidence_scheduling=True) chooses the drafts a step verifies. The
measured policy (deepinfer.engine.step_times, the default): the step-time curve of every graph,
measured once, and per step the drafts (by rank of confidence, taken at the acceptance observed)
that maximise expected tokens per ms, the drafter's cost included; where none pays, the step is
a plain decoding step (no drafter) and drafting stops. It starts again with a probe (a step
that drafts but verifies nothing) where drafts could pay at all on the curve, after a back-off
that doubles, up to a cap, each time an episode of drafting emitted fewer tokens than plain
steps would have in its time, on the curve or by the wall clock (tick). A chain of
verification steps starts where the chooser takes its width K and goes on while the drafts of
its next step pay at K and it verifies some. The budget policy (step_token_budget
given): a decode step's forward costs about the same for any token count up to a knee; so a
step may hold step_token_budget tokens in all: with R requests waiting or running (one token
each), the drafts get budget = max(0, step_token_budget - R) tokens, given to the drafts of
highest confidence across the batch (confidences fall along a request's drafts, so each request verifies a
prefix). When no draft is chosen the step is a plain decoding step: no drafter, and graphs and
async scheduling where they are on. A request's first step after plain steps has no drafts; the
MTP head's cache misses the positions plain steps computed, which lowers its acceptance, never
the outputs' exactness. Verification is rejection sampling with the drafter's one-hot q
(deepinfer.engine.rejection): sampling each row and comparing is exactly that.

Steps with drafts (or that draft) are synchronous: the next step's drafts depend on this
step's accepted tokens; the engine processes every token in flight before scheduling one. A
step whose requests all decode (up to max_num_seqs of them, needing no host logits processing
or log-probabilities; not with expert parallelism) is two graph replays (Worker.verify_launch):
the forward over every request padded to 1 + width tokens, then the draw of every row at once,
acceptance and the drafter's next block on the device (deepinfer.engine.drafters); the host
reads the result once. Drawing every row before acceptance is the same as drawing them one by one: each row's
noise depends only on its request's seed and position, and without logits processors a row's
distribution does not depend on the tokens appended before it. Such steps chain (Chain): a
graph of width K also writes the next step's inputs on the device (chain_next_inputs), so the
engine launches step N + 1 before it processes step N, as async scheduling does for plain
steps. Other steps run an eager forward (or a prefill graph) that keeps the hidden states; the
host samples and accepts (EagerStep), then the worker's drafter proposes over host-built spans.

This module is the host's policy only: the draft budget, the confidence cut, which steps
verify by graphs and chain, and the processing of a step's results. The engine's step loop
launches every step (deepinfer.engine.llm_engine), the worker runs them on the device
(deepinfer.engine.worker), and the scheduler is the one writer of a request's progress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from deepinfer.config import DEFAULT_STEP_TOKEN_BUDGET
from deepinfer.engine.graphs import PendingVerify, VerifyResult
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.step_times import (
    Acceptance,
    Backoff,
    Episode,
    StepTimes,
    choose_drafts,
    schedule_drafts,
    width_value,
)
from deepinfer.engine.worker import ForwardOutput, Worker

logger = logging.getLogger(__name__)

# With the measured policy, a request without drafts yet is estimated to have drafts of these
# confidences: a running mean of the confidences the drafter gave (optimistic at the start, so
# that the first decoding step tries drafting; below the threshold counts as 0).
ESTIMATE_WEIGHT = 0.1  # of a new observation in the running mean


def draft_budget(step_token_budget: int | None, num_requests: int) -> int | None:
    """Draft tokens a step may verify: step_token_budget less one token per request (None: no cap)."""
    if step_token_budget is None:
        return None
    return max(0, step_token_budget - num_requests)


# A chain of verification steps makes each request's blocks cover this many steps ahead when it
# starts (at most 1 + K positions per step); it goes on while every request has room for two.
CHAIN_STEPS = 32


@dataclass
class VerifyStep:
    """A launched verification step (graph replays): seqs[b] verified num_drafts[b] drafts (a
    chained step's are known once the step before it is read) with cache writes below
    limits[b]; its results on their way to the host."""

    seqs: list[Sequence]
    pending: PendingVerify
    num_drafts: list[int]
    limits: list[int]


@dataclass
class EagerStep:
    """A launched eager step with drafts: its forward (logits and the hidden states the drafter
    reads) and each request's first computed position."""

    batch: ScheduledBatch
    starts: list[int]
    out: ForwardOutput


@dataclass
class Chain:
    """Verification steps launched back to back: the engine processes step N while the device
    runs step N + 1, whose inputs step N wrote on the device (chain_next_inputs)."""

    seqs: list[Sequence]
    bucket: int
    greedy: bool
    limits: list[int]  # positions each request's blocks cover (below max_model_len)
    last: VerifyStep  # the step launched last
    stop: bool = False  # launch no further step


class SpeculativeDecoder:
    """The host side of steps with drafts: the draft budget and confidences, their launch
    (verification graphs, chained where they can be, or an eager forward), their results."""

    def __init__(
        self,
        worker: Worker,
        scheduler: Scheduler,
        sampler: Sampler,
        outputs: OutputProcessor,
        max_model_len: int,
    ) -> None:
        """The drafts per step, the confidence threshold and confidence scheduling's cap on a
        step's tokens (step_token_budget; None: every confident draft is verified) are the
        engine config's speculative_config."""
        self.worker, self.scheduler, self.sampler, self.outputs = worker, scheduler, sampler, outputs
        config = worker.config
        self.k = config.num_speculative_tokens
        self.min_draft_confidence = config.min_draft_confidence
        self.max_model_len = max_model_len
        assert worker.proposer is not None
        self.mtp = config.speculative_method == "mtp"  # its chain writes cache rows ahead
        self.dflash = config.speculative_method == "dflash"  # its block writes rows ahead
        # the drafter's cache rows past a step's verified ones (the block drafter keeps no cache)
        self.head_rows = worker.proposer.head_rows
        self.step_token_budget = config.step_token_budget
        # confidence scheduling: None (off), "budget" (step_token_budget) or "measured" (step_times)
        self.policy = config.schedule_policy
        self.step_times: StepTimes | None = None  # measured on first use (tests set a curve)
        self.estimates = [1.0] * self.k  # the expected confidence of draft j (measured policy)
        self.acceptance = Acceptance()  # the head's confidences against the acceptance observed
        self.backoff = Backoff()  # plain steps before the next probe
        self.episode: Episode | None = None  # drafting since the last probe (None: plain steps)
        self.num_draft_tokens = 0  # drafts verified, and accepted
        self.num_accepted_tokens = 0
        self.num_steps = 0  # steps that verified or proposed drafts
        self.num_graph_steps = 0  # of which verification graph replays
        self.num_probes = 0  # of which probes (measured policy: drafting after plain steps)
        self.num_plain_steps = 0  # steps without drafts or drafter (plain_launched)
        # the wall clock (s) of the measured policy's episodes: set once the curve is measured
        # (tests that inject a curve leave it None, or inject a clock of their own)
        self.clock: Callable[[], float] | None = None
        self.plain_ms: dict[int, float] = {}  # requests -> wall ms of a plain decoding step (running mean)
        self._last_tick: tuple[float, int, int] | None = None  # (time, plain steps, drafting steps)
        self._plain_rows = 0  # requests of the last plain step when all decode (else 0: not timed)
        # overlap: chain verification steps (the host reads step N while the device runs N + 1)
        self.overlap = True
        self.chain: Chain | None = None
        self.last_budget: int | None = None  # the draft budget of the last step (None: no cap)
        self.confidence: dict[int, list[float]] = {}  # id(seq) -> its drafts' confidences
        self.num_offered = 0  # requests the last step's drafter drafted for (confident or not)

    # ------------------------------------------------------------------ policy

    def budget(self) -> int | None:
        """The budget policy's draft budget: one token per request that may run (waiting ones
        included, up to max_num_seqs) is taken out of step_token_budget."""
        return draft_budget(self.step_token_budget, self.num_requests())

    def num_requests(self) -> int:
        """The requests the next step may hold: running or waiting, up to max_num_seqs."""
        sch = self.scheduler
        return min(len(sch.running) + len(sch.waiting), sch.max_num_seqs)

    def times(self) -> StepTimes | None:
        """The measured policy's step-time curve, measured once (Worker.measure_step_times); None
        without verification graphs, where the budget policy applies instead."""
        if self.step_times is None and self.policy == "measured":
            self.step_times = self.worker.measure_step_times()
            if self.step_times is not None:
                self.clock = time.perf_counter
                curve = self.step_times
                logger.info(
                    "confidence scheduling: step times (ms, forward + sampler) by (bucket, width): %s",
                    ", ".join(
                        f"{key}: {curve.forward[key]:.3f} + {curve.sampler.get(key, 0.0):.3f}"
                        for key in sorted(curve.forward)
                    )
                    + "; probes (a width-0 step that drafts) by bucket: "
                    + ", ".join(f"{b}: {ms:.3f}" for b, ms in sorted(curve.probe.items())),
                )
            else:
                logger.warning(
                    "confidence scheduling: no verification graphs to time (eager steps); the "
                    "fixed step_token_budget rule applies"
                )
                self.policy = "budget"
                self.step_token_budget = self.step_token_budget or DEFAULT_STEP_TOKEN_BUDGET
        return self.step_times

    def _drafts_of(self, seqs: list[Sequence]) -> list[list[float]]:
        """The confidences of each request's drafts, as the head gave them."""
        return [self.confidence.get(id(s), [1.0] * len(s.draft))[: len(s.draft)] for s in seqs]

    def wants_step(self) -> bool:
        """Whether the next step drafts (False: a plain decoding step, without the drafter)."""
        times = self.times()
        if self.policy == "measured" and times is not None:
            return self._measured_wants(times)
        budget = self.budget()
        return budget is None or budget > 0

    def _measured_wants(self, times: StepTimes) -> bool:
        """The measured policy: while an episode drafts, go on where the chooser verifies some of
        the requests' drafts (taken at the observed acceptance); else end it (a plain step). Out
        of one, after the back-off, probe where drafts could pay at all at this batch."""
        requests = self.num_requests()
        if self.episode is not None:
            seqs = [s for s in self.scheduler.running if s.draft]
            conf = [self.acceptance.calibrated(c) for c in self._drafts_of(seqs)]
            if not self.episode.losing and any(choose_drafts(times, conf, max(requests, len(conf)))):
                return True
            # it failed with drafts that did not pay or none confident enough; neither when no
            # step of it ran or the drafter ran for no request left (a generate call's end)
            failed = self.episode.tokens > 0 and bool(seqs or self.num_offered)
            if self.episode.paid:
                self.backoff.paid()
            elif failed:
                self.backoff.failed()
            self.episode = None
        elif not self.backoff.waits() and times.drafting_can_pay(max(requests, 1), self.k):
            self.episode = Episode()
            return True
        self.acceptance.plain_step()
        return False

    def limit_drafts(self) -> None:
        """Before scheduling: each running request keeps the drafts the policy gives it."""
        seqs = [s for s in self.scheduler.running if s.draft]
        conf = self._drafts_of(seqs)
        times = self.times()
        if self.policy == "measured" and times is not None:
            conf = [self.acceptance.calibrated(c) for c in conf]
            counts = choose_drafts(times, conf, max(self.num_requests(), len(conf)))
            self.last_budget = sum(counts)
        else:
            self.last_budget = budget = self.budget()
            counts = schedule_drafts(conf, budget)
        for seq, n in zip(seqs, counts):
            del seq.draft[n:]

    def chain_pays(self, batch: ScheduledBatch) -> bool:
        """Measured policy: whether a chain starts at this step: it verifies drafts (a probe
        does not) and, by the drafts' estimates at the observed acceptance, the chooser takes
        the chain's width K (graphs verify every request padded to K drafts): wider than a
        plain step, and than any narrower width on the curve."""
        times = self.step_times
        if self.policy != "measured" or times is None:
            return True
        r = len(batch)
        conf = [self.acceptance.calibrated(self.estimates[: self.k])] * r
        return any(batch.num_draft_tokens) and max(choose_drafts(times, conf, r), default=0) == self.k

    def plain_launched(self, batch: ScheduledBatch) -> None:
        """The engine launched a plain step (no drafts, no drafter)."""
        self.num_plain_steps += 1
        self._plain_rows = len(batch) if all(n == 1 for n in batch.num_new_tokens) else 0

    def untimed(self) -> None:
        """The engine starts a generate call: the time since the last step is no step's."""
        self._last_tick = None

    def tick(self) -> None:
        """At the start of each engine step: the wall time since the last one is the step then
        launched's, a plain decoding step's (its running mean per batch size) or an episode's."""
        if self.clock is None or self.step_times is None:
            return
        now = self.clock()
        last, self._last_tick = self._last_tick, (now, self.num_plain_steps, self.num_steps)
        if last is None:
            return
        ms = (now - last[0]) * 1e3
        plain, drafting = self.num_plain_steps > last[1], self.num_steps > last[2]
        if plain and not drafting and self._plain_rows:
            r = self._plain_rows
            old = self.plain_ms.get(r)
            self.plain_ms[r] = ms if old is None else old + ESTIMATE_WEIGHT * (ms - old)
        elif drafting and not plain and self.episode is not None:
            r = max(1, self.num_requests())
            # without a timed plain step of r requests yet: the curve's (device only: less)
            self.episode.timed(r, ms, self.plain_ms.get(r, self.step_times.plain_ms(r)))

    def _observe(
        self, rows: int, width: int, tokens: int, drafts: int, expected: float, accepted: int
    ) -> None:
        """Measured policy, a processed step with drafts of `rows` requests at `width` (0: a
        probe): it emitted `tokens`, verified `drafts` drafts of confidences adding up to
        `expected`, `accepted` of them accepted."""
        times = self.step_times
        if self.policy != "measured" or times is None:
            return
        if drafts:
            self.acceptance.verified(drafts, expected, accepted)
        if self.episode is not None and rows:
            self.episode.add(times, rows, min(width, times.max_width), tokens)

    def _chain_next_pays(self, seqs: list[Sequence], result: VerifyResult) -> bool:
        """Measured policy, a chained step just read: whether the chain's next step but one is
        worth launching: the step after it (launched already) verifies some drafts, these
        drafts, as its next drafts are likely to be, pay at width K against a plain step, and
        the episode is not losing to plain steps by the wall clock."""
        times = self.step_times
        if self.policy != "measured" or times is None:
            return True
        live = [b for b, s in enumerate(seqs) if not s.is_finished]
        if not any(result.next_drafts[b] for b in live) or (self.episode is not None and self.episode.losing):
            return False
        conf = [self.acceptance.calibrated(result.confidences[b][: result.next_drafts[b]]) for b in live]
        return width_value(times, conf, len(live), self.k) > width_value(times, [], len(live), 0)

    def drop_drafts(self) -> None:
        """Before a plain step: no request verifies drafts."""
        for seq in self.scheduler.running:
            seq.draft = []
        self.confidence = {}

    def chain_goes_on(self) -> bool:
        """Whether the chain launches its next step: not stopped, every request with room for it
        and the one after (the blocks the chain's start covered), nothing waiting."""
        chain = self.chain
        assert chain is not None
        q = 1 + self.k
        room = all(s.num_computed_tokens + 2 * q <= lim for s, lim in zip(chain.seqs, chain.limits))
        return not chain.stop and room and not self.scheduler.waiting

    def _keep_confident(self, seq: Sequence, chain: Iterable[tuple[int, float]]) -> None:
        """seq's drafts: the chain's tokens up to the first below min_draft_confidence. Their
        confidences update the measured policy's estimates (a draft cut off counts as 0)."""
        offered = list(chain)
        self.num_offered += bool(offered)
        conf: list[float] = []
        for token, c in offered:
            if c < self.min_draft_confidence:
                break
            seq.draft.append(token)
            conf.append(min(c, conf[-1]) if conf else c)
        if conf:
            self.confidence[id(seq)] = conf
        for j in range(len(offered)):
            seen = conf[j] if j < len(conf) else 0.0
            self.estimates[j] += ESTIMATE_WEIGHT * (seen - self.estimates[j])

    # ------------------------------------------------------------------ launching

    def launch(self, batch: ScheduledBatch | None) -> VerifyStep | EagerStep:
        """Launch a step with drafts: verification graph replays where they serve the batch (the
        first of a chain where one can start), else an eager forward that keeps its hidden
        states. batch None: the chain's next step, its inputs written by the step before."""
        self.num_steps += 1
        if batch is None:
            return self._launch_chained()
        self.num_probes += self.episode is not None and not any(batch.num_draft_tokens)
        graph = self.worker.verify_graphs.bucket_for(batch)
        seqs = batch.seqs
        on_host = self.sampler.needs_processing(seqs) or any(s.needs_logprob for s in seqs)
        if graph is not None and not on_host:  # processors and log-probabilities: eager
            return self._launch_verify(batch, *graph)
        starts = [s.num_computed_tokens for s in seqs]
        # logits (rows, V): 1 + draft rows per request; eager or a prefill graph, with the hidden states
        out = self.worker.forward(batch, keep_hidden=True)
        assert out.hidden is not None, "a speculative step keeps its hidden states"
        self.scheduler.advance(batch)
        return EagerStep(batch, starts, out)

    def _launch_verify(self, batch: ScheduledBatch, bucket: int, width: int) -> VerifyStep:
        """A decode step verified by graph replays: the drafter's cache rows past the verified
        ones get blocks first (where the pool has them); a chain's first step pads every request
        to K drafts and covers CHAIN_STEPS steps."""
        self.num_graph_steps += 1
        seqs, greedy = list(batch.seqs), all(s.params.greedy for s in batch.seqs)
        chained = (
            self.overlap
            and (bucket, self.k) in self.worker.verify_graphs
            and not self.scheduler.waiting
            and self.chain_pays(batch)
        )
        if chained:  # fewer steps where the pool runs short
            limits = self._cover(seqs, [CHAIN_STEPS * (1 + self.k) + self.head_rows] * len(seqs))
        else:
            limits = self._cover(seqs, [1 + nd + self.head_rows for nd in batch.num_draft_tokens])
        self.worker.set_chain_limits(limits, self._chain_budget(len(seqs)))
        width = self.k if chained else width
        pending = self.worker.verify_launch(batch, bucket, width, greedy, len(seqs))
        step = VerifyStep(seqs, pending, list(batch.num_draft_tokens), limits)
        if chained:
            self.chain = Chain(seqs, bucket, greedy, limits, step)
        return step

    def _launch_chained(self) -> VerifyStep:
        chain = self.chain
        assert chain is not None
        self.num_graph_steps += 1
        rows = len(chain.seqs)
        pending = self.worker.verify_launch(None, chain.bucket, self.k, chain.greedy, rows)
        chain.last = VerifyStep(chain.seqs, pending, [], chain.limits)  # its drafts: read with the one before
        return chain.last

    def _cover(self, seqs: list[Sequence], tokens: list[int]) -> list[int]:
        """Blocks for request b's next tokens[b] positions (below max_model_len; none more where
        the pool runs short) -> the positions its blocks cover, below max_model_len: the limits
        of its cache writes on the device (Worker.set_chain_limits)."""
        blocks = self.scheduler.block_manager
        limits = []
        for seq, n in zip(seqs, tokens):
            want = min(seq.num_computed_tokens + n, self.max_model_len)
            self.scheduler.reserve(seq, want - seq.num_computed_tokens)  # if it fails: less room
            covered = blocks.positions_covered(seq)  # None: rings only (DeepSeek-V4's wrap)
            limits.append(self.max_model_len if covered is None else min(covered, self.max_model_len))
        return limits

    def _chain_budget(self, num_requests: int) -> int:
        """The draft budget of a chained step (every draft when unscheduled): the same for every
        step of a chain, as nothing waits and nothing joins."""
        if self.policy == "measured" and self.step_times is not None:
            return num_requests * self.k  # in a graph a draft costs what its padding row would
        budget = self.budget()
        return num_requests * self.k if budget is None else budget

    # ------------------------------------------------------------------ results

    def process(self, done: VerifyStep | EagerStep) -> list[Sequence]:
        """A launched step's results: tokens appended, drafts accepted, the next drafts kept ->
        the requests that finished."""
        if isinstance(done, EagerStep):
            return self._accept(done)
        result = self.worker.verify_read(done.pending)
        finished = self._append_verified(done.seqs, done.num_drafts, result, done.limits, done.pending.width)
        chain = self.chain
        if chain is None:
            return finished
        if chain.last is done or all(s.is_finished for s in chain.seqs):
            self.chain = None  # a step still in flight writes only its finished requests' rows
        else:
            chain.stop = chain.stop or bool(finished) or not self._chain_next_pays(done.seqs, result)
        chain.last.num_drafts = result.next_drafts  # the step launched after it, if any
        return finished

    def _append_verified(
        self, seqs: list[Sequence], num_drafts: list[int], result: VerifyResult, limits: list[int], width: int
    ) -> list[Sequence]:
        """The host's side of a verified step (of `width`): each request's row and accepted drafts
        count as computed, their tokens are appended (stop conditions checked token by token),
        and the next block's confident drafts become its drafts. limits: the positions below
        which the step wrote cache rows (the MTP head's draft i > 0 is kept only if its row was
        written)."""
        finished: list[Sequence] = []
        verified, self.confidence, self.num_offered = self.confidence, {}, 0
        rows = drafts = accepted = tokens = 0
        expected = 0.0
        for b, (seq, nd, limit) in enumerate(zip(seqs, num_drafts, limits)):
            if seq.is_finished:  # a chained step's row of a request that finished before it
                continue
            self.num_draft_tokens += nd
            rows, drafts, accepted = rows + 1, drafts + nd, accepted + result.accepted[b]
            expected += sum(verified.get(id(seq), [1.0] * nd)[:nd])
            tokens += 1 + result.accepted[b]
            self.scheduler.advance_token(seq)  # its last token's row
            for j in range(result.accepted[b] + 1):
                if j > 0:  # the token just appended equals draft j - 1
                    self.scheduler.advance_token(seq)
                    self.num_accepted_tokens += 1
                self.outputs.append_and_check(seq, result.tokens[b][j], None, finished)
                if seq.is_finished:
                    break
            seq.draft = []
            if not seq.is_finished:
                k = min(self.k, self.max_model_len - seq.num_tokens)
                if self.mtp:  # the head's row of draft i > 0 sits at num_tokens - 2 + i
                    k = min(k, max(1, limit - seq.num_tokens + 2))
                self._keep_confident(seq, zip(result.drafts[b][:k], result.confidences[b][:k]))
        self._observe(rows, width, tokens, drafts, expected, accepted)
        return finished

    def _accept(self, done: EagerStep) -> list[Sequence]:
        """An eager step's results: the token after each sampling request's last one is sampled
        from its first row; while the token just sampled equals the next draft, that draft was
        right and the token after it is sampled from the next row. Then the drafter proposes."""
        batch, logits = done.batch, done.out.logits
        verified = self.confidence  # the confidences of the drafts this step verifies
        finished: list[Sequence] = []
        sampling, first_rows, drafted = [], [], []  # drafted: (seq, logits row of its 1st draft)
        row = drafts = 0
        expected = 0.0  # the accepted drafts the confidences expect
        for seq, nd in zip(batch.seqs, batch.num_draft_tokens):
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
                first_rows.append(row)
                if nd:
                    drafted.append((seq, row + 1))
                    self.num_draft_tokens += nd
                    drafts += nd
                    expected += sum(verified.get(id(seq), [1.0] * nd)[:nd])
                row += 1 + nd
        accepted: dict[int, int] = {}  # id(seq) -> drafts accepted this step
        if sampling:
            self._sample_and_append(logits[first_rows], sampling, finished)
        j, pending = 0, drafted
        while pending:  # draft j was right if the token just sampled equals it
            right = [(s, r) for s, r in pending if not s.is_finished and s.token_ids[-1] == s.draft[j]]
            for seq, _ in right:
                self.scheduler.advance_token(seq)
                accepted[id(seq)] = accepted.get(id(seq), 0) + 1
            self.num_accepted_tokens += len(right)
            if right:
                self._sample_and_append(logits[[r for _, r in right]], [s for s, _ in right], finished)
            j += 1
            pending = [(s, r + 1) for s, r in right if len(s.draft) > j]
        for seq in batch.seqs:
            seq.draft = []
        taken = sum(accepted.values())
        width = max(batch.num_draft_tokens, default=0)
        self._observe(len(sampling), width, len(sampling) + taken, drafts, expected, taken)
        self._propose(batch, done.starts, accepted)
        if done.out.prompt_logprobs is not None:  # from the step's hidden states
            self.outputs.add_prompt_logprobs(done.out.prompt_logprobs, finished)
        return finished

    def _sample_and_append(
        self, logits: torch.Tensor, seqs: list[Sequence], finished: list[Sequence]
    ) -> None:
        tokens, logprobs = self.sampler.sample_now(logits, seqs, [s.num_tokens for s in seqs])
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            self.outputs.append_and_check(seq, token, logprobs.get(row), finished)

    def _propose(self, batch: ScheduledBatch, starts: list[int], accepted: dict[int, int]) -> None:
        """Have the worker's drafter run over the positions computed this step whose next token
        is now known, and give each request that reached its last known token drafts for the
        next step (no more than fit below max_model_len, cut at the first the drafter is not
        confident of)."""
        seqs, spans, rows, ks = [], [], [], []  # ks: drafts wanted (0: not at its last token yet)
        row = 0
        self.confidence, self.num_offered = {}, 0
        for seq, start, n, nd in zip(batch.seqs, starts, batch.num_new_tokens, batch.num_draft_tokens):
            valid = n - nd + accepted.get(id(seq), 0)  # positions holding real tokens
            end = min(start + valid, seq.num_tokens - 1)
            if not seq.is_finished and end > start:
                k = 0
                if end == seq.num_tokens - 1:  # draft positions num_tokens .. num_tokens + k - 1
                    k = min(self.k, self.max_model_len - seq.num_tokens)
                    # the MTP chain writes the head's cache at num_tokens - 1 .. num_tokens + k - 2
                    if self.mtp and k > 1 and not self.scheduler.reserve(seq, k):
                        k = 1
                    # the DFlash block writes rows at num_tokens - 1 .. + head_rows - 1 (where
                    # blocks run short, fewer: a slot without its row still drafts)
                    if self.dflash:
                        self.scheduler.reserve(seq, self.head_rows)
                if k > 0 or self.mtp:  # the MTP head also fills its cache
                    seqs.append(seq)
                    spans.append((start, end))
                    rows.append(row)
                    ks.append(k)
            row += n
        if not seqs:
            return
        wants = [max(k, 1) for k in ks]
        limits = []  # the MTP chain's (DFlash block's) rows stay below the positions the blocks cover
        for seq, (_, e), n in zip(seqs, spans, wants):
            covered = self.scheduler.block_manager.positions_covered(seq)
            ahead = e + self.head_rows if self.dflash else e + n - 1
            limits.append(ahead if covered is None else min(ahead, covered))
        drafts = self.worker.propose(seqs, spans, rows, wants, limits)
        for seq, k, chain in zip(seqs, ks, drafts):
            self._keep_confident(seq, chain[:k])

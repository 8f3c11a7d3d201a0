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

Confidence scheduling (confidence_scheduling=True). A decode step's forward costs about the
same for any token count up to a knee (it is bound by reading the weights, not by arithmetic);
beyond it, every verified draft takes compute that plain decoding would have spent on other
requests. So a step may hold step_token_budget tokens in all: with R requests waiting or
running (one token each), the drafts get budget = max(0, step_token_budget - R) tokens, given
to the drafts of highest confidence across the batch (the expected accepted tokens are the sum
of the verified confidences; confidences fall along a request's drafts, so each request
verifies a prefix). When budget = 0 the step is a plain decoding step: no drafter, and graphs
and async scheduling where they are on, so a large batch is never slower than without drafts.
A request's first step after plain steps has no drafts; the MTP head's cache misses the
positions plain steps computed, which lowers its acceptance, never the outputs' exactness.

Steps with drafts (or that draft) are synchronous: the next step's drafts depend on this
step's accepted tokens. A step whose requests all decode (at most MAX_VERIFY_GRAPH_BATCH of
them, needing no host logits processing or log-probabilities) is two graph replays
(ModelRunner.verify): the forward over every request padded to 1 + width tokens, then the draw
of every row at once, acceptance and the drafter's next block on the device (accept_and_draft
with block_drafts or mtp_drafts); the host reads the result once. Drawing every row before
acceptance is the same as drawing them one by one: each row's noise depends only on its
request's seed and position, and without logits processors a row's distribution does not
depend on the tokens appended before it. Such steps chain (Chain): a graph of width K also
writes the next step's inputs on the device (chain_next_inputs), so the host launches step
N + 1 before it reads step N, as async scheduling does for plain steps. Other steps run eagerly,
or replay a prefill graph that keeps the hidden states (a short prefill step), then draft (the MTP
head's proposals: propose_mtp, over host-built spans, then the same mtp_chain).

The MTP head in a graph step: it runs over every row of the step (1 + w per request), its cache
written at the accepted rows only (the others' slots masked to -1), then k - 1 single-row passes
per request (mtp_chain) at positions computed on the device, each writing its cache row only
below the request's limit: the positions its blocks cover, allocated by the host before the
step (k - 1 rows past the verified ones; a chained run's blocks cover CHAIN_STEPS steps). A
draft whose row could not be written is dropped.

A model with several cache groups (DeepSeek-V4: a ring per request and compressed-entry caches)
runs eager steps only; its MTP layer's caches are rows of those groups (KVCacheGroup.
num_mtp_caches), paged by the request's tables: the ring's unrolled over the positions the head
writes (mtp_batch; the head's pass over a span longer than the ring takes in place goes through
step scratch as the model's forward does, deepinfer.engine.ring, and its chain through the ring
alone), the entry groups' as group_block_tables; the limit is what the growing groups' blocks
cover (positions_covered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.engine.inputs import SamplingInputs, ring_table
from deepinfer.engine.model_runner import ModelRunner, PendingVerify, VerifyResult
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.models.drafter import BlockDrafter
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup


def mtp_batch(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    tokens: list[list[int]],
    block_size: int,
    device: torch.device,
    limits: list[int] | None = None,
    groups: list[KVCacheGroup] | None = None,
    tables: list[list[int]] | None = None,
) -> ForwardBatch:
    """The MTP head's input: request b computes positions spans[b] = [start, end) with input
    tokens tokens[b] (position p writes cache slot table[p // BS] * BS + p % BS); its last
    position gets logits. groups: the model's cache groups (None: one, seq.block_table): the
    first one's tables page slot_mapping and attn.block_tables (`tables` when given, else a
    ring's unrolled over the positions below max(end, limits[b]): those mtp_chain writes next),
    the others' are group_block_tables."""
    if tables is None:
        tables = ring_tables(seqs, spans, block_size, limits, groups)
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    for table, (start, end), ids in zip(tables, spans, tokens):
        input_ids.extend(ids)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        logits_indices.append(len(input_ids) - 1)

    def padded(rows: list[list[int]]) -> torch.Tensor:
        return padded_tables(rows, device)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    num_groups = len(groups) if groups is not None else 1
    return ForwardBatch(
        input_ids=dev(input_ids),
        positions=dev(positions),
        slot_mapping=dev(slots),
        attn=AttentionMetadata.build(padded(tables), [e for _, e in spans], [e - s for s, e in spans]),
        logits_indices=dev(logits_indices),
        group_block_tables=tuple(padded([s.block_tables[g] for s in seqs]) for g in range(1, num_groups)),
    )


def ring_tables(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    block_size: int,
    limits: list[int] | None = None,
    groups: list[KVCacheGroup] | None = None,
) -> list[list[int]]:
    """Each request's table of the first cache group (seq.block_table; a ring's unrolled over
    the positions below max(end, limits[b]))."""
    if groups is None or not groups[0].ring_blocks:
        return [s.block_table for s in seqs]
    return [
        ring_table(s.block_table, -(-max(e, limits[b] if limits else e) // block_size))
        for b, (s, (_, e)) in enumerate(zip(seqs, spans))
    ]


def padded_tables(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(B, MB) int32 block tables on `device`, short rows padded with block 0."""
    out = torch.zeros((len(rows), max([1, *map(len, rows)])), dtype=torch.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out.to(device)


# draft(fb, sampled (B, q), hidden (B q, Dm), accepted (B,), limit (B,), K) -> (drafts (B, K),
# confidences (B, K)): a drafter's next block after a verification step (block_drafts, mtp_drafts)
DraftFn = Callable[
    [ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor],
]


def accept_and_draft(
    draft: DraftFn,
    fb: ForwardBatch,
    sampled: torch.Tensor,
    hidden: torch.Tensor,
    limit: torch.Tensor,
    out_tokens: torch.Tensor,
    out_conf: torch.Tensor,
) -> None:
    """Device only (graph-safe): acceptance and the next block of a verification step.

    fb: the step's inputs, request b at rows b q .. b q + q - 1 (q = 1 + w: its last token, then
    the drafts verified; padding drafts write no cache row, slot -1); sampled (B, q) the token
    drawn at each row; hidden (B q, Dm) the final hidden states by row; limit (B,) the positions
    below which the drafter may write a cache row. Draft j is accepted when drafts 0..j all equal
    the tokens drawn before them; with a accepted, the request's last known token is
    sampled[b, a] and `draft` proposes the next K. Writes out_tokens (B, q + 1 + K) =
    [sampled | a | K drafts] and out_conf (B, K) their confidences."""
    b, q = sampled.shape
    k = out_conf.shape[1]
    drafts = fb.input_ids.view(b, q)[:, 1:]  # (B, w)
    valid = fb.slot_mapping.view(b, q)[:, 1:] >= 0  # (B, w): False for padding
    match = (sampled[:, : q - 1] == drafts) & valid  # (B, w)
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,)
    block, conf = draft(fb, sampled, hidden, accepted, limit, k)  # (B, K) each
    out_tokens[:, :q].copy_(sampled)
    out_tokens[:, q].copy_(accepted)
    out_tokens[:, q + 1 :].copy_(block)
    out_conf.copy_(conf)


def block_drafts(
    drafter: BlockDrafter,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    fb: ForwardBatch,
    sampled: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    limit: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DraftFn of the block drafter: one pass from the hidden state of row b q + a (the last
    accepted position) and the token drawn there. It keeps no cache (fb and limit unused)."""
    b, q = sampled.shape
    rows = torch.arange(b, device=sampled.device) * q + accepted
    last = sampled.gather(1, accepted[:, None])[:, 0]  # (B,)
    return drafter.draft(hidden[rows], last, embed, lm_head, k)


def mtp_drafts(
    model: Any,
    caches: list[PagedKVCache],
    block_size: int,
    fb: ForwardBatch,
    sampled: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    limit: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DraftFn of the MTP head: the head over every row of the step (row j of request b at
    position p = start + j takes the model's hidden state there and the token drawn at it, token
    p + 1), writing its cache at the verified rows j <= a only; then mtp_chain from row a, the
    last accepted position."""
    b, q = sampled.shape
    j = torch.arange(q, device=sampled.device)
    slots = torch.where(j[None, :] <= accepted[:, None], fb.slot_mapping.view(b, q), -1)  # (B, q)
    verified = dataclasses.replace(fb, input_ids=sampled.view(-1), slot_mapping=slots.view(-1))
    out = model.forward_mtp(verified, hidden, caches)  # (B q, Dm)
    rows = torch.arange(b, device=sampled.device) * q + accepted
    last = fb.positions.view(b, q)[:, 0] + accepted  # (B,) the position of row a
    return mtp_chain(
        model, caches, block_size, out[rows], last, fb.attn.block_tables, limit, fb.attn.max_seq_len, k
    )


def mtp_chain(
    model: Any,
    caches: list[PagedKVCache],
    block_size: int,
    h: torch.Tensor,
    last: torch.Tensor,
    tables: torch.Tensor,
    limit: torch.Tensor,
    max_seq_len: int,
    k: int,
    group_tables: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device only (graph-safe): k greedy drafts per request from the MTP head, each with its
    confidence (the product of the head's probabilities of it and of the drafts before it).

    h (B, Dm): the head's output at position last[b], which predicts token last + 2 (draft 0).
    Draft i > 0: the head one position on (last + i) on draft i - 1 and its own previous output
    (the model's hidden state there is not known yet; the next step's pass over verified rows
    rewrites those cache rows). Its cache row is written only below limit[b] (the positions
    allocated for it); a row at or past it writes nothing, sits at limit - 1 and drafts noise
    that the caller drops. tables (B, MB) block tables (a ring's unrolled over the positions
    below limit), group_tables those of further cache groups (ForwardBatch.group_block_tables);
    max_seq_len: a host upper bound of limit (the attention's host lengths)."""
    b, dev = h.shape[0], h.device
    rows = torch.arange(b, device=dev)
    starts = torch.arange(b + 1, dtype=torch.int32, device=dev)  # one query row per request
    table = tables.long()
    top = (limit - 1).clamp(min=0)
    conf = torch.ones(b, dtype=torch.float32, device=dev)
    drafts, confs = [], []
    for i in range(k):
        probs = torch.softmax(model.compute_mtp_logits(h), dim=-1)  # (B, V)
        p, token = probs.max(dim=-1)
        conf = conf * p
        drafts.append(token)
        confs.append(conf)
        if i == k - 1:
            break
        pos = last + i + 1  # (B,)
        write = pos < limit
        pos = torch.minimum(pos, top)
        col = (pos // block_size).clamp(max=table.shape[1] - 1)
        slots = torch.where(write, table.gather(1, col[:, None])[:, 0] * block_size + pos % block_size, -1)
        attn = AttentionMetadata(
            block_tables=tables, seq_lens=(pos + 1).to(torch.int32), query_start_loc=starts,
            seq_lens_host=(max_seq_len,) * b, query_lens_host=(1,) * b, max_query_len=1,
            max_seq_len=max_seq_len,
        )  # fmt: skip
        step = ForwardBatch(
            input_ids=token, positions=pos, slot_mapping=slots, attn=attn, logits_indices=rows,
            group_block_tables=group_tables,
        )  # fmt: skip
        h = model.forward_mtp(step, h, caches)  # (B, ...) the head's hidden state
    return torch.stack(drafts, dim=1), torch.stack(confs, dim=1)


def chain_next_inputs(
    block_size: int,
    threshold: float,
    fb: ForwardBatch,
    sampling: SamplingInputs,
    out_tokens: torch.Tensor,
    out_conf: torch.Tensor,
    limit: torch.Tensor,
    budget: torch.Tensor,
) -> None:
    """Device only (graph-safe), after accept_and_draft in a verification step of width K: the
    next step's inputs in the same layout, written over this step's (fb, sampling), so the next
    step replays without the host. Request b continues at position n = start + a + 1 with its
    last known token (the one drawn after its a accepted drafts) and the K drafts just made;
    drafts below `threshold` confidence, past the step's draft budget (budget (1,): the most
    confident drafts of the batch first, as schedule_drafts ranks them), and every row at or past
    limit[b] (the positions its blocks cover, below max_model_len; 0 for padding requests), are
    padding (slot -1). Also writes out_tokens[:, 2 + 2K] = the drafts the next step verifies."""
    b, k = out_conf.shape
    q = 1 + k
    start = fb.positions.view(b, q)[:, 0]
    accepted = out_tokens[:, q]
    last = out_tokens.gather(1, accepted[:, None])  # (B, 1)
    first = torch.minimum(start + accepted + 1, limit)  # (B,)
    pos = first[:, None] + torch.arange(q, device=first.device)  # (B, q)
    confident = torch.cat([torch.ones_like(out_conf[:, :1], dtype=torch.bool), out_conf >= threshold], 1)
    valid = confident & (pos < limit[:, None])  # a prefix: confidences fall along the block
    # the budget: rank the candidate drafts by (confidence down, block position, request), in
    # (K, B) order so that a stable sort breaks ties as schedule_drafts does; keeps prefixes
    key = torch.where(valid[:, 1:], out_conf, -1.0).t().reshape(-1)  # (K B)
    order = torch.sort(-key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    within = (rank < budget).view(k, b).t()  # (B, K)
    valid = torch.cat([valid[:, :1], valid[:, 1:] & within], 1)
    table = fb.attn.block_tables.long()
    col = (pos // block_size).clamp(max=table.shape[1] - 1)
    slots = torch.where(valid, table.gather(1, col) * block_size + pos % block_size, -1)
    fb.input_ids.copy_(torch.cat([last, out_tokens[:, q + 1 : q + 1 + k]], 1).view(-1))
    fb.positions.copy_(pos.view(-1))
    fb.slot_mapping.copy_(slots.view(-1))
    fb.attn.seq_lens.copy_(first + q)
    sampling.offsets.copy_((pos + 1).view(-1))  # row j draws token first + j + 1
    out_tokens[:, q + 1 + k].copy_(valid[:, 1:].sum(1))


def draft_budget(step_token_budget: int | None, num_requests: int) -> int | None:
    """Draft tokens a step may verify: step_token_budget less one token per request (None: no cap)."""
    if step_token_budget is None:
        return None
    return max(0, step_token_budget - num_requests)


def schedule_drafts(confidences: list[list[float]], budget: int | None) -> list[int]:
    """How many of its drafts each request verifies: the `budget` drafts of highest confidence
    across the batch (every draft when budget is None), taken as a prefix of each request's
    drafts. confidences[b][j]: draft j of request b, non-increasing in j (ties go to the earlier
    draft, then to the earlier request)."""
    if budget is None:
        return [len(c) for c in confidences]
    ranked = sorted(
        ((c, j, b) for b, conf in enumerate(confidences) for j, c in enumerate(conf)),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    counts = [0] * len(confidences)
    for _, j, b in ranked[:budget]:
        counts[b] = max(counts[b], j + 1)  # confidences fall along j: the taken ones are a prefix
    return counts


# A chain of verification steps makes each request's blocks cover this many steps ahead when it
# starts (at most 1 + K positions per step); it goes on while every request has room for two.
CHAIN_STEPS = 32


@dataclass
class Chain:
    """Verification steps launched back to back: the host reads step N's results while the
    device runs step N + 1, whose inputs step N wrote on the device (chain_next_inputs)."""

    seqs: list[Sequence]
    bucket: int
    greedy: bool
    pending: PendingVerify  # launched, results not read yet
    num_drafts: list[int]  # drafts each request verifies in the pending step
    limits: list[int]  # positions each request's blocks cover (below max_model_len)
    stop: bool = False  # launch no further step


class SpeculativeDecoder:
    """Steps with drafts: forward, verification, proposals (MTP or block drafter); eager and
    synchronous, or verification graph replays, chained where they can be."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        outputs: OutputProcessor,
        num_speculative_tokens: int,
        min_draft_confidence: float,
        max_model_len: int,
        drafter: BlockDrafter | None = None,
        step_token_budget: int | None = None,
    ) -> None:
        """drafter: the block drafter (None: the model's MTP head). step_token_budget: confidence
        scheduling's cap on a step's tokens (None: every confident draft is verified)."""
        self.runner, self.scheduler, self.sampler, self.outputs = runner, scheduler, sampler, outputs
        self.block_manager = scheduler.block_manager
        self.k = num_speculative_tokens
        self.min_draft_confidence = min_draft_confidence
        self.max_model_len = max_model_len
        self.drafter = drafter
        # the drafter's cache rows past a step's verified ones: the MTP head's chain writes k - 1
        # (the block drafter keeps no cache)
        self.head_rows = num_speculative_tokens - 1 if drafter is None else 0
        self.step_token_budget = step_token_budget
        self.num_draft_tokens = 0  # drafts verified, and accepted
        self.num_accepted_tokens = 0
        self.num_steps = 0  # steps that verified or proposed drafts
        self.num_graph_steps = 0  # of which verification graph replays
        # overlap: chain verification steps (host reads step N while the device runs N + 1)
        self.overlap = True
        self.chain: Chain | None = None
        self.last_budget: int | None = None  # the draft budget of the last step (None: no cap)
        self.hidden: torch.Tensor | None = None  # the model's final hidden states of this step
        self.confidence: dict[int, list[float]] = {}  # id(seq) -> its drafts' confidences

    def budget(self) -> int | None:
        """This step's draft budget: one token per request that may run (waiting ones included,
        up to max_num_seqs) is taken out of step_token_budget."""
        sch = self.scheduler
        requests = min(len(sch.running) + len(sch.waiting), sch.max_num_seqs)
        return draft_budget(self.step_token_budget, requests)

    def wants_step(self) -> bool:
        """Whether the next step drafts (False: confidence scheduling left no budget for drafts,
        and the step is a plain decoding step)."""
        budget = self.budget()
        return budget is None or budget > 0

    def limit_drafts(self) -> None:
        """Before scheduling: each running request keeps the drafts the budget gives it."""
        self.last_budget = budget = self.budget()
        seqs = [s for s in self.scheduler.running if s.draft]
        conf = [self.confidence.get(id(s), [1.0] * len(s.draft))[: len(s.draft)] for s in seqs]
        for seq, n in zip(seqs, schedule_drafts(conf, budget)):
            del seq.draft[n:]

    def drop_drafts(self) -> None:
        """Before a plain step: no request verifies drafts."""
        for seq in self.scheduler.running:
            seq.draft = []
        self.confidence = {}

    def step(self, batch: ScheduledBatch) -> list[Sequence]:
        self.num_steps += 1
        graph = self.runner.verify_bucket_for(batch)
        seqs = batch.seqs
        on_host = self.sampler.needs_processing(seqs) or any(s.needs_logprob for s in seqs)
        if graph is not None and not on_host:  # processors and log-probabilities: eager
            if self._can_chain(batch, graph[0]):
                return self._start_chain(batch, graph[0])
            return self._graph_step(batch, *graph)
        starts = [s.num_computed_tokens for s in batch.seqs]
        # logits (rows, V): 1 + draft rows per request; eager or a prefill graph, with the hidden states
        _, logits, hidden = self.runner.forward(batch, with_hidden=True)
        assert hidden is not None, "a speculative step keeps its hidden states"
        self.hidden = hidden  # (T, Dm): what the MTP head drafts from, in propose
        self.scheduler.advance(batch)
        finished: list[Sequence] = []
        sampling, first_rows, drafted = [], [], []  # drafted: (seq, logits row of its 1st draft)
        row = 0
        for seq, nd in zip(batch.seqs, batch.num_draft_tokens):
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
                first_rows.append(row)
                if nd:
                    drafted.append((seq, row + 1))
                    self.num_draft_tokens += nd
                row += 1 + nd
        accepted: dict[int, int] = {}  # id(seq) -> drafts accepted this step
        if sampling:
            self._sample_and_append(logits[first_rows], sampling, finished)
        j, pending = 0, drafted
        while pending:  # draft j was right if the token just sampled equals it
            right = [(s, r) for s, r in pending if not s.is_finished and s.token_ids[-1] == s.draft[j]]
            for seq, _ in right:
                self.scheduler.accept_draft(seq)
                accepted[id(seq)] = accepted.get(id(seq), 0) + 1
            self.num_accepted_tokens += len(right)
            if right:
                self._sample_and_append(logits[[r for _, r in right]], [s for s, _ in right], finished)
            j += 1
            pending = [(s, r + 1) for s, r in right if len(s.draft) > j]
        for seq in batch.seqs:
            seq.draft = []
        self._propose(batch, starts, accepted)
        return finished

    def _graph_step(self, batch: ScheduledBatch, bucket: int, width: int) -> list[Sequence]:
        """A decode step verified by graph replays (ModelRunner.verify): append each request's
        accepted drafts and the token after them, then keep the next block's confident drafts.
        The drafter's cache rows past the verified ones get blocks first (where the pool has them)."""
        self.hidden = None
        self.num_graph_steps += 1
        limits = self._cover(batch.seqs, [1 + nd + self.head_rows for nd in batch.num_draft_tokens])
        self.runner.set_chain_limits(limits, self._chain_budget(len(batch)))
        result = self.runner.verify(batch, bucket, width, greedy=all(s.params.greedy for s in batch.seqs))
        return self._append_verified(batch.seqs, batch.num_draft_tokens, result, limits)

    def _cover(self, seqs: list[Sequence], tokens: list[int]) -> list[int]:
        """Blocks for request b's next tokens[b] positions (below max_model_len; none more where
        the pool runs short) -> the positions its blocks cover, below max_model_len: the limits
        of its cache writes on the device (ModelRunner.set_chain_limits)."""
        bs = self.block_manager.block_size
        limits = []
        for seq, n in zip(seqs, tokens):
            want = min(seq.num_computed_tokens + n, self.max_model_len)
            self.block_manager.allocate(seq, want - seq.num_computed_tokens)  # if it fails: less room
            limits.append(min(len(seq.block_table) * bs, self.max_model_len))
        return limits

    def _chain_budget(self, num_requests: int) -> int:
        """The draft budget of a chained step (every draft when unscheduled): the same for every
        step of a chain, as nothing waits and nothing joins."""
        budget = self.budget()
        return num_requests * self.k if budget is None else budget

    def _append_verified(
        self, seqs: list[Sequence], num_drafts: list[int], result: VerifyResult, limits: list[int]
    ) -> list[Sequence]:
        """The host's side of a verified step: each request's row and accepted drafts count as
        computed, their tokens are appended (stop conditions checked token by token), and the
        next block's confident drafts become its drafts. limits: the positions below which the
        step wrote cache rows (the MTP head's draft i > 0 is kept only if its row was written)."""
        finished: list[Sequence] = []
        self.confidence = {}
        for b, (seq, nd, limit) in enumerate(zip(seqs, num_drafts, limits)):
            if seq.is_finished:  # a chained step's row of a request that finished before it
                continue
            self.num_draft_tokens += nd
            seq.num_computed_tokens += 1  # its last token's row (Scheduler.advance)
            self.block_manager.cache_full_blocks(seq)
            for j in range(result.accepted[b] + 1):
                if j > 0:  # the token just appended equals draft j - 1
                    self.scheduler.accept_draft(seq)
                    self.num_accepted_tokens += 1
                self.outputs.append_and_check(seq, result.tokens[b][j], None, finished)
                if seq.is_finished:
                    break
            seq.draft = []
            if not seq.is_finished:
                k = min(self.k, self.max_model_len - seq.num_tokens)
                if self.head_rows:  # the head's row of draft i > 0 sits at num_tokens - 2 + i
                    k = min(k, max(1, limit - seq.num_tokens + 2))
                self._keep_confident(seq, zip(result.drafts[b][:k], result.confidences[b][:k]))
        return finished

    # ------------------------------------------------------------------ chained steps

    def _can_chain(self, batch: ScheduledBatch, bucket: int) -> bool:
        """Chain from this step: overlap on, a width-K graph for the bucket, nothing waiting."""
        return self.overlap and (bucket, self.k) in self.runner.verify_graphs and not self.scheduler.waiting

    def _start_chain(self, batch: ScheduledBatch, bucket: int) -> list[Sequence]:
        """Launch the chain's first step (prepared by the host, padded to width K) after making
        each request's blocks cover CHAIN_STEPS steps, then go on as chain_step does."""
        self.hidden = None
        # fewer steps where the pool runs short
        limits = self._cover(batch.seqs, [CHAIN_STEPS * (1 + self.k) + self.head_rows] * len(batch))
        self.runner.set_chain_limits(limits, self._chain_budget(len(batch)))
        greedy = all(s.params.greedy for s in batch.seqs)
        self.num_graph_steps += 1
        pending = self.runner.verify_launch(batch, bucket, self.k, greedy, len(batch))
        self.chain = Chain(list(batch.seqs), bucket, greedy, pending, list(batch.num_draft_tokens), limits)
        return self.chain_step()

    def chain_step(self) -> list[Sequence]:
        """Launch the chain's next step (if every request has room for it), then read and append
        the pending one. A request that finishes ends the chain after the step in flight; the
        drafts of the last step read stay with the requests for the next scheduled step."""
        chain = self.chain
        assert chain is not None
        launched = None
        q = 1 + self.k
        room = all(s.num_computed_tokens + 2 * q <= lim for s, lim in zip(chain.seqs, chain.limits))
        if not chain.stop and room and not self.scheduler.waiting:
            self.num_steps += 1
            self.num_graph_steps += 1
            launched = self.runner.verify_launch(None, chain.bucket, self.k, chain.greedy, len(chain.seqs))
        result = self.runner.verify_read(chain.pending)
        finished = self._append_verified(chain.seqs, chain.num_drafts, result, chain.limits)
        if launched is None or all(s.is_finished for s in chain.seqs):
            self.chain = None  # a step still in flight writes only its finished requests' rows
        else:
            chain.stop = chain.stop or bool(finished)
            chain.pending, chain.num_drafts = launched, result.next_drafts
        return finished

    def _keep_confident(self, seq: Sequence, chain: Iterable[tuple[int, float]]) -> None:
        """seq's drafts: the chain's tokens up to the first below min_draft_confidence."""
        conf: list[float] = []
        for token, c in chain:
            if c < self.min_draft_confidence:
                break
            seq.draft.append(token)
            conf.append(min(c, conf[-1]) if conf else c)
        if conf:
            self.confidence[id(seq)] = conf

    def _sample_and_append(
        self, logits: torch.Tensor, seqs: list[Sequence], finished: list[Sequence]
    ) -> None:
        tokens, logprobs = self.sampler.sample_now(logits, seqs, [s.num_tokens for s in seqs])
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            self.outputs.append_and_check(seq, token, logprobs.get(row), finished)

    def _propose(self, batch: ScheduledBatch, starts: list[int], accepted: dict[int, int]) -> None:
        """Run the MTP head over the positions computed this step whose next token is now known,
        and give each request that reached its last known token drafts for the next step (no
        more than fit below max_model_len, cut at the first the head is not confident of)."""
        seqs, spans, rows, ks = [], [], [], []  # ks: drafts wanted (0: not at its last token yet)
        row = 0
        self.confidence = {}
        for seq, start, n, nd in zip(batch.seqs, starts, batch.num_new_tokens, batch.num_draft_tokens):
            valid = n - nd + accepted.get(id(seq), 0)  # positions holding real tokens
            end = min(start + valid, seq.num_tokens - 1)
            if not seq.is_finished and end > start:
                k = 0
                if end == seq.num_tokens - 1:  # draft positions num_tokens .. num_tokens + k - 1
                    k = min(self.k, self.max_model_len - seq.num_tokens)
                    # the MTP chain writes the head's cache at num_tokens - 1 .. num_tokens + k - 2
                    if self.drafter is None and k > 1 and not self.block_manager.allocate(seq, k):
                        k = 1
                if k > 0 or self.drafter is None:  # the MTP head also fills its cache
                    seqs.append(seq)
                    spans.append((start, end))
                    rows.append(row)
                    ks.append(k)
            row += n
        if not seqs:
            return
        drafts = self.propose(seqs, spans, rows, [max(k, 1) for k in ks])
        for seq, k, chain in zip(seqs, ks, drafts):
            self._keep_confident(seq, chain[:k])

    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
    ) -> list[list[tuple[int, float]]]:
        """num_drafts[b] (token, confidence) drafts for request b after its position spans[b][1]
        (request b's hidden states of positions spans[b] = [start, end) are this step's rows
        hidden_rows[b] ..): from the MTP head or the block drafter."""
        if self.drafter is None:
            return self.propose_mtp(seqs, spans, hidden_rows, num_drafts)
        return self.propose_block(seqs, spans, hidden_rows, num_drafts)

    @torch.inference_mode()
    def propose_block(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
    ) -> list[list[tuple[int, float]]]:
        """The block drafter, one pass for the batch: from the model's hidden state at end - 1
        and the token at end (the last known one), drafts for positions end + 1 ...."""
        assert self.hidden is not None and self.drafter is not None
        model, device = self.runner.model, self.runner.device
        rows = [r + e - s - 1 for r, (s, e) in zip(hidden_rows, spans)]
        last = [seq.token_ids[e] for seq, (_, e) in zip(seqs, spans)]
        hidden = self.hidden[torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)]  # (B, Dm)
        tokens = torch.tensor(last, dtype=torch.int64).to(device, non_blocking=True)  # (B,)
        k = max(num_drafts)
        drafts, conf = self.drafter.draft(hidden, tokens, model.embed_tokens, model.lm_head, k)  # (B, k)
        return [list(zip(d[:n], c[:n])) for d, c, n in zip(drafts.tolist(), conf.tolist(), num_drafts)]

    @torch.inference_mode()
    def propose_mtp(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
    ) -> list[list[tuple[int, float]]]:
        """num_drafts[b] draft tokens for request b, each with its confidence: the product of the
        MTP head's probabilities of it and of the drafts before it.

        The head first runs over positions spans[b] = [start, end) of request b: position p takes
        the model's hidden state of p (self.hidden row hidden_rows[b] + p - start) and token p + 1,
        and writes the head's own cache. Its output at end - 1 predicts token end + 1, the first
        draft (end = num_tokens - 1: the token after the last known one). The further drafts are
        mtp_chain's, as in a verification graph step; their cache rows end .. end + n - 2 (n the
        drafts wanted) are written, no others. Greedy drafts: verification keeps the outputs exact
        anyway."""
        runner, model = self.runner, self.runner.model
        assert self.hidden is not None and runner.mtp_caches
        bs, device = runner.block_size, runner.device
        tokens = [s.token_ids[a + 1 : b + 1] for s, (a, b) in zip(seqs, spans)]
        limits = []  # the chain's rows stay below the positions the blocks cover
        for seq, (_, e), n in zip(seqs, spans, num_drafts):
            covered = self.block_manager.positions_covered(seq)
            limits.append(e + n - 1 if covered is None else min(e + n - 1, covered))
        # a span longer than the ring takes in place: the head's rows through step scratch
        tables, copies = None, None
        ring = runner.inputs.ring
        if ring is not None:
            columns = [-(-max(e, lim) // bs) for (_, e), lim in zip(spans, limits)]
            tables, copies = ring.tables([s.block_table for s in seqs], spans, columns)
        fb = mtp_batch(seqs, spans, tokens, bs, device, limits, runner.kv_groups, tables)
        rows = torch.cat([torch.arange(r, r + b - a) for r, (a, b) in zip(hidden_rows, spans)]).to(device)
        chain_tables = fb.attn.block_tables
        if copies:
            copies.before(runner.backend, runner.ring_caches(mtp=True))
        out = model.forward_mtp(fb, self.hidden[rows], runner.mtp_caches)  # (T, ...)
        if copies:
            copies.after(runner.backend, runner.ring_caches(mtp=True))
            chain_tables = padded_tables(ring_tables(seqs, spans, bs, limits, runner.kv_groups), device)
        last = [e - 1 for _, e in spans]

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        drafts, conf = mtp_chain(
            model, runner.mtp_caches, bs, out[fb.logits_indices], dev(last), chain_tables, dev(limits),
            max(limits), max(num_drafts), fb.group_block_tables,
        )  # fmt: skip
        return [list(zip(d[:n], c[:n])) for d, c, n in zip(drafts.tolist(), conf.tolist(), num_drafts)]

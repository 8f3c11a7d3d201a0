"""Drafters as proposers: the MTP head (the checkpoint's, chained on its own output), the
block drafter (deepinfer.models.drafter, k tokens in one pass) and the DFlash drafter
(deepinfer.models.dflash: a block of B slots over caches the model's forward injects into).
The worker calls them after a verification forward: inside a verification graph
(accept_and_draft with the proposer's graph_draft), or eagerly over host-built spans (propose).
Each draft comes with its confidence: the chance that the drafts up to it are all accepted.

The MTP head in a graph step: it runs over every row of the step (1 + w per request), its cache
written at the accepted rows only (the others' slots masked to -1), then k - 1 single-row passes
per request (mtp_chain) at positions computed on the device, each writing its cache row only
below the request's limit: the positions its blocks cover, allocated by the host before the
step (k - 1 rows past the verified ones; a chained run's blocks cover CHAIN_STEPS steps). A
draft whose row could not be written is dropped.

A model with several cache groups (DeepSeek-V4: a ring per request and compressed-entry caches)
keeps its MTP layer's caches as rows of those groups (KVCacheGroup.num_mtp_caches), paged by the
request's tables: the ring's unrolled over the positions the head writes (eagerly: mtp_batch,
the head's pass over a span longer than the ring takes in place going through step scratch as
the model's forward does, deepinfer.engine.ring, and its chain through the ring alone; in a
verification graph: the step's table, a ring unrolled over every column), the entry groups' as
group_block_tables (the chain passes the step's on); the limit is what the growing groups'
blocks cover (GroupedBlockManager.positions_covered), and an entry whose closing row is not
written (slot -1) stores nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.engine.inputs import SamplingInputs, ring_table
from deepinfer.engine.ring import RingScratch
from deepinfer.engine.sequence import Sequence
from deepinfer.models.dflash import DFlashHeads
from deepinfer.models.drafter import BlockDrafter
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup
from deepinfer.models.interface import CausalLM


def mtp_batch(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    tokens: list[list[int]],
    block_size: int,
    device: torch.device,
    limits: list[int],
    groups: list[KVCacheGroup],
    tables: list[list[int]] | None = None,
) -> ForwardBatch:
    """The MTP head's input: request b computes positions spans[b] = [start, end) with input
    tokens tokens[b] (position p writes cache slot table[p // BS] * BS + p % BS); its last
    position gets logits. groups: the model's cache groups: the first one's tables page
    slot_mapping and attn.block_tables (`tables` when given, else a ring's unrolled over the
    positions below max(end, limits[b]): those mtp_chain writes next), the others' are
    group_block_tables."""
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

    return ForwardBatch(
        input_ids=dev(input_ids),
        positions=dev(positions),
        slot_mapping=dev(slots),
        attn=AttentionMetadata.build(padded(tables), [e for _, e in spans], [e - s for s, e in spans]),
        logits_indices=dev(logits_indices),
        group_block_tables=tuple(padded([s.block_tables[g] for s in seqs]) for g in range(1, len(groups))),
    )


def ring_tables(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    block_size: int,
    limits: list[int],
    groups: list[KVCacheGroup],
) -> list[list[int]]:
    """Each request's table of the first cache group (seq.block_table; a ring's unrolled over
    the positions below max(end, limits[b]))."""
    if not groups[0].ring_blocks:
        return [s.block_table for s in seqs]
    return [
        ring_table(s.block_table, -(-max(e, limits[b]) // block_size))
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


def dflash_drafts(
    drafter: DFlashHeads,
    caches: list[PagedKVCache],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    fb: ForwardBatch,
    sampled: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    limit: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DraftFn of the DFlash drafter: the step's forward injected the context's rows into its
    caches (the rows of rejected drafts are rewritten by the block and by later steps); its block
    starts at row a + 1's position with the token drawn at row a, the last accepted one. Slot rows
    at or past limit[b] are not written (hidden unused)."""
    b, q = sampled.shape
    last = sampled.gather(1, accepted[:, None])[:, 0]  # (B,) the emitted token
    start = fb.positions.view(b, q)[:, 0] + accepted + 1  # (B,) its position
    bound = fb.attn.max_seq_len + drafter.block_size  # a host upper bound of the block's lengths
    return drafter.draft(last, start, fb.attn.block_tables, limit, caches, embed, lm_head, k, bound)


def mtp_drafts(
    model: CausalLM,
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
        model, caches, block_size, out[rows], last, fb.attn.block_tables, limit, fb.attn.max_seq_len, k,
        fb.group_block_tables,
    )  # fmt: skip


def mtp_chain(
    model: CausalLM,
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


# (token, confidence) drafts of one request, in order
Drafts = list[tuple[int, float]]


class Proposer(Protocol):
    """A drafter as the worker calls it. head_rows: the cache rows past a verification step's
    verified ones that its graph_draft writes (their blocks are allocated before the step)."""

    head_rows: int

    def graph_draft(self) -> DraftFn:
        """The DraftFn a verification graph captures."""
        ...

    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
        limits: list[int],
        hidden: torch.Tensor,
    ) -> list[Drafts]:
        """num_drafts[b] drafts for request b after its position spans[b][1] (the last known
        token): its hidden states of positions spans[b] = [start, end) are rows hidden_rows[b]..
        of `hidden`, the step's final hidden states; its cache rows stay below limits[b]."""
        ...


def _dev(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _drafts(drafts: torch.Tensor, conf: torch.Tensor, num_drafts: list[int]) -> list[Drafts]:
    return [list(zip(d[:n], c[:n])) for d, c, n in zip(drafts.tolist(), conf.tolist(), num_drafts)]


class BlockProposer:
    """The block drafter: one pass for the batch, from the model's hidden state at end - 1 and
    the token at end (the last known one), drafts for positions end + 1 ...; no cache."""

    head_rows = 0

    def __init__(self, drafter: BlockDrafter, model: CausalLM) -> None:
        self.drafter, self.model = drafter, model

    def graph_draft(self) -> DraftFn:
        return functools.partial(block_drafts, self.drafter, self.model.embed_tokens, self.model.lm_head)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
        limits: list[int],
        hidden: torch.Tensor,
    ) -> list[Drafts]:
        device, model = hidden.device, self.model
        rows = [r + e - s - 1 for r, (s, e) in zip(hidden_rows, spans)]
        last = [seq.token_ids[e] for seq, (_, e) in zip(seqs, spans)]
        # (B, Dm) and (B,) -> (B, k) each
        k = max(num_drafts)
        drafts, conf = self.drafter.draft(
            hidden[_dev(rows, device)], _dev(last, device), model.embed_tokens, model.lm_head, k
        )
        return _drafts(drafts, conf, num_drafts)


class DFlashProposer:
    """The DFlash drafter over its caches (the model's forward writes the context's rows): a
    block of B slots from the last known token, its rows written at positions end .. end + B - 1
    below the limits (head_rows: B past a step's verified rows)."""

    def __init__(
        self,
        drafter: DFlashHeads,
        model: CausalLM,
        caches: list[PagedKVCache],
        block_size: int = 0,
        groups: Seq[KVCacheGroup] = (),
    ) -> None:
        """block_size, groups: the engine's (a ring group's tables unroll over the positions)."""
        self.drafter, self.model, self.caches = drafter, model, caches
        self.block_size, self.groups = block_size, list(groups)
        self.head_rows = drafter.block_size

    def graph_draft(self) -> DraftFn:
        m = self.model
        return functools.partial(dflash_drafts, self.drafter, self.caches, m.embed_tokens, m.lm_head)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
        limits: list[int],
        hidden: torch.Tensor,
    ) -> list[Drafts]:
        """The block after the last known token (position end = spans[b][1]); the step's forward
        injected positions up to end - 1 already."""
        device, model = hidden.device, self.model
        last = [seq.token_ids[e] for seq, (_, e) in zip(seqs, spans)]
        rows = [s.block_table for s in seqs]
        if self.groups:
            rows = ring_tables(seqs, spans, self.block_size, limits, self.groups)
        tables = padded_tables(rows, device)
        starts = _dev([e for _, e in spans], device)
        drafts, conf = self.drafter.draft(
            _dev(last, device), starts, tables, _dev(limits, device), self.caches, model.embed_tokens,
            model.lm_head, max(num_drafts), max(limits),
        )  # fmt: skip
        return _drafts(drafts, conf, num_drafts)


class MTPProposer:
    """The MTP head over its caches (the last num_mtp_caches of each cache group), paged by the
    requests' tables. ring: the ring group's step scratch (None: no ring); ring_caches: the
    head's caches of the ring group."""

    def __init__(
        self,
        model: CausalLM,
        backend: Backend,
        caches: list[PagedKVCache],
        block_size: int,
        k: int,
        groups: list[KVCacheGroup],
        ring: RingScratch | None,
        ring_caches: Seq[PagedKVCache],
    ) -> None:
        self.model, self.backend, self.caches, self.block_size = model, backend, caches, block_size
        self.head_rows = k - 1  # its chain writes k - 1 rows past the verified ones
        # expert parallelism: every propose runs the head this many times (1 + a chain of
        # fixed_calls - 1, its drafts past those asked dropped), as every rank's drafting step
        # makes the same MoE exchanges; None: as many as the most drafts asked
        self.fixed_calls: int | None = None
        self.groups, self.ring, self.ring_caches = groups, ring, ring_caches

    def graph_draft(self) -> DraftFn:
        return functools.partial(mtp_drafts, self.model, self.caches, self.block_size)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
        limits: list[int],
        hidden: torch.Tensor,
    ) -> list[Drafts]:
        """The head first runs over positions spans[b] = [start, end) of request b: position p
        takes the model's hidden state of p and token p + 1, and writes the head's own cache.
        Its output at end - 1 predicts token end + 1, the first draft (end = num_tokens - 1: the
        token after the last known one). The further drafts are mtp_chain's, as in a
        verification graph step; their cache rows end .. end + n - 2 (n the drafts wanted) are
        written, no others (limits[b]: at most end + n - 1). Greedy drafts: verification keeps
        the outputs exact anyway."""
        model, bs, device = self.model, self.block_size, hidden.device
        tokens = [s.token_ids[a + 1 : b + 1] for s, (a, b) in zip(seqs, spans)]
        # a span longer than the ring takes in place: the head's rows through step scratch
        tables, copies = None, None
        if self.ring is not None:
            columns = [-(-max(e, lim) // bs) for (_, e), lim in zip(spans, limits)]
            tables, copies = self.ring.tables([s.block_table for s in seqs], spans, columns)
        fb = mtp_batch(seqs, spans, tokens, bs, device, limits, self.groups, tables)
        rows = torch.cat([torch.arange(r, r + b - a) for r, (a, b) in zip(hidden_rows, spans)]).to(device)
        chain_tables = fb.attn.block_tables
        if copies:
            copies.before(self.backend, self.ring_caches)
        out = model.forward_mtp(fb, hidden[rows], self.caches)  # (T, ...)
        if copies:
            copies.after(self.backend, self.ring_caches)
            chain_tables = padded_tables(ring_tables(seqs, spans, bs, limits, self.groups), device)
        drafts, conf = mtp_chain(
            model, self.caches, bs, out[fb.logits_indices], _dev([e - 1 for _, e in spans], device),
            chain_tables, _dev(limits, device), max(limits), self.fixed_calls or max(num_drafts),
            fb.group_block_tables,
        )  # fmt: skip
        return _drafts(drafts, conf, num_drafts)

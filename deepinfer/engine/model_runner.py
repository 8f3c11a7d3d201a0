"""Model runner: one ForwardBatch per step on the device, the model, logits where tokens are sampled."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence
from deepinfer.models.forward_batch import ForwardBatch


def _forward_batch(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    tokens: list[list[int]],
    logits_rows: list[int],
    block_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Request b computes positions spans[b] = [start, end) with input tokens tokens[b]; position
    p goes to cache slot block_table[p // BS] * BS + p % BS; the last logits_rows[b] positions of
    each request get logits."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    for seq, (start, end), ids, rows in zip(seqs, spans, tokens, logits_rows):
        input_ids.extend(ids)
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        logits_indices.extend(range(len(input_ids) - rows, len(input_ids)))
    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = torch.zeros((len(seqs), max_blocks), dtype=torch.int32)  # (B, MB)
    for b, seq in enumerate(seqs):
        block_tables[b, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    seq_lens = [end for _, end in spans]
    query_lens = [end - start for start, end in spans]
    return ForwardBatch(
        input_ids=dev(input_ids),
        positions=dev(positions),
        slot_mapping=dev(slots),
        attn=AttentionMetadata.build(block_tables.to(device), seq_lens, query_lens),
        logits_indices=dev(logits_indices),
    )


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardBatch:
    """Lay the scheduled tokens out back to back; a request samples when its last token is in.

    Request b computes tokens [start, start + n) of its sequence (start = num_computed_tokens),
    its draft tokens last; a request that samples gets logits for its last token and each draft
    token (1 + draft rows, in order)."""
    spans, tokens, rows = [], [], []
    for seq, n, nd in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens):
        start = seq.num_computed_tokens
        spans.append((start, start + n))
        tokens.append(seq.token_ids[start : start + n - nd] + seq.draft[:nd])
        rows.append(1 + nd if start + n - nd == seq.num_tokens else 0)
    return _forward_batch(batch.seqs, spans, tokens, rows, block_size, device)


class ModelRunner:
    """Runs the model over the paged KV caches it owns (and the MTP head over its own cache,
    mtp_caches, when speculative decoding is on)."""

    def __init__(
        self,
        model: Any,
        backend: Backend,
        kv_caches: list[PagedKVCache],
        block_size: int,
        mtp_caches: list[PagedKVCache] | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.mtp_caches = mtp_caches or []
        self.block_size = block_size
        self.device = backend.device.device()
        self.last_hidden: torch.Tensor | None = None  # (T, Dm) of the last run, for propose

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the scheduled tokens; -> logits (S, V) float32 for the requests that sample
        (1 + draft rows each), in batch order."""
        fb = build_forward_batch(batch, self.block_size, self.device)
        hidden = self.model.forward(fb, self.kv_caches)  # (T, Dm)
        self.last_hidden = hidden
        if fb.logits_indices.numel() == 0:
            return torch.empty((0, self.model.config.vocab_size), dtype=torch.float32, device=self.device)
        logits: torch.Tensor = self.model.compute_logits(hidden[fb.logits_indices])  # (S, V)
        return logits.float()

    @torch.inference_mode()
    def run_idle(self) -> None:
        """A forward pass over no tokens: with expert parallelism a rank without requests still
        takes part in every MoE layer's exchange while the other ranks step."""
        empty = torch.zeros((0,), dtype=torch.int64, device=self.device)
        tables = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            input_ids=empty, positions=empty, slot_mapping=empty,
            attn=AttentionMetadata.build(tables, [], []), logits_indices=empty,
        )  # fmt: skip
        self.model.forward(fb, self.kv_caches)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
    ) -> list[list[tuple[int, float]]]:
        """num_drafts[b] draft tokens for request b, each with its probability under the MTP head.

        The head first runs over positions spans[b] = [start, end) of request b: position p takes
        the model's hidden state of p (last_hidden row hidden_rows[b] + p - start) and token p + 1,
        and writes the head's own cache. Its output at end - 1 predicts token end + 1, the first
        draft (end = num_tokens - 1: the token after the last known one). Each further draft runs
        the head one position on, on its own previous output and the previous draft (the model's
        hidden state there is not known yet; the next step's run over verified positions
        rewrites those cache rows). Greedy drafts: verification keeps the outputs exact anyway."""
        assert self.last_hidden is not None and self.mtp_caches
        tokens = [s.token_ids[a + 1 : b + 1] for s, (a, b) in zip(seqs, spans)]
        fb = _forward_batch(seqs, spans, tokens, [1] * len(seqs), self.block_size, self.device)
        rows = torch.cat([torch.arange(r, r + b - a) for r, (a, b) in zip(hidden_rows, spans)]).to(
            self.device
        )
        out = self.model.forward_mtp(fb, self.last_hidden[rows], self.mtp_caches)  # (T, Dm)
        h = out[fb.logits_indices]  # (B, Dm): the head's output at each request's last position
        drafts: list[list[tuple[int, float]]] = [[] for _ in seqs]
        live = list(range(len(seqs)))  # requests that want another draft
        for j in range(max(num_drafts)):
            probs = torch.softmax(self.model.compute_logits(h), dim=-1)  # (len(live), V)
            top_p, top_t = probs.max(dim=-1)
            for b, t, p in zip(live, top_t.tolist(), top_p.tolist()):
                drafts[b].append((int(t), float(p)))
            keep = [i for i, b in enumerate(live) if num_drafts[b] > j + 1]
            if not keep:
                break
            live = [live[i] for i in keep]
            pos = [spans[b][1] + j for b in live]  # the head's next position, fed the last draft
            fb = _forward_batch(
                [seqs[b] for b in live], [(q, q + 1) for q in pos], [[drafts[b][-1][0]] for b in live],
                [1] * len(live), self.block_size, self.device,
            )  # fmt: skip
            h = self.model.forward_mtp(fb, h[keep], self.mtp_caches)
        return drafts

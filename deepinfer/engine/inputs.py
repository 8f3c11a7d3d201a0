"""Input preparation: one step's tokens, positions, cache slots, attention metadata and sampling
parameters, written on the host into one pinned staging buffer and sent with ONE copy into a
persistent device buffer. The model reads typed views of that device buffer.

Graphs need their inputs at fixed addresses: a decode step of a graph bucket (Bp requests, one
token each) always uses the same layout, so the views of a bucket are the same tensors at every
step, and the graph captured with them reads whatever the latest copy put there. A verification
step of a graph bucket (Bp requests of exactly 1 + w tokens each: the last token, its drafts, and
padding drafts up to w) has a fixed layout per (Bp, w) too, and so has a prefill graph step (Bp
requests, each padded to q tokens after its own: the prompt chunk it computes). Eager steps
(long prefills, other speculative steps) use views cut to their own sizes.

Tokens the host does not know yet (async scheduling: the token sampled by the step still on the
device) are written as placeholders row - max_num_seqs (negative), row being where the previous
step's sampler put that token in `sampled_ids`; the worker resolves them on the device before the
embedding (worker.resolve_placeholders).

A model with several KV cache groups (DeepSeek-V4, KVCacheGroup) gets the first group's slots
and block tables in slot_mapping / block_tables, a ring's as a table whose column i is ring block
i % n (one column per block of the sequence: position p at column p // BS, as for any table; a
request computing more tokens than its ring takes in place gets step-scratch blocks for the
columns of its new positions, deepinfer.engine.ring, and the step the copies around its forward),
and each further group's own tables in group_block_tables (in a graph step, each as wide as
max_model_len needs).

Layout of one step (T tokens, B requests, S sampled rows, MB block-table columns, MBg those of
further group g, K previous tokens per token), in bytes from the start of the buffer: int64
[input_ids T | positions T | slot_mapping T | logits_indices S | seeds S | offsets S | top_k S |
token_history T*K], float32 [temperature S | top_p S | min_p S], int32 [seq_lens B |
query_start_loc B+1 | block_tables B*MB | group_block_tables B*MB1, B*MB2, ...].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata
from deepinfer.engine.ring import RingCopies, RingScratch
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup

_I64 = (
    "input_ids",
    "positions",
    "slot_mapping",
    "logits_indices",
    "seeds",
    "offsets",
    "top_k",
    "token_history",
)
_F32 = ("temperature", "top_p", "min_p")
_I32 = ("seq_lens", "query_start_loc", "block_tables", "group_block_tables")
_NUMPY = {torch.int64: np.int64, torch.float32: np.float32, torch.int32: np.int32}


def _lengths(t: int, b: int, s: int, mb: int, group_mbs: tuple[int, ...], history: int) -> dict[str, int]:
    n = dict.fromkeys(_I64, s)
    n.update(input_ids=t, positions=t, slot_mapping=t, token_history=t * history, **dict.fromkeys(_F32, s))
    n.update(seq_lens=b, query_start_loc=b + 1, block_tables=b * mb, group_block_tables=b * sum(group_mbs))
    return n


def layout(
    t: int, b: int, s: int, mb: int, group_mbs: tuple[int, ...] = (), history: int = 0
) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
    """name -> (byte offset, count, dtype) of each field, and the total size in bytes.
    group_mbs: the block-table width of each further cache group; history: the previous tokens
    of each token the model reads (CausalLM.token_history)."""
    n = _lengths(t, b, s, mb, group_mbs, history)
    fields: dict[str, tuple[int, int, torch.dtype]] = {}
    off = 0
    for names, dtype, size in ((_I64, torch.int64, 8), (_F32, torch.float32, 4), (_I32, torch.int32, 4)):
        for name in names:
            fields[name] = (off, n[name], dtype)
            off += n[name] * size
    return fields, off


@dataclass(frozen=True)
class SamplingInputs:
    """Per sampled row (S,), on the device: temperature (0 = greedy), top_k (<= 0: off), top_p,
    min_p, and the (seed, offset) pair the noise of that row is drawn from."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor


def ring_table(ring: list[int], columns: int) -> list[int]:
    """A ring's blocks unrolled into a block table of `columns` columns: column i = ring[i % n]."""
    return (ring * -(-columns // len(ring)))[:columns]


@dataclass
class PreparedStep:
    """A scheduled batch laid out on the device. `bucket` is the graph bucket size (the batch
    padded to Bp decode rows) or None for an eager step. sampling_seqs[i] owns logits row i.
    ring_copies: the ring group's copies around the forward (step scratch), if any. tables: each
    request's block table of the first group this step (a ring's unrolled, step scratch in it)."""

    batch: ScheduledBatch
    forward: ForwardBatch
    sampling: SamplingInputs
    sampling_seqs: list[Sequence]
    bucket: int | None
    ring_copies: RingCopies | None = None
    tables: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Logits rows the step produces (the bucket size for a graph step)."""
        return self.bucket if self.bucket is not None else len(self.sampling_seqs)


class StepInputs:
    """The persistent device buffer of step inputs, its pinned staging twins, and the views."""

    def __init__(
        self,
        backend: Backend,
        block_size: int,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        max_draft_width: int,
        groups: list[KVCacheGroup],
        history: int = 0,
    ) -> None:
        """max_draft_width: the most drafts a verification graph step pads a request to (its
        padding rows sit past the request's last position, up to max_model_len + width).
        groups: the model's cache groups (the first one's table is seq.block_table).
        history: K = CausalLM.token_history, the previous tokens of each token the model reads
        (ForwardBatch.token_history, (T, K) rows of this buffer; 0: no such field)."""
        self.history = history
        self.device = backend.device.device()
        self._device_ops = backend.device  # to_device: the step's one copy
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_draft_width = max_draft_width
        # block-table columns of a graph step
        self.max_blocks = -(-(max_model_len + max_draft_width) // block_size)
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.groups = groups
        # a ring group's step scratch: none until the worker sizes the pools (Worker._allocate)
        self.ring: RingScratch | None = None
        if groups[0].ring_blocks:
            self.ring = RingScratch(groups[0], block_size, 0, 0)
        rows = max(max_num_tokens, max_num_seqs)
        # block-table columns of each further group in a graph step: at least one, as in an eager
        # step (a ratio above max_model_len holds no entry, and the step still indexes column 0),
        # and the entries a verification step's padding drafts reach (up to max_model_len + width)
        most = max_model_len + max_draft_width + 1
        self.group_mbs = tuple(max(1, g.blocks_for(most, block_size)) for g in groups[1:])
        _, nbytes = layout(rows, max_num_seqs, rows, self.max_blocks, self.group_mbs, history)
        self._device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        # Two staging buffers: the host fills one while the copy from the other may be queued.
        self._staging = [backend.device.pinned_empty((nbytes,), torch.uint8) for _ in range(2)]
        self._staging_np = [buf.numpy() for buf in self._staging]
        self._copied = [backend.device.new_event() for _ in range(2)]
        self._turn = 0
        # (bucket, width, prefill) -> the views every step of that graph reads
        self._bucket_views: dict[tuple[int, int | None, bool], dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ views

    @staticmethod
    def _views(buf: torch.Tensor, fields: dict[str, tuple[int, int, torch.dtype]]) -> dict[str, torch.Tensor]:
        return {
            name: buf[off : off + n * dtype.itemsize].view(dtype) for name, (off, n, dtype) in fields.items()
        }

    @staticmethod
    def _host_views(
        buf: np.ndarray, fields: dict[str, tuple[int, int, torch.dtype]]
    ) -> dict[str, np.ndarray]:
        """numpy views of a staging buffer, which the host fills. Torch views and their .numpy()
        took about 0.2 ms of each decode step on the host under cProfile (15 fields, an element
        size probe each: bench/results/2026-12-03_H200_v4_step_profile), the host's step being
        the critical path whenever it runs behind the device."""
        return {
            name: buf[off : off + n * dtype.itemsize].view(_NUMPY[dtype])
            for name, (off, n, dtype) in fields.items()
        }

    def _device_views(
        self,
        t: int,
        b: int,
        s: int,
        mb: int,
        key: tuple[int, int | None, bool] | None,
        group_mbs: tuple[int, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """The typed views of one layout; a graph step's (key: (bucket, width, prefill)) are cached, so
        every step of that graph reads the same tensors."""
        if key is not None and key in self._bucket_views:
            return self._bucket_views[key]
        fields, _ = layout(t, b, s, mb, group_mbs, self.history)
        views = self._views(self._device_buf, fields)
        views["block_tables"] = views["block_tables"].view(b, mb)
        if key is not None:
            self._bucket_views[key] = views
        return views

    def _first_group_tables(
        self, batch: ScheduledBatch, columns: int | None = None
    ) -> tuple[list[list[int]], RingCopies | None]:
        """Each request's table of the first cache group; a ring's unrolled over the sequence
        (column i = ring block i % n, one column per block of its KV length this step, or
        `columns` columns), with step-scratch columns and copies for a request computing more
        than the ring takes."""
        if self.ring is None:
            return [q.block_table for q in batch.seqs], None
        spans = [
            (q.num_computed_tokens, q.num_computed_tokens + n)
            for q, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        cols = None if columns is None else [columns] * len(spans)
        tables, copies = self.ring.tables([q.block_table for q in batch.seqs], spans, cols)
        return tables, copies or None

    # ------------------------------------------------------------------ building a step

    def prepare(
        self, batch: ScheduledBatch, bucket: int | None, width: int | None = None, prefill: bool = False
    ) -> PreparedStep:
        """Lay `batch` out and queue its copy. Request b computes tokens [start, start + n) of its
        sequence (start = num_computed_tokens), its draft tokens last; a request whose last
        computed token is its last token samples: it gets logits for that token and each draft
        (1 + draft rows, in order). With `bucket`, the batch (decode rows only) is padded to that
        many requests: padding rows write no cache row (slot -1) and see one cache row.

        With `bucket` and `width` (a verification graph step: every request has one uncomputed
        token and at most `width` drafts), each request is padded to q = 1 + width tokens and
        every token gets a logits row (row b * q + j); padding drafts have id 0, write no cache
        row and draw with their request's sampling parameters (the drafts of a chained step,
        which the device writes in their place); their rows are discarded.

        With `bucket`, `width` and `prefill` (a prefill graph step: at most `bucket` requests, no
        drafts, each computing at most q = 1 + width tokens and ending at or before
        max_model_len once padded), request b's tokens take rows [b * q, b * q + n) and padding
        tokens the rest of its q (id 0, the positions after its last, no cache row); logits rows
        as in an eager step (one per sampling request, at its last token), padded to `bucket`.
        The step draws eagerly: its PreparedStep has no bucket, its sampling inputs one row per
        sampling request."""
        seqs = batch.seqs
        q = 1 + (width or 0)
        b = len(seqs) if bucket is None else bucket
        t = batch.num_tokens if bucket is None else bucket * q
        rows: list[int] = []  # the token index of each logits row
        offsets: list[int] = []  # the position each row samples (its noise offset)
        sampling_seqs: list[Sequence] = []
        row_seqs: list[Sequence | None] = []  # per logits row, its request (None: padding)
        verify = width is not None and not prefill  # every token of every request samples
        start = 0
        for seq, n, nd in zip(seqs, batch.num_new_tokens, batch.num_draft_tokens):
            if verify:
                assert n == 1 + nd <= q and seq.num_computed_tokens + 1 == seq.num_tokens
                offsets.extend(range(seq.num_tokens, seq.num_tokens + q))
                sampling_seqs.extend([seq] * (1 + nd))
                # padding drafts draw with the request's parameters too: a chained step turns
                # them into its drafts without the host (chain_next_inputs rewrites offsets only)
                row_seqs.extend([seq] * q)
            elif seq.num_computed_tokens + n - nd == seq.num_tokens:
                rows.extend(range(start + n - 1 - nd, start + n))
                offsets.extend(range(seq.num_tokens, seq.num_tokens + 1 + nd))
                sampling_seqs.extend([seq] * (1 + nd))
                row_seqs.extend([seq] * (1 + nd))
            start += q if prefill else n
        s = len(rows) if bucket is None else t if verify else bucket
        if verify:
            rows = list(range(len(row_seqs)))
        # a verification graph step: a ring unrolled over the whole table, so that the slots its
        # chained steps and the MTP head's drafts compute on the device are the request's own
        tables, copies = self._first_group_tables(batch, self.max_blocks if verify else None)
        assert bucket is None or copies is None, "graph steps stay within the ring"
        mb = self.max_blocks if bucket is not None else max((len(tb) for tb in tables), default=1)
        mb = max(mb, 1)
        group_mbs = self.group_mbs
        if bucket is None:
            group_mbs = tuple(
                max([1, *(len(q.block_tables[g]) for q in seqs)]) for g in range(1, len(self.groups))
            )
        fields, nbytes = layout(t, b, s, mb, group_mbs, self.history)

        turn = self._turn
        self._turn ^= 1
        self._copied[turn].synchronize()  # the copy that last read this staging buffer is done
        np_ = self._host_views(self._staging_np[turn], fields)
        self._fill_tokens(np_, batch, t, tables, width)
        self._fill_attention(np_, batch, b, mb, tables, width)
        self._fill_group_tables(np_, batch, b, group_mbs)
        np_["logits_indices"][: len(rows)] = rows
        np_["logits_indices"][len(rows) :] = np.arange(len(rows), s)
        self._fill_sampling(np_, row_seqs, offsets, s)

        self._device_ops.to_device(self._staging[turn][:nbytes], self._device_buf[:nbytes])
        self._copied[turn].record()
        key = None if bucket is None else (bucket, width, prefill)
        views = self._device_views(t, b, s, mb, key, group_mbs)
        if bucket is None:
            seq_lens_host = tuple(r.num_computed_tokens + n for r, n in zip(seqs, batch.num_new_tokens))
            query_lens_host = tuple(batch.num_new_tokens)
        else:  # upper bounds: the graph was captured with them and replays any shorter length
            # (a prefill graph step's requests end at or before max_model_len, padding included)
            seq_lens_host = (self.max_model_len + (0 if prefill else q - 1),) * b
            query_lens_host = (q,) * b
        attn = AttentionMetadata(
            block_tables=views["block_tables"],
            seq_lens=views["seq_lens"],
            query_start_loc=views["query_start_loc"],
            seq_lens_host=seq_lens_host,
            query_lens_host=query_lens_host,
            max_query_len=max(query_lens_host, default=0),
            max_seq_len=max(seq_lens_host, default=0),
        )
        forward = ForwardBatch(
            input_ids=views["input_ids"],
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            attn=attn,
            logits_indices=views["logits_indices"],
            group_block_tables=self._split_group_tables(views["group_block_tables"], b, group_mbs),
            fixed_exchange=bucket is not None,
            token_history=views["token_history"].view(t, self.history) if self.history else None,
        )
        sampling = SamplingInputs(
            temperature=views["temperature"],
            top_k=views["top_k"],
            top_p=views["top_p"],
            min_p=views["min_p"],
            seeds=views["seeds"],
            offsets=views["offsets"],
        )
        if prefill:  # an eager draw over the sampling requests' rows
            n = len(sampling_seqs)
            sampling = SamplingInputs(*(getattr(sampling, f.name)[:n] for f in dataclasses.fields(sampling)))
            return PreparedStep(batch, forward, sampling, sampling_seqs, None, copies, tables)
        return PreparedStep(batch, forward, sampling, sampling_seqs, bucket, copies, tables)

    def _fill_tokens(
        self,
        h: dict[str, np.ndarray],
        batch: ScheduledBatch,
        t: int,
        tables: list[list[int]],
        width: int | None,
    ) -> None:
        """input_ids, positions, slot_mapping (through `tables`, the first group's); padding
        tokens: id 0, position 0, slot -1 (padding drafts of a verification step, and a prefill
        graph step's padding tokens: id 0, the positions after the request's last, slot -1).
        Built as Python lists and stored once per field (the per-request loop is the host's hot
        path at large batch)."""
        bs, k = self.block_size, self.history
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        history: list[int] = []
        for seq, n, nd, table in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens, tables):
            start = seq.num_computed_tokens
            stop = start + n - nd
            known = len(seq.token_ids)
            first = len(ids)
            if stop <= known:
                ids.extend(seq.token_ids[start:stop])
            else:  # the pending token (async): a placeholder resolved on the device
                assert stop == known + 1 and seq.pending_row >= 0, "one pending token at most"
                ids.extend(seq.token_ids[start:known])
                ids.append(seq.pending_row - self.max_num_seqs)
            ids.extend(seq.draft[:nd])
            if k:  # token i's previous k tokens: the k before the step, then the step's own
                before = seq.token_ids[max(0, start - k) : start]
                w = [0] * (k - len(before)) + before + ids[first:]
                for i in range(n):
                    history.extend(w[i + k - 1 : i - 1 if i else None : -1])
            if n == 1:
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                span = range(start, start + n)
                pos.extend(span)
                slots.extend(table[p // bs] * bs + p % bs for p in span)
            pad = 0 if width is None else 1 + width - n
            if pad > 0:  # padding drafts, or a prefill graph step's padding tokens
                ids.extend([0] * pad)
                pos.extend(range(start + n, start + n + pad))
                slots.extend([-1] * pad)
                history.extend([0] * (pad * k))
        n_real = len(ids)
        h["input_ids"][:n_real] = ids
        h["positions"][:n_real] = pos
        h["slot_mapping"][:n_real] = slots
        h["input_ids"][n_real:t] = 0
        h["slot_mapping"][n_real:t] = -1
        if k:  # padding tokens: id 0 before them
            h["token_history"][: len(history)] = history
            h["token_history"][len(history) : t * k] = 0
        if width is None:
            h["positions"][n_real:t] = 0
        else:  # padding requests: positions 0 .. width each
            h["positions"][n_real:t] = np.tile(np.arange(1 + width), (t - n_real) // (1 + width))

    def _fill_attention(
        self,
        h: dict[str, np.ndarray],
        batch: ScheduledBatch,
        b: int,
        mb: int,
        tables: list[list[int]],
        width: int | None,
    ) -> None:
        """seq_lens, query_start_loc, block_tables (`tables`); padding requests: one query token
        seeing one cache row (any block: its output is discarded). In a verification step (and a
        prefill graph step) every request has 1 + width query tokens (padding included), and the
        block-table columns past a request's blocks that its padding drafts reach point to block 0."""
        out = h["block_tables"].reshape(b, mb)
        real = len(batch.seqs)
        qsl = h["query_start_loc"]
        if width is None:
            lengths = zip(batch.seqs, batch.num_new_tokens)
            h["seq_lens"][:real] = [r.num_computed_tokens + n for r, n in lengths]
            h["seq_lens"][real:] = 1
            qsl[0] = 0
            np.cumsum(batch.num_new_tokens, out=qsl[1 : real + 1])
            qsl[real + 1 :] = qsl[real] + np.arange(1, b - real + 1)
        else:
            q = 1 + width
            h["seq_lens"][:real] = [r.num_computed_tokens + q for r in batch.seqs]
            h["seq_lens"][real:] = q
            qsl[:] = np.arange(0, (b + 1) * q, q)
        bs = self.block_size
        for r, (seq, table) in enumerate(zip(batch.seqs, tables)):
            n = len(table)
            out[r, :n] = table
            if width is not None:
                out[r, n : -(-(seq.num_computed_tokens + 1 + width) // bs)] = 0
        if width is None:
            out[real:, 0] = 0
        else:
            out[real:, : -(-(1 + width) // bs)] = 0

    @staticmethod
    def _fill_group_tables(
        h: dict[str, np.ndarray], batch: ScheduledBatch, b: int, group_mbs: tuple[int, ...]
    ) -> None:
        """group_block_tables: group g's (B, MBg) tables one after the other; unused entries 0."""
        at = 0
        for g, width in enumerate(group_mbs, start=1):
            out = h["group_block_tables"][at : at + b * width].reshape(b, width)
            out[:] = 0
            for r, seq in enumerate(batch.seqs):
                out[r, : len(seq.block_tables[g])] = seq.block_tables[g]
            at += b * width

    @staticmethod
    def _split_group_tables(
        flat: torch.Tensor, b: int, group_mbs: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        out, at = [], 0
        for width in group_mbs:
            out.append(flat[at : at + b * width].view(b, width))
            at += b * width
        return tuple(out)

    @staticmethod
    def _fill_sampling(
        h: dict[str, np.ndarray], seqs: list[Sequence | None], offsets: list[int], s: int
    ) -> None:
        """Per sampled row (seqs[i]: row i's request); padding rows (None, or past the list) are
        greedy."""
        k = len(seqs)
        h["temperature"][:k] = [0.0 if q is None or q.params.greedy else q.params.temperature for q in seqs]
        h["top_k"][:k] = [0 if q is None else q.params.top_k for q in seqs]
        h["top_p"][:k] = [1.0 if q is None else q.params.top_p for q in seqs]
        h["min_p"][:k] = [0.0 if q is None else q.params.min_p for q in seqs]
        h["seeds"][:k] = [0 if q is None else q.seed for q in seqs]
        h["offsets"][:k] = offsets[:k]
        for name, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            h[name][k:s] = value
        h["seeds"][k:s] = 0
        h["offsets"][k:s] = 0

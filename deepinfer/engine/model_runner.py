"""Model runner: the model over the paged KV caches it owns, eagerly or as graph replays.

Decode steps (one token per request, no drafts) of up to the largest bucket's requests replay
graphs captured per batch-size bucket (GRAPH_BUCKETS), padded to the bucket: one graph for the
forward (every layer and the LM head, into a persistent logits buffer) and one for the draw
(greedy or sampled, into the persistent sampled_ids buffer). Logits processors that need the
host (penalties, grammars) run between the two. Other steps run the same functions eagerly.

Short prefill steps replay graphs too (prefill_graph_shapes: up to 8 requests, each padded to
q = 16, 32, .. 512 tokens, up to max_prefill_graph_tokens in all): eagerly, such a step's few
hundred launches take the host several times the device's time (on the H200, a 128-token
prompt of the V2-Lite shape: 37 ms on the host for 11 ms of device work). Its forward writes the
logits of each sampling request's last token; the draw runs eagerly.

Everything a graph reads lives at a fixed address: the step inputs (deepinfer.engine.inputs),
the caches, logits and sampled_ids. Input ids that are placeholders for tokens still on the
device (async scheduling) are resolved from sampled_ids as the first op of the forward: one
gather from the token table, the identity over the vocabulary followed by sampled_ids, which a
placeholder's negative id reaches from its end (resolve_placeholders).

Expert parallelism: a graph step's MoE layers exchange fixed-size buffers with the other ranks
(ForwardBatch.fixed_exchange), captured in the graph; every rank replays the same bucket at the
same step (the engine has them agree on it), an idle rank with every row padding (run_idle).
The ranks capture together: each capture's warm-up run exchanges with the others.

Speculative steps verify as graph replays too, per (bucket, width) with every request padded to
1 + width tokens (deepinfer.engine.inputs): one graph for the forward (logits of every row and
the final hidden states, into persistent buffers) and one per greedy flag for the rest (the draw
of every row, acceptance, and the drafter's next block from the last accepted position: the
block drafter's one pass, or the MTP head over the verified rows and chained on its own output,
writing its cache: deepinfer.engine.speculative.accept_and_draft). The host reads the result
with one copy per step.

A ring cache group (DeepSeek-V4's window and compressor state) keeps a fixed number of rows per
request; an eager step in which a request computes more tokens than its ring takes runs over
step-scratch blocks, copied from and back to the ring around the forward (deepinfer.engine.ring).

Prompt log-probabilities need the logits of every prompt position a step computes, not only of
the sampled rows: steps that compute some run eagerly, and prompt_logprobs() takes the LM head
over those rows of the step's final hidden states (in chunks), chunk by chunk of a prefill.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from deepinfer.backend.ops import Backend, GraphRunner
from deepinfer.backend.types import AttentionMetadata, Event, PagedKVCache
from deepinfer.engine.inputs import PreparedStep, SamplingInputs, StepInputs
from deepinfer.engine.ring import RingScratch
from deepinfer.engine.sampler import (
    LOGPROB_CHUNK_ELEMENTS,
    LogprobTensors,
    PromptLogprobs,
    Sampler,
    num_top_logprobs,
    token_logprobs,
)
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup
from deepinfer.parallel.exchanges import current_log

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, up to (and covering) max_num_seqs."""
    sizes = [1, 2, 4, *range(8, 65, 8)]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 16)
    return [b for b in sizes if b < max_num_seqs] + [next(b for b in sizes if b >= max_num_seqs)]


def token_table(vocab_size: int, max_rows: int, device: torch.device) -> torch.Tensor:
    """(V + R,) int64: [0, 1, .., V - 1 | sampled ids of rows 0 .. R - 1]. The last R entries
    are the sampler's output (ModelRunner.sampled_ids is that view)."""
    table = torch.zeros(vocab_size + max_rows, dtype=torch.int64, device=device)
    table[:vocab_size] = torch.arange(vocab_size, device=device)
    return table


def resolve_placeholders(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids in [0, V) as they are; a placeholder r - R (R = the table's sampled rows, so -R .. -1)
    -> sampled_ids[r] (the token the previous step sampled in row r, not yet seen by the host):
    table[ids] in ONE gather, a negative index counting from the table's end. Device only."""
    return table[input_ids]


# accept(step inputs, sampled (B, 1 + w), hidden (B (1 + w), Dm), limit (B,),
#        out_tokens (B, 2 + w + K), out_conf (B, K)): see speculative.accept_and_draft
VerifyFinish = Callable[
    [ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]
# chain(step inputs, out_tokens (B, 3 + 2K), out_conf (B, K), limit (B,), budget (1,)): writes the
# next step's inputs of the same (bucket, K) layout on the device: see speculative.chain_next_inputs
VerifyChain = Callable[
    [ForwardBatch, SamplingInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]

# Prefill graphs: (requests, tokens per request) shapes, each request padded to a width.
PREFILL_GRAPH_REQUESTS = (1, 2, 4, 8)
PREFILL_GRAPH_WIDTHS = (16, 32, 64, 128, 256, 512)


def prefill_graph_shapes(max_rows: int, max_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """The prefill graphs' (requests b, width q) shapes: b up to max_rows (the largest decode
    bucket), q up to max_model_len, b * q up to max_tokens (0: none)."""
    return [
        (b, q)
        for b in PREFILL_GRAPH_REQUESTS
        for q in PREFILL_GRAPH_WIDTHS
        if b <= max_rows and q <= max_model_len and b * q <= max_tokens
    ]


# Verification graphs are captured for the buckets up to this many requests: beyond it
# confidence scheduling leaves drafts little room, and eager steps serve what is left.
MAX_VERIFY_GRAPH_BATCH = 32


class VerifyResult(NamedTuple):
    """A verification step's results on the host, per request b of the step (real ones only):
    tokens (B, 1 + w) sampled at each row, accepted (B,) drafts accepted, drafts (B, K) and
    confidences (B, K) the drafter's next block, and next_drafts (B,) how many of them the
    chained next step verifies (its inputs written on the device; width-K graphs only)."""

    tokens: list[list[int]]
    accepted: list[int]
    drafts: list[list[int]]
    confidences: list[list[float]]
    next_drafts: list[int]


class PendingVerify(NamedTuple):
    """A launched verification step whose results are on their way to host slot `slot`."""

    done: Event
    slot: int
    rows: int
    width: int


class ForwardOutput(NamedTuple):
    """A launched forward: its inputs, logits (rows, V) float32 on the device (1 + draft rows per
    sampling request in batch order, then padding rows), and the final hidden states (T, Dm;
    DeepSeek-V4: its (T, N, Dm) streams) of an eager step (None for a graph replay: they stay
    inside the graph)."""

    step: PreparedStep
    logits: torch.Tensor
    hidden: torch.Tensor | None


class ModelRunner:
    """Owns the step inputs, the KV caches (and the MTP head's, for speculative decoding), the
    logits / sampled-ids buffers and the graphs."""

    def __init__(
        self,
        model: Any,
        backend: Backend,
        sampler: Sampler,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_draft_width: int = 0,
        kv_groups: list[KVCacheGroup] | None = None,
        max_prefill_graph_tokens: int = 0,
    ) -> None:
        """max_draft_width: speculative drafts per request (verification graphs pad to it).
        kv_groups: the model's cache groups (None: one, paged by seq.block_table).
        max_prefill_graph_tokens: the most tokens of a prefill graph step, padding included."""
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.kv_groups = kv_groups
        self.device = backend.device.device()
        self.vocab_size: int = model.config.vocab_size
        # most requests (rows) in a step: max_num_seqs, padded up to a graph bucket
        self.max_rows = graph_buckets(max_num_seqs)[-1]
        self.max_draft_width = max_draft_width
        # a verification graph step of the largest verify bucket: B x (1 + K) tokens
        verify_rows = min(self.max_rows, MAX_VERIFY_GRAPH_BATCH) * (1 + max_draft_width)
        self.inputs = StepInputs(
            backend, block_size, max(max_num_batched_tokens, verify_rows, max_prefill_graph_tokens),
            self.max_rows, max_model_len, max_draft_width, kv_groups,
        )  # fmt: skip
        self.token_table = token_table(self.vocab_size, self.max_rows, self.device)
        self.sampled_ids = self.token_table[self.vocab_size :]  # (R,): placeholders read it
        self.kv_caches: list[PagedKVCache] = []
        self.mtp_caches: list[PagedKVCache] = []
        self.logits: torch.Tensor | None = None  # (max bucket, V) float32: graph outputs
        self.graphs: dict[int, GraphRunner] = {}  # bucket -> forward
        self.draws: dict[tuple[int, bool], GraphRunner] = {}  # (bucket, greedy) -> draw
        # verification graphs: (bucket, width) -> forward, (bucket, width, greedy) -> the rest
        self.verify_graphs: dict[tuple[int, int], GraphRunner] = {}
        self.verify_draws: dict[tuple[int, int, bool], GraphRunner] = {}
        self._verify_buffers: dict[str, torch.Tensor] = {}
        self.prefill_graphs: dict[tuple[int, int], GraphRunner] = {}  # (requests, width) -> forward
        # (b * q, Dm): the prefill graphs' hidden states, kept where a speculative decoder drafts
        # from them (None: not kept)
        self.prefill_hidden: torch.Tensor | None = None
        self.num_prefill_graph_steps = 0  # steps that replayed one

    def set_ring_scratch(self, first_block: int, num_blocks: int) -> None:
        """The ring group's step-scratch blocks: ids [first_block, first_block + num_blocks) of its
        caches, past the blocks the block manager hands out."""
        assert self.kv_groups is not None and self.kv_groups[0].ring_blocks
        self.inputs.ring = RingScratch(self.kv_groups[0], self.block_size, first_block, num_blocks)

    def ring_caches(self, mtp: bool = False) -> list[PagedKVCache]:
        """The ring group's caches: the model's (kv_caches' first ones), or the MTP layers'."""
        if self.kv_groups is None or not self.kv_groups[0].ring_blocks:
            return []
        ring = self.kv_groups[0]
        if mtp:
            return self.mtp_caches[: ring.num_mtp_caches]
        return self.kv_caches[: ring.num_caches - ring.num_mtp_caches]

    # ------------------------------------------------------------------ graphs

    def decode_memory_bytes(self, bucket: int, width: int | None = None, prefill: bool = False) -> int | None:
        """Device memory one decode forward + draw of `bucket` requests (of 1 + width tokens
        each: a verification step; with `prefill`, a prefill graph step's forward) takes beyond
        its inputs (measured on a one-block cache; None where the device has no peak counter).
        Graphs share one pool: this is what they need."""
        dev = self.backend.device
        dev.synchronize()
        dev.reset_peak_memory()
        base = dev.peak_memory_bytes()
        if base is None:
            return None
        caches = self.backend.kv_cache.allocate(
            self.model.kv_cache_spec(1, self.block_size), self.model.num_kv_layers
        )
        real, self.kv_caches = self.kv_caches, caches
        try:
            step = self.inputs.prepare(ScheduledBatch(), bucket, width, prefill)
            _, logits = self._logits(step.forward)
            if not prefill:
                out = torch.empty_like(logits[:, 0], dtype=torch.int64)
                self.sampler.draw(logits, step.sampling, False, out)
            dev.synchronize()
            peak = dev.peak_memory_bytes()
        finally:
            self.kv_caches = real
        del caches, step, logits
        assert peak is not None
        return peak - base

    def capture_graphs(self, buckets: list[int]) -> None:
        """Capture the forward and both draws of every bucket, largest first (one shared pool).
        Leaves no graphs where the backend has none."""
        self.logits = torch.zeros((max(buckets), self.vocab_size), dtype=torch.float32, device=self.device)
        for bs in sorted(buckets, reverse=True):
            step = self.inputs.prepare(ScheduledBatch(), bs)  # all padding: any content will do
            logits, out = self.logits[:bs], self.sampled_ids[:bs]

            def forward(fb: ForwardBatch = step.forward, logits: torch.Tensor = logits) -> None:
                self._logits(fb, out=logits, every_row=True)

            first = next(iter(self.graphs.values()), None)  # the largest: its pool serves all
            try:
                graph = self.backend.device.capture_graph(forward, share_with=first)
            except NotImplementedError as exc:  # the backend cannot capture this model's ops
                logger.warning("decode graphs are off, steps run eagerly: %s", exc)
                graph = None
            if graph is None:
                self.graphs, self.draws, self.logits = {}, {}, None
                return
            self.graphs[bs] = graph
            for greedy in (True, False):

                def draw(
                    p: SamplingInputs = step.sampling,
                    g: bool = greedy,
                    x: torch.Tensor = logits,
                    y: torch.Tensor = out,
                ) -> None:
                    self.sampler.draw(x, p, g, y)

                runner = self.backend.device.capture_graph(draw, share_with=graph)
                assert runner is not None
                self.draws[(bs, greedy)] = runner

    def bucket_for(self, batch: ScheduledBatch) -> int | None:
        """The graph bucket that serves `batch`, None for an eager step."""
        if not self.graphs or len(batch) > max(self.graphs):
            return None
        if any(n != 1 for n in batch.num_new_tokens) or any(batch.num_draft_tokens):
            return None
        if any(s.num_computed_tokens + 1 != s.num_tokens for s in batch.seqs):
            return None  # a one-token prompt chunk samples nothing: the graph's rows all sample
        if any(s.wants_prompt_logprobs for s in batch.seqs):  # needs the hidden states
            return None
        return min(b for b in self.graphs if b >= len(batch))

    def capture_prefill_graphs(self, shapes: list[tuple[int, int]], keep_hidden: bool = False) -> None:
        """Capture the prefill graph of every (requests, width) shape, after capture_graphs (their
        pool is shared; the logits land in the decode graphs' buffer). keep_hidden: the graphs
        also copy the final hidden states out (prefill_hidden), for a speculative decoder."""
        if not self.graphs or self.logits is None or not shapes:
            return
        pool = next(iter(self.graphs.values()))
        if keep_hidden:
            shape = (max(b * q for b, q in shapes), self.model.config.hidden_size)
            self.prefill_hidden = torch.zeros(shape, dtype=self.model.embed_tokens.dtype, device=self.device)
        for b, q in sorted(shapes, key=lambda s: (-s[0] * s[1], -s[1])):
            step = self.inputs.prepare(ScheduledBatch(), b, q - 1, prefill=True)  # all padding

            def forward(fb: ForwardBatch = step.forward, logits: torch.Tensor = self.logits[:b]) -> None:
                hidden, _ = self._logits(fb, out=logits)
                if self.prefill_hidden is not None:
                    self.prefill_hidden[: hidden.shape[0]].copy_(hidden)

            graph = self.backend.device.capture_graph(forward, share_with=pool)
            assert graph is not None
            self.prefill_graphs[(b, q)] = graph

    def prefill_shape_for(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The (requests, width) of the smallest prefill graph that serves `batch` (no drafts, no
        prompt log-probabilities, every request ending at or before max_model_len once padded),
        None for an eager step."""
        if not self.prefill_graphs or len(batch) == 0 or any(batch.num_draft_tokens):
            return None
        if any(s.wants_prompt_logprobs for s in batch.seqs):  # needs the hidden states
            return None
        longest = max(batch.num_new_tokens)
        fits = [(b, q) for b, q in self.prefill_graphs if b >= len(batch) and q >= longest]
        if not fits:
            return None
        b, q = min(fits, key=lambda s: (s[0] * s[1], s[0]))
        if any(s.num_computed_tokens + q > self.inputs.max_model_len for s in batch.seqs):
            return None
        return b, q

    def capture_verify_graphs(
        self, buckets: list[int], accept: VerifyFinish, chain: VerifyChain | None = None
    ) -> None:
        """Capture the verification graphs of every bucket and width 0..max_draft_width, after
        capture_graphs (their pool is shared). `accept` (deepinfer.engine.speculative.
        accept_and_draft with a drafter bound: block_drafts or mtp_drafts) turns the sampled rows
        into the result, writing a drafter's cache rows below the limits (set_chain_limits); in the
        graphs of width max_draft_width, `chain` then writes the next step's inputs (a chained
        step replays without the host preparing it)."""
        if not self.graphs or not buckets:
            return
        k, dev = self.max_draft_width, self.device
        rows = max(buckets) * (1 + k)
        dtype = self.model.embed_tokens.dtype
        self._verify_buffers = {
            "logits": torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=dev),
            "hidden": torch.zeros((rows, self.model.config.hidden_size), dtype=dtype, device=dev),
            "sampled": torch.zeros((rows,), dtype=torch.int64, device=dev),
            "tokens": torch.zeros((max(buckets), 3 + 2 * k), dtype=torch.int64, device=dev),
            "conf": torch.zeros((max(buckets), k), dtype=torch.float32, device=dev),
            "limit": torch.zeros((max(buckets),), dtype=torch.int64, device=dev),
            "budget": torch.zeros((1,), dtype=torch.int64, device=dev),
        }
        buf = self._verify_buffers
        pool = next(iter(self.graphs.values()))
        for bs in sorted(buckets, reverse=True):
            for w in range(k, -1, -1):
                step = self.inputs.prepare(ScheduledBatch(), bs, w)
                t = bs * (1 + w)

                def forward(fb: ForwardBatch = step.forward, t: int = t) -> None:
                    hidden, logits = self._logits(fb)
                    buf["logits"][:t].copy_(logits)
                    buf["hidden"][:t].copy_(hidden)

                graph = self.backend.device.capture_graph(forward, share_with=pool)
                assert graph is not None
                self.verify_graphs[(bs, w)] = graph
                for greedy in (True, False):

                    def finish(
                        step: PreparedStep = step, bs: int = bs, w: int = w, t: int = t, g: bool = greedy
                    ) -> None:
                        sampled = buf["sampled"][:t]
                        self.sampler.draw(buf["logits"][:t], step.sampling, g, sampled)
                        q = 1 + w
                        fb = step.forward
                        accept(
                            fb, sampled.view(bs, q), buf["hidden"][:t], buf["limit"][:bs],
                            buf["tokens"][:bs, : q + 1 + k], buf["conf"][:bs],
                        )  # fmt: skip
                        if chain is not None and w == k:
                            chain(
                                fb, step.sampling, buf["tokens"][:bs], buf["conf"][:bs], buf["limit"][:bs],
                                buf["budget"],
                            )  # fmt: skip

                    runner = self.backend.device.capture_graph(finish, share_with=pool)
                    assert runner is not None
                    self.verify_draws[(bs, w, greedy)] = runner
        pinned = self.backend.device.pinned_empty
        # two slots: a chained step's results land in one while the host reads the other
        self._verify_host = [
            (pinned(tuple(buf["tokens"].shape), torch.int64), pinned(tuple(buf["conf"].shape), torch.float32))
            for _ in range(2)
        ]
        self._verify_turn = 0

    def verify_bucket_for(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(bucket, width) of the verification graph that serves `batch`, None for an eager
        step: every request decodes (one uncomputed token, its drafts after it)."""
        if not self.verify_graphs:
            return None
        largest = max(b for b, _ in self.verify_graphs)
        if len(batch) == 0 or len(batch) > largest:
            return None
        for seq, n, nd in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens):
            if n != 1 + nd or seq.num_computed_tokens + 1 != seq.num_tokens or seq.wants_prompt_logprobs:
                return None
        width = max(batch.num_draft_tokens)
        if width > self.max_draft_width:
            return None
        return min(b for b, _ in self.verify_graphs if b >= len(batch)), width

    @torch.inference_mode()
    def verify_launch(
        self, batch: ScheduledBatch | None, bucket: int, width: int, greedy: bool, rows: int
    ) -> PendingVerify:
        """Launch one verification step (two graph replays) and the copy of its results to the
        host, without waiting. batch None: a chained step, whose inputs the previous step of the
        same (bucket, width) wrote on the device. `rows`: the real requests."""
        if batch is not None:
            self.inputs.prepare(batch, bucket, width)
        self.verify_graphs[(bucket, width)].replay()
        self.verify_draws[(bucket, width, greedy)].replay()
        slot = self._verify_turn
        self._verify_turn ^= 1
        tokens, conf = self._verify_host[slot]
        tokens[:rows].copy_(self._verify_buffers["tokens"][:rows], non_blocking=True)
        conf[:rows].copy_(self._verify_buffers["conf"][:rows], non_blocking=True)
        done = self.backend.device.new_event()
        done.record()
        return PendingVerify(done, slot, rows, width)

    def verify_read(self, pending: PendingVerify) -> VerifyResult:
        """Wait for a launched verification step's results."""
        pending.done.synchronize()
        tokens, conf = self._verify_host[pending.slot]
        q, k, n = 1 + pending.width, self.max_draft_width, pending.rows
        rows = tokens[:n].tolist()
        return VerifyResult(
            [r[:q] for r in rows],
            [r[q] for r in rows],
            [r[q + 1 : q + 1 + k] for r in rows],
            conf[:n].tolist(),
            [r[q + 1 + k] for r in rows],
        )

    def verify(self, batch: ScheduledBatch, bucket: int, width: int, greedy: bool) -> VerifyResult:
        """One verification step, waited for."""
        return self.verify_read(self.verify_launch(batch, bucket, width, greedy, len(batch)))

    def set_chain_limits(self, limits: list[int], budget: int) -> None:
        """For the next verification steps: per request (in batch order) the positions below
        which a step may write cache rows (covered by allocated blocks, below max_model_len): a
        chained step's tokens, the MTP head's drafts; and the most drafts a chained step
        verifies. Stream-ordered: steps launched after this read it."""
        buf = self._verify_buffers
        lim = torch.tensor([*limits, budget], dtype=torch.int64)
        buf["limit"][: len(limits)].copy_(lim[:-1], non_blocking=True)
        buf["limit"][len(limits) :].zero_()
        buf["budget"].copy_(lim[-1:], non_blocking=True)

    # ------------------------------------------------------------------ steps

    def _logits(
        self, fb: ForwardBatch, out: torch.Tensor | None = None, every_row: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device only: the forward of one step -> (hidden (T, Dm), logits (S, V) float32 at
        fb.logits_indices), written into `out` when given. every_row: the step's logits rows are
        its tokens in order (a decode graph step, bucket_for), so no row gather."""
        fb = dataclasses.replace(fb, input_ids=resolve_placeholders(fb.input_ids, self.token_table))
        hidden = self.model.forward(fb, self.kv_caches)  # (T, Dm), or V4's (T, N, Dm)
        rows = hidden if every_row else hidden[fb.logits_indices]
        logits: torch.Tensor = self.model.compute_logits(rows, out)
        return hidden, logits

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, eager: bool = False, bucket: int | None = None, with_hidden: bool = False
    ) -> ForwardOutput:
        """Launch one step's forward: a graph replay for a decode batch that fits a bucket, or
        for a short prefill step that fits a prefill graph (unless `eager`: expert-parallel ranks
        that agreed on eager forwards). `bucket`: the graph to replay (the one the expert-parallel
        ranks agreed on; at least bucket_for's); default: bucket_for's. with_hidden: the step's
        hidden states are returned (T, Dm, packed as the eager forward's): eager, or a prefill
        graph that keeps them (prefill_hidden)."""
        assert not (with_hidden and bucket is not None), "decode graphs keep no hidden states"
        if with_hidden and self.prefill_hidden is None:  # no graph keeps them
            eager = True
        if eager:
            bucket = None
        elif bucket is None:
            bucket = None if with_hidden else self.bucket_for(batch)  # decode graphs keep none
            shape = self.prefill_shape_for(batch) if bucket is None else None
            if shape is not None:
                assert self.logits is not None
                step = self.inputs.prepare(batch, shape[0], shape[1] - 1, prefill=True)
                self.prefill_graphs[shape].replay()
                self.num_prefill_graph_steps += 1
                hidden = None
                if with_hidden:  # request i's rows start at i * q: packed again
                    assert self.prefill_hidden is not None
                    rows, q = self.prefill_hidden, shape[1]
                    parts = [rows[i * q : i * q + n] for i, n in enumerate(batch.num_new_tokens)]
                    hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
                return ForwardOutput(step, self.logits[: len(step.sampling_seqs)], hidden)
        step = self.inputs.prepare(batch, bucket)
        if bucket is None:
            copies = step.ring_copies
            if copies is not None:  # step scratch: ring -> scratch, the forward, scratch -> ring
                copies.before(self.backend, self.ring_caches())
            hidden, logits = self._logits(step.forward)
            if copies is not None:
                copies.after(self.backend, self.ring_caches())
            return ForwardOutput(step, logits, hidden)
        assert self.logits is not None and len(batch) <= bucket
        self._replay(bucket)
        return ForwardOutput(step, self.logits[:bucket], None)

    def _replay(self, bucket: int) -> None:
        """Replay the forward graph of `bucket`; its MoE exchanges (expert parallelism) all ran."""
        self.graphs[bucket].replay()
        log = current_log()
        if log is not None:
            log.replayed()

    @staticmethod
    def prompt_logprob_spans(batch: ScheduledBatch) -> list[tuple[Sequence, int, int, int]]:
        """Before the step's scheduled tokens count as computed: the prompt positions whose
        log-probability the step's hidden states give, as (seq, first position, count, hidden row
        of the token before it), and marks them launched (seq.prompt_logprob_pos). Position p
        (0 < p < prompt length) is the step's if it computes position p - 1."""
        spans = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.wants_prompt_logprobs:
                start = seq.num_computed_tokens
                first = seq.prompt_logprob_pos
                assert first > start, "a prompt position's logits were skipped (prefix cache?)"
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last >= first:
                    spans.append((seq, first, last - first + 1, row + first - 1 - start))
                    seq.prompt_logprob_pos = last + 1
            row += n
        return spans

    @torch.inference_mode()
    def prompt_logprobs(
        self, spans: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor
    ) -> PromptLogprobs | None:
        """Device: the log-probabilities of the prompt positions `spans` (prompt_logprob_spans)
        from the step's final hidden states (T, Dm): the LM head over those rows, in chunks of
        rows, the raw log-softmax, the prompt token's value and rank and the top-k."""
        if not spans:
            return None
        rows = torch.cat([hidden[r : r + count] for _, _, count, r in spans])  # (R, Dm)
        targets: list[int] = []
        for seq, first, count, _ in spans:
            targets.extend(seq.prompt_token_ids[first : first + count])
        target = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        k = max(num_top_logprobs(seq.params.prompt_logprobs, self.vocab_size) for seq, *_ in spans)
        chunk = max(1, LOGPROB_CHUNK_ELEMENTS // self.vocab_size)
        parts = [
            token_logprobs(self.model.compute_logits(rows[i : i + chunk]), target[i : i + chunk], k)
            for i in range(0, rows.shape[0], chunk)
        ]
        values = LogprobTensors([], *(torch.cat(t) for t in zip(*parts)))
        return PromptLogprobs([(seq, first, count) for seq, first, count, _ in spans], values)

    @torch.inference_mode()
    def draw(self, step: PreparedStep, logits: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Sample every row of `logits` on the device -> sampled_ids[:rows] (a persistent view
        that the next step's placeholders read)."""
        rows = step.num_rows
        if step.bucket is not None:
            self.draws[(step.bucket, greedy)].replay()
        else:
            self.sampler.draw(logits, step.sampling, greedy, self.sampled_ids[:rows])
        return self.sampled_ids[:rows]

    @torch.inference_mode()
    def run_idle(self, bucket: int | None = None) -> None:
        """A forward pass over no tokens: with expert parallelism a rank without requests still
        takes part in every MoE layer's exchange while the other ranks step. `bucket`: the graph
        step the ranks agreed on, replayed with every row padding; None: an eager forward."""
        if bucket is not None:
            self.inputs.prepare(ScheduledBatch(), bucket)
            self._replay(bucket)
            return
        empty = torch.zeros((0,), dtype=torch.int64, device=self.device)
        tables = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            input_ids=empty, positions=empty, slot_mapping=empty,
            attn=AttentionMetadata.build(tables, [], []), logits_indices=empty,
        )  # fmt: skip
        self.model.forward(fb, self.kv_caches)

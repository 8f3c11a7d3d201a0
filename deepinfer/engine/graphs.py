"""Graph sets: the worker's captured steps, each set with its capture and its lookup.

  DecodeGraphs   per batch bucket (graph_buckets: 1, 2, 4, 8, 16, ...): the forward (every layer
                 and the LM head, into a persistent logits buffer) and two draws (greedy,
                 sampled; into the persistent sampled_ids buffer), the batch padded to the bucket
  PrefillGraphs  per (requests b, width q) shape (prefill_graph_shapes): a short prefill step's
                 forward, each request padded to q tokens; its draw runs eagerly
  VerifyGraphs   per (bucket, width): a verification step's forward (logits of every row and the
                 final hidden states) and, per greedy flag, the rest (the draw of every row,
                 acceptance, the drafter's next block, and in the width-K graphs the next step's
                 inputs: a chained step)

Capturing is handed what it captures (the step inputs' prepare, the forward, the draw, the
drafter's finish), so nothing here imports the worker, the sampler or the model. Every set
shares the memory pool of the largest decode graph, captured first. Graphs read their inputs
at fixed addresses: the step inputs' views of each bucket or shape (deepinfer.engine.inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple, TypeVar

import torch

from deepinfer.backend.ops import DeviceOps, GraphRunner
from deepinfer.backend.types import Event
from deepinfer.engine.inputs import PreparedStep, SamplingInputs
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, up to (and covering) max_num_seqs."""
    sizes = [1, 2, 4, *range(8, 65, 8)]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 16)
    return [b for b in sizes if b < max_num_seqs] + [next(b for b in sizes if b >= max_num_seqs)]


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


# Verification graphs are captured for every decode bucket, up to max_num_seqs: the worker sets
# aside the graph memory of the largest (Worker._graph_reserve: its forward and draw measured,
# plus VerifyGraphs.capture's logits, hidden-state and sampled-token copies of its B (1 + K) rows).

# prepare(bucket, width, prefill) -> an all-padding step of that layout (StepInputs.prepare)
Prepare = Callable[[int, int | None, bool], PreparedStep]
# forward(step inputs, logits out, every_row) -> (hidden (T, Dm), logits): Worker.logits
Forward = Callable[[ForwardBatch, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor]]
# draw(logits (S, V), sampling inputs, greedy, out (S,)): Sampler.draw
Draw = Callable[[torch.Tensor, SamplingInputs, bool, torch.Tensor], None]
# accept(step inputs, sampled (B, 1 + w), hidden (B (1 + w), Dm), limit (B,),
#        out_tokens (B, 2 + w + K), out_conf (B, K)): deepinfer.engine.drafters.accept_and_draft
VerifyFinish = Callable[
    [ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]
# chain(step inputs, sampling inputs, out_tokens (B, 3 + 2K), out_conf (B, K), limit (B,),
# budget (1,)): writes the next step's inputs of the same (bucket, K) layout on the device
# (deepinfer.engine.drafters.chain_next_inputs)
VerifyChain = Callable[
    [ForwardBatch, SamplingInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]

K = TypeVar("K")


class GraphSet(Mapping[K, GraphRunner]):
    """Captured forwards by key (a bucket, a shape): a read-only mapping."""

    def __init__(self, device: DeviceOps) -> None:
        self.device = device
        self.forwards: dict[K, GraphRunner] = {}

    def __getitem__(self, key: K) -> GraphRunner:
        return self.forwards[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self.forwards)

    def __len__(self) -> int:
        return len(self.forwards)

    def pool(self) -> GraphRunner | None:
        """The graph whose memory pool later captures share (the first captured)."""
        return next(iter(self.forwards.values()), None)


class DecodeGraphs(GraphSet[int]):
    """Decode steps (one token per request, no drafts) of up to the largest bucket's requests."""

    def __init__(self, device: DeviceOps) -> None:
        super().__init__(device)
        self.draws: dict[tuple[int, bool], GraphRunner] = {}  # (bucket, greedy) -> draw
        self.logits: torch.Tensor | None = None  # (max bucket, V) float32: graph outputs

    def capture(
        self, buckets: list[int], prepare: Prepare, forward: Forward, draw: Draw, vocab_size: int,
        sampled_ids: torch.Tensor,
    ) -> None:  # fmt: skip
        """The forward and both draws of every bucket, largest first (one shared pool), drawing
        into sampled_ids. Leaves no graphs where the backend cannot capture the model's ops."""
        dev = sampled_ids.device
        self.logits = torch.zeros((max(buckets), vocab_size), dtype=torch.float32, device=dev)
        for bs in sorted(buckets, reverse=True):
            step = prepare(bs, None, False)  # all padding: any content will do
            logits, out = self.logits[:bs], sampled_ids[:bs]

            def run(fb: ForwardBatch = step.forward, logits: torch.Tensor = logits) -> None:
                forward(fb, logits, True)

            try:
                graph = self.device.capture_graph(run, share_with=self.pool())
            except NotImplementedError as exc:  # the backend cannot capture this model's ops
                logger.warning("decode graphs are off, steps run eagerly: %s", exc)
                graph = None
            if graph is None:
                logger.debug("decode graphs: the backend captures none (batch size %d)", bs)
                self.forwards, self.draws, self.logits = {}, {}, None
                return
            self.forwards[bs] = graph
            logger.debug("decode graph captured: batch size %d (forward, greedy and sampled draws)", bs)
            for greedy in (True, False):

                def sample(
                    p: SamplingInputs = step.sampling, g: bool = greedy, x: torch.Tensor = logits,
                    y: torch.Tensor = out,
                ) -> None:  # fmt: skip
                    draw(x, p, g, y)

                runner = self.device.capture_graph(sample, share_with=graph)
                assert runner is not None
                self.draws[(bs, greedy)] = runner

    def bucket_for(self, batch: ScheduledBatch) -> int | None:
        """The graph bucket that serves `batch`, None for an eager step."""
        if not self.forwards or len(batch) > max(self.forwards):
            return None
        if any(n != 1 for n in batch.num_new_tokens) or any(batch.num_draft_tokens):
            return None
        if any(s.num_computed_tokens + 1 != s.num_tokens for s in batch.seqs):
            return None  # a one-token prompt chunk samples nothing: the graph's rows all sample
        if any(s.wants_prompt_logprobs for s in batch.seqs):  # needs the hidden states
            return None
        return self.smallest(len(batch))

    def smallest(self, rows: int) -> int:
        """The smallest bucket that holds `rows` requests."""
        return min(b for b in self.forwards if b >= rows)


class PrefillGraphs(GraphSet[tuple[int, int]]):
    """Short prefill steps (up to 8 requests, each padded to q = 16, 32, .. 512 tokens): eagerly,
    such a step's few hundred launches take the host several times the device's time (on the
    H200, a 128-token prompt of the V2-Lite shape: 37 ms on the host for 11 ms of device work).
    Their forward writes the logits of each sampling request's last token into the decode
    graphs' logits buffer."""

    def __init__(self, device: DeviceOps) -> None:
        super().__init__(device)
        # (b * q, Dm): the graphs' hidden states, kept where a speculative decoder drafts from
        # them (None: not kept)
        self.hidden: torch.Tensor | None = None

    def capture(
        self, shapes: list[tuple[int, int]], prepare: Prepare, forward: Forward, logits: torch.Tensor,
        pool: GraphRunner, hidden: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """The graph of every shape, largest first, in `pool`'s memory pool; `hidden`: a buffer
        the graphs also copy the final hidden states into."""
        self.hidden = hidden
        for b, q in sorted(shapes, key=lambda s: (-s[0] * s[1], -s[1])):
            step = prepare(b, q - 1, True)  # all padding

            def run(fb: ForwardBatch = step.forward, out: torch.Tensor = logits[:b]) -> None:
                rows, _ = forward(fb, out, False)
                if self.hidden is not None:
                    self.hidden[: rows.shape[0]].copy_(rows)

            graph = self.device.capture_graph(run, share_with=pool)
            assert graph is not None
            self.forwards[(b, q)] = graph
            logger.debug("prefill graph captured: %d requests of up to %d tokens", b, q)

    def shape_for(self, batch: ScheduledBatch, max_model_len: int) -> tuple[int, int] | None:
        """The (requests, width) of the smallest prefill graph that serves `batch` (no drafts, no
        prompt log-probabilities, every request ending at or before max_model_len once padded),
        None for an eager step."""
        if not self.forwards or len(batch) == 0 or any(batch.num_draft_tokens):
            return None
        if any(s.wants_prompt_logprobs for s in batch.seqs):  # needs the hidden states
            return None
        longest = max(batch.num_new_tokens)
        fits = [(b, q) for b, q in self.forwards if b >= len(batch) and q >= longest]
        if not fits:
            return None
        b, q = min(fits, key=lambda s: (s[0] * s[1], s[0]))
        if any(s.num_computed_tokens + q > max_model_len for s in batch.seqs):
            return None
        return b, q


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


class VerifyGraphs(GraphSet[tuple[int, int]]):
    """Verification steps: every request padded to 1 + width tokens (deepinfer.engine.inputs),
    two replays, the host reading the result with one copy per step."""

    def __init__(self, device: DeviceOps, max_draft_width: int) -> None:
        super().__init__(device)
        self.k = max_draft_width
        self.finishes: dict[tuple[int, int, bool], GraphRunner] = {}  # (bucket, width, greedy)
        self.buffers: dict[str, torch.Tensor] = {}
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0

    def capture(
        self, buckets: list[int], prepare: Prepare, forward: Forward, draw: Draw, accept: VerifyFinish,
        chain: VerifyChain | None, pool: GraphRunner, vocab_size: int, hidden_like: torch.Tensor,
    ) -> None:  # fmt: skip
        """Every bucket and width 0..K, in `pool`'s memory pool. `accept` turns the sampled rows
        into the result, writing a drafter's cache rows below the limits (set_limits); in the
        graphs of width K, `chain` then writes the next step's inputs. hidden_like: one row of
        the forward's hidden states, (1, Dm) (DeepSeek-V4: (1, N, Dm)), of their dtype and
        device."""
        k, dev = self.k, hidden_like.device
        rows, most = max(buckets) * (1 + k), max(buckets)
        self.buffers = buf = {
            "logits": torch.zeros((rows, vocab_size), dtype=torch.float32, device=dev),
            "hidden": hidden_like.new_zeros((rows, *hidden_like.shape[1:])),
            "sampled": torch.zeros((rows,), dtype=torch.int64, device=dev),
            "tokens": torch.zeros((most, 3 + 2 * k), dtype=torch.int64, device=dev),
            "conf": torch.zeros((most, k), dtype=torch.float32, device=dev),
            "limit": torch.zeros((most,), dtype=torch.int64, device=dev),
            "budget": torch.zeros((1,), dtype=torch.int64, device=dev),
        }
        for bs in sorted(buckets, reverse=True):
            for w in range(k, -1, -1):
                step, t = prepare(bs, w, False), bs * (1 + w)

                def run(fb: ForwardBatch = step.forward, t: int = t) -> None:
                    hidden, logits = forward(fb, None, False)
                    buf["logits"][:t].copy_(logits)
                    buf["hidden"][:t].copy_(hidden)

                graph = self.device.capture_graph(run, share_with=pool)
                assert graph is not None
                self.forwards[(bs, w)] = graph
                for greedy in (True, False):

                    def finish(
                        step: PreparedStep = step, bs: int = bs, w: int = w, t: int = t, g: bool = greedy
                    ) -> None:
                        sampled, q, fb = buf["sampled"][:t], 1 + w, step.forward
                        draw(buf["logits"][:t], step.sampling, g, sampled)
                        accept(
                            fb, sampled.view(bs, q), buf["hidden"][:t], buf["limit"][:bs],
                            buf["tokens"][:bs, : q + 1 + k], buf["conf"][:bs],
                        )  # fmt: skip
                        if chain is not None and w == k:
                            chain(
                                fb, step.sampling, buf["tokens"][:bs], buf["conf"][:bs], buf["limit"][:bs],
                                buf["budget"],
                            )  # fmt: skip

                    runner = self.device.capture_graph(finish, share_with=pool)
                    assert runner is not None
                    self.finishes[(bs, w, greedy)] = runner
        pinned = self.device.pinned_empty
        # two slots: a chained step's results land in one while the host reads the other
        self._host = [
            (pinned(tuple(buf["tokens"].shape), torch.int64), pinned(tuple(buf["conf"].shape), torch.float32))
            for _ in range(2)
        ]

    def bucket_for(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(bucket, width) of the verification graph that serves `batch`, None for an eager
        step: every request decodes (one uncomputed token, its drafts after it)."""
        if not self.forwards:
            return None
        largest = max(b for b, _ in self.forwards)
        if len(batch) == 0 or len(batch) > largest:
            return None
        for seq, n, nd in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens):
            if n != 1 + nd or seq.num_computed_tokens + 1 != seq.num_tokens or seq.wants_prompt_logprobs:
                return None
        width = max(batch.num_draft_tokens)
        if width > self.k:
            return None
        return min(b for b, _ in self.forwards if b >= len(batch)), width

    def launch(self, bucket: int, width: int, greedy: bool, rows: int) -> PendingVerify:
        """Replay the step's two graphs (its inputs in place) and queue the copy of its results
        for the `rows` real requests to the host, without waiting."""
        self.forwards[(bucket, width)].replay()
        self.finishes[(bucket, width, greedy)].replay()
        slot = self._turn
        self._turn ^= 1
        tokens, conf = self._host[slot]
        tokens[:rows].copy_(self.buffers["tokens"][:rows], non_blocking=True)
        conf[:rows].copy_(self.buffers["conf"][:rows], non_blocking=True)
        done = self.device.new_event()
        done.record()
        return PendingVerify(done, slot, rows, width)

    def read(self, pending: PendingVerify) -> VerifyResult:
        """Wait for a launched step's results."""
        pending.done.synchronize()
        tokens, conf = self._host[pending.slot]
        q, k, n = 1 + pending.width, self.k, pending.rows
        rows = tokens[:n].tolist()
        return VerifyResult(
            [r[:q] for r in rows],
            [r[q] for r in rows],
            [r[q + 1 : q + 1 + k] for r in rows],
            conf[:n].tolist(),
            [r[q + 1 + k] for r in rows],
        )

    def set_limits(self, limits: list[int], budget: int) -> None:
        """For the next steps: per request (in batch order) the positions below which a step may
        write cache rows (covered by allocated blocks, below max_model_len): a chained step's
        tokens, the MTP head's drafts; and the most drafts a chained step verifies.
        Stream-ordered: steps launched after this read it."""
        buf = self.buffers
        lim = torch.tensor([*limits, budget], dtype=torch.int64)
        buf["limit"][: len(limits)].copy_(lim[:-1], non_blocking=True)
        buf["limit"][len(limits) :].zero_()
        buf["budget"].copy_(lim[-1:], non_blocking=True)

"""Confidence scheduling from measured step times: whether a step drafts, and how many drafts it
verifies.

A verification step of R requests padded to 1 + w rows each replays the graph of (bucket >= R,
width w); its time is the forward's plus the sampler's: the draw, acceptance and the drafter's
next block, so a width w >= 1 on the curve includes the drafter's own cost. StepTimes keeps those
times, measured once at start-up for every captured graph through a callable the worker provides
(Worker.measure_step_times; tests inject synthetic curves); width 0 is a plain decoding step (the
decode graph: no drafter), and probe[bucket] a step that drafts but verifies nothing (the width-0
verification graph with its drafter). A graph's time depends on the step's width, not on how
many of its rows are real drafts (the others are padding), and is taken non-decreasing in width.
Past the largest bucket a step runs eagerly: a plain one at the largest plain graph's per-token
time; one with drafts is not measured and never chosen (eager verification steps cost several
plain steps: docs/speculative.md).

Each draft j of request b carries its confidence c[b][j], the chance that drafts 0..j are all
accepted (a prefix probability, non-increasing in j). A step that verifies n_b drafts of request
b emits on average E = sum_b (1 + c[b][0] + ... + c[b][n_b - 1]) tokens, in
T = step_ms(R, max_b n_b, R + sum_b n_b) ms. choose_drafts maximises E / T. Within a graph of
width w a draft costs what its padding row would, so the best allocation of width w verifies
every draft below position w (each request a prefix of its drafts, which confidence ranks
first); the best of widths 0..K is the best allocation (tests/test_step_times.py checks it
against every allocation). Width 0 (a plain step: no drafts, no drafter) is a candidate, and
another wins only when it is strictly faster per token, drafter included: a step never loses to
plain decoding on the curve. The choice costs O(R K) per step (the engine makes it every step).

The head's confidences can be off: Acceptance keeps the acceptance actually observed against
the confidences of the drafts verified (running sums) and scales the confidences by their ratio
before they are chosen on. Drafting runs in episodes (SpeculativeDecoder): a probe step (the
drafter's first block after plain steps), then steps while the chooser verifies drafts; an
episode that emitted fewer tokens than plain steps would have in its time on the curve did not
pay, and Backoff then keeps the next steps plain, twice as many after each such episode up to a
cap, before the next probe. The curve holds device time only: an episode is also timed by the
wall clock against plain steps (the host's work is on no curve, and a step with drafts is
synchronous where plain ones overlap the device), and ends once it loses by that account.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def schedule_drafts(confidences: list[list[float]], budget: int | None) -> list[int]:
    """How many of its drafts each request verifies: the `budget` drafts of highest confidence
    across the batch (every draft when budget is None), taken as a prefix of each request's
    drafts. confidences[b][j]: draft j of request b, non-increasing in j (ties go to the earlier
    draft, then to the earlier request)."""
    if budget is None:
        return [len(c) for c in confidences]
    counts = [0] * len(confidences)
    for _, j, b in ranked(confidences)[:budget]:
        counts[b] = max(counts[b], j + 1)  # confidences fall along j: the taken ones are a prefix
    return counts


def ranked(confidences: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every draft as (confidence, j, b), most confident first (ties: earlier draft, then
    earlier request)."""
    drafts = ((c, j, b) for b, conf in enumerate(confidences) for j, c in enumerate(conf))
    return sorted(drafts, key=lambda t: (-t[0], t[1], t[2]))


@dataclass(frozen=True)
class StepTimes:
    """ms of one step per (bucket, width): forward[(b, w)] the forward of b requests padded to
    1 + w rows (w = 0: a plain decoding step), sampler[(b, w)] its draw, acceptance and drafting
    (missing: 0); probe[b] a step of b requests that verifies no draft but drafts (forward and
    sampler; missing: the width-1 step's time). Every bucket has the same widths 0..K."""

    forward: Mapping[tuple[int, int], float]
    sampler: Mapping[tuple[int, int], float]
    probe: Mapping[int, float] = field(default_factory=dict)
    # per width: the buckets (ascending) and their step times (non-decreasing in width)
    _graphs: dict[int, tuple[list[int], list[float]]] = field(init=False, repr=False, compare=False)
    _can_pay: dict[tuple[int, int], bool] = field(init=False, repr=False, compare=False)  # asked every step

    def __post_init__(self) -> None:
        if not self.forward:
            raise ValueError("StepTimes needs at least one measured (bucket, width)")
        times = [*self.forward.values(), *self.probe.values()]
        if any(not t > 0 for t in times) or any(not t >= 0 for t in self.sampler.values()):
            raise ValueError(
                "StepTimes: forward and probe times must be positive, sampler times non-negative (ms)"
            )
        if not any(w == 0 for _, w in self.forward):
            raise ValueError("StepTimes needs the plain step's time (width 0) of at least one bucket")
        graphs = {}
        for width in range(self.max_width + 1):
            buckets = sorted({b for b, w in self.forward if w == width})
            ms = [max(self._at(b, v) for v in range(width + 1) if (b, v) in self.forward) for b in buckets]
            graphs[width] = (buckets, ms)
        object.__setattr__(self, "_graphs", graphs)
        object.__setattr__(self, "_can_pay", {})

    @property
    def max_width(self) -> int:
        return max(w for _, w in self.forward)

    def _at(self, bucket: int, width: int) -> float:
        return self.forward[(bucket, width)] + self.sampler.get((bucket, width), 0.0)

    def step_ms(self, requests: int, width: int, tokens: int) -> float:
        """A step of `requests` requests, the widest verifying `width` drafts, `tokens` tokens in
        all: the graph of the smallest bucket that holds them (non-decreasing in width: the most
        of the widths up to `width`, as a narrower step can always pad). Past the largest
        bucket of that width the step runs eagerly: a plain one costs the largest plain graph's
        per-token time times `tokens`; one with drafts is not measured (eager speculative steps
        cost several plain steps) and never chosen: inf."""
        if width > self.max_width:
            raise ValueError(f"no step time measured for width {width} (at most {self.max_width})")
        buckets, ms = self._graphs[width]
        i = bisect.bisect_left(buckets, requests)
        if i < len(buckets):
            return ms[i]
        if width > 0 or not buckets:
            return float("inf")
        return self._at(buckets[-1], 0) * tokens / buckets[-1]

    def probe_ms(self, requests: int) -> float:
        """A step of `requests` requests that verifies no draft but drafts: probe's smallest bucket
        that holds them; without one, the width-1 step (it drafts too); inf past the graphs."""
        fits = [b for b in self.probe if b >= requests]
        if fits:
            return self.probe[min(fits)]
        return self.step_ms(requests, min(1, self.max_width), 2 * requests)

    def plain_ms(self, requests: int) -> float:
        return self.step_ms(requests, 0, requests)

    def drafting_can_pay(self, requests: int, k: int) -> bool:
        """Whether any step of `requests` requests with drafts could beat plain decoding: one
        whose k drafts each are sure to be accepted (else no probe is worth its cost)."""
        known = self._can_pay.get((requests, k))
        if known is None:
            plain = requests / self.plain_ms(requests)
            known = self._can_pay[(requests, k)] = any(
                requests * (1 + v) / self.step_ms(requests, v, requests * (1 + v)) > plain * (1 + 1e-9)
                for v in range(1, min(k, self.max_width) + 1)
            )
        return known


def expected_tokens(confidences: list[list[float]], counts: list[int]) -> float:
    """Tokens a step emits on average: one per request, plus its verified drafts' confidences."""
    return sum(1.0 + sum(c[:n]) for c, n in zip(confidences, counts))


def step_value(times: StepTimes, confidences: list[list[float]], counts: list[int], requests: int) -> float:
    """Expected tokens per ms of a step verifying counts[b] drafts of request b; `requests` (at
    least len(counts)) counts those in the step without drafts too."""
    extra = requests - len(counts)
    width = max(counts, default=0)
    ms = times.step_ms(requests, width, requests + sum(counts))
    return (expected_tokens(confidences, counts) + extra) / ms


def width_value(times: StepTimes, confidences: list[list[float]], requests: int, width: int) -> float:
    """Expected tokens per ms of a step padded to `width` (a chained step's: K) that verifies
    every draft below it; confidences: the requests with drafts, `requests` counts all."""
    gained = sum(sum(c[:width]) for c in confidences)
    tokens = requests + sum(min(width, len(c)) for c in confidences)
    return (requests + gained) / times.step_ms(requests, width, tokens)


def choose_drafts(times: StepTimes, confidences: list[list[float]], requests: int | None = None) -> list[int]:
    """How many of its drafts each request verifies, maximising expected tokens per ms
    (module docstring); all zeros when no draft pays (a plain step). confidences[b][j]: draft j
    of request b, non-increasing in j; requests: the requests in the step (default: one per
    row of confidences; more: requests without drafts)."""
    r = len(confidences) if requests is None else requests
    longest = max((len(c) for c in confidences), default=0)
    gain = [0.0] * (longest + 1)  # gain[v]: sum of every confidence at a position below v
    drafts = [0] * (longest + 1)  # drafts[v]: how many drafts sit below v
    for conf in confidences:
        for j, c in enumerate(conf):
            gain[j + 1] += c
            drafts[j + 1] += 1
    for v in range(1, longest + 1):
        gain[v] += gain[v - 1]
        drafts[v] += drafts[v - 1]
    best, best_value = 0, r / times.step_ms(r, 0, r)  # a plain step
    for v in range(1, min(longest, times.max_width) + 1):
        value = (r + gain[v]) / times.step_ms(r, v, r + drafts[v])
        if value > best_value * (1 + 1e-9):  # strictly better: ties stay with fewer drafts
            best, best_value = v, value
    return [min(best, len(c)) for c in confidences]


class Acceptance:
    """The acceptance observed against the confidences of the drafts verified: running sums of
    the drafts accepted and of their confidences (the accepted drafts expected), each weighing
    (1 - 1 / window) less per draft verified after it, from a calibrated prior of `prior`
    drafts. scale = their ratio: the factor the confidences are taken at. A plain step pulls both
    sums back toward the prior (half-way in half_life plain steps), so that after a back-off the
    head is trusted again by degrees and its drafts are verified, and measured, anew."""

    def __init__(self, window: int = 32, prior: float = 2.0, half_life: float = 16.0) -> None:
        self.window, self.prior, self.keep = window, prior, 0.5 ** (1.0 / half_life)
        self.observed = self.expected = prior

    @property
    def scale(self) -> float:
        return self.observed / self.expected if self.expected > 1e-12 else 1.0

    def calibrated(self, confidences: list[float]) -> list[float]:
        """confidences taken at the observed scale (at most 1; still non-increasing)."""
        s = self.scale
        return [min(1.0, c * s) for c in confidences]

    def verified(self, drafts: int, expected: float, accepted: int) -> None:
        """A step verified `drafts` drafts whose confidences add up to `expected`, and
        `accepted` of them were accepted."""
        decay = (1.0 - 1.0 / self.window) ** drafts
        self.observed = decay * self.observed + accepted
        self.expected = decay * self.expected + expected

    def plain_step(self) -> None:
        k = self.keep
        self.observed = k * self.observed + (1 - k) * self.prior
        self.expected = k * self.expected + (1 - k) * self.prior


@dataclass
class Backoff:
    """Plain steps before the next probe: after an episode of drafting that did not pay,
    `length` doubles (from 2, at most cap) and that many steps stay plain; after one that paid,
    none."""

    cap: int = 64
    length: int = 0
    left: int = 0  # plain steps still to run before the next probe

    def failed(self) -> None:
        self.length = min(self.cap, max(2, 2 * self.length))
        self.left = self.length

    def paid(self) -> None:
        self.length = self.left = 0

    def waits(self) -> bool:
        """Whether the next step stays plain (counted as one of the back-off's)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False


@dataclass
class Episode:
    """Drafting steps since a probe: the tokens they emitted, and the tokens plain steps would
    have emitted in their time on the curve (requests x step ms / plain step ms) and in their
    wall time (timed: the engine's host work between steps is on no curve; a step with drafts
    is synchronous where a plain one overlaps the device)."""

    tokens: float = 0.0
    plain_tokens: float = 0.0
    timed_steps: int = 0  # steps whose wall time is counted
    wall_plain_tokens: float = 0.0  # tokens plain steps would have emitted in that wall time

    def timed(self, requests: int, wall_ms: float, plain_ms: float) -> None:
        """One of its steps took wall_ms, where a plain step of `requests` requests takes
        plain_ms."""
        self.timed_steps += 1
        self.wall_plain_tokens += requests * wall_ms / plain_ms

    @property
    def losing(self) -> bool:
        """Whether its timed steps emitted fewer tokens than plain steps would have meanwhile
        (after a few, so that one slow step does not decide)."""
        return self.timed_steps >= TIMED_STEPS and self.tokens < self.wall_plain_tokens

    def add(self, times: StepTimes, requests: int, width: int, tokens: int) -> None:
        """A processed drafting step of `requests` requests at `width` (0: a probe) that emitted
        `tokens` tokens."""
        ms = (
            times.probe_ms(requests) if width == 0 else times.step_ms(requests, width, requests * (1 + width))
        )
        self.tokens += tokens
        self.plain_tokens += requests * ms / times.plain_ms(requests)

    @property
    def paid(self) -> bool:
        return self.tokens > self.plain_tokens and not self.losing


TIMED_STEPS = 4  # an episode's wall time decides only once it has this many steps


def measure_curve(
    buckets: list[int], widths: list[int], time_step: Callable[[int, int], tuple[float, float]]
) -> StepTimes:
    """StepTimes from time_step(bucket, width) -> (forward ms, sampler ms), called once per
    (bucket, width)."""
    forward, sampler = {}, {}
    for b in buckets:
        for w in widths:
            forward[(b, w)], sampler[(b, w)] = time_step(b, w)
    return StepTimes(forward, sampler)

"""Confidence scheduling from measured step times: how many drafts a step verifies.

A verification step of R requests padded to 1 + w rows each replays the graph of (bucket >= R,
width w); its time is the forward's plus the sampler's (the draw, acceptance and the drafter's
next block). StepTimes keeps those times, measured once at start-up for every captured graph
through a callable the worker provides (Worker.measure_step_times; tests inject synthetic
curves); width 0 is a plain decoding step (the decode graph). A graph's time depends on the
step's width, not on how many of its rows are real drafts (the others are padding), and is taken
non-decreasing in width. Past the largest bucket a step runs eagerly: a plain one at the largest
plain graph's per-token time; one with drafts is not measured and never chosen (eager
verification steps cost several plain steps: docs/speculative.md).

Each draft j of request b carries its confidence c[b][j], the chance that drafts 0..j are all
accepted (a prefix probability, non-increasing in j). A step that verifies n_b drafts of request
b emits on average E = sum_b (1 + c[b][0] + ... + c[b][n_b - 1]) tokens, in
T = step_ms(R, max_b n_b, R + sum_b n_b) ms. choose_drafts maximises E / T: for each width w and
each count n of verified drafts, the n most confident drafts below position w across the batch
(by rank: prefixes of each request's drafts, as schedule_drafts takes them) give the most
expected tokens among allocations of at most that width and that size, at no more time (T
grows with the width), so the best of these candidates is the best allocation
(tests/test_step_times.py checks it against every allocation). Width 0 (a plain step, no drafts)
is a candidate, and another wins only when it is strictly faster per token: the step never loses
to plain decoding on the curve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


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
    (missing: 0). Every bucket has the same widths 0..K."""

    forward: Mapping[tuple[int, int], float]
    sampler: Mapping[tuple[int, int], float]

    def __post_init__(self) -> None:
        if not self.forward:
            raise ValueError("StepTimes needs at least one measured (bucket, width)")
        if any(not t > 0 for t in self.forward.values()) or any(not t >= 0 for t in self.sampler.values()):
            raise ValueError("StepTimes: forward times must be positive and sampler times non-negative (ms)")

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
        buckets = sorted({b for b, w in self.forward if w == width})
        for b in buckets:
            if b >= requests:
                return max(self._at(b, v) for v in range(width + 1) if (b, v) in self.forward)
        if width > 0:
            return float("inf")
        return self._at(buckets[-1], 0) * tokens / buckets[-1]


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


def choose_drafts(times: StepTimes, confidences: list[list[float]], requests: int | None = None) -> list[int]:
    """How many of its drafts each request verifies, maximising expected tokens per ms
    (module docstring); all zeros when no draft pays (a plain step). confidences[b][j]: draft j
    of request b, non-increasing in j; requests: the requests in the step (default: one per
    row of confidences; more: requests without drafts)."""
    r = len(confidences) if requests is None else requests
    best = [0] * len(confidences)
    best_value = step_value(times, confidences, best, r)  # a plain step
    for w in range(1, times.max_width + 1):
        counts, value = best_at_width(times, confidences, r, w)
        if value > best_value * (1 + 1e-9):  # strictly better: ties stay with fewer drafts
            best, best_value = counts, value
    return best


def best_at_width(
    times: StepTimes, confidences: list[list[float]], requests: int, width: int
) -> tuple[list[int], float]:
    """The allocation of at least one draft, each below position `width`, with the most
    expected tokens per ms, and that value (0 where no request has a draft): for n = 1, 2, ...
    the n most confident such drafts across the batch."""
    r = requests
    counts, gained, widest, n = [0] * len(confidences), 0.0, 0, 0
    best, best_value = list(counts), 0.0
    for c, j, b in ranked(confidences):
        if j >= width:
            continue
        counts[b] = max(counts[b], j + 1)
        gained, widest, n = gained + c, max(widest, j + 1), n + 1
        value = (r + gained) / times.step_ms(r, widest, r + n)
        if value > best_value * (1 + 1e-9):
            best, best_value = list(counts), value
    return best, best_value


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

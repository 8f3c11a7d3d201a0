"""LLM.get_metrics(): the engine's counters as vLLM's metrics reader gives them
(vllm.v1.metrics.reader: Counter, Gauge, Histogram, Vector), with vLLM's names ("vllm:..."), so
that a script that prints or exports them runs unchanged.

Offline, the statistics are those of the finished generate() calls of this LLM: counters sum
over them, histograms hold one sample per request, gauges are read when get_metrics() is called
(between calls no request is running or waiting).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# vLLM's bucket bounds (seconds), so that exported histograms line up with a vLLM server's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class Metric:
    """One metric: its name and labels (vLLM's: model_name, engine, finished_reason, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """count samples summing to `sum`; buckets: upper bound ("0.5", ..., "+Inf") -> the samples
    at or below it (cumulative, as Prometheus)."""

    count: int
    sum: float
    buckets: dict[str, int]


def build_1_2_5_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass
class _Samples:
    bounds: tuple[float, ...]
    values: list[float] = field(default_factory=list)

    def histogram(self, name: str, labels: dict[str, str]) -> Histogram:
        ordered = sorted(self.values)
        buckets = {f"{b:g}": bisect.bisect_right(ordered, b) for b in self.bounds}
        buckets["+Inf"] = len(ordered)
        return Histogram(name, labels, count=len(ordered), sum=float(sum(ordered)), buckets=buckets)


class CallStats:
    """What this LLM's finished generate() calls did, summed (record() after each call)."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.finished: dict[str, int] = {}  # finish_reason -> completions
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.samples = {
            "vllm:time_to_first_token_seconds": _Samples(TTFT_BUCKETS),
            "vllm:e2e_request_latency_seconds": _Samples(LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": _Samples(LATENCY_BUCKETS),
            "vllm:request_prompt_tokens": _Samples(token_buckets),
            "vllm:request_generation_tokens": _Samples(token_buckets),
        }

    def record(self, outputs: Sequence[Any], prefix_caching: bool) -> None:
        """Add a call's RequestOutputs."""
        s = self.samples
        for out in outputs:
            prompt = len(out.prompt_token_ids or [])
            generated = sum(len(c.token_ids) for c in out.outputs)
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            if prefix_caching:
                self.prefix_cache_queries += prompt
                self.prefix_cache_hits += out.num_cached_tokens or 0
            for c in out.outputs:
                reason = c.finish_reason or "abort"
                self.finished[reason] = self.finished.get(reason, 0) + 1
            s["vllm:request_prompt_tokens"].values.append(prompt)
            s["vllm:request_generation_tokens"].values.append(generated)
            m = out.metrics
            if m is None:
                continue
            if m.first_token_time is not None:
                s["vllm:time_to_first_token_seconds"].values.append(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                s["vllm:e2e_request_latency_seconds"].values.append(m.finished_time - m.arrival_time)
            if m.time_in_queue is not None:
                s["vllm:request_queue_time_seconds"].values.append(m.time_in_queue)

    def metrics(
        self, model_name: str, kv_cache_usage: float, num_preemptions: int, spec: tuple[int, int] | None
    ) -> list[Metric]:
        """Every metric, vLLM's names and labels (spec: drafted and accepted tokens, or None)."""
        labels = {"model_name": model_name, "engine": "0"}
        out: list[Metric] = [
            Gauge("vllm:num_requests_running", dict(labels), 0.0),
            Gauge("vllm:num_requests_waiting", dict(labels), 0.0),
            Gauge("vllm:kv_cache_usage_perc", dict(labels), kv_cache_usage),
            Counter("vllm:num_preemptions", dict(labels), num_preemptions),
            Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.generation_tokens),
            Counter("vllm:prefix_cache_queries", dict(labels), self.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", dict(labels), self.prefix_cache_hits),
        ]
        for reason in ("stop", "length", "abort", "error"):
            n = self.finished.get(reason, 0)
            out.append(Counter("vllm:request_success", {**labels, "finished_reason": reason}, n))
        if spec is not None:
            out.append(Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec[0]))
            out.append(Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec[1]))
        out += [samples.histogram(name, dict(labels)) for name, samples in self.samples.items()]
        return out

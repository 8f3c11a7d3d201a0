"""vLLM's `vllm.v1.metrics.reader`: the metric types LLM.get_metrics() returns (deepinfer.metrics)."""

from deepinfer.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]

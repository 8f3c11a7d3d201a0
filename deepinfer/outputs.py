"""vLLM's `vllm.outputs` import path: `from deepinfer.outputs import RequestOutput, CompletionOutput`
(defined in deepinfer.engine.outputs)."""

from __future__ import annotations

from deepinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]

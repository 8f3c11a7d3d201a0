"""vLLM's `vllm.logprobs` import path: `from deepinfer.logprobs import Logprob` (also `deepinfer.Logprob`)."""

from __future__ import annotations

from deepinfer.engine.outputs import Logprob, PositionLogprobs

__all__ = ["Logprob", "PositionLogprobs"]

"""vLLM's `vllm.sampling_params` import path: `from deepinfer.sampling_params import SamplingParams,
StructuredOutputsParams, BeamSearchParams, RequestOutputKind` (defined in deepinfer.engine and
deepinfer.beam_search)."""

from __future__ import annotations

from deepinfer.beam_search import BeamSearchParams
from deepinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.engine.structured import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

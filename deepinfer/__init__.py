"""deepinfer: offline inference for DeepSeek-architecture models on any accelerator with a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]

if TYPE_CHECKING:
    from deepinfer.api import (
        LLM,
        CompletionOutput,
        Logprob,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.inputs import TextPrompt, TokensPrompt


def __getattr__(name: str) -> Any:
    # Lazy, so that `import deepinfer` (the CLI, backend plugins) does not load the engine.
    if name in ("TextPrompt", "TokensPrompt"):
        from deepinfer import inputs

        return getattr(inputs, name)
    if name == "EngineArgs":
        from deepinfer.engine.args import EngineArgs

        return EngineArgs
    if name == "LLMEngine":
        from deepinfer.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in __all__:
        from deepinfer import api

        return getattr(api, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")

"""vLLM's `vllm.engine.arg_utils` import path: EngineArgs (deepinfer.engine.args)."""

from deepinfer.engine.args import EngineArgs

__all__ = ["EngineArgs"]

"""vLLM's import paths under vllm.v1 (deepinfer.v1.metrics.reader)."""

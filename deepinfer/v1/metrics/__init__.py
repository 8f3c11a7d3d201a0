"""vLLM's vllm.v1.metrics (the reader: deepinfer.metrics)."""

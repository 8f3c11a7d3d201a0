"""The offline engine: scheduler, KV-cache manager, worker, sampler, tokenizer, CLI commands."""

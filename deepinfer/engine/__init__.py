"""The offline engine: scheduler, KV-cache manager, model runner, sampler, tokenizer, CLI commands."""

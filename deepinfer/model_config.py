"""`llm.llm_engine.model_config` / `llm.model_config`: what vLLM's ModelConfig tells a script
or an evaluation harness about the model being served (its names; lm-eval reads max_model_len,
scripts read hf_config and the vocabulary size), read-only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import EngineConfig


@dataclass(frozen=True)
class ServedModelConfig:
    """The served model, as vLLM's ModelConfig names it.

    model / tokenizer / served_model_name: the checkpoint directory (and the tokenizer's);
    max_model_len: the resolved context length (the model's max_position_embeddings when not
    given); dtype: the activations' dtype; hf_config: config.json as a transformers
    PretrainedConfig (every key an attribute; None for a model built without a directory's
    config.json); hf_text_config: its text_config where it has one (DeepSeek-V4.1), else itself.
    """

    model: str
    tokenizer: str
    served_model_name: str
    revision: str | None
    max_model_len: int
    dtype: torch.dtype
    seed: int
    max_logprobs: int
    quantization: str | None
    enforce_eager: bool
    generation_config: str
    hf_config: Any = field(repr=False)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    trust_remote_code: bool = False
    engine_config: EngineConfig | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_engine(cls, config: EngineConfig, model_config: Any, max_model_len: int) -> ServedModelConfig:
        """From the engine arguments and the loaded model's config (deepinfer.models.config)."""
        hf_config = None
        path = Path(config.model) / "config.json"
        if path.is_file():
            from transformers import PretrainedConfig

            hf_config = PretrainedConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
        return cls(
            model=config.model,
            tokenizer=config.tokenizer or config.model,
            served_model_name=config.model,
            revision=config.revision,
            max_model_len=max_model_len,
            dtype=config.torch_dtype or model_config.torch_dtype,
            seed=config.seed,
            max_logprobs=config.max_logprobs,
            quantization=config.quantization,
            enforce_eager=config.enforce_eager,
            generation_config=config.generation_config,
            hf_config=hf_config,
            vocab_size=model_config.vocab_size,
            hidden_size=model_config.hidden_size,
            num_hidden_layers=model_config.num_hidden_layers,
            engine_config=config,
        )

    @property
    def hf_text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def max_seq_len_to_capture(self) -> int:
        return self.max_model_len

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        """The decoder layers (vLLM's takes the parallel config for its pipeline share: deepinfer
        has no pipeline parallelism, so every layer)."""
        return self.num_hidden_layers

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling values the model's generation config sets (vLLM's): what
        get_default_sampling_params() takes over SamplingParams()."""
        from deepinfer.engine.requests import default_sampling_params
        from deepinfer.engine.sampling_params import SamplingParams

        config = self.engine_config
        if config is None:
            config = EngineConfig(model=self.model, generation_config=self.generation_config)
        ours, base = default_sampling_params(config), SamplingParams()
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        diff = {n: getattr(ours, n) for n in names if getattr(ours, n) != getattr(base, n)}
        if "max_tokens" in diff:
            diff["max_new_tokens"] = diff.pop("max_tokens")
        return diff

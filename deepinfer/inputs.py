"""vLLM's `vllm.inputs` names for prompts: `from deepinfer.inputs import TokensPrompt, TextPrompt`.

A prompt is a string or one of these dicts; generate() reads "prompt" (text),
"prompt_token_ids" and, for a model with a vision tower, "multi_modal_data" ({"image": a
PIL.Image or a list of them}, one placeholder per image in the prompt: deepinfer.engine.images),
and refuses any other key with a value (vLLM's mm_processor_kwargs, cache_salt, ...).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenised by the engine (with the model's BOS where its tokenizer adds it)."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt of token ids, used as given; `prompt` (optional) is its text for the output."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


PromptType = str | TextPrompt | TokensPrompt

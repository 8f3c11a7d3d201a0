"""vLLM's `vllm.inputs` names for prompts: `from deepinfer.inputs import TokensPrompt, TextPrompt`.

A prompt is a string or one of these dicts; generate() reads "prompt" (text) and
"prompt_token_ids" only, and refuses any other key with a value (vLLM's multi_modal_data,
mm_processor_kwargs, cache_salt, ...: deepinfer serves text prompts).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenised by the engine (with the model's BOS where its tokenizer adds it)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt of token ids, used as given; `prompt` (optional) is its text for the output."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

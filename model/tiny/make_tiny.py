"""Build the RANDOM-weight tiny DeepSeek-V3 checkpoint the test suite runs on (fixed seed).

    python model/tiny/make_tiny.py OUT_DIR

Writes config.json, generation_config.json, model.safetensors (transformers'
DeepseekV3ForCausalLM, float32, about 300 k parameters) and a byte-level BPE tokenizer
(tokenizer.json, tokenizer_config.json with a chat template) trained on the English text below.
The engine's tests build it into a temporary directory (tests/tiny_model.py) so that they never
depend on what model/tiny ships: model/tiny holds the TRAINED model written by
train/train_tiny.py (see model/tiny/README.md). Needs transformers (the `test` extra); the engine
itself does not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 1234
VOCAB_SIZE = 1024
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL = [BOS, EOS, USER, ASSISTANT]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

TEXT = """
The quick brown fox jumps over the lazy dog. A small model can still tell a story, one token at a time.
Once upon a time there was a little engine that served many requests at once. Every step it looked at
the queue, picked the requests that fit in its budget, and ran them together on the device. When the
memory for the cache ran out, it paused the youngest request, freed its blocks, and started it again
later from the beginning, so that nothing was ever lost.
The weather today is sunny with a light breeze from the west. Tomorrow there will be rain in the morning
and clouds in the afternoon. People walk their dogs in the park, children play football on the grass,
and old friends sit on benches talking about books, music, travel and the price of bread.
Numbers are easy to count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Colours are everywhere: red, orange, yellow, green, blue, indigo and violet make the rainbow.
Hello! How are you? I am fine, thank you. What is your name? My name is Deep. Where do you live?
I live in a small house near the river, with a garden full of flowers and a tree full of birds.
Science asks questions about the world: why is the sky blue, how do plants grow, what is inside an atom,
how far away are the stars? Mathematics gives us tools: addition, subtraction, multiplication and division,
fractions and equations, geometry with its circles and triangles, and the patience to prove things.
A computer stores numbers in memory. A program tells it what to do with them. Attention lets a model look
back at every earlier word and decide which ones matter for the next word. Experts in a mixture each learn
a part of the job, and a router chooses a few of them for every token.
The teacher opened the book and read aloud: "In the beginning the world was quiet, and then there was
language." The students wrote down every word, asked questions, and laughed when the cat walked across
the desk. After school they went home, ate dinner with their families, and slept well.
Cooking is simple when you follow the recipe: take two eggs, a cup of flour, a spoon of sugar and a little
milk; mix them well, pour the batter into a hot pan, and wait until it turns golden brown.
The history of the city is long. Merchants came by sea and by road, bringing spices, cloth, silver and
news from far away lands. Kings built walls and towers; farmers grew wheat and grapes; artists painted
the faces of the people they loved.
"""


def train_tokenizer(texts: list[str] | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE with DeepSeek's special tokens (ids 0..3) over `texts` (default: the sample
    text above, four times); train/train_tiny.py trains the shipped model's with it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = [line for line in TEXT.strip().splitlines() if line] * 4
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build(out: Path) -> None:
    """Write the random tiny checkpoint and its tokenizer into `out` (created if missing)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )

    config = DeepseekV3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2048,
        num_nextn_predict_layers=0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config).float().eval()
    # Random routing-correction bias so the sigmoid router's selection path is exercised.
    for layer in model.model.layers[config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.1)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python model/tiny/make_tiny.py OUT_DIR")
    build(Path(sys.argv[1]))
    print(f"wrote the random tiny model to {sys.argv[1]}")

"""DeepSeek-V4 with the lightning indexer's top-k well below the candidate count on long prompts:
index_topk 5 of up to 32 compressed entries (ratio 4, prompts 97-129 tokens, two CSA layers,
one index head, so many rows have fewer than 5 positive scores and their top-k boundary falls
inside a group of exactly tied zeros). Greedy tokens through LLM.generate, whole and chunked,
equal transformers' generate with its top-k tie-stable (transformers_ties), and the
teacher-forced log-probabilities agree to float32 rounding, far inside the top-1 / top-2 margin.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from models_util import build_hf_v4

from deepinfer import LLM, SamplingParams
from deepinfer.testing.checkpoints import tiny_v4_config
from deepinfer.testing.transformers_ties import stable_indexer_topk

pytest.importorskip("transformers")

NEW = 10
LENS = (97, 113, 129)


def test_topk_below_candidates_long_prompts(tmp_path: Path) -> None:
    cfg = tiny_v4_config(
        layer_types=["compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention"],
        index_topk=5, index_n_heads=1, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hf = build_hf_v4(cfg, seed=3)
    hf.save_pretrained(tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, cfg["vocab_size"]) for _ in range(n)] for n in LENS]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=-1)
    for budget in (256, 7):  # whole prefill; chunks that cut compression windows anywhere
        llm = LLM(
            str(tmp_path), backend="reference", dtype="float32", block_size=4, max_model_len=160,
            max_num_batched_tokens=budget, max_logprobs=-1,
        )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            ours = list(o.outputs[0].token_ids)
            ids = torch.tensor([p])
            with torch.no_grad(), stable_indexer_topk():
                gen = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                    do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, len(p) :].tolist()  # fmt: skip
                want = torch.log_softmax(
                    hf(torch.tensor([p + ours[:-1]])).logits[0, len(p) - 1 :].double(), -1
                )
            assert ours == gen, (budget, len(p))
            got = torch.tensor(
                [[lp.logprob for _, lp in sorted(row.items())] for row in o.outputs[0].logprobs],
                dtype=torch.float64,
            )
            err = float((got - want).abs().max())
            top2 = want.topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            assert err <= 1e-4 and margin > 10 * err, (budget, len(p), err, margin)

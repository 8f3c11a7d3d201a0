"""Parity fuzzing for DeepSeek-V4: random valid configs and prompt lengths around every window and
compression boundary, deepinfer's LLM (reference backend, float32) against transformers'
DeepseekV4ForCausalLM on the same random weights, its lightning-indexer top-k made tie-stable
(deepinfer.testing.transformers_ties.stable_indexer_topk: lower entry id wins on exact ties, as
deepinfer's contract states).

One seed gives one case: a config (random_config), up to 8 prompts and three engines over the same
checkpoint: whole prefill, chunked prefill (a step budget of 2 to 12 tokens) and chunked prefill
with preemption (a pool about what the longest request alone needs), each with a random block
size, eager or graph decode, async scheduling on or off. Checked for every prompt and engine,
teacher-forced (transformers runs one forward over the prompt and deepinfer's tokens, so every row
is conditioned on what deepinfer saw):
  - the log-probabilities of the whole vocabulary at every prompt row and every generated row
    (prompt_logprobs=-1, logprobs=-1) within LOGPROB_TOL (1e-4) of transformers' (or, where
    float32 rounding is amplified, as close to transformers in float64 as transformers' float32);
  - each greedy token is transformers' argmax, unless the two are within TIE_TOL (a tie);
and for the longest prompt, transformers' own generate gives deepinfer's tokens (transformers
agrees with itself once its top-k is tie-stable).

    python tests/fuzz_v4.py --seeds 1000-1100        # explore other seeds
    python tests/fuzz_v4.py --replay case.json       # a case printed by a failure, saved to a file

tests/test_fuzz_v4.py runs CI_SEEDS. A divergence prints the case as JSON (config, prompts, engine
arguments) so it can be replayed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models_util import build_hf_v4

from deepinfer.testing.transformers_ties import stable_indexer_topk

CI_SEEDS = range(36)
NEW_TOKENS = (4, 8)  # generated tokens per prompt, inclusive range
MAX_PROMPT = 70
# Log-probabilities agree to float32 rounding through a few layers: over seeds 0-235 the largest
# difference is 4e-5 but for one row (below), most cases 1e-6 to 1e-5; a wrong entry, window row
# or rope angle moves them by 1e-2 or more.
LOGPROB_TOL = 1e-4
# Above LOGPROB_TOL, a row still agrees when float32 rounding explains it: deepinfer within twice
# transformers' own float32 difference from transformers in float64 (and DIFF_FLOOR at least).
# Seen once in seeds 0-235 (seed 158: heads of width 2, weights of std 0.19): deepinfer and
# transformers each 9e-5 from float64, 1.7e-4 apart.
DIFF_FLOOR = 2e-5
# A greedy token that is not transformers' argmax is a tie when the two log-probabilities differ
# by no more than this (both engines' rounding).
TIE_TOL = 1e-4

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@dataclass
class FuzzCase:
    """One config, its prompts and the engines that run them; JSON-serialisable for replay."""

    seed: int
    config: dict[str, Any]  # config.json as written (transformers' or DeepSeek's legacy names)
    prompts: list[list[int]]
    new_tokens: int
    # name -> {"llm": LLM(...) kwargs, "order": prompt indices in submit order,
    #          "prompt_logprobs": whether prompt rows are compared too}
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FuzzCase:
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- generator


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_config(rng: random.Random) -> dict[str, Any]:
    """A tiny DeepSeek-V4 config.json both transformers' DeepseekV4Config and deepinfer accept:
    2-4 layers of any attention type (sliding-window only, CSA, HCA), CSA / HCA ratios 2-16,
    windows 2-16, index_topk from 1 to past the longest prompt's entry count, 1-8 index heads,
    1-4 hyper-connection streams, any o_groups dividing the heads, rotated widths 2-10 of odd or
    even head widths, odd hidden / rank / expert widths, hash-routed MoE at any layers, sigmoid
    or sqrtsoftplus routing, YaRN on the compressed branches. Legacy field names (num_hash_layers,
    qk_rope_head_dim, compress_rate_csa / _hca, compress_ratios) where transformers folds them."""
    n = rng.randint(2, 4)
    heads = rng.choice([1, 2, 3, 4, 6])
    rope_dim = rng.choice([2, 4, 6, 8, 10])
    head_dim = rope_dim + rng.choice([0, 1, 3, 6, 8, 11, 14, 22])
    csa = rng.randint(2, 6)
    hca = rng.choice([r for r in range(2, 17) if r != csa])
    # window 1 is out: transformers' sliding cache keeps rows[-window + 1:], all of them at 1
    window = rng.choice([2, 3, rng.randint(4, 10), rng.randint(11, 16)])
    max_entries = (MAX_PROMPT + NEW_TOKENS[1]) // csa
    topk = rng.choice([1, 2, rng.randint(1, max_entries), rng.randint(max_entries, max_entries + 8)])
    experts = rng.randint(1, 8)
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": rng.randint(128, 256),
        "hidden_size": rng.randint(24, 64),
        "moe_intermediate_size": rng.randint(7, 32),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "q_lora_rank": rng.randint(4, 40),
        "num_experts_per_tok": rng.randint(1, min(3, experts)),
        "n_routed_experts": experts,
        "scoring_func": rng.choice(["sqrtsoftplus", "sigmoid"]),
        "norm_topk_prob": rng.choice([True, False]),  # both always renormalise: V4 ignores it
        "routed_scaling_factor": round(rng.uniform(0.5, 2.5), 3),
        "hc_mult": rng.randint(1, 4),
        "hc_sinkhorn_iters": rng.randint(1, 6),
        "hc_eps": rng.choice([1e-6, 1e-3]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "swiglu_limit": rng.choice([0.3, 1.0, 10.0]),
        "o_groups": rng.choice(_divisors(heads)),
        "o_lora_rank": rng.randint(2, 16),
        "index_n_heads": rng.choice([1, 2, 3, 8]),
        "index_head_dim": rope_dim + rng.randint(0, 9),
        "index_topk": topk,
        "sliding_window": window,
        "rope_theta": rng.choice([10000.0, 500.0, 50.0]),
        "compress_rope_theta": rng.choice([160000.0, 1000.0, 40.0]),
        "max_position_embeddings": 256,
        "num_nextn_predict_layers": rng.choice([0, 1]),
        "tie_word_embeddings": rng.random() < 0.15,
        # wider random weights than transformers' 0.02: distinct logits, indexer scores and
        # router picks, and pre-activations that reach the SwiGLU clamp
        "initializer_range": round(rng.uniform(0.05, 0.2), 3),
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    # layer types: any sequence, at least one compressed layer most of the time
    types = [rng.choice(LAYER_TYPES) for _ in range(n)]
    if all(t == LAYER_TYPES[0] for t in types) and rng.random() < 0.8:
        types[rng.randrange(n)] = rng.choice(LAYER_TYPES[1:])
    if rng.random() < 0.1:  # DeepSeek's per-layer ratios: transformers maps only 0 / 4 / 128
        cfg["compress_ratios"] = [
            {LAYER_TYPES[0]: 0, LAYER_TYPES[1]: 4, LAYER_TYPES[2]: 128}[t] for t in types
        ]
    else:
        cfg["layer_types"] = types
        if rng.random() < 0.2:
            cfg["compress_rate_csa"], cfg["compress_rate_hca"] = csa, hca
        else:
            cfg["compress_rates"] = {LAYER_TYPES[1]: csa, LAYER_TYPES[2]: hca}
    # hash-routed MoE: any layers, or DeepSeek's first num_hash_layers
    if rng.random() < 0.3:
        cfg["num_hash_layers"] = rng.randint(0, n)
    else:
        cfg["mlp_layer_types"] = ["hash_moe" if rng.random() < 0.4 else "moe" for _ in range(n)]
    # the rotated width, as a fraction or (legacy) as qk_rope_head_dim where transformers'
    # int(head_dim * (qk_rope_head_dim / head_dim)) gives it back exactly
    if rng.random() < 0.3 and int(head_dim * (rope_dim / head_dim)) == rope_dim:
        cfg["qk_rope_head_dim"] = rope_dim
    else:
        cfg["partial_rotary_factor"] = rope_dim / head_dim
    if rng.random() < 0.2:  # V4 has one shared expert whatever this says (transformers too)
        cfg["n_shared_experts"] = rng.choice([0, 1, 2])
    if rng.random() < 0.3:  # YaRN on the compressed branches (transformers: attention_factor 1)
        cfg["rope_scaling"] = {
            "type": "yarn",
            "factor": rng.choice([2.0, 4.0, 8.0]),
            "original_max_position_embeddings": rng.choice([16, 32, 64]),
            "beta_fast": 32,
            "beta_slow": 1,
        }
    return cfg


def layer_schedule(cfg: dict[str, Any]) -> tuple[list[str], int, int]:
    """(layer types, CSA ratio, HCA ratio) as transformers reads cfg."""
    if "layer_types" in cfg:
        types = list(cfg["layer_types"])
    else:
        types = [
            {0: LAYER_TYPES[0], 4: LAYER_TYPES[1], 128: LAYER_TYPES[2]}[r] for r in cfg["compress_ratios"]
        ]
    rates = cfg.get("compress_rates") or {}
    csa = cfg.get("compress_rate_csa", rates.get(LAYER_TYPES[1], 4))
    hca = cfg.get("compress_rate_hca", rates.get(LAYER_TYPES[2], 128))
    return types, csa, hca


def boundary_lengths(cfg: dict[str, Any], longest: int) -> list[int]:
    """Prompt lengths 1..longest on a boundary: the window's (W - 1, W, W + 1), each used ratio's
    multiples +-1 (entries closing), and where the CSA entry count crosses index_topk."""
    types, csa, hca = layer_schedule(cfg)
    w = cfg["sliding_window"]
    found = {1, 2, w - 1, w, w + 1}
    for ratio, kind in ((csa, LAYER_TYPES[1]), (hca, LAYER_TYPES[2])):
        if kind in types:
            for k in range(1, longest // ratio + 2):
                found |= {k * ratio - 1, k * ratio, k * ratio + 1}
    if LAYER_TYPES[1] in types:
        k = cfg["index_topk"] * csa
        found |= {k - 1, k, k + 1, k + csa - 1}
    return sorted(x for x in found if 1 <= x <= longest)


def tight_pool(cfg: dict[str, Any], total: int, block_size: int, max_num_seqs: int) -> int:
    """The fewest num_gpu_blocks_override blocks the engine takes for max_model_len `total` and
    with which a request of `total` tokens fits alone (0 when no cache grows: sliding-window
    layers only). A growing group of entries at ratio r gets cdiv(N, r) + max_num_seqs blocks
    (engine/kv_cache.py group_pool_blocks); one request needs cdiv(total // r, block_size)."""
    types, csa, hca = layer_schedule(cfg)
    ratios = {csa for t in types if t == LAYER_TYPES[1]} | {hca for t in types if t == LAYER_TYPES[2]}
    if not ratios:
        return 0
    fewest = -(-total // block_size)
    for r in ratios:
        short = -(-(total // r) // block_size) - max_num_seqs  # blocks beyond the per-slot ones
        fewest = max(fewest, (short - 1) * r + 1 if short > 0 else 1)
    return fewest


def make_case(seed: int) -> FuzzCase:
    """The case of one seed: config, prompts (lengths on boundaries, the longest 40-70) and the
    three engines' arguments."""
    rng = random.Random(seed)
    cfg = random_config(rng)
    longest = rng.randint(40, MAX_PROMPT)
    lengths = boundary_lengths(cfg, longest)
    picked = sorted(set(rng.sample(lengths, min(len(lengths), rng.randint(4, 7)))) | {longest})
    prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(n)] for n in picked]
    rng.shuffle(prompts)
    new_tokens = rng.randint(*NEW_TOKENS)

    def engine(
        budget: int, seqs: int, bs: int, blocks: int, order: list[int], prompt_logprobs: bool
    ) -> dict[str, Any]:
        llm = {
            "max_num_batched_tokens": budget,
            "max_num_seqs": seqs,
            "block_size": bs,
            "num_gpu_blocks_override": blocks,
            "enforce_eager": rng.random() < 0.5,
            "async_scheduling": rng.random() < 0.7,
        }
        return {"llm": llm, "order": order, "prompt_logprobs": prompt_logprobs}

    total = longest + new_tokens
    ample = 4 * len(prompts) * total  # token blocks of size 1 for every request: never short
    bs = rng.choice([2, 4, 8])
    tight = tight_pool(cfg, total, bs, 4)
    shuffled = list(range(len(prompts)))
    rng.shuffle(shuffled)
    longest_first = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
    engines = {
        "whole": engine(max(256, total), len(prompts), rng.choice([2, 4, 8]), ample, shuffled, True),
        "chunked": engine(
            rng.randint(2, 12), rng.randint(2, 4), rng.choice([1, 2, 4]), ample, shuffled, True
        ),
        # a pool about what the longest request alone needs, the longest requests first: they
        # preempt one another. No prompt log-probabilities: prefill steps may replay graphs.
        "preempting": engine(
            rng.randint(8, 40), 4, bs, tight + rng.randint(0, 1) if tight else ample, longest_first, False
        ),
    }
    return FuzzCase(seed, cfg, prompts, new_tokens, engines)


# --------------------------------------------------------------------------- checks


@dataclass
class Divergence:
    engine: str
    prompt: int  # index into case.prompts
    what: str

    def __str__(self) -> str:
        return f"[{self.engine}] prompt {self.prompt}: {self.what}"


@dataclass
class CaseResult:
    case: FuzzCase
    divergences: list[Divergence]
    ties: list[str]
    noise: list[str]  # differences above LOGPROB_TOL that float32 rounding explains
    checks: int  # (prompt, engine) pairs compared
    preemptions: int
    worst: float  # the largest log-probability difference seen
    seconds: float


def _dense(rows: list[dict[int, Any]], vocab: int) -> torch.Tensor:
    """Log-probability dicts (token id -> Logprob) of the whole vocabulary -> (R, V) float64."""
    out = torch.full((len(rows), vocab), float("nan"), dtype=torch.float64)
    for i, row in enumerate(rows):
        ids = torch.tensor(list(row.keys()))
        out[i, ids] = torch.tensor([lp.logprob for lp in row.values()], dtype=torch.float64)
    return out


def _save_checkpoint(case: FuzzCase, root: Path) -> Any:
    """The transformers model of the case, saved to root with the case's own config.json (so
    deepinfer reads the legacy names as written)."""
    # transformers' experts as a plain loop: its grouped_mm path needs 16-byte strides (even widths)
    hf = build_hf_v4({**case.config, "experts_implementation": "eager"}, seed=case.seed)
    hf.save_pretrained(root)
    (root / "config.json").write_text(json.dumps(case.config, indent=1))
    return hf


def run_case(case: FuzzCase, root: Path) -> CaseResult:
    """Build the case's checkpoint under root, run its engines, compare with transformers."""
    from deepinfer import LLM, SamplingParams

    start = time.process_time()
    hf = _save_checkpoint(case, root)
    vocab = case.config["vocab_size"]
    divergences: list[Divergence] = []
    ties: list[str] = []
    noise: list[str] = []
    oracle: dict[tuple[int, ...], torch.Tensor] = {}  # (model, token ids) -> transformers' log-probs

    def theirs(ids: list[int], model: Any = hf) -> torch.Tensor:
        key = (id(model), *ids)
        if key not in oracle:
            with torch.no_grad(), stable_indexer_topk():
                logits = model(torch.tensor([ids])).logits[0]
            oracle[key] = torch.log_softmax(logits.double(), dim=-1)
        return oracle[key]

    exact: list[Any] = []  # transformers in float64, built on the first difference above tolerance

    def float32_noise(ids: list[int], ours: torch.Tensor, rows: slice) -> bool:
        """Whether deepinfer is as close to transformers' float64 result as transformers' own
        float32 is (within twice its difference, DIFF_FLOOR at least): an ill-conditioned row
        (tiny heads, large weights), not a wrong one."""
        if not exact:
            exact.append(copy.deepcopy(hf).double())
        truth = theirs(ids, exact[0])[rows]
        own = float((theirs(ids)[rows] - truth).abs().max())
        return float((ours - truth).abs().max()) <= max(2 * own, DIFF_FLOOR)

    max_len = max(map(len, case.prompts)) + case.new_tokens
    tokens: dict[str, list[list[int]]] = {}
    preemptions = 0
    worst = 0.0
    for name, spec in case.engines.items():
        params = SamplingParams(
            temperature=0, max_tokens=case.new_tokens, ignore_eos=True, logprobs=-1,
            prompt_logprobs=-1 if spec["prompt_logprobs"] else None,
        )  # fmt: skip
        order = spec["order"]
        try:
            llm = LLM(
                str(root), backend="reference", dtype="float32", max_model_len=max_len, max_logprobs=-1,
                **spec["llm"],
            )  # fmt: skip
            submitted = llm.generate(
                [{"prompt_token_ids": case.prompts[k]} for k in order], params, use_tqdm=False
            )
        except Exception as exc:  # refusing the config or crashing is a divergence too
            divergences.append(Divergence(name, -1, f"raised {exc!r}\n{traceback.format_exc()}"))
            continue
        outs = [submitted[order.index(k)] for k in range(len(case.prompts))]
        preemptions += llm.llm_engine.scheduler.num_preemptions
        tokens[name] = []
        for i, (prompt, out) in enumerate(zip(case.prompts, outs)):
            gen = list(out.outputs[0].token_ids)
            tokens[name].append(gen)
            if len(gen) != case.new_tokens:
                divergences.append(Divergence(name, i, f"{len(gen)} tokens, want {case.new_tokens}"))
                continue
            want = theirs(prompt + gen[:-1])  # (L + G - 1, V): row r predicts token r + 1
            rows = list(out.outputs[0].logprobs)
            if spec["prompt_logprobs"]:
                rows = list(out.prompt_logprobs[1:]) + rows
            ours = _dense(rows, vocab)
            diff = (ours - want[len(want) - len(rows) :]).abs()
            err = float(diff.max())
            worst = max(worst, err)
            if not err <= LOGPROB_TOL:  # NaN too: a missing entry
                row = len(want) - len(rows) + int(diff.nan_to_num(math.inf).amax(-1).argmax())
                what = f"log-probabilities differ by {err:.2e} (most at position {row})"
                if float32_noise(prompt + gen[:-1], ours, slice(len(want) - len(rows), None)):
                    noise.append(f"[{name}] prompt {i}: {what}, as close to float64 as transformers'")
                else:
                    divergences.append(Divergence(name, i, what))
            for j, t in enumerate(gen):
                r = len(prompt) - 1 + j
                best = int(want[r].argmax())
                if t == best:
                    continue
                gap = float(want[r, best] - want[r, t])
                note = f"[{name}] prompt {i} token {j}: {t} against transformers' {best}, gap {gap:.1e}"
                if gap <= TIE_TOL:
                    ties.append(note)
                else:
                    divergences.append(Divergence(name, i, note))
    # transformers' own generate (its caches, one token a step) agrees with its forward
    i = max(range(len(case.prompts)), key=lambda k: len(case.prompts[k]))
    ids = torch.tensor([case.prompts[i]])
    with torch.no_grad(), stable_indexer_topk():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=case.new_tokens,
            min_new_tokens=case.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    generated = out[0, ids.shape[1] :].tolist()
    if "whole" in tokens and generated != tokens["whole"][i] and not ties:
        divergences.append(
            Divergence(
                "whole", i, f"transformers' generate gives {generated}, deepinfer {tokens['whole'][i]}"
            )
        )
    checks = len(case.prompts) * len(case.engines)
    seconds = time.process_time() - start
    return CaseResult(case, divergences, ties, noise, checks, preemptions, worst, seconds)


def report(result: CaseResult) -> str:
    """A failure's message: what diverged, then the case as JSON (save it and pass --replay)."""
    lines = [f"seed {result.case.seed}: {len(result.divergences)} divergence(s)"]
    lines += [f"  {d}" for d in result.divergences]
    lines += [f"  prompt {i}: {len(p)} tokens {p}" for i, p in enumerate(result.case.prompts)]
    lines.append("case JSON (python tests/fuzz_v4.py --replay FILE):")
    lines.append(result.case.to_json())
    return "\n".join(lines)


def _seed_range(text: str) -> list[int]:
    """'1000-1100' (inclusive), '7' or '1,5,9-12' -> seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += range(int(lo), int(hi or lo) + 1)
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seeds", type=_seed_range, help="e.g. 1000-1100 or 3,8,20-25 (default: CI's)")
    group.add_argument("--replay", type=Path, help="a case's JSON, as a failure prints it")
    parser.add_argument("--show", action="store_true", help="print each case's config and go on")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = (
        [FuzzCase.from_json(args.replay.read_text())]
        if args.replay
        else [make_case(s) for s in (args.seeds or CI_SEEDS)]
    )
    failed = 0
    for case in cases:
        if args.show:
            print(case.to_json())
        with tempfile.TemporaryDirectory() as tmp:
            result = run_case(case, Path(tmp))
        status = "FAIL" if result.divergences else "ok"
        print(
            f"seed {case.seed}: {status} ({result.checks} prompt-engine checks, {len(result.ties)} ties, "
            f"{len(result.noise)} float32 noise, "
            f"{result.preemptions} preemptions, max |dlogprob| {result.worst:.1e}, {result.seconds:.1f}s)",
            flush=True,
        )
        for t in result.ties:
            print(f"  tie: {t}")
        for t in result.noise:
            print(f"  float32 noise: {t}")
        if result.divergences:
            failed += 1
            print(report(result), flush=True)
    print(f"{len(cases) - failed} of {len(cases)} cases agree")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

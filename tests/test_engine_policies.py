"""Engine policies that change no output but that users and the docs rely on, each pinned
against the rule as stated (docs/policies.md lists them):

- KV block reuse: the least recently freed block is handed out first, a freed sequence's last
  block before its first, so a prefix cache evicts the coldest blocks and a prefix from its tail
  (BlockManager); checked by hand and against a brute-force model of the rule under random load;
- preemption: preempted requests go back to the FRONT of the waiting queue, the
  higher-priority victim first, and resume before requests that never ran (vLLM's behaviour);
- sampling: penalties on the raw logits, then temperature, top-k, top-p over the top-k
  survivors renormalised, min-p relative to the best token: the probabilities and the draws of
  the engine's sampler against a float64 brute force, for several parameter sets;
- the data-parallel gather: outputs in prompt order whichever rank answers first.
"""

from __future__ import annotations

import math
import os
import random
import threading
from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepinfer.backend.registry import get_backend
from deepinfer.engine.kv_cache import BlockManager
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.entrypoints import data_parallel
from deepinfer.entrypoints.data_parallel import DataParallelEngine, balance
from deepinfer.reference import small as ref_small

# --------------------------------------------------------------------------- KV block reuse


def seq(tokens: list[int], rid: str = "r", max_tokens: int = 16) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(temperature=0, max_tokens=max_tokens))


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """s's first n tokens are now in its blocks (what Scheduler.advance records)."""
    s.num_computed_tokens = n
    bm.cache_full_blocks(s)


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    """A fresh pool hands out ids in order; freed blocks queue behind the never-used ones, each
    sequence's last block first; allocation takes the head of that queue (FIFO, not LIFO)."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq([1, 2, 3, 4], "a"), seq([5, 6, 7, 8], "b")
    assert bm.allocate(a, 4) and bm.allocate(b, 4)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free_sequence(a)  # free queue: 4 5 | 1 0
    bm.free_sequence(b)  # free queue: 4 5 1 0 | 3 2
    c = seq(list(range(12)), "c")
    assert bm.allocate(c, 12)
    assert c.block_table == [4, 5, 1, 0, 3, 2]  # LIFO would give [2, 3, 0, 1, 5, 4]


def test_prefix_cache_evicts_the_least_recently_freed_blocks_a_prefix_tail_first() -> None:
    """Two cached prompts, freed a then b: each new block evicts the head of the free queue, a's
    blocks before b's and each prompt's from its last block back, so what survives of a prompt
    is always its leading blocks (LIFO would evict b's first block first)."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    pa, pb = [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]
    a, b = seq(pa, "a"), seq(pb, "b")
    assert bm.allocate(a, 7) and bm.allocate(b, 7)
    assert (a.block_table, b.block_table) == ([0, 1, 2, 3], [4, 5, 6, 7])
    computed(bm, a, 7)  # 3 full blocks cached each; the 4th holds one token
    computed(bm, b, 7)
    bm.free_sequence(a)
    bm.free_sequence(b)

    def cached() -> tuple[list[int], list[int]]:
        return bm.match_prefix(seq(pa)), bm.match_prefix(seq(pb))

    assert cached() == ([0, 1, 2], [4, 5, 6])
    taken, left = [], []
    for i in range(8):
        s = seq([100 + i], f"x{i}")
        assert bm.allocate(s, 1)
        taken.append(s.block_table[0])
        left.append(tuple(map(len, cached())))
    assert taken == [3, 2, 1, 0, 7, 6, 5, 4]
    assert left == [(3, 3), (2, 3), (1, 3), (0, 3), (0, 3), (0, 2), (0, 1), (0, 0)]


class ReuseModel:
    """The stated rule, brute force: every block has the time it was last freed (never-used
    blocks: before any, in id order); a new block is the free one freed longest ago. A cached
    block is known by the whole token prefix it ends (not a hash); its entry goes when the block
    is handed out anew. The first block to hold a prefix keeps the entry."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.freed_at = {b: b - num_blocks for b in range(num_blocks)}  # free blocks only
        self.refs = [0] * num_blocks
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # cached block -> the prefix it ends
        self.clock = 0
        self.evictions = 0  # cached blocks handed out anew

    def match(self, tokens: list[int]) -> list[int]:
        holder = {p: b for b, p in self.prefix_of.items()}
        hits = []
        for i in range((len(tokens) - 1) // self.bs):
            b = holder.get(tuple(tokens[: (i + 1) * self.bs]))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate(self, table: list[int], need: int, prefix: list[int]) -> bool:
        revived = [b for b in prefix if self.refs[b] == 0]
        if need + len(revived) > len(self.freed_at):
            return False
        for b in prefix:
            self.freed_at.pop(b, None)
            self.refs[b] += 1
            table.append(b)
        for _ in range(need):
            b = min(self.freed_at, key=lambda b: self.freed_at[b])
            del self.freed_at[b]
            self.evictions += self.prefix_of.pop(b, None) is not None
            self.refs[b] = 1
            table.append(b)
        return True

    def cache(self, table: list[int], tokens: list[int], num_computed: int) -> None:
        held = set(self.prefix_of.values())
        for i in range(num_computed // self.bs):
            p = tuple(tokens[: (i + 1) * self.bs])
            if table[i] not in self.prefix_of and p not in held:
                self.prefix_of[table[i]] = p
                held.add(p)

    def free(self, table: list[int]) -> None:
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.clock += 1
                self.freed_at[b] = self.clock
        table.clear()


def test_block_reuse_and_prefix_hits_follow_the_rule_under_random_load() -> None:
    """400 random admissions, decode growth and frees (prompts from a few shared stems, so
    prefixes hit, revive freed blocks and get evicted): every block handed out and every prefix
    hit equals the brute-force model's."""
    rng = random.Random(39)
    bs, num_blocks = 4, 24
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=True)
    model = ReuseModel(num_blocks, bs)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: list[tuple[Sequence, list[int]]] = []  # a sequence, the model's block table for it
    table: list[int]
    hits = revived = 0
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 4):
            s, table = live.pop(rng.randrange(len(live)))
            bm.free_sequence(s)
            model.free(table)
        elif live and rng.random() < 0.5:  # a running request decodes a few tokens
            s, table = rng.choice(live)
            n = rng.randint(1, 6)
            s.token_ids.extend(rng.randrange(50) for _ in range(n))
            need = bm.blocks_needed(s, n)
            ok = bm.allocate(s, n)
            assert ok == model.allocate(table, need, [])
            if not ok:
                del s.token_ids[-n:]
                continue
            assert s.block_table == table, f"step {step}: blocks {s.block_table}, the rule gives {table}"
            computed(bm, s, s.num_tokens)
            model.cache(table, s.token_ids, s.num_tokens)
        else:  # a new request, its prefix looked up in the cache
            stem = rng.choice(stems)[: rng.randint(4, 12)]
            s = seq(stem + [rng.randrange(50) for _ in range(rng.randint(1, 9))], f"s{step}")
            prefix = bm.match_prefix(s)
            assert prefix == model.match(s.token_ids), f"step {step}: prefix hits differ"
            hits += bool(prefix)
            revived += sum(1 for b in prefix if model.refs[b] == 0)
            n = s.num_tokens - len(prefix) * bs
            need = bm.blocks_needed(s, n, len(prefix))
            table = []
            ok = bm.allocate(s, n, prefix)
            assert ok == model.allocate(table, need, prefix)
            if not ok:
                continue
            assert s.block_table == table, f"step {step}: blocks {s.block_table}, the rule gives {table}"
            computed(bm, s, s.num_tokens)
            model.cache(table, s.token_ids, s.num_tokens)
            live.append((s, table))
        assert bm.num_free_blocks == len(model.freed_at)
    # the load exercised prefix hits, hits on freed blocks (revived) and evictions
    assert hits > 50 and revived > 10 and model.evictions > 10, (hits, revived, model.evictions)


# --------------------------------------------------------------------------- preemption


def test_preempted_requests_resume_at_the_front_of_the_queue() -> None:
    """Rule (scheduler.py, vLLM): the victim is the running request of lowest priority (still
    prefilling before decoding, then the most recently admitted); each victim goes to the front
    of the waiting queue, so after two victims in one step the higher-priority one (preempted
    last) leads, both ahead of a request that never ran, and they are admitted in that order,
    recomputed from token 0.

    6 blocks of 4 tokens, chunks of at most 8 tokens: step 1 admits a, b, c (2 blocks each) and
    leaves d waiting; in step 2 a's next chunk needs 2 blocks: c is preempted, then b (b's own
    chunk finds none free)."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_tokens_per_request=8)
    a, b, c, d = seq([1] * 24, "a"), seq([2] * 12, "b"), seq([3] * 12, "c"), seq([4] * 4, "d")
    for s in (a, b, c, d):
        sched.add(s)

    def step() -> list[tuple[str, int]]:
        batch = sched.schedule()
        sched.advance(batch)
        return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]

    assert step() == [("a", 8), ("b", 8), ("c", 8)]
    assert [s.request_id for s in sched.waiting] == ["d"]
    assert step() == [("a", 8)]
    assert [s.request_id for s in sched.waiting] == ["b", "c", "d"]  # at the back: d, c, b
    assert (b.num_computed_tokens, c.num_computed_tokens) == (0, 0)
    assert (b.num_preemptions, c.num_preemptions, sched.num_preemptions) == (1, 1, 2)
    sched.finish(a)
    assert step() == [("b", 8), ("c", 8), ("d", 4)]  # the victims first, in priority order


# --------------------------------------------------------------------------- sampling

VOCAB = 24
# (parameters, prompt, output so far): penalties count the prompt (repetition) and the output
SAMPLING_SETS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_k": 8, "top_p": 0.6},
    {"temperature": 0.8, "min_p": 0.1},
    {"temperature": 1.5, "top_p": 0.75, "repetition_penalty": 0.8},
    {"temperature": 0.9, "top_k": 10, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3,
     "frequency_penalty": 0.4, "presence_penalty": 0.2},
    {"temperature": 0.5, "top_k": 12, "top_p": 0.8, "min_p": 0.02, "frequency_penalty": -0.3,
     "presence_penalty": 0.5},
    {"temperature": 2.0, "top_k": 6, "top_p": 0.7, "min_p": 0.3, "frequency_penalty": 0.8},
    {"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 1.0},  # greedy, penalised
]  # fmt: skip
PROMPT, OUTPUT = [3, 5, 5, 8, 13, 21], [1, 3, 3, 3, 8, 17, 0]


def brute_force(
    logits: list[float],
    p: dict[str, Any],
    *,
    top_p_before_renorm: bool = False,
    penalties_after_temperature: bool = False,
    min_p_before_temperature: bool = False,
) -> tuple[list[float], float]:
    """The distribution of one row in float64, from the rule as stated (SamplingParams, the
    sample op), and its smallest distance to a filter's threshold. The keyword flags build a
    variant in another order, to show the cases tell the orders apart."""
    t, k = p.get("temperature", 1.0), p.get("top_k", 0)
    top_p, min_p = p.get("top_p", 1.0), p.get("min_p", 0.0)
    rep, freq, pres = (p.get(n, d) for n, d in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                                ("presence_penalty", 0.0)))  # fmt: skip

    def penalise(x: list[float]) -> list[float]:
        x = list(x)
        for v in set(PROMPT + OUTPUT):
            x[v] = x[v] / rep if x[v] > 0 else x[v] * rep
        for v in set(OUTPUT):
            x[v] -= freq * OUTPUT.count(v) + pres
        return x

    def softmax(x: dict[int, float]) -> dict[int, float]:
        m = max(x.values())
        e = {v: math.exp(z - m) for v, z in x.items()}
        total = sum(e.values())
        return {v: q / total for v, q in e.items()}

    x = list(logits) if penalties_after_temperature else penalise(logits)
    if t == 0:
        best = max(range(VOCAB), key=lambda v: (x[v], -v))
        return [float(v == best) for v in range(VOCAB)], math.inf
    z = [v / t for v in x]
    if penalties_after_temperature:
        z = penalise(z)
    order = sorted(range(VOCAB), key=lambda v: -z[v])
    full = softmax(dict(enumerate(z)))
    kept = order[:k] if 0 < k < VOCAB else order
    q = softmax({v: z[v] for v in kept})  # the top-k survivors, renormalised
    mass = full if top_p_before_renorm else q
    margin, before, by_p = math.inf, 0.0, []
    for v in kept:  # the smallest prefix whose mass reaches top_p
        if top_p < 1.0:
            margin = min(margin, abs(before - top_p))
            if before >= top_p:
                break
        by_p.append(v)
        before += mass[v]
    ratio = softmax(dict(enumerate(x))) if min_p_before_temperature else q
    best = max(ratio[v] for v in kept)
    by_min_p = set()
    for v in kept:
        if min_p > 0:
            margin = min(margin, abs(ratio[v] / best - min_p))
        if ratio[v] >= min_p * best:
            by_min_p.add(v)
    final = softmax({v: z[v] for v in by_p if v in by_min_p})
    return [final.get(v, 0.0) for v in range(VOCAB)], margin


@pytest.fixture(scope="module")
def sampling_rows() -> tuple[torch.Tensor, list[Sequence]]:
    """(S, V) float32 logits, one row per parameter set, and their sequences (seeded)."""
    gen = torch.Generator().manual_seed(40)  # every filter threshold clear by 2e-3 (asserted below)
    logits = torch.randn((len(SAMPLING_SETS), VOCAB), generator=gen)
    seqs = []
    for i, p in enumerate(SAMPLING_SETS):
        s = Sequence(f"r{i}", None, PROMPT, SamplingParams(seed=100 + i, **p), 100 + i)
        s.token_ids.extend(OUTPUT)
        seqs.append(s)
    return logits, seqs


def test_sampling_probabilities_match_a_float64_brute_force(
    sampling_rows: tuple[torch.Tensor, list[Sequence]],
) -> None:
    """The engine's processors (penalties) then the backend's filters: exactly the brute-force
    distribution (to float32 rounding) for every parameter set. Each order variant (top-p over
    the whole distribution instead of the top-k survivors, penalties after temperature, min-p
    before temperature) differs from it somewhere, so the cases pin the order."""
    logits, seqs = sampling_rows
    sampler = Sampler(get_backend("reference"), eos_token_ids=[0])
    processed = logits.clone()
    sampler.process_logits(processed, seqs)
    ps = [s.params for s in seqs]
    got = ref_small.sampling_probs(
        processed,
        torch.tensor([p.temperature for p in ps]),
        torch.tensor([p.top_k for p in ps]),
        torch.tensor([p.top_p for p in ps]),
        torch.tensor([p.min_p for p in ps]),
    ).double()
    orders = ["top_p_before_renorm", "penalties_after_temperature", "min_p_before_temperature"]
    variants = dict.fromkeys(orders, 0.0)
    for r, p in enumerate(SAMPLING_SETS):
        row = logits[r].double().tolist()
        want, margin = brute_force(row, p)
        assert margin > 1e-3, f"set {r} {p}: a filter threshold within {margin:.1e}: pick other logits"
        if p.get("temperature", 1.0) > 0:
            torch.testing.assert_close(got[r], torch.tensor(want, dtype=torch.float64), rtol=0, atol=2e-6,
                                       msg=lambda m, r=r, p=p: f"set {r} {p}: {m}")  # fmt: skip
        for name in variants:
            other, _ = brute_force(row, p, **{name: True})
            variants[name] = max(variants[name], max(abs(a - b) for a, b in zip(other, want)))
    assert all(d > 1e-3 for d in variants.values()), variants  # 500 times the tolerance


def test_sampled_tokens_are_the_exponential_race_over_the_brute_force_distribution(
    sampling_rows: tuple[torch.Tensor, list[Sequence]],
) -> None:
    """Sampler.sample_now (processors, then the reference backend's sample op) over 300 positions
    of each row: every token is argmax(p / noise) with p the float64 brute force and noise the
    request's (seed, position) Exp(1) draws, wherever the race is not within 1e-4 of a tie; the
    greedy row takes the penalised argmax."""
    logits, seqs = sampling_rows
    n = 300
    sampler = Sampler(get_backend("reference"), eos_token_ids=[0])
    rows = torch.repeat_interleave(logits, n, dim=0)
    batch = [s for s in seqs for _ in range(n)]
    offsets = list(range(n)) * len(seqs)
    tokens, _ = sampler.sample_now(rows, batch, offsets)
    seeds = torch.tensor([s.seed for s in batch])
    noise = ref_small.exponential_noise(seeds, torch.tensor(offsets), VOCAB).double()
    for r, p in enumerate(SAMPLING_SETS):
        want = torch.tensor(brute_force(logits[r].double().tolist(), p)[0], dtype=torch.float64)
        race = want / noise[r * n : (r + 1) * n]  # (n, V)
        top2 = race.topk(2, dim=-1).values
        clear = top2[:, 0] > top2[:, 1] * (1 + 1e-4)
        expected = race.argmax(dim=-1)
        drawn = torch.tensor(tokens[r * n : (r + 1) * n])
        assert int(clear.sum()) >= 0.95 * n
        wrong = ((drawn != expected) & clear).nonzero().flatten().tolist()
        assert not wrong, (
            f"set {r} {p}: positions {wrong[:8]} drew {drawn[wrong[:8]].tolist()}, the race over the "
            f"brute-force distribution gives {expected[wrong[:8]].tolist()}"
        )
        if p.get("temperature", 1.0) > 0:
            assert len(set(drawn.tolist())) > 1, f"set {r} {p}: never sampled more than one token"


# --------------------------------------------------------------------------- data parallelism


def test_data_parallel_outputs_come_back_in_prompt_order_whichever_rank_answers_first() -> None:
    """The calling process's gather (DataParallelEngine.generate over two in-process stand-ins
    for worker processes): rank 1 answers first, rank 0 only once rank 1's reply was read;
    outputs still follow the prompts (each rank's share is a set of prompt indices), request
    ids too."""
    prompts: list[Any] = [{"prompt_token_ids": [i] * n} for i, n in enumerate([9, 2, 7, 30, 1, 5])]
    params = [SamplingParams(temperature=0, max_tokens=4) for _ in prompts]
    shares = balance([len(p["prompt_token_ids"]) + 4 for p in prompts], 2)
    assert all(shares) and shares[0] != sorted(shares[0] + shares[1])[: len(shares[0])]  # interleaved

    engine = DataParallelEngine.__new__(DataParallelEngine)
    engine.config = SimpleNamespace(distributed_timeout_s=5.0)  # type: ignore[assignment]
    engine.size, engine.closed, engine.num_preemptions, engine._next_id = 2, None, 0, 0
    engine._seed_rng = random.Random(0)
    rank1_read = threading.Event()
    arrivals: list[int] = []

    def read(w: Any) -> dict[str, Any] | None:
        reply = DataParallelEngine._read(w)
        arrivals.append(w.rank)
        if w.rank == 1:
            rank1_read.set()
        return reply

    engine._read = read  # type: ignore[method-assign]
    fds: list[int] = []
    workers, threads = [], []
    for rank in range(2):
        parent, child = Pipe()
        never, keep = os.pipe()  # a process sentinel that never becomes ready: the worker lives
        fds += [never, keep]
        workers.append(data_parallel._Worker(rank, SimpleNamespace(sentinel=never), parent))  # type: ignore[arg-type]

        def serve(rank: int = rank, conn: Any = child) -> None:
            _, mine, _, _ = conn.recv()
            if rank == 0:
                assert rank1_read.wait(30), "rank 1's reply was never read"
            outputs = [SimpleNamespace(prompt=p, request_id=None) for p in mine]
            conn.send({"outputs": outputs, "num_preemptions": rank})

        threads.append(threading.Thread(target=serve, daemon=True))
    engine._workers = workers
    for t in threads:
        t.start()
    try:
        outputs = engine.generate(prompts, params, use_tqdm=False)
    finally:
        for t in threads:
            t.join(30)
        for fd in fds:
            os.close(fd)
    assert arrivals == [1, 0]
    assert [getattr(o, "prompt", None) for o in outputs] == prompts
    assert [getattr(o, "request_id", None) for o in outputs] == [str(i) for i in range(len(prompts))]
    assert engine.num_preemptions == 1

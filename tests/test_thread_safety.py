"""One LLM called from two threads at once: the calls run one at a time, each gives what it gives
alone, and no request comes back unfinished."""

from __future__ import annotations

import threading

from tiny_model import TINY

from deepinfer import LLM, SamplingParams

ROUNDS = 8  # calls per thread


def calls() -> list[tuple[list[str], list[SamplingParams]]]:
    """Calls of different sizes, greedy and seeded sampling (outputs do not depend on call order)."""
    texts = ["The capital of France is", "Hello", "def fibonacci(n):", "1, 2, 3,", "import os", "Once"]
    out = []
    for c in range(4):
        prompts = texts[c : c + 1 + c]
        params = [
            SamplingParams(temperature=0.0 if (c + i) % 2 else 0.9, seed=100 * c + i, max_tokens=6 + 3 * i)
            for i in range(len(prompts))
        ]
        out.append((prompts, params))
    return out


def outputs(llm: LLM, call: tuple[list[str], list[SamplingParams]]) -> list[tuple[list[int], str | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(*call, use_tqdm=False)]


def test_two_threads_share_one_llm() -> None:
    llm = LLM(str(TINY), backend="reference", dtype="float32", block_size=16, max_model_len=128, seed=3)
    work = calls()
    expected = [outputs(llm, call) for call in work]
    assert all(reason in ("stop", "length") for out in expected for _, reason in out)

    start = threading.Barrier(2)
    results: dict[int, list[tuple[int, list[tuple[list[int], str | None]]]]] = {0: [], 1: []}
    errors: list[str] = []

    def serve(thread: int) -> None:
        try:
            start.wait(timeout=60)
            for r in range(ROUNDS):
                i = (r + thread) % len(work)  # the threads run different calls at the same time
                results[thread].append((i, outputs(llm, work[i])))
        except BaseException as exc:  # reported below: a dead thread must fail the test
            errors.append(f"thread {thread}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 300 s"
    assert not errors, errors
    for thread, done in results.items():
        assert len(done) == ROUNDS, f"thread {thread}"
        for i, got in done:
            assert got == expected[i], f"thread {thread}, call {i}"
    engine = llm.llm_engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

"""Expert-parallel faults over two gloo processes on the CPU: every rank learns of a
failure on any rank and raises an error naming that rank and the cause, within a bounded time,
instead of waiting for torch's 30-minute default timeout.

- A rank whose generate raises and stays alive (the user caught the error), wherever it raises:
  before the call starts, before, in the middle of and after a step's forward, inside its
  experts, in a forward with no tokens. Every rank raises at once; the next call works.
- Ranks that call generate a different number of times: the rank that waits gives up after
  distributed_timeout_s, and the late rank raises as soon as it calls; every later call on
  either rank says that the group is broken, and why.
- A rank that does not reach the next step within distributed_timeout_s: the same.
- A rank whose process exits: the others raise at once, and so does every later call.

The default group keeps torch's default timeout: the bound comes from distributed_timeout_s.
Each case runs under a deadline: a hang fails the test with a message.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.parallel.rank_sync import CALL, STEP, Status
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

WORLD = 2
BOUND_S = 10.0  # distributed_timeout_s of these tests
LIMIT_S = 60.0  # what a failure may take to reach every rank on a slow CI machine
JOIN_S = 600.0  # deadline of one case's processes: sized to catch a hang, not slowness
# rank 0 steps longer than rank 1, which then runs forwards with no tokens
PROMPTS = {
    0: [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 20, 4])],
    1: [[11 + (5 * j) % 100 for j in range(6)]],
}
MAX_TOKENS = {0: 10, 1: 4}
# where rank 1 raises: the call's start, a step's forward (before it, between two MoE layers,
# inside the experts of one, after it), a forward with no tokens
FAULTS = ["start", "before-forward", "mid-forward", "in-experts", "after-forward", "idle"]


def _llm(rank: int, ckpt: str, store: str) -> LLM:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    os.environ["LOCAL_RANK"] = str(rank)
    llm = LLM(
        ckpt, backend="reference", dtype="float32", block_size=8, max_model_len=128,
        enable_expert_parallel=True, distributed_timeout_s=BOUND_S,
    )  # fmt: skip
    dist.barrier()  # the first calls start together, however long each rank took to load
    return llm


def _call(llm: LLM, rank: int) -> dict[str, Any]:
    """One generate call of this rank's requests: tokens, or the error; and when it ended."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[rank]]
    out: dict[str, Any] = {"start": time.time()}
    try:
        done = llm.generate(prompts, params, use_tqdm=False)
        out["tokens"] = [r.outputs[0].token_ids for r in done]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["end"] = time.time()
    return out


def _idle_state(llm: LLM) -> dict[str, Any]:
    engine = llm.llm_engine
    assert engine.expert_parallel is not None
    bm = engine.block_manager
    return {
        "unfinished": engine.has_unfinished(),
        "free_blocks": bm.num_free_blocks == bm.num_blocks,
        "broken": engine.expert_parallel.sync.broken,
    }


def _wait_for(path: Path, limit: float = JOIN_S) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {limit} s")
        time.sleep(0.05)


class Faults:
    """Rank 1's injected faults: arm(point) makes `point` raise RuntimeError once, in the
    current call (at its third step where steps matter)."""

    def __init__(self, llm: LLM) -> None:
        self.point: str | None = None
        self.fired_at: float | None = None
        self.steps = 0
        engine = llm.llm_engine
        worker = engine.worker
        moe_layer = engine.model.layers[2]  # layers 1-3 are MoE: layer 2 runs between exchanges
        self._wrap(engine, "make_sequences", "start", at_step=0)
        self._wrap(engine, "step", "before-forward", count=True)
        self._wrap(moe_layer.self_attn, "forward", "mid-forward")
        self._wrap(engine.backend.moe, "fused_moe", "in-experts")
        self._wrap(worker, "draw", "after-forward")
        self._wrap(worker, "idle", "idle", at_step=0)

    def arm(self, point: str) -> None:
        self.point, self.steps, self.fired_at = point, 0, None

    def _wrap(self, obj: Any, name: str, point: str, count: bool = False, at_step: int = 3) -> None:
        real: Callable[..., Any] = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if count:
                self.steps += 1
            if self.point == point and self.steps >= at_step:
                self.point, self.fired_at = None, time.time()
                raise RuntimeError(f"injected fault: {point}")
            return real(*args, **kwargs)

        setattr(obj, name, wrapper)


def _faults_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        llm = _llm(rank, ckpt, store)
        faults = Faults(llm) if rank == 1 else None
        result["clean"] = _call(llm, rank)
        for point in FAULTS:
            if faults is not None:
                faults.arm(point)
            result[point] = _call(llm, rank)
            if faults is not None:
                result[point]["fired_at"] = faults.fired_at
            result[point]["state"] = _idle_state(llm)
            result[point]["again"] = _call(llm, rank)  # the ranks go on serving
        dist.destroy_process_group()
    except Exception:
        result["worker_error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _calls_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    """Rank 0 calls generate twice; rank 1 once, and again only after rank 0 gave up."""
    result: dict[str, Any] = {}
    gave_up = Path(out_dir, "rank0_gave_up")
    try:
        llm = _llm(rank, ckpt, store)
        result["first"] = _call(llm, rank)
        if rank == 1:
            _wait_for(gave_up)
        result["second"] = _call(llm, rank)
        if rank == 0:
            gave_up.touch()
        result["third"] = _call(llm, rank)  # a broken group says so, at once
        dist.destroy_process_group()
    except Exception:
        result["worker_error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _stall_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    """Rank 1 stalls when it processes sampled tokens the third time (after the MoE exchanges of
    that step: the third, or with async scheduling the fourth) until rank 0 gave up on it."""
    result: dict[str, Any] = {}
    gave_up = Path(out_dir, "rank0_gave_up")
    try:
        llm = _llm(rank, ckpt, store)
        if rank == 1:
            outputs, ep = llm.llm_engine.outputs, llm.llm_engine.expert_parallel
            assert ep is not None
            real = outputs.process
            steps = {"n": 0}

            def stalling(*args: Any, **kwargs: Any) -> Any:
                steps["n"] += 1
                if steps["n"] == 3:
                    result["stalled_at"] = time.time()
                    result["stalled_step"] = ep.sync.steps
                    _wait_for(gave_up)
                    result["resumed_at"] = time.time()
                return real(*args, **kwargs)

            outputs.process = stalling  # type: ignore[method-assign]
        result["first"] = _call(llm, rank)
        if rank == 0:
            gave_up.touch()
        result["second"] = _call(llm, rank)
        dist.destroy_process_group()
    except Exception:
        result["worker_error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _exit_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    """Rank 1's process exits at its third step (killed, crashed)."""
    result: dict[str, Any] = {}
    try:
        llm = _llm(rank, ckpt, store)
        if rank == 1:
            engine = llm.llm_engine
            real = engine.step
            steps = {"n": 0}

            def exiting() -> Any:
                steps["n"] += 1
                if steps["n"] == 3:
                    result["exited_at"] = time.time()
                    Path(out_dir, "rank1.json").write_text(json.dumps(result))
                    os._exit(0)
                return real()

            engine.step = exiting  # type: ignore[method-assign]
        result["first"] = _call(llm, rank)
        result["second"] = _call(llm, rank)
    except Exception:
        result["worker_error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(worker: Callable[..., None], tmp_path: Path) -> dict[int, dict[str, Any]]:
    cfg = tiny_config(
        num_nextn_predict_layers=0, num_hidden_layers=4, hidden_size=128, moe_intermediate_size=128
    )
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=6)
    args = (str(ckpt), str(tmp_path / "store"), str(tmp_path))
    workers = spawn(worker, args=args, nprocs=WORLD, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + JOIN_S
    while not workers.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            done = sorted(p.name for p in tmp_path.glob("rank*.json"))
            pytest.fail(
                f"the expert-parallel ranks hung: not finished within {JOIN_S:.0f} s (results: {done})"
            )
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    for r, res in results.items():
        assert "worker_error" not in res, f"rank {r}:\n{res['worker_error']}"
    return results


def _report(case: str, seconds: dict[str, float]) -> None:
    print(f"\n{case}: " + ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()))


def test_a_rank_that_raises_and_stays_alive_fails_the_call_on_every_rank(tmp_path: Path) -> None:
    results = _run(_faults_worker, tmp_path)
    clean = {r: results[r]["clean"]["tokens"] for r in range(WORLD)}
    assert [len(t) for t in clean[0]] == [MAX_TOKENS[0]] * 3 and [len(t) for t in clean[1]] == [MAX_TOKENS[1]]
    seconds = {}
    for point in FAULTS:
        own, peer = results[1][point], results[0][point]
        assert own.get("error") == f"RuntimeError: injected fault: {point}", point
        prefix = "RuntimeError: generate failed on another expert-parallel rank: rank 1 "
        assert peer.get("error", "").startswith(prefix), (point, peer)
        assert f"injected fault: {point}" in peer["error"], point
        # from the fault on rank 1 to the error on every rank
        fired = own["fired_at"]
        assert fired is not None, point
        took = max(results[r][point]["end"] for r in range(WORLD)) - fired
        assert took < LIMIT_S, (point, took)
        seconds[point] = took
        for r in range(WORLD):
            state = results[r][point]["state"]
            assert state == {"unfinished": False, "free_blocks": True, "broken": None}, (point, r, state)
            assert results[r][point]["again"].get("tokens") == clean[r], (
                point,
                r,
                results[r][point]["again"],
            )
    _report("raise and stay alive: fault -> error on every rank", seconds)


def test_ranks_that_call_generate_a_different_number_of_times(tmp_path: Path) -> None:
    results = _run(_calls_worker, tmp_path)
    for r in range(WORLD):
        assert "tokens" in results[r]["first"], (r, results[r]["first"])
    cause = f"rank 1 did not call generate a 2nd time within distributed_timeout_s={BOUND_S:g} s"
    waited = results[0]["second"]
    assert cause in waited.get("error", ""), waited
    waited_s = waited["end"] - waited["start"]
    assert BOUND_S * 0.5 < waited_s < LIMIT_S, waited_s  # it waited for the bound, no longer
    late = results[1]["second"]  # rank 1's late second call: the same cause, at once
    assert cause in late.get("error", "") and "rank 0 gave up" in late["error"], late
    late_s = late["end"] - late["start"]
    assert late_s < LIMIT_S, late_s
    third_s = {}
    for r in range(WORLD):  # every later call: the group is broken, and why
        third = results[r]["third"]
        assert third.get("error", "").startswith("RuntimeError: the expert-parallel group is broken: "), third
        assert cause in third["error"], third
        third_s[r] = third["end"] - third["start"]
        assert third_s[r] < LIMIT_S
    _report(
        "different numbers of calls",
        {"rank 0 waiting": waited_s, "rank 1 late call": late_s, "later calls": max(third_s.values())},
    )


def test_a_rank_that_does_not_reach_the_next_step_in_time(tmp_path: Path) -> None:
    results = _run(_stall_worker, tmp_path)
    step = results[1]["stalled_step"] + 1
    cause = f"rank 1 did not reach step {step} of generate call 1 within distributed_timeout_s={BOUND_S:g} s"
    waited = results[0]["first"]
    assert cause in waited.get("error", ""), waited
    waited_s = waited["end"] - results[1]["stalled_at"]
    assert waited_s < LIMIT_S, waited_s
    stalled = results[1]["first"]
    assert cause in stalled.get("error", "") and "rank 0 gave up" in stalled["error"], stalled
    resumed_s = stalled["end"] - results[1]["resumed_at"]
    assert resumed_s < LIMIT_S, resumed_s
    for r in range(WORLD):
        again = results[r]["second"]
        assert again.get("error", "").startswith("RuntimeError: the expert-parallel group is broken: "), again
        assert again["end"] - again["start"] < LIMIT_S
    _report(
        "a stalled rank", {"rank 0 after the stall began": waited_s, "rank 1 after it resumed": resumed_s}
    )


def test_a_rank_that_exits(tmp_path: Path) -> None:
    results = _run(_exit_worker, tmp_path)
    first = results[0]["first"]
    assert first.get("error", "").startswith("RuntimeError: the expert-parallel group is broken: "), first
    assert "step 3 of generate call 1" in first["error"], first
    took = first["end"] - results[1]["exited_at"]
    assert took < LIMIT_S, took
    second = results[0]["second"]
    assert second.get("error", "").startswith("RuntimeError: the expert-parallel group is broken: "), second
    assert second["end"] - second["start"] < LIMIT_S
    _report("a rank that exits", {"rank 0 after the exit": took})


def test_status_records_round_trip() -> None:
    long = "é" * 2000  # more than a record holds: cut, never a failed decode
    got = Status.decode(1, Status(1, STEP, 3, 7, True, long).encode())
    assert (got.rank, got.kind, got.call, got.step, got.busy) == (1, STEP, 3, 7, True)
    assert (
        got.error is not None and 400 < len(got.error) < 1000 and long.startswith(got.error.rstrip("\ufffd"))
    )
    ok = Status.decode(0, Status(0, CALL, 1, 0, False, None).encode())
    assert ok.error is None and ok.where() == "the start of generate call 1"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_distributed_timeout_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="distributed_timeout_s must be a positive number"):
        EngineConfig(model="m", distributed_timeout_s=bad)  # type: ignore[arg-type]

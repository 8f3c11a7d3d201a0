"""Expert-parallel load balancing (deepinfer.parallel.eplb).

- The plan against brute force on small cases: the replica counts minimise the highest load per
  replica exactly; the placement's busiest rank is within one replica's load of the best
  placement of any replica counts.
- move_experts over three gloo processes: each rank's rows end up holding the experts the new
  placement names.
- Two gloo ranks serving a tiny DeepSeek-V3 whose router correction bias makes experts 2 and 3
  hot (both held by rank 0 at first): after a rearrangement the busiest rank's share falls below
  a bound computed from the window's counts, each rank's weights are those of the experts its
  slots name, and the greedy tokens equal one process holding every expert (so, the run without
  EPLB too); with rearrangements every few steps, in the middle of generation, as well.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
import traceback
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig, EplbConfig
from deepinfer.parallel.eplb import (
    ExpertMap,
    initial_placement,
    move_experts,
    plan,
    rank_loads,
    replicate,
)
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

RANKS_DEADLINE_S = 300.0  # past this the ranks hang: a collective that never completes fails the test
HOT = [2, 3]  # the experts the router bias makes hot (rank 0 holds both before any rearrangement)
ARGS = {
    "backend": "reference",
    "dtype": "float32",
    "block_size": 8,
    "max_model_len": 128,
    "enforce_eager": True,
}
PROMPTS = {
    0: [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 17, 4])],
    1: [[11 + (5 * j) % 100 for j in range(6)], [7 + (3 * j) % 90 for j in range(12)]],
}
MAX_TOKENS = {0: 8, 1: 6}


# --------------------------------------------------------------------------- the plan


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write total as parts positive integers, in order."""
    if parts == 1:
        return [(total,)]
    return [(i, *rest) for i in range(1, total - parts + 2) for rest in _compositions(total - i, parts - 1)]


def _best_max_rank_load(load: list[int], num_physical: int, world: int) -> Fraction:
    """Brute force: the least busiest-rank load over every replica count and every placement of
    the replicas on world ranks of P / W slots (an expert's load split evenly over its replicas)."""
    cap, best = num_physical // world, None
    for counts in _compositions(num_physical, len(load)):
        replicas = [Fraction(load[e], counts[e]) for e in range(len(load)) for _ in range(counts[e])]
        for ranks in itertools.product(range(world), repeat=len(replicas)):
            if any(ranks.count(r) != cap for r in range(world)):
                continue
            busiest = max(
                sum((w for w, r in zip(replicas, ranks) if r == q), Fraction(0)) for q in range(world)
            )
            best = busiest if best is None or busiest < best else best
    assert best is not None
    return best


def _cases(n: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(load (E,), P, W) with P % W == 0, E >= W, small enough for brute force."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        world = rng.choice([2, 3])
        experts = rng.randint(world, 4)
        physical = experts + rng.randint(0, 2)
        physical += -physical % world
        if physical > 6:
            continue
        out.append(
            (
                [rng.choice([0, 1, 3, 10, 40, 100]) * rng.randint(1, 3) for _ in range(experts)],
                physical,
                world,
            )
        )
    return out


@pytest.mark.parametrize("case", _cases(40, seed=1))
def test_replica_counts_minimise_the_load_per_replica(case: tuple[list[int], int, int]) -> None:
    load, physical, _ = case
    counts = replicate(load, physical)
    assert sum(counts) == physical and min(counts) >= 1
    got = max(Fraction(load[e], counts[e]) for e in range(len(load)))
    best = min(max(Fraction(w, c) for w, c in zip(load, cs)) for cs in _compositions(physical, len(load)))
    assert got == best


@pytest.mark.parametrize("case", _cases(40, seed=2))
def test_placement_within_one_replica_of_the_best(case: tuple[list[int], int, int]) -> None:
    load, physical, world = case
    phys2log = plan(load, physical, world, initial_placement(len(load), physical))
    assert sorted(set(phys2log)) == list(range(len(load)))  # every logical expert has a replica
    counts = [phys2log.count(e) for e in range(len(load))]
    assert counts == replicate(load, physical)
    heaviest = max(Fraction(load[e], counts[e]) for e in range(len(load)))
    busiest = max(rank_loads(load, phys2log, world))
    assert busiest <= _best_max_rank_load(load, physical, world) + heaviest


@pytest.mark.parametrize("case", _cases(20, seed=3))
def test_an_expert_that_stays_on_its_rank_keeps_its_slot(case: tuple[list[int], int, int]) -> None:
    """Slots that keep their expert = the experts a rank holds before and after (a multiset
    intersection): nothing moves within a rank, so fewer weights move."""
    load, physical, world = case
    cap = physical // world
    before = plan(list(reversed(load)), physical, world, initial_placement(len(load), physical))
    after = plan(load, physical, world, before)
    for r in range(world):
        old, new = before[r * cap : (r + 1) * cap], after[r * cap : (r + 1) * cap]
        common = sum(min(old.count(e), new.count(e)) for e in set(old))
        assert sum(a == b for a, b in zip(old, new)) == common


def test_eplb_config_is_checked() -> None:
    assert EplbConfig.from_dict({"num_redundant_experts": 2}).window_size == 1000
    with pytest.raises(ValueError, match="unknown keys \\['window'\\]"):
        EplbConfig.from_dict({"window": 3})
    with pytest.raises(ValueError, match="step_interval must be an integer >= 1"):
        EplbConfig.from_dict({"step_interval": 0})
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        EngineConfig(model="m", enable_eplb=True)
    with pytest.raises(ValueError, match="eplb_config is given but enable_eplb is False"):
        EngineConfig(model="m", enable_expert_parallel=True, eplb_config={"window_size": 5})
    assert EngineConfig(model="m").eplb is None


def test_physical_ids_spread_a_replicated_expert_by_the_token_alone() -> None:
    """Each pair goes to a replica of its own expert; which one depends on the token's routing
    weight only (the same for the token alone and within a batch), and both replicas serve."""
    m = ExpertMap(4, 6)
    m.set_placement([0, 1, 2, 3, 0, 0])  # expert 0 on slots 0, 4, 5
    g = torch.Generator().manual_seed(0)
    weights = torch.rand((64, 2), generator=g)
    ids = torch.stack([torch.zeros(64, dtype=torch.int64), torch.randint(1, 4, (64,), generator=g)], dim=1)
    phys = m.physical(weights, ids, record=True)
    assert torch.equal(torch.tensor(m.placement)[phys], ids)
    assert set(phys[:, 0].tolist()) == {0, 4, 5}
    alone = torch.cat([m.physical(weights[i : i + 1], ids[i : i + 1], record=False) for i in range(64)])
    assert torch.equal(alone, phys)
    assert m.counts.tolist() == torch.bincount(phys.reshape(-1), minlength=6).tolist()


# --------------------------------------------------------------------------- moving weights


def _move_worker(rank: int, store: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        world = 3
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from deepinfer.reference.backend import create_reference_backend

        collectives = create_reference_backend().collectives
        rng = random.Random(5)
        old = initial_placement(7, 9)
        rows = []
        for _ in range(3):
            new = [rng.randrange(7) for _ in range(9)]
            new[:7] = rng.sample(range(7), 7)  # every expert somewhere
            rng.shuffle(new)
            cap = 3
            # expert e's rows: float32 (2, 3) filled with e, and bytes (5,) filled with e
            mine = old[rank * cap : (rank + 1) * cap]
            a = torch.tensor(mine, dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 3).contiguous()
            b = torch.tensor(mine, dtype=torch.uint8).view(-1, 1).expand(-1, 5).contiguous()
            move_experts(collectives, [a, b], old, new, rank, world)
            rows.append({"new": new[rank * cap : (rank + 1) * cap], "a": a[:, 0, 0].tolist(),
                         "a_all": bool((a == a[:, :1, :1]).all()), "b": b[:, 0].tolist(),
                         "b_all": bool((b == b[:, :1]).all())})  # fmt: skip
            old = new
        result["rows"] = rows
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _spawn(fn: Any, args: tuple[Any, ...], nprocs: int, tmp_path: Path) -> dict[int, dict[str, Any]]:
    workers = spawn(fn, args=args, nprocs=nprocs, join=False)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + RANKS_DEADLINE_S
    while not workers.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the ranks did not finish within {RANKS_DEADLINE_S:.0f} s")
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)}
    for r, res in results.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def test_move_experts_over_three_ranks(tmp_path: Path) -> None:
    results = _spawn(_move_worker, (str(tmp_path / "store"), str(tmp_path)), 3, tmp_path)
    for r, res in results.items():
        for step in res["rows"]:
            assert step["a"] == step["new"] and step["b"] == step["new"], (r, step)
            assert step["a_all"] and step["b_all"]


# --------------------------------------------------------------------------- two ranks serving


def _skew(llm: LLM) -> list[Any]:
    """Make experts HOT win most selections: +0.5 on their correction bias. -> the MoE layers."""
    from deepinfer.models.moe import MoE

    layers = [m for m in llm.llm_engine.model.modules() if isinstance(m, MoE)]
    for moe in layers:
        moe.e_score_correction_bias[HOT] += 0.5
    return layers


def _tokens(llm: LLM, rank: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[rank]]
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


def _serve_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        os.environ["LOCAL_RANK"] = str(rank)
        # 1. one rearrangement, between two calls (step_interval beyond them)
        eplb = {"num_redundant_experts": 2, "step_interval": 10**6}
        llm = LLM(ckpt, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb, **ARGS)
        layers = _skew(llm)
        engine = llm.llm_engine
        balancer, collectives = engine.expert_balancer, engine.backend.collectives
        assert balancer is not None and len(balancer.layers) == len(layers)
        result["held"] = [m.held for m in layers]
        result["first"] = _tokens(llm, rank)
        balancer.step(collectives)  # the last step's counts into the window
        result["share_before"] = balancer.busiest_share(collectives)
        result["load"] = collectives.all_reduce(balancer.window.sum(dim=0)).tolist()  # (L, E)
        balancer.rearrange(collectives)
        result["placement"] = [m.eplb.placement for m in layers]
        result["second"] = _tokens(llm, rank)
        balancer.step(collectives)
        result["share_after"] = balancer.busiest_share(collectives)
        torch.save([m.w13.clone() for m in layers], Path(out_dir, f"w13_rank{rank}.pt"))
        # 2. rearrangements every 3 steps, during generation
        eplb = {"num_redundant_experts": 2, "step_interval": 3, "window_size": 2}
        llm2 = LLM(ckpt, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb, **ARGS)
        _skew(llm2)
        result["often"] = _tokens(llm2, rank)
        b2 = llm2.llm_engine.expert_balancer
        assert b2 is not None
        result["rearrangements"], result["moved"] = b2.rearrangements, b2.moved
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def test_eplb_lowers_the_busiest_share_and_keeps_the_tokens(tmp_path: Path) -> None:
    cfg = tiny_config(num_nextn_predict_layers=0, num_hidden_layers=3)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=6)
    results = _spawn(_serve_worker, (str(ckpt), str(tmp_path / "store"), str(tmp_path)), 2, tmp_path)

    single = LLM(str(ckpt), **ARGS)
    moes = _skew(single)
    for r in range(2):
        expected = _tokens(single, r)
        assert results[r]["first"] == expected, f"rank {r}"
        assert results[r]["second"] == expected, f"rank {r} after the rearrangement"
        assert results[r]["often"] == expected, f"rank {r}, rearranging every 3 steps"
    # rank 0 holds slots 0..4 = experts 0..4, rank 1 slots 5..9 = experts 5, 6, 7, 0, 1
    assert results[0]["held"] == [[0, 1, 2, 3, 4]] * 2 and results[1]["held"] == [[5, 6, 7, 0, 1]] * 2
    assert results[0]["rearrangements"] >= 2 and results[0]["moved"] + results[1]["moved"] > 0

    # the share falls, below halfway from where it was to what the plan predicts from the window
    loads, placements = results[0]["load"], results[0]["placement"]
    hot_pairs = sum(load[e] for load in loads for e in HOT)
    assert hot_pairs > 0.5 * sum(map(sum, loads)), "the bias did not make HOT hot"
    predicted = sum(float(max(rank_loads(ld, p, 2))) for ld, p in zip(loads, placements)) / sum(
        map(sum, loads)
    )
    before, after = results[0]["share_before"], results[0]["share_after"]
    assert before > 0.7 and predicted < before - 0.1, (before, predicted)
    assert after < (before + predicted) / 2, (before, predicted, after)
    assert results[1]["share_after"] == after

    # each rank's slots hold the weights of the experts the placement names
    for r in range(2):
        w13 = torch.load(tmp_path / f"w13_rank{r}.pt")
        for layer, (moe, placement) in enumerate(zip(moes, placements)):
            for i, e in enumerate(placement[r * 5 : (r + 1) * 5]):
                assert torch.equal(w13[layer][i], moe.w13[e]), (r, layer, i, e)


def test_random_weights_seeded_by_name_do_not_depend_on_the_order() -> None:
    """bench/bench_ep.py compares two expert-parallel ranks with one process on random weights:
    with by_name each tensor's values depend on its name alone, not on what was drawn before (a
    rank draws only its experts), and the default source keeps its one stream."""
    from deepinfer.testing.weights import BENCH_INIT, RandomSource

    names = [f"model.layers.1.mlp.experts.{e}.gate_proj" for e in range(3)]
    one, other = RandomSource(BENCH_INIT, 4, by_name=True), RandomSource(BENCH_INIT, 4, by_name=True)
    whole = [one.linear(n, (8, 4), torch.float32)[0] for n in names]
    assert torch.equal(other.linear(names[2], (8, 4), torch.float32)[0], whole[2])
    assert not torch.equal(whole[0], whole[1])
    stream = RandomSource(BENCH_INIT, 4)
    first = stream.linear(names[0], (8, 4), torch.float32)[0]
    assert not torch.equal(stream.linear(names[0], (8, 4), torch.float32)[0], first)


def _v4_worker(rank: int, ckpt: str, store: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        os.environ["LOCAL_RANK"] = str(rank)
        eplb = {"num_redundant_experts": 1, "step_interval": 3, "window_size": 2}
        llm = LLM(ckpt, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb, **V4_ARGS)
        result["tokens"] = _tokens(llm, rank)
        balancer = llm.llm_engine.expert_balancer
        assert balancer is not None
        result["layers"], result["moved"] = len(balancer.layers), balancer.moved
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


V4_ARGS = {**ARGS, "block_size": 4, "max_model_len": 64}


def test_eplb_on_v4_moves_mxfp4_experts_and_keeps_the_tokens(tmp_path: Path) -> None:
    """DeepSeek-V4 in its published format (FP8 linears, MXFP4 routed experts and their scales
    moving between ranks), a hash-routed layer and top-k-routed ones; 5 experts + 1 redundant
    slot over 2 ranks, rearranged every 3 steps: the greedy tokens of one process."""
    from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint

    cfg = tiny_v4_config(n_routed_experts=5)
    ckpt = write_random_v4_checkpoint(tmp_path / "ckpt", cfg, seed=3, quantized=True, mtp=False)
    results = _spawn(_v4_worker, (str(ckpt), str(tmp_path / "store"), str(tmp_path)), 2, tmp_path)
    single = LLM(str(ckpt), **V4_ARGS)
    for r in range(2):
        assert results[r]["tokens"] == _tokens(single, r), f"rank {r}"
        assert results[r]["layers"] == cfg["num_hidden_layers"]
    assert results[0]["moved"] + results[1]["moved"] > 0

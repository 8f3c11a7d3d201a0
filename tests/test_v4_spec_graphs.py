"""DeepSeek-V4's speculative steps (the MTP head, speculative_config method "mtp") in graphs:
verification steps of 1 + k rows per request and the MTP head's chained drafts replay
verification graphs (chained steps too: each step writes the next one's inputs on the device),
writing 1 + k rows into each request's window ring and compressor / indexer state per position,
the compressed entries closing in the step found on the device.

Oracles: the same engine with enforce_eager=True (every speculative step an eager forward and
the proposer over host-built spans) and plain decoding without drafts; the tokens of all three
are equal, greedy and seeded, on tiny random V4 checkpoints: sliding-window, CSA and HCA layers
at several windows and compression ratios, k = 1..3, batches that fill a graph bucket or pad
one, prompts shorter and longer than the window and crossing compression boundaries,
generations that end at max_model_len = max_position_embeddings (padding drafts past the rope
table's positions), chunked prefill and preemption. Mirrored checkpoints (an MTP layer that
mostly drafts what the model samples) make accepted drafts common, random ones rejected ones.

That the graph path is taken: the verification graphs replayed, by (bucket, width) key, chained
steps among them, and every graph replay runs under no_host_reads (deepinfer.testing.
host_reads): the captured functions read no device tensor on the host outside the backend ops,
as CUDA capture needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.backend.ops import RerunGraph
from deepinfer.testing.checkpoints import (
    tiny_v4_config,
    write_mirrored_v4_mtp_checkpoint,
    write_random_v4_checkpoint,
)
from deepinfer.testing.host_reads import no_host_reads


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    return [[2 + (5 * i + 3 * j + seed) % 120 for j in range(n)] for i, n in enumerate(lengths)]


@dataclass(frozen=True)
class Case:
    """A checkpoint kind, its config overrides, engine arguments and the batch's prompt lengths."""

    ckpt: str  # "mirrored": write_mirrored_v4_mtp_checkpoint; "random": write_random_v4_checkpoint
    config: dict[str, Any]
    lengths: list[int]
    max_tokens: int = 20
    engine: dict[str, Any] = field(default_factory=dict)


CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

CASES = {
    # one CSA layer (hash-routed) and an MTP layer of its type; window 8, prompts around it
    "csa-w8": Case(
        "mirrored",
        {"sliding_window": 8, "layer_types": [CSA], "mlp_layer_types": ["hash_moe"]},
        [3, 9, 17, 30],
    ),
    # HCA of ratio 16 and window 5: generations cross entry boundaries at 16, 32, 48
    "hca16-w5": Case(
        "mirrored",
        {"sliding_window": 5, "layer_types": [HCA], "compress_rates": {CSA: 4, HCA: 16}},
        [1, 15, 31],
        max_tokens=24,
    ),
    # CSA of ratio 2 (entries closing at every other position, several per 1 + k rows), window 3
    "csa2-w3": Case(
        "mirrored",
        {"sliding_window": 3, "layer_types": [CSA], "compress_rates": {CSA: 2, HCA: 8}},
        [2, 5, 11, 6, 7],
    ),
    # sliding / CSA / HCA layers, a random (sliding) MTP layer: drafts all but always rejected;
    # six requests padded to the bucket of 8
    "swa-csa-hca": Case("random", {"sliding_window": 6}, [4, 13, 7, 22, 1, 9]),
    # one request (bucket 1), generating up to max_model_len = max_position_embeddings = 48
    "to-the-end": Case(
        "mirrored",
        {"sliding_window": 7, "layer_types": [CSA], "max_position_embeddings": 48},
        [29],
        max_tokens=40,
        engine={"max_model_len": 48},
    ),
    # prefill chunks through step scratch, then graph steps
    "chunked": Case(
        "mirrored",
        {"sliding_window": 8, "layer_types": [HCA]},
        [3, 26, 40],
        engine={"max_num_batched_tokens": 11},
    ),
    # blocks of 2 tokens and entry pools short of what the requests need at once: preemption
    "preempting": Case(
        "mirrored",
        {"sliding_window": 6, "layer_types": [CSA]},
        [5, 14, 21, 30],
        max_tokens=24,
        engine={"block_size": 2, "max_num_batched_tokens": 32, "num_gpu_blocks_override": 48},
    ),
}

_ckpts: dict[str, Path] = {}


def checkpoint(name: str, root: Path) -> Path:
    case = CASES[name]
    if name not in _ckpts:
        path = root / name
        if case.ckpt == "mirrored":
            _ckpts[name] = write_mirrored_v4_mtp_checkpoint(path, seed=5, **case.config)
        else:
            _ckpts[name] = write_random_v4_checkpoint(path, tiny_v4_config(**case.config), seed=3)
    return _ckpts[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("v4_spec_graphs")


def make(ckpt: Path, case: Case, k: int = 0, **kw: Any) -> LLM:
    args: dict[str, Any] = {
        "backend": "reference", "dtype": "float32", "block_size": 4, "max_model_len": 96, "max_num_seqs": 8,
    }  # fmt: skip
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLM(str(ckpt), **{**args, **case.engine, **kw})


def params(case: Case) -> list[SamplingParams | list[SamplingParams]]:
    n = len(case.lengths)
    greedy = SamplingParams(temperature=0, max_tokens=case.max_tokens, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=case.max_tokens, ignore_eos=True)
        for i in range(n)
    ]
    return [greedy, seeded]


def generate(llm: LLM, case: Case) -> list[list[list[int]]]:
    batch = [{"prompt_token_ids": p} for p in prompts(case.lengths)]
    return [
        [list(o.outputs[0].token_ids) for o in llm.generate(batch, p, use_tqdm=False)] for p in params(case)
    ]


class Replays:
    """Every graph replay run under no_host_reads; the verification graphs' launches by
    (bucket, width), and how many were chained (inputs written by the step before)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[tuple[int, int]] = []
        self.chained = 0
        self.replays = 0
        worker = llm.llm_engine.worker
        graphs = worker.verify_graphs
        real_launch, real_verify = graphs.launch, worker.verify_launch

        def launch(bucket: int, width: int, greedy: bool, rows: int) -> Any:
            self.keys.append((bucket, width))
            return real_launch(bucket, width, greedy, rows)

        def verify_launch(batch: Any, *args: Any) -> Any:
            self.chained += batch is None
            return real_verify(batch, *args)

        def replay(graph: RerunGraph) -> None:
            self.replays += 1
            with no_host_reads():
                graph.fn()

        monkeypatch.setattr(graphs, "launch", launch)
        monkeypatch.setattr(worker, "verify_launch", verify_launch)
        monkeypatch.setattr(RerunGraph, "replay", replay)


_plain: dict[str, list[list[list[int]]]] = {}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_graph_steps_equal_eager_and_plain(
    name: str, k: int, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MTP steps in graphs: the tokens of MTP steps run eagerly and of plain decoding, greedy
    and seeded; verification graphs of width k replayed (chained ones too), with no host read
    of a device tensor in any replay; every block returned."""
    case = CASES[name]
    ckpt = checkpoint(name, root)
    if name not in _plain:
        _plain[name] = generate(make(ckpt, case), case)
    eager = make(ckpt, case, k, enforce_eager=True)
    want = generate(eager, case)
    assert eager.llm_engine.speculative is not None and eager.llm_engine.speculative.num_graph_steps == 0
    assert want == _plain[name]

    llm = make(ckpt, case, k)
    replays = Replays(llm, monkeypatch)
    got = generate(llm, case)
    assert got == want
    engine = llm.llm_engine
    decoder = engine.speculative
    assert decoder is not None and decoder.num_graph_steps == len(replays.keys) > 0
    widths = {w for _, w in replays.keys}
    assert k in widths and replays.chained > 0, replays.keys
    assert set(replays.keys) <= set(engine.worker.verify_graphs)
    assert replays.replays >= 2 * len(replays.keys)  # the forward and the finish of each step
    if case.ckpt == "mirrored":
        assert 0 < decoder.num_accepted_tokens < decoder.num_draft_tokens
    if name == "preempting":
        assert engine.scheduler.num_preemptions > 0
    if name == "to-the-end":
        assert all(len(p) + len(t) == 48 for p, t in zip(prompts(case.lengths), got[0]))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_padded_buckets_are_replayed(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests replay the bucket of 8 (two padding requests of 1 + k rows each, writing
    no cache row and storing no compressed entry), and as requests finish one by one, smaller
    buckets: eager MTP steps' tokens."""
    case = CASES["swa-csa-hca"]
    ckpt = checkpoint("swa-csa-hca", root)
    batch = [{"prompt_token_ids": p} for p in prompts(case.lengths)]
    staggered = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    llm = make(ckpt, case, 2)
    replays = Replays(llm, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, staggered, use_tqdm=False)]
    eager = make(ckpt, case, 2, enforce_eager=True)
    assert got == [o.outputs[0].token_ids for o in eager.generate(batch, staggered, use_tqdm=False)]
    buckets = {b for b, _ in replays.keys}
    assert 8 in buckets and len(buckets) >= 3, replays.keys


def test_v4_graph_path_rejects_host_reads() -> None:
    """The check itself: a host read in engine code (the eager proposer's .tolist()) is named
    with its line."""
    import torch

    from deepinfer.engine.drafters import _drafts
    from deepinfer.testing.host_reads import HostReadError

    with (
        pytest.raises(HostReadError, match=r"deepinfer/engine/drafters.py:\d+: .tolist\(\)"),
        no_host_reads(),
    ):
        _drafts(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), [1, 2])


def test_bench_spec_step_small_run(tmp_path: Path) -> None:
    """bench/bench_spec_step.py at a CPU size on a tiny V4 config with its MTP layer: a row per
    k and batch whose MTP steps replayed verification graphs, ratio and ceiling from the two
    step costs, the JSON and the table written."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_spec_step

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_v4_config(num_nextn_predict_layers=1)))
    args = f"--random-config {config} --backend reference --dtype float32 --small --num-hidden-layers 3"
    args += " --block-size 4 --k 1 3 --repeats 1"
    rows = bench_spec_step.main(["--out", str(tmp_path / "out"), *args.split()])
    assert [(r["k"], r["batch"]) for r in rows] == [(k, b) for k in (1, 3) for b in (1, 4)]
    for r in rows:
        assert r["plain_step_ms"] > 0 and r["spec_step_ms"] > 0 and 0 < r["graph_steps"] <= 1
        assert r["ratio"] == pytest.approx(r["spec_step_ms"] / r["plain_step_ms"], rel=1e-2)
        assert r["ceiling_speedup"] == pytest.approx((1 + r["k"]) / r["ratio"], rel=1e-2)
        assert r["meets_goal"] == (r["ratio"] <= 1.3)
    assert json.loads((tmp_path / "out" / "spec_step.json").read_text()) == rows
    assert (tmp_path / "out" / "spec_step.md").read_text().count("\n| 4 |") == 2

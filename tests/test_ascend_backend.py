"""The ascend backend itself: probe, path choice, NPU graphs with in-graph length updates.

Runs on the torch_npu simulation, installed only while a test that needs it runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.npu_sim` under plain `pytest` too

from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import BackendRegistry
from deepinfer.backend.types import AttentionMetadata, KVCacheSpec
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import v4 as ref_v4
from deepinfer.testing.helpers import (
    make_paged_batch,
    mxfp4_weight,
    oracle,
    randn,
    random_block_tables,
    slots_of,
)
from deepinfer.testing.tolerances import assert_close
from tests.npu_sim import install, uninstall
from tests.npu_sim import torch_npu_sim as tnpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sim() -> Iterator[None]:
    install(soc_version=220)
    yield
    uninstall()


@pytest.fixture
def backend(sim: None) -> Backend:
    return BackendRegistry.discover().create("ascend")


# --------------------------------------------------------------------------- probe


def test_registration_does_not_import_torch_npu() -> None:
    code = (
        "import sys; from deepinfer.backend.registry import BackendRegistry; "
        "r = BackendRegistry.discover(); assert 'ascend' in r.names; "
        "assert 'torch_npu' not in sys.modules; print(r.availability('ascend').reason)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu is not installed" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_unavailable_without_torch_npu() -> None:
    avail = BackendRegistry.discover().availability("ascend")
    assert not avail.available and "torch_npu is not installed" in avail.reason


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_cli_lists_ascend_unavailable_with_its_reason() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer", "backends"], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    row = next((line for line in proc.stdout.splitlines() if line.startswith("ascend ")), "")
    assert row.split()[3:4] == ["no"], proc.stdout + proc.stderr
    assert "torch_npu is not installed" in row


def test_probe_reports_cann_not_sourced(monkeypatch: pytest.MonkeyPatch) -> None:
    """import torch_npu raising OSError (libhccl.so missing) is reported, not raised."""
    from deepinfer_ascend import npu

    spec = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "torch_npu" else None)

    def broken(name: str) -> Any:
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    avail = npu.probe()
    assert not avail.available
    assert "libhccl.so" in avail.reason and "ASCEND_HOME_PATH" in avail.reason


def test_available_on_the_simulation(sim: None) -> None:
    avail = BackendRegistry.discover().availability("ascend")
    assert avail.available and "1 NPU(s), torch_npu 2.10.0.post4+sim" in avail.reason


@pytest.mark.parametrize(("soc", "fp8"), [(220, False), (250, False), (260, True)])
def test_fp8_capability_follows_the_soc(soc: int, fp8: bool) -> None:
    install(soc_version=soc)
    try:
        assert BackendRegistry.discover().create("ascend").capabilities.supports_fp8 is fp8
    finally:
        uninstall()


def test_shipped_code_never_imports_the_simulation() -> None:
    for path in [*(ROOT / "backends" / "ascend").rglob("*.py"), *(ROOT / "deepinfer").rglob("*.py")]:
        assert "npu_sim" not in path.read_text(), f"{path} refers to the test double"


# --------------------------------------------------------------------------- attention paths


class Spy:
    """Records the keyword arguments of every FIA call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        real = tnpu.npu_fused_infer_attention_score_v2

        class Wrapped:
            def __call__(_, **kw: Any) -> Any:
                self.calls.append(kw)
                return real(**kw)

            def out(_, **kw: Any) -> Any:
                self.calls.append(kw)
                return real.out(**kw)

        monkeypatch.setattr(tnpu, "npu_fused_infer_attention_score_v2", Wrapped())


def test_deepseek_shapes_take_the_fused_paged_mla_path(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    seq, ql = [40, 3, 70], [9, 1, 17]
    batch = make_paged_batch(backend, seq_lens=seq, query_lens=ql, block_size=16, head_dim=576,
                             dtype=torch.bfloat16, gen=gen, rope_dim=64)  # fmt: skip
    q = randn((sum(ql), 5, 576), torch.bfloat16, "cpu", gen)
    out = backend.attention.prefill(q, batch.cache, batch.meta, scale=576**-0.5, v_dim=512)
    (kw,) = spy.calls
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["block_table"] is not None
    assert kw["num_query_heads"] == 8 and kw["query"].shape == (27, 8, 512)  # 5 heads padded
    assert kw["actual_seq_qlen"] == [9, 10, 27] and kw["actual_seq_kvlen"] == seq
    expected = ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, 576**-0.5, 512)
    assert_close(out, expected, torch.bfloat16)


def test_v4_indexer_takes_the_lightning_indexer(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """V4's shapes (bf16, D 128, block size 16): one npu_lightning_indexer call, a batch entry per
    query row with its visible entries as key length; the same picks as the reference."""
    calls: list[dict[str, Any]] = []
    real = tnpu.npu_lightning_indexer

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(tnpu, "npu_lightning_indexer", spy)
    gen = torch.Generator().manual_seed(3)
    ratio, heads, topk, bs = 4, 8, 6, 16
    seq, ql = [150, 9, 40, 3], [5, 9, 1, 1]
    entries = [n // ratio for n in seq]
    table, nb = random_block_tables(entries, bs, gen)
    keys = backend.kv_cache.allocate(KVCacheSpec(nb, bs, 128, 0, torch.bfloat16), 1)[0]
    for b, n in enumerate(entries):
        if n:
            rows = randn((n, 128), torch.bfloat16, "cpu", gen)
            backend.kv_cache.write_kv(keys, rows, slots_of(table[b], torch.arange(n), bs))
    meta = AttentionMetadata.build(table, seq, ql)
    q = randn((sum(ql), heads, 128), torch.bfloat16, "cpu", gen)
    q[::3] = 0  # rows whose scores all tie: the lowest visible ids
    weights = randn((sum(ql), heads), torch.float32, "cpu", gen)
    got = backend.attention.indexer_topk(q, weights, keys, meta, ratio=ratio, topk=topk, scale=0.1)
    (kw,) = calls
    assert kw["layout_query"] == "TND" and kw["layout_key"] == "PA_BSND" and kw["sparse_count"] == topk
    assert kw["actual_seq_lengths_query"].tolist() == list(range(1, sum(ql) + 1))
    pos = [n - k + i for n, k in zip(seq, ql) for i in range(k)]
    assert kw["actual_seq_lengths_key"].tolist() == [(p + 1) // ratio for p in pos]
    want = ref_v4.indexer_topk(q, weights, keys, meta, ratio, topk, 0.1, backend.kv_cache.read_kv)
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


def test_v4_indexer_other_shapes_run_the_reference(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 or D != 128 is outside the op's limits: the contract's reference definition."""
    monkeypatch.setattr(tnpu, "npu_lightning_indexer", None)  # a call would fail
    gen = torch.Generator().manual_seed(4)
    table, nb = random_block_tables([3], 4, gen)
    keys = backend.kv_cache.allocate(KVCacheSpec(nb, 4, 12, 0, torch.float32), 1)[0]
    backend.kv_cache.write_kv(
        keys, randn((3, 12), torch.float32, "cpu", gen), slots_of(table[0], torch.arange(3), 4)
    )
    meta = AttentionMetadata.build(table, [13], [2])
    q, w = randn((2, 5, 12), torch.float32, "cpu", gen), randn((2, 5), torch.float32, "cpu", gen)
    got = backend.attention.indexer_topk(q, w, keys, meta, ratio=4, topk=2, scale=0.3)
    assert got.shape == (2, 2)


def test_vision_varlen_attention_takes_npu_fusion_attention(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vision tower's attention (16 heads of 64, bf16, images of 5, 0 and 33 patches): one
    npu_fusion_attention call in TND with the non-empty segments' cumulative lengths; the
    result the reference's. D = 40 (not a multiple of 16) runs the reference definition."""
    calls: list[dict[str, Any]] = []
    real = tnpu.npu_fusion_attention

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(kw | {"layout": args[4]})
        return real(*args, **kw)

    monkeypatch.setattr(tnpu, "npu_fusion_attention", spy)
    gen = torch.Generator().manual_seed(5)
    qkv = randn((38, 3, 16, 64), torch.bfloat16, "cpu", gen)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # strided views: the backend makes them contiguous
    cu = torch.tensor([0, 5, 5, 38], dtype=torch.int32)
    got = backend.attention.varlen_attention(q, k, v, cu, 33, scale=0.125)
    (kw,) = calls
    assert kw["layout"] == "TND" and kw["actual_seq_qlen"] == [5, 38] == kw["actual_seq_kvlen"]
    assert kw["sparse_mode"] == 0
    want = ref_attention.varlen_attention(q, k, v, cu, 0.125)
    assert_close(got, oracle(want), torch.bfloat16, what="varlen_attention")
    monkeypatch.setattr(tnpu, "npu_fusion_attention", None)  # a call would fail
    small = randn((7, 2, 40), torch.bfloat16, "cpu", gen)
    out = backend.attention.varlen_attention(
        small, small, small, torch.tensor([0, 7], dtype=torch.int32), 7, scale=0.2
    )
    assert out.shape == (7, 2, 40)


def test_v4_model_index_keys_reach_the_lightning_indexer(
    sim: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random V4 (D 16, Di 128, bf16, blocks of 16) through the engine: the indexer keys' group
    allocates rows Di wide, which npu_lightning_indexer takes as they are ((NB, 16, 1, 128)
    keys); the greedy tokens are those of the same engine with the indexer on the reference."""
    from deepinfer_ascend.attention import AscendAttention

    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint

    root = write_random_v4_checkpoint(
        tmp_path / "v4", tiny_v4_config(index_head_dim=128, index_topk=3, max_position_embeddings=256)
    )
    keys: list[tuple[int, ...]] = []
    real = tnpu.npu_lightning_indexer

    def spy(*args: Any, **kw: Any) -> Any:
        keys.append(tuple(args[1].shape))
        return real(*args, **kw)

    monkeypatch.setattr(tnpu, "npu_lightning_indexer", spy)
    prompt = {"prompt_token_ids": [(7 * i) % 100 + 2 for i in range(60)]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(AscendAttention, "_indexer_fits", staticmethod(lambda *a: False))
        llm = LLM(
            str(root), backend="ascend", dtype="bfloat16", block_size=16, max_model_len=128,
            max_num_batched_tokens=32, max_num_seqs=2, enforce_eager=True,
        )  # fmt: skip
        groups = llm.llm_engine.worker.kv_groups
        assert groups is not None and (groups[-1].name, groups[-1].row_dim) == ("index/4", 128)
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        if fused:
            assert keys and all(k[1:] == (16, 1, 128) for k in keys)
    assert outs[0] == outs[1]


def test_float32_attention_is_refused(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(2)
    batch = make_paged_batch(backend, seq_lens=[5], query_lens=[1], block_size=16, head_dim=576,
                             dtype=torch.float32, gen=gen, rope_dim=64)  # fmt: skip
    with pytest.raises(NotImplementedError, match="bf16/fp16"):
        backend.attention.decode(torch.zeros(1, 2, 576), batch.cache, batch.meta, scale=0.1, v_dim=512)


# --------------------------------------------------------------------------- graphs


def _decode_setup(backend: Backend, gen: torch.Generator) -> tuple[Any, torch.Tensor, list[int]]:
    seq = [18, 41, 6]
    batch = make_paged_batch(backend, seq_lens=seq, query_lens=[1, 1, 1], block_size=16, head_dim=576,
                             dtype=torch.bfloat16, gen=gen, rope_dim=64)  # fmt: skip
    q = randn((3, 4, 576), torch.bfloat16, "cpu", gen)
    return batch, q, seq


def test_graph_replay_updates_sequence_lengths(backend: Backend) -> None:
    """Capture a whole decode step (KV write + attention), then replay it for the next step: the
    inputs, slots and the metadata's device tensors are refreshed in place, and the captured FIA
    task is updated with the new host lengths before replay (graph_task_update_begin / _end)."""
    from deepinfer.backend.types import AttentionMetadata
    from deepinfer.reference import memory as ref_memory

    gen = torch.Generator().manual_seed(3)
    batch, q, seq = _decode_setup(backend, gen)
    meta, table = batch.meta, batch.meta.block_tables

    def slots_at(positions: list[int]) -> torch.Tensor:  # one padding row (-1) at the end
        return torch.tensor([int(table[b, p // 16]) * 16 + p % 16 for b, p in enumerate(positions)] + [-1])

    rows = randn((4, 576), torch.bfloat16, "cpu", gen)
    slots = slots_at([n - 1 for n in seq])  # this step's token is the last cached position
    out = torch.zeros(3, 4, 512, dtype=torch.bfloat16)

    def step() -> None:
        backend.kv_cache.write_kv(batch.cache, rows, slots)
        out.copy_(backend.attention.decode(q, batch.cache, meta, scale=0.05, v_dim=512))

    runner = backend.device.capture_graph(step)
    assert runner is not None
    ref_memory.write_kv(batch.ref_cache, oracle(rows), slots)
    first = out.clone()
    expected = ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, 0.05, 512)
    assert_close(first, expected, torch.bfloat16, what="captured decode")

    # the next step: one more token per request
    rows.copy_(randn((4, 576), torch.bfloat16, "cpu", gen))
    slots.copy_(slots_at(seq))
    q.copy_(randn((3, 4, 576), torch.bfloat16, "cpu", gen))
    meta.seq_lens.add_(1)
    runner.replay()

    ref_memory.write_kv(batch.ref_cache, oracle(rows), slots)
    ref_meta = AttentionMetadata.build(table, [n + 1 for n in seq], [1, 1, 1])
    expected = ref_attention.paged_attention(oracle(q), batch.ref_cache, ref_meta, 0.05, 512)
    assert_close(out, expected, torch.bfloat16, what="replayed decode")
    assert not torch.equal(out, first)
    assert_close(backend.kv_cache.read_kv(batch.cache, slots[:3]), oracle(rows[:3]), torch.bfloat16)


def test_graph_replay_without_update_uses_stale_lengths(backend: Backend) -> None:
    """The simulation bakes host arguments into the graph: skipping the task update reads the old
    lengths (what an NPU does), so a backend that forgot it would fail the test above."""
    gen = torch.Generator().manual_seed(4)
    batch, q, _ = _decode_setup(backend, gen)
    out = torch.zeros(3, 4, 512, dtype=torch.bfloat16)

    def step() -> None:
        out.copy_(backend.attention.decode(q, batch.cache, batch.meta, scale=0.05, v_dim=512))

    runner = backend.device.capture_graph(step)
    assert runner is not None
    before = out.clone()
    runner._tasks.clear()  # type: ignore[attr-defined]  # drop the updates
    batch.meta.seq_lens.add_(1)  # the row at position n is still zero in the cache
    runner.replay()
    assert torch.equal(out, before)


def test_graph_capture_refuses_the_gathered_path(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(5)
    batch = make_paged_batch(backend, seq_lens=[6, 9], query_lens=[1, 1], block_size=4, head_dim=20,
                             dtype=torch.bfloat16, gen=gen, rope_dim=4)  # fmt: skip
    q = randn((2, 3, 20), torch.bfloat16, "cpu", gen)
    with pytest.raises(NotImplementedError, match="graph capture"):
        backend.device.capture_graph(
            lambda: backend.attention.decode(q, batch.cache, batch.meta, scale=0.2, v_dim=16)
        )


# --------------------------------------------------------------------------- MXFP4 experts


def test_mxfp4_experts_dequantise_into_the_grouped_matmul(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No MXFP4 grouped matmul in torch_npu: the experts with rows are dequantised to bf16,
    FP4_EXPERTS_PER_CALL at a time, each batch through one npu_grouped_matmul on its rows."""
    from deepinfer_ascend.gemm import FP4_EXPERTS_PER_CALL

    calls: list[tuple[tuple[int, ...], list[int]]] = []
    real = tnpu.npu_grouped_matmul

    def spy(x: list[torch.Tensor], weight: list[torch.Tensor], **kw: Any) -> Any:
        calls.append((tuple(weight[0].shape), kw["group_list"].tolist()))
        return real(x, weight, **kw)

    monkeypatch.setattr(tnpu, "npu_grouped_matmul", spy)
    gen = torch.Generator().manual_seed(3)
    experts = FP4_EXPERTS_PER_CALL + 4
    sizes = [0 if e % 3 == 1 else 1 + e % 4 for e in range(experts)]  # 13 used, 7 empty
    sizes += [2] * 6  # 19 used: one full batch of 16 and a second of 3
    x = randn((sum(sizes), 64), torch.bfloat16, "cpu", gen)
    packed, scales = mxfp4_weight((len(sizes), 40, 64), "cpu", gen, 0.125)
    y = backend.gemm.grouped_gemm_fp4(x, packed, scales, torch.tensor(sizes))
    used = [n for n in sizes if n]
    assert calls == [
        ((FP4_EXPERTS_PER_CALL, 64, 40), used[:FP4_EXPERTS_PER_CALL]),
        ((len(used) - FP4_EXPERTS_PER_CALL, 64, 40), used[FP4_EXPERTS_PER_CALL:]),
    ]
    expected = ref_gemm.grouped_gemm_fp4(oracle(x), packed, scales, torch.tensor(sizes))
    assert_close(y, expected, torch.bfloat16, what="grouped_gemm_fp4")

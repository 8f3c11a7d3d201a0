"""The torch_npu simulation rejects calls the torch_npu documentation forbids.

Each test starts from a valid call (checked to pass in test_valid_calls_pass) and breaks one
documented constraint; the error must name it. These are the mistakes a backend could make
without noticing on the CPU: the simulation is what makes them fail in CI as on an NPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.npu_sim` under plain `pytest` too

from tests.npu_sim import SimError, install, uninstall
from tests.npu_sim import runtime as npu
from tests.npu_sim import torch_npu_sim as tnpu


@pytest.fixture(scope="module", autouse=True)
def _sim() -> Any:
    """Installed only while this module runs: other tests must not see a fake NPU."""
    install(soc_version=220)
    yield
    uninstall()


T, NB, BS = 5, 4, 16  # tokens, blocks, block size


def mla_call(**over: Any) -> dict[str, Any]:
    """A valid paged MLA decode/prefill call: 2 requests with 2 and 3 query rows (TND)."""
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    latent = torch.randn(NB, 1, BS, 512, generator=g).to(bf)
    rope = torch.randn(NB, 1, BS, 64, generator=g).to(bf)
    kw: dict[str, Any] = dict(
        query=torch.randn(T, 8, 512, generator=g).to(bf),
        key=latent,
        value=latent,
        query_rope=torch.randn(T, 8, 64, generator=g).to(bf),
        key_rope=rope,
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1),
        actual_seq_qlen=[2, 5],  # cumulative
        actual_seq_kvlen=[20, 9],  # per request
        block_table=torch.tensor([[0, 2], [1, 0]], dtype=torch.int32),
        num_query_heads=8,
        num_key_value_heads=1,
        softmax_scale=0.04,
        input_layout="TND",
        sparse_mode=3,
        block_size=BS,
    )
    kw.update(over)
    return kw


def fia(kw: dict[str, Any]) -> Any:
    kw = dict(kw)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    return tnpu.npu_fused_infer_attention_score_v2(q, k, v, **kw)


def routing_args() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1]], dtype=torch.int32)
    return x, ids


def test_valid_calls_pass() -> None:
    out, _ = fia(mla_call())
    assert out.shape == (T, 8, 512) and torch.isfinite(out.float()).all()
    x, ids = routing_args()
    x_sorted, src_to_dst, counts, _ = tnpu.npu_moe_init_routing_v2(
        x, ids, active_num=8, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    assert counts.tolist() == [2, 2, 0, 0] or counts.sum().item() == 8
    y = tnpu.npu_moe_token_unpermute(x_sorted, src_to_dst, probs=torch.full((4, 2), 0.5))
    assert torch.allclose(y, x, atol=1e-6)  # each token's two copies, weighted 0.5 + 0.5


def test_cumulative_query_lengths_in_tnd() -> None:
    """TND: actual_seq_qlen is cumulative; per-request lengths [2, 3] are a misuse."""
    with pytest.raises(SimError, match="cumulative actual_seq_qlen"):
        fia(mla_call(actual_seq_qlen=[2, 3]))


def test_per_request_kv_lengths_in_bsnd() -> None:
    """BSND (non-TND) lengths are per batch entry; cumulative lengths overflow the key's S."""
    q = torch.randn(2, 3, 4, 32).to(torch.bfloat16)
    k = torch.randn(2, 6, 1, 32).to(torch.bfloat16)
    ok = dict(
        input_layout="BSND",
        num_query_heads=4,
        num_key_value_heads=1,
        softmax_scale=0.2,
        actual_seq_qlen=[3, 2],
        actual_seq_kvlen=[6, 4],
        sparse_mode=3,
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1),
    )
    tnpu.npu_fused_infer_attention_score_v2(q, k, k, **ok)
    with pytest.raises(SimError, match="PER-BATCH lengths"):
        tnpu.npu_fused_infer_attention_score_v2(q, k, k, **{**ok, "actual_seq_kvlen": [6, 10]})


def test_mla_heads_must_be_a_power_of_two() -> None:
    """Query D = 512 with query_rope: N in {1, 2, 4, ..., 128}; 5 heads must be padded to 8."""
    kw = mla_call()
    with pytest.raises(SimError, match="power of two"):
        fia(
            mla_call(
                query=kw["query"][:, :5].contiguous(),
                query_rope=kw["query_rope"][:, :5].contiguous(),
                num_query_heads=5,
            )
        )


def test_causal_mask_convention() -> None:
    """sparse_mode 3 takes the 2048x2048 mask with 1 = masked ABOVE the diagonal; a 'keep' mask
    (1 = visible, the opposite convention) is rejected."""
    keep = torch.tril(torch.ones(2048, 2048, dtype=torch.int8))
    with pytest.raises(SimError, match="lower-triangular causal mask"):
        fia(mla_call(atten_mask=keep))
    with pytest.raises(SimError, match=r"shape must be \(2048, 2048\)"):
        fia(mla_call(atten_mask=torch.triu(torch.ones(20, 20, dtype=torch.int8), diagonal=1)))


def test_paged_block_size_limits() -> None:
    """512-wide MLA page attention needs block_size % 16 == 0 (and <= 1024)."""
    kw = mla_call()
    lat = torch.randn(8, 1, 8, 512).to(torch.bfloat16)
    with pytest.raises(SimError, match="multiple of 16"):
        fia(
            mla_call(
                key=lat,
                value=lat,
                key_rope=torch.randn(8, 1, 8, 64).to(torch.bfloat16),
                block_size=8,
                block_table=torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32),
            )
        )
    assert kw["block_size"] == BS


def test_lengths_are_host_lists_not_tensors() -> None:
    """actual_seq_qlen / actual_seq_kvlen are SymInt[] host lists; device tensors are a misuse."""
    with pytest.raises(SimError, match="host int list"):
        fia(mla_call(actual_seq_kvlen=torch.tensor([20, 9])))


def test_query_dtype_float32_rejected() -> None:
    """FIA's query is float16 or bfloat16."""
    kw = mla_call()
    with pytest.raises(SimError, match="float16 or bfloat16"):
        fia(mla_call(query=kw["query"].float()))


def test_non_contiguous_query_rejected() -> None:
    """FIA does not take non-contiguous tensors (不支持非连续的Tensor)."""
    kw = mla_call()
    wide = torch.randn(T, 8, 576).to(torch.bfloat16)
    with pytest.raises(SimError, match="non-contiguous"):
        fia(mla_call(query=wide[..., :512]))
    assert kw["query"].is_contiguous()


def test_learnable_sink_needs_tnd_and_small_value_dim() -> None:
    """learnable_sink: TND / NTD_TND only, value D <= 128."""
    with pytest.raises(SimError, match="learnable_sink"):
        fia(mla_call(learnable_sink=torch.zeros(8, dtype=torch.bfloat16)))


def test_init_routing_expert_ids_are_int32() -> None:
    x, ids = routing_args()
    with pytest.raises(SimError, match="expert_idx dtype must be int32"):
        tnpu.npu_moe_init_routing_v2(x, ids.long(), active_num=8, expert_num=4)


def test_unpermute_rejects_invalid_row_ids() -> None:
    """sorted_indices is a permutation of [0, tokens * topK): no -1 (dropped) or repeated ids."""
    x, ids = routing_args()
    _, src_to_dst, _, _ = tnpu.npu_moe_init_routing_v2(x, ids, active_num=8, expert_num=4)
    bad = src_to_dst.clone()
    bad[3] = bad[2]
    with pytest.raises(SimError, match="no repeated index"):
        tnpu.npu_moe_token_unpermute(x.repeat(2, 1), bad, probs=torch.ones(4, 2))


def test_k_major_row_ids_give_a_wrong_combine() -> None:
    """init_routing_v2's row ids are TOKEN-major (src = t*K + k). A K-major map (src = k*T + t,
    as init_routing v1 / gating_top_k_softmax produce) is a valid permutation, so the op cannot
    reject it: the result is wrong, which the conformance comparison catches."""
    x, ids = routing_args()
    x_sorted, src_to_dst, _, _ = tnpu.npu_moe_init_routing_v2(x, ids, active_num=8, expert_num=4)
    t, k = ids.shape
    k_major = src_to_dst.view(t, k).t().reshape(-1).to(torch.int32)
    probs = torch.tensor([[1.0, 0.0]] * t)
    good = tnpu.npu_moe_token_unpermute(x_sorted, src_to_dst, probs=probs)
    wrong = tnpu.npu_moe_token_unpermute(x_sorted, k_major, probs=probs)
    assert torch.allclose(good, x)
    assert not torch.allclose(wrong, x)


def test_grouped_matmul_requires_group_type() -> None:
    """op-plugin: 'Requires manual passing group_type'."""
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    with pytest.raises(SimError, match="group_type"):
        tnpu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), split_item=2, group_list_type=1)


def test_gating_top_k_group_size_limit() -> None:
    """npu_moe_gating_top_k: experts per group must be > 2."""
    with pytest.raises(SimError, match="quotient > 2"):
        tnpu.npu_moe_gating_top_k(torch.randn(3, 8), 2, k_group=2, group_count=4)


def test_scatter_update_rejects_padding_slots() -> None:
    """npu_scatter_nd_update_ has no 'skip' index: slot -1 must be filtered before the call."""
    cache = torch.zeros(8, 4)
    with pytest.raises(SimError, match="no -1 padding slots"):
        tnpu.npu_scatter_nd_update_(cache, torch.tensor([[1], [-1]]), torch.ones(2, 4))


def test_host_sync_inside_graph_capture() -> None:
    """An NPU graph cannot capture a host sync (.item(), .tolist(), nonzero)."""
    x = torch.arange(4.0)
    g = npu.NPUGraph()
    with pytest.raises(SimError, match="host sync"), npu.graph(g):
        (x > 1).nonzero()


def li_call(**over: Any) -> dict[str, Any]:
    """A valid paged lightning-indexer call: 3 query rows of one request, 20 keys."""
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    kw: dict[str, Any] = dict(
        query=torch.randn(3, 4, 128, generator=g).to(bf),
        key=torch.randn(NB, BS, 1, 128, generator=g).to(bf),
        weights=torch.randn(3, 4, generator=g),
        actual_seq_lengths_query=torch.tensor([3], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([20], dtype=torch.int32),
        block_table=torch.tensor([[2, 0]], dtype=torch.int32),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=8,
        sparse_mode=3,
    )
    kw.update(over)
    return kw


def test_lightning_indexer_valid_call_and_causal_padding() -> None:
    ids, _ = tnpu.npu_lightning_indexer(**li_call())
    assert ids.shape == (3, 1, 8) and ids.dtype == torch.int32
    assert int(ids.max()) < 20 and int(ids[0].min()) >= 0  # row 0 sees keys 0..17


@pytest.mark.parametrize(
    "over,rule",
    [
        ({"query": torch.zeros(3, 4, 64, dtype=torch.bfloat16)}, "must both be 128"),
        ({"query": torch.zeros(3, 4, 128)}, "query: bfloat16/float16"),
        ({"query": torch.zeros(3, 65, 128, dtype=torch.bfloat16)}, "N1 <= 64"),
        ({"key": torch.zeros(NB * 4, 4, 1, 128, dtype=torch.bfloat16)}, "multiple of 16"),
        ({"actual_seq_lengths_query": torch.tensor([2], dtype=torch.int32)}, "CUMULATIVE"),
        ({"actual_seq_lengths_key": [20]}, "int32 tensor"),
        ({"sparse_count": 2049}, "sparse_count"),
        ({"block_table": torch.tensor([[2]], dtype=torch.int32)}, "second dim"),
    ],
)
def test_lightning_indexer_misuse(over: dict[str, Any], rule: str) -> None:
    with pytest.raises(SimError, match=rule):
        tnpu.npu_lightning_indexer(**li_call(**over))


def test_clipped_swiglu_rejects_empty_tensors() -> None:
    with pytest.raises(SimError, match="empty"):
        tnpu.npu_clipped_swiglu(torch.zeros(0, 8), limit=1.0)

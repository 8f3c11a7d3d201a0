"""The contract's defaults go through the backend's own ops (each part knows its Backend): a port
that speeds up grouped_gemm speeds up the default experts, one that fuses rms_norm gets it in
add_rms_norm and write_mla_kv, one that fuses rope gets it in mla_query too. Also: how a Backend
is assembled (parts bound, types checked, the KV ops that moved off DeviceOps refused loudly)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer.backend import (
    AttentionMetadata,
    AttentionModifiers,
    Backend,
    BackendOptions,
    DeviceOps,
    GemmOps,
    KVCacheOps,
    KVCacheSpec,
    MoeOps,
    RouterConfig,
    SmallOps,
)
from deepinfer.backend.fp8 import quantize_weight
from deepinfer.reference.backend import ReferenceDevice, ReferenceGemm, create_reference_backend


def counting(calls: Counter[str], cls: type, *names: str) -> type:
    """A subclass of `cls` whose methods `names` count their calls, then do what cls does."""

    def wrap(name: str) -> Callable[..., Any]:
        base = getattr(cls, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return base(self, *args, **kwargs)

        return method

    return type(f"Counting{cls.__name__}", (cls,), {n: wrap(n) for n in names})


def instrumented() -> tuple[Backend, Counter[str]]:
    calls: Counter[str] = Counter()
    opts = BackendOptions()
    ref = create_reference_backend(opts)
    backend = dataclasses.replace(
        ref,
        gemm=counting(calls, ReferenceGemm, "linear", "grouped_gemm", "quantize_fp8", "fp8_gemm")(opts),
        small=counting(calls, SmallOps, "rms_norm", "rope", "silu_and_mul")(opts),
        kv_cache=counting(calls, KVCacheOps, "write_kv")(opts),
    )
    return backend, calls


def test_experts_go_through_the_backends_grouped_gemm_and_silu() -> None:
    backend, calls = instrumented()
    x = torch.randn(7, 16)
    w13, w2 = torch.randn(3, 2 * 8, 16), torch.randn(3, 16, 8)
    backend.moe.experts(x, torch.tensor([3, 0, 4]), w13, w2)
    assert calls["grouped_gemm"] == 2 and calls["silu_and_mul"] == 1
    assert calls["linear"] == 4, "the default grouped_gemm runs this backend's linear per non-empty group"
    calls.clear()
    ids = torch.tensor([[0, 2], [1, 2], [0, 1]], dtype=torch.int32)
    backend.moe.fused_moe(torch.randn(3, 16), torch.rand(3, 2), ids, w13, w2)
    assert calls["grouped_gemm"] == 2 and calls["silu_and_mul"] == 1


def test_select_experts_is_the_backends_router_logits_then_route() -> None:
    """The default whole router: this backend's router_logits, then its route, on those logits."""
    calls: Counter[str] = Counter()
    opts = BackendOptions()
    backend = dataclasses.replace(
        create_reference_backend(opts), moe=counting(calls, MoeOps, "router_logits", "route")(opts)
    )
    x, gate = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(12, 16)
    config = RouterConfig("sigmoid", top_k=3, num_groups=4, topk_groups=2, group_score="top2_sum")
    bias = torch.randn(12)
    weights, ids = backend.moe.select_experts(x, gate, config, bias)
    assert (calls["router_logits"], calls["route"]) == (1, 1)
    want_w, want_ids = backend.moe.route(backend.moe.router_logits(x, gate), config, bias)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_fp8_defaults_go_through_quantize_and_fp8_gemm() -> None:
    backend, calls = instrumented()
    w = torch.stack([quantize_weight(torch.randn(128, 256))[0] for _ in range(2)])
    s = torch.stack([quantize_weight(torch.randn(128, 256))[1] for _ in range(2)])
    backend.gemm.grouped_gemm_fp8(torch.randn(5, 256), w, s, torch.tensor([2, 3]))
    assert calls["quantize_fp8"] == 1 and calls["fp8_gemm"] == 2
    calls.clear()
    backend.gemm.linear_fp8(torch.randn(5, 256), w[0], s[0])
    assert calls["quantize_fp8"] == 1 and calls["fp8_gemm"] == 1


def test_fp4_default_dequantises_each_used_expert_into_linear() -> None:
    """grouped_gemm_fp4's default: one linear per non-empty group, on weights dequantised to the
    activation dtype (exact), so it equals the reference's float32 product."""
    from deepinfer.backend import fp4
    from deepinfer.reference.gemm import grouped_gemm_fp4

    backend, calls = instrumented()
    packed, scales = fp4.quantize_weight(torch.randn(3, 24, 64))
    x, sizes = torch.randn(6, 64), torch.tensor([2, 0, 4])
    y = backend.gemm.grouped_gemm_fp4(x, packed, scales, sizes)
    assert calls["linear"] == 2
    torch.testing.assert_close(y, grouped_gemm_fp4(x, packed, scales, sizes))


def test_norm_and_kv_defaults_go_through_the_backends_small_ops() -> None:
    backend, calls = instrumented()
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    y, h = backend.small.add_rms_norm(x, r, w, 1e-6)
    assert calls["rms_norm"] == 1
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, backend.small.rms_norm(x + r, w, 1e-6))
    calls.clear()
    cache = backend.kv_cache.allocate(KVCacheSpec(2, 4, 8, 4, torch.float32), 1)[0]
    table = torch.cat([torch.ones(16, 2), torch.zeros(16, 2)], dim=-1)  # cos 1, sin 0
    backend.kv_cache.write_mla_kv(
        cache, torch.randn(3, 12), torch.ones(8), 1e-6, torch.tensor([0, 1, 2]), table, True,
        torch.tensor([0, 5, -1]),
    )  # fmt: skip
    assert (calls["rms_norm"], calls["rope"], calls["write_kv"]) == (1, 1, 1)


def test_mla_query_default_goes_through_batched_linear_and_rope() -> None:
    """[q_nope @ w_uk^T per head | rope(q_pe)] from this backend's batched_linear and rope, on
    strided slices of one projection output (cos 1, sin 0: rope is the identity here)."""
    calls: Counter[str] = Counter()
    opts = BackendOptions()
    backend = dataclasses.replace(
        create_reference_backend(opts),
        gemm=counting(calls, ReferenceGemm, "batched_linear")(opts),
        small=counting(calls, SmallOps, "rope")(opts),
    )
    q = torch.randn(5, 3, 8 + 4)
    w_uk = torch.randn(3, 6, 8)
    table = torch.cat([torch.ones(16, 2), torch.zeros(16, 2)], dim=-1)
    positions = torch.tensor([3, 0, 9, 1, 2])
    out = backend.attention.mla_query(q[..., :8], q[..., 8:], w_uk, positions, table, True)
    assert (calls["batched_linear"], calls["rope"]) == (1, 1)
    torch.testing.assert_close(out[..., :6], torch.einsum("thn,hcn->thc", q[..., :8], w_uk))
    torch.testing.assert_close(out[..., 6:], q[..., 8:])


def test_batched_linear_batch_invariant_default_uses_linear() -> None:
    calls: Counter[str] = Counter()
    opts = BackendOptions(batch_invariant=True)
    backend = dataclasses.replace(
        create_reference_backend(opts), gemm=counting(calls, ReferenceGemm, "linear")(opts)
    )
    out = backend.gemm.batched_linear(torch.randn(3, 5, 8), torch.randn(3, 4, 8))
    assert out.shape == (3, 5, 4) and calls["linear"] == 3


def test_parts_are_bound_to_their_backend() -> None:
    backend = create_reference_backend()
    assert all(part.backend is backend for part in backend.parts())
    assert len(list(backend.parts())) == 7
    loose = MoeOps(BackendOptions())
    with pytest.raises(RuntimeError, match="not part of a Backend"):
        loose.experts(torch.randn(1, 4), torch.tensor([1]), torch.randn(1, 4, 4), torch.randn(1, 4, 2))


def test_a_part_of_the_wrong_type_is_refused() -> None:
    ref = create_reference_backend()
    with pytest.raises(TypeError, match="`gemm` must be a GemmOps instance, got MoeOps"):
        dataclasses.replace(ref, gemm=MoeOps(BackendOptions()))  # type: ignore[arg-type]


def test_kv_ops_left_on_the_device_part_are_refused() -> None:
    """A port written before KVCacheOps existed would have its layout silently ignored."""

    class OldDevice(ReferenceDevice):
        def allocate_kv_cache(self, spec: KVCacheSpec, num_layers: int) -> list[Any]:
            return []

        def write_kv(self, *args: Any) -> None:
            pass

    ref = create_reference_backend()
    old = OldDevice(BackendOptions(), torch.device("cpu"))
    with pytest.raises(TypeError, match=r"defines allocate_kv_cache, write_kv; the KV-cache ops moved"):
        dataclasses.replace(ref, device=old)


def test_host_stand_ins_on_the_cpu_only() -> None:
    """The stream / event defaults are host stand-ins on the CPU (synchronous), torch's generic
    stream and event objects elsewhere (checked here by type only: no accelerator in CI)."""
    from deepinfer.backend.host import HostEvent, HostStream

    device = create_reference_backend().device
    assert isinstance(device.new_stream(), HostStream) and isinstance(device.new_event(), HostEvent)
    assert not device.pinned_empty((2,), torch.float32).is_pinned()

    class MetaDevice(DeviceOps):
        def device(self) -> torch.device:
            return torch.device("meta")

        def synchronize(self) -> None:
            pass

        def memory_info(self) -> tuple[int, int]:
            return (0, 1)

    meta = MetaDevice(BackendOptions())
    assert not meta._synchronous()


def test_v4_host_loop_defaults_refuse_graph_capture() -> None:
    """DeepSeek-V4's compressed_attention and indexer_topk defaults (and DeepSeek-V4.1's two
    candidate-block stages) read request lengths on the host: while a real graph captures
    (DeviceOps.is_capturing) they raise NotImplementedError, which the model runner takes as
    "run decode eagerly"; otherwise they run."""

    class Capturing(ReferenceDevice):
        capturing = False

        def is_capturing(self) -> bool:
            return self.capturing

    device = Capturing(BackendOptions(), torch.device("cpu"))
    backend = dataclasses.replace(create_reference_backend(), device=device)
    cache = backend.kv_cache.allocate(KVCacheSpec(2, 4, 8, 0, torch.float32), 1)[0]
    meta = AttentionMetadata.build(torch.tensor([[0, 1]], dtype=torch.int32), [5], [1])
    q = torch.randn(1, 2, 8)

    def both() -> None:
        backend.attention.compressed_attention(q, cache, cache, meta, scale=0.3, ratio=4)
        backend.attention.indexer_topk(q, torch.ones(1, 2), cache, meta, ratio=4, topk=2, scale=1.0)

    both()
    device.capturing = True
    with pytest.raises(NotImplementedError, match="compressed_attention reads request lengths on the host"):
        both()
    with pytest.raises(NotImplementedError, match="indexer_topk"):
        backend.attention.indexer_topk(q, torch.ones(1, 2), cache, meta, ratio=4, topk=2, scale=1.0)
    blocks = torch.zeros((1, 8), dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="indexer_candidate_blocks reads request lengths"):
        backend.attention.indexer_candidate_blocks(
            q, torch.ones(1, 2), cache, meta, ratio=1, topk=2, scale=1.0, block_size=2, topk_blocks=8
        )
    with pytest.raises(NotImplementedError, match="indexer_topk_in_blocks reads request lengths"):
        backend.attention.indexer_topk_in_blocks(
            q, torch.ones(1, 2), cache, meta, blocks, ratio=1, topk=2, scale=1.0, block_size=2
        )


def test_attention_modifiers_describe_and_plain() -> None:
    assert AttentionModifiers().is_plain and AttentionModifiers().describe() == "none"
    mods = AttentionModifiers(
        window=8, sinks=torch.zeros(2), topk_indices=torch.zeros((3, 6), dtype=torch.int32)
    )
    assert not mods.is_plain and mods.describe() == "window=8, sinks, top-k 6"


def test_gemm_defaults_need_only_linear() -> None:
    """A GemmOps with only `linear` has every other op (grouped and batched through it)."""

    class OnlyLinear(GemmOps):
        def linear(
            self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return torch.nn.functional.linear(x, weight, bias)

    opts = BackendOptions()
    backend = dataclasses.replace(create_reference_backend(opts), gemm=OnlyLinear(opts))
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8)
    y = backend.gemm.grouped_gemm(x, w, torch.tensor([2, 4]))
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[1].t()]))

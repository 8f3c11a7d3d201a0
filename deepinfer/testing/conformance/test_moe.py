"""MoE routing, permutation, expert MLP and the fused routed-expert layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import RouterConfig
from deepinfer.reference import moe as ref_moe
from deepinfer.testing.helpers import mxfp4_weight, oracle, quantized_weight, randn, router_margin
from deepinfer.testing.tolerances import assert_close, index_locator

V3 = RouterConfig(
    "sigmoid", top_k=6, num_groups=8, topk_groups=4, group_score="top2_sum", renormalize=True,
    routed_scaling_factor=2.5,
)  # fmt: skip
V2 = RouterConfig(
    "softmax", top_k=3, num_groups=4, topk_groups=2, group_score="max", routed_scaling_factor=16.0
)
V3_FULL = RouterConfig(  # DeepSeek-V3 / R1: 256 experts, top-8 of the 4 best of 8 groups
    "sigmoid", top_k=8, num_groups=8, topk_groups=4, group_score="top2_sum", renormalize=True,
    routed_scaling_factor=2.5,
)  # fmt: skip
V4 = RouterConfig("sqrtsoftplus", top_k=4, renormalize=True, routed_scaling_factor=1.5)
ROUTERS = {  # name: (config, experts, with correction bias)
    "softmax_greedy": (RouterConfig("softmax", top_k=2), 16, False),  # V2-Lite
    "softmax_group_max": (V2, 32, False),
    "sigmoid_top2_sum_bias": (V3, 64, True),
    "sigmoid_bias_no_groups": (RouterConfig("sigmoid", top_k=4, renormalize=True), 24, True),
    "sqrtsoftplus_bias": (V4, 40, True),
    "softmax_all_experts": (RouterConfig("softmax", top_k=8, renormalize=True), 8, False),
    "sigmoid_all_groups": (
        RouterConfig(
            "sigmoid", top_k=5, num_groups=4, topk_groups=4, group_score="top2_sum", renormalize=True
        ),
        32,
        True,
    ),
    "softmax_top1": (RouterConfig("softmax", top_k=1, routed_scaling_factor=2.0), 12, False),
    # the published routers at full size
    "deepseek_v3": (V3_FULL, 256, True),
    "deepseek_v2_lite": (RouterConfig("softmax", top_k=6), 64, False),  # greedy top-6 of 64
    "deepseek_v2_group_max": (  # V2: 160 experts, top-6 of the 3 best of 8 groups (max score)
        RouterConfig("softmax", top_k=6, num_groups=8, topk_groups=3, routed_scaling_factor=16.0),
        160,
        False,
    ),
    "sigmoid_384_experts": (
        RouterConfig("sigmoid", top_k=8, renormalize=True, routed_scaling_factor=2.8),
        384,
        True,
    ),
}


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row's (id, weight) pairs by expert id: the op's output order is not part of
    the contract, the set of pairs is."""
    ids = ids.cpu().long()
    order = ids.argsort(dim=-1)
    return weights.cpu().double().gather(1, order), ids.gather(1, order)


def routing_stage(got: list[int], want: list[int], config: RouterConfig, experts: int) -> str:
    """Which stage of group-limited routing two choices of routed experts part at: "group" (the
    experts lie in other groups: the group scores or their top-k differ) or "expert"."""
    per = experts // config.num_groups
    if config.num_groups > 1 and {e // per for e in got} != {e // per for e in want}:
        return "group"
    return "expert"


def assert_same_experts(
    ids: torch.Tensor,
    ref_ids: torch.Tensor,
    config: RouterConfig,
    experts: int,
    rows: list[int] | None = None,
    what: str = "selected experts differ from the reference",
) -> None:
    """ids, ref_ids (T, K (+ S)): each row's set of experts equals the reference's. A failure names
    the first row that differs (by its index in the op's input: `rows` maps the rows compared
    to it) and the routing stage (group or expert; hash routing has none)."""
    __tracebackhide__ = True
    got, want = ids.cpu().long().tolist(), ref_ids.cpu().long().tolist()
    for i, (g, w) in enumerate(zip(got, want)):
        if sorted(g) != sorted(w):
            routed_g = sorted(e for e in g if e < experts)
            routed_w = sorted(e for e in w if e < experts)
            row = i if rows is None else rows[i]
            stage = routing_stage(routed_g, routed_w, config, experts)
            raise AssertionError(
                f"{what}: row {row} chose experts {sorted(g)}, the reference {sorted(w)} "
                f"({sum(a != b for a, b in zip(got, want))} of {len(got)} rows differ); the {stage} "
                f"stage differs ({config.scoring}, {config.num_groups} group(s), top-{config.topk_groups} "
                f"groups, top-{config.top_k} of {experts} experts)"
            )


@pytest.mark.parametrize("tokens", [0, 1, 13, 70])
@pytest.mark.parametrize("experts,dm", [(64, 200), (10, 1100)], ids=["E64", "E10-wide"])
def test_router_logits(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int, experts: int, dm: int
) -> None:
    """x in the model's dtype, the gate in float32 -> float32 scores equal to x @ W^T in float64
    within float32 rounding (70 tokens: past a backend's decode-sized path, if it has one)."""
    dev = backend.device.device()
    x = randn((tokens, dm), dtype, dev, gen)
    w = randn((experts, dm), torch.float32, dev, gen, dm**-0.5)
    logits = backend.moe.router_logits(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (tokens, experts)
    assert_close(logits, oracle(x) @ oracle(w).T, torch.float32, what="router logits")


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_route(backend: Backend, gen: torch.Generator, name: str, tokens: int) -> None:
    config, experts, with_bias = ROUTERS[name]
    dev = backend.device.device()
    logits = randn((tokens, experts), torch.float32, dev, gen, 2.0)
    bias = randn((experts,), torch.float32, dev, gen, 0.5) if with_bias else None
    weights, ids = backend.moe.route(logits, config, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, config.top_k)
    ref_w, ref_ids = ref_moe.route(oracle(logits), config, None if bias is None else oracle(bias))
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    assert_same_experts(i, ri, config, experts)
    assert_close(w, rw, torch.float32, what="router weights")


def test_route_sqrtsoftplus_extreme_logits(backend: Backend, gen: torch.Generator) -> None:
    """sqrt(softplus) where softplus switches to x (above 20) and where it is tiny (log1p of a
    tiny exp: selection among small scores must still follow the reference)."""
    dev = backend.device.device()
    experts = 24
    logits = torch.rand((9, experts), generator=gen) * 80 - 40  # [-40, 40)
    logits[0] = torch.linspace(-38, -20, experts)  # all tiny scores
    logits[1, :4] = torch.tensor([19.5, 20.0, 20.5, 35.0])
    config = RouterConfig("sqrtsoftplus", top_k=6, renormalize=True, routed_scaling_factor=1.5)
    weights, ids = backend.moe.route(logits.to(dev), config)
    ref_w, ref_ids = ref_moe.route(oracle(logits), config)
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    assert_same_experts(i, ri, config, experts)
    assert_close(w, rw, torch.float32, what="router weights")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("experts,top_k", [(20, 3), (256, 8)], ids=["E20-K3", "E256-K8"])
def test_route_hash(backend: Backend, gen: torch.Generator, scoring: str, experts: int, top_k: int) -> None:
    tokens = 11
    dev = backend.device.device()
    config = RouterConfig(scoring, top_k=top_k, renormalize=scoring != "softmax", routed_scaling_factor=1.5)  # type: ignore[arg-type]
    logits = randn((tokens, experts), torch.float32, dev, gen)
    hash_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(
        torch.int32
    )
    weights, ids = backend.moe.route(logits, config, hash_ids=hash_ids.to(dev))
    ref_w, ref_ids = ref_moe.route(oracle(logits), config, hash_ids=hash_ids)
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    assert_same_experts(i, ri, config, experts, what="hash routing must select exactly the given experts")
    assert_close(w, rw, torch.float32, what="hash-routed weights")


SHARED_ROUTERS = {  # name: (config, experts, with correction bias); shared experts appended
    "deepseek_v2_lite_shared2": (RouterConfig("softmax", top_k=6, shared_experts=2), 64, False),
    "deepseek_v3_shared1": (dataclasses.replace(V3_FULL, shared_experts=1), 256, True),
    "softmax_group_max_shared3": (dataclasses.replace(V2, shared_experts=3), 32, False),
    "softmax_top1_renorm_shared1": (
        RouterConfig("softmax", top_k=1, renormalize=True, routed_scaling_factor=2.0, shared_experts=1),
        12,
        False,
    ),
}


@pytest.mark.parametrize("name", list(SHARED_ROUTERS))
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_route_with_shared_experts(backend: Backend, gen: torch.Generator, name: str, tokens: int) -> None:
    """Shared experts fused as S more experts: every row also holds (E + s, 1.0) for s < S, the
    routed weights unchanged (renormalised and scaled without them)."""
    config, experts, with_bias = SHARED_ROUTERS[name]
    s = config.shared_experts
    dev = backend.device.device()
    logits = randn((tokens, experts), torch.float32, dev, gen, 2.0)
    bias = randn((experts,), torch.float32, dev, gen, 0.5) if with_bias else None
    weights, ids = backend.moe.route(logits, config, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, config.top_k + s)
    ref_w, ref_ids = ref_moe.route(oracle(logits), config, None if bias is None else oracle(bias))
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    assert_same_experts(i, ri, config, experts)
    assert torch.equal(i[:, -s:], torch.arange(experts, experts + s).expand(tokens, s)), "shared ids"
    assert torch.equal(w[:, -s:], torch.ones((tokens, s), dtype=torch.float64)), "shared weights must be 1"
    assert_close(w, rw, torch.float32, what="router weights")
    plain_w, _ = ref_moe.route(
        oracle(logits), dataclasses.replace(config, shared_experts=0), None if bias is None else oracle(bias)
    )
    torch.testing.assert_close(rw[:, :-s].sum(1), plain_w.double().sum(1))


def test_route_hash_with_shared_experts(backend: Backend, gen: torch.Generator) -> None:
    tokens, experts, top_k = 7, 20, 3
    dev = backend.device.device()
    config = RouterConfig(
        "sigmoid", top_k=top_k, renormalize=True, routed_scaling_factor=1.5, shared_experts=2
    )
    logits = randn((tokens, experts), torch.float32, dev, gen)
    hash_ids = random_ids(tokens, top_k, experts, gen)
    weights, ids = backend.moe.route(logits, config, hash_ids=hash_ids.to(dev))
    ref_w, ref_ids = ref_moe.route(oracle(logits), config, hash_ids=hash_ids)
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    assert_same_experts(
        i, ri, config, experts, what="hash routing must select exactly the given experts plus the shared ones"
    )
    assert_close(w, rw, torch.float32, what="hash-routed weights")


SELECT_ROUTERS = {  # name: (config, experts, with correction bias, hash routing)
    "softmax_greedy": (RouterConfig("softmax", top_k=6), 64, False, False),  # V2-Lite
    "softmax_group_max_shared2": (dataclasses.replace(V2, shared_experts=2), 32, False, False),
    "sigmoid_groups_bias": (V3, 64, True, False),
    "deepseek_v3_shared1": (dataclasses.replace(V3_FULL, shared_experts=1), 256, True, False),
    "sqrtsoftplus_bias": (V4, 40, True, False),  # V4-Flash's router
    "sqrtsoftplus_hash": (V4, 40, False, True),  # V4-Flash's hash layers
    "sigmoid_hash_shared2": (
        RouterConfig("sigmoid", top_k=3, renormalize=True, routed_scaling_factor=1.5, shared_experts=2),
        20,
        False,
        True,
    ),
}
# Selection scores closer than this (float64 oracle) may order either way at float32 precision.
ROUTER_TIE = 1e-4


SELECT_CASES = [
    *((name, t) for name in SELECT_ROUTERS for t in (0, 1, 5)),
    # 64 tokens: the most a backend's decode-sized path may take (the cuda backend's); 200: past it
    ("softmax_group_max_shared2", 64),
    ("sqrtsoftplus_hash", 64),
    ("sigmoid_hash_shared2", 200),
    *(pytest.param("deepseek_v3_shared1", t, marks=pytest.mark.heavy) for t in (64, 200)),
]


@pytest.mark.parametrize("name,tokens", SELECT_CASES)
def test_select_experts(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str, tokens: int
) -> None:
    """The whole router from x (T, Dm) and the float32 gate: route(x @ gate^T) in float64, the
    same pairs as the composition router_logits + route. Rows whose choice is within ROUTER_TIE
    of changing are left out of the comparison (and must be few)."""
    config, experts, with_bias, hashed = SELECT_ROUTERS[name]
    dm, s = 136, config.shared_experts
    dev = backend.device.device()
    x = randn((tokens, dm), dtype, dev, gen)
    gate = randn((experts, dm), torch.float32, dev, gen, 2.0 * dm**-0.5)
    bias = randn((experts,), torch.float32, dev, gen, 0.5) if with_bias else None
    hash_ids = random_ids(tokens, config.top_k, experts, gen) if hashed else None
    weights, ids = backend.moe.select_experts(
        x, gate, config, bias, None if hash_ids is None else hash_ids.to(dev)
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, config.top_k + s)
    logits = oracle(x) @ oracle(gate).T
    ref_w, ref_ids = ref_moe.route(logits, config, to_ref(bias), hash_ids)
    w, i = by_expert(weights, ids)
    rw, ri = by_expert(ref_w, ref_ids)
    if s:
        assert torch.equal(i[:, -s:], torch.arange(experts, experts + s).expand(tokens, s)), "shared ids"
        assert torch.equal(w[:, -s:], torch.ones((tokens, s), dtype=torch.float64)), "shared weights"
    clear = torch.ones(tokens, dtype=torch.bool)
    if not hashed:
        clear = router_margin(logits, config, to_ref(bias)) > ROUTER_TIE
    assert int(clear.sum()) >= int(0.8 * tokens), f"only {int(clear.sum())}/{tokens} rows clear of ties"
    assert_same_experts(i[clear], ri[clear], config, experts, clear.nonzero().flatten().tolist())
    assert_close(w[clear], rw[clear], torch.float32, what="router weights")


def random_ids(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """(T, K) int32 distinct experts per token."""
    if tokens == 0:
        return torch.empty((0, top_k), dtype=torch.int32)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(
        torch.int32
    )


@pytest.mark.parametrize("tokens", [0, 1, 11])
def test_permute(backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int) -> None:
    experts, top_k, dm = 8, 3, 33
    dev = backend.device.device()
    x = randn((tokens, dm), dtype, dev, gen)
    ids = random_ids(tokens, top_k, experts, gen)
    x_sorted, src_to_dst, counts = backend.moe.permute(x, ids.to(dev), experts)
    rx, rs, rc = ref_moe.permute(x.cpu(), ids, experts)
    assert src_to_dst.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(counts.cpu(), rc), "expert counts"
    assert torch.equal(src_to_dst.cpu(), rs), "src_to_dst (stable order within an expert)"
    assert torch.equal(x_sorted.cpu(), rx), "permuted rows"


@pytest.mark.parametrize("tokens,top_k,experts", [(120, 8, 256), (700, 8, 256), (97, 6, 64)])
def test_permute_many_rows(
    backend: Backend, gen: torch.Generator, tokens: int, top_k: int, experts: int
) -> None:
    """Decode-to-prefill sizes (DeepSeek-V3's 256 experts, top-8; V2-Lite's 64, top-6): thousands
    of token copies, stable within each expert."""
    dev = backend.device.device()
    x = randn((tokens, 8), torch.float32, dev, gen)
    ids = random_ids(tokens, top_k, experts, gen)
    x_sorted, src_to_dst, counts = backend.moe.permute(x, ids.to(dev), experts)
    rx, rs, rc = ref_moe.permute(x.cpu(), ids, experts)
    assert torch.equal(counts.cpu(), rc), "expert counts"
    assert torch.equal(src_to_dst.cpu(), rs), "src_to_dst (stable order within an expert)"
    assert torch.equal(x_sorted.cpu(), rx), "permuted rows"


@pytest.mark.parametrize(
    "experts,top_k,used",
    [(16, 2, (5, 15)), (1, 1, (0,)), (6, 1, (5,)), (9, 3, (0, 4, 8))],
    ids=["sparse", "single_expert", "last_only", "every_4th"],
)
def test_permute_idle_experts(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    experts: int,
    top_k: int,
    used: tuple[int, ...],
) -> None:
    """Most experts receive no token (counts 0, empty groups between and after used ones)."""
    tokens, dm = 7, 24
    dev = backend.device.device()
    x = randn((tokens, dm), dtype, dev, gen)
    pool = torch.tensor(used, dtype=torch.int32)
    ids = torch.stack([pool[torch.randperm(len(used), generator=gen)[:top_k]] for _ in range(tokens)])
    x_sorted, src_to_dst, counts = backend.moe.permute(x, ids.to(dev), experts)
    rx, rs, rc = ref_moe.permute(x.cpu(), ids, experts)
    assert counts.shape == (experts,) and torch.equal(counts.cpu(), rc), "expert counts"
    assert torch.equal(src_to_dst.cpu(), rs), "src_to_dst (stable order within an expert)"
    assert torch.equal(x_sorted.cpu(), rx), "permuted rows"


@pytest.mark.parametrize("top_k,dm", [(4, 65), (1, 65), (2, 1100)], ids=["K4", "K1", "K2-wide"])
@pytest.mark.parametrize("tokens", [0, 1, 11])
def test_unpermute(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int, top_k: int, dm: int
) -> None:
    dev = backend.device.device()
    y = randn((tokens * top_k, dm), dtype, dev, gen)
    src_to_dst = torch.randperm(tokens * top_k, generator=gen)
    weights = torch.rand((tokens, top_k), generator=gen)
    out = backend.moe.unpermute(y, src_to_dst.to(dev), weights.to(dev))
    expected = ref_moe.unpermute(oracle(y), src_to_dst, oracle(weights))
    assert out.dtype == dtype
    assert_close(out, expected, dtype, what="unpermute")


def expert_weights(
    experts: int, dm: int, inter: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(w13 (E, 2I, Dm), w2 (E, Dm, I), scales or None); O(1) outputs."""
    if fp8:
        w13, s13 = quantized_weight((experts, 2 * inter, dm), dev, gen, dm**-0.5)
        w2, s2 = quantized_weight((experts, dm, inter), dev, gen, inter**-0.5)
        return w13, w2, s13, s2
    w13 = randn((experts, 2 * inter, dm), dtype, dev, gen, dm**-0.5)
    return w13, randn((experts, dm, inter), dtype, dev, gen, inter**-0.5), None, None


def to_ref(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else oracle(t)


@pytest.mark.parametrize("quant", ["float", "fp8"])
@pytest.mark.parametrize(
    "sizes",
    [[0, 0, 0], [2, 0, 5, 1], [1, 9, 0, 0, 3], [0, 0, 0, 6], [5]],
    ids=lambda g: "-".join(map(str, g)),
)
def test_experts(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, sizes: list[int]
) -> None:
    is_fp8 = quant == "fp8"
    run_experts(backend, dtype, gen, is_fp8, sizes, *((200, 136) if is_fp8 else (48, 37)))


@pytest.mark.parametrize("quant", ["float", "fp8"])
@pytest.mark.parametrize(
    "sizes",
    [[64, 0, 128, 32], [128, 128, 0, 0], [16, 1, 0, 47]],
    ids=lambda g: "aligned-" + "-".join(map(str, g)),
)
def test_experts_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, sizes: list[int]
) -> None:
    """Hidden 256 and intermediate 128 (both GEMMs' K and N multiples of 128)."""
    run_experts(backend, dtype, gen, quant == "fp8", sizes, 256, 128)


def run_experts(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    is_fp8: bool,
    sizes: list[int],
    dm: int,
    inter: int,
) -> None:
    if is_fp8 and not backend.capabilities.supports_fp8:
        pytest.skip(f"backend {backend.name!r} does not claim FP8")
    dev = backend.device.device()
    w13, w2, s13, s2 = expert_weights(len(sizes), dm, inter, dtype, dev, gen, is_fp8)
    x = randn((sum(sizes), dm), dtype, dev, gen)
    counts = torch.tensor(sizes, dtype=torch.int64)
    y = backend.moe.experts(x, counts.to(dev), w13, w2, s13, s2)
    expected = ref_moe.experts(oracle(x), counts, oracle(w13), oracle(w2), to_ref(s13), to_ref(s2))
    assert y.dtype == dtype
    where = index_locator(tuple(y.shape), ("row", "column"))
    case = f"{'FP8' if is_fp8 else 'float'} weights, expert sizes {sizes}, Dm={dm} I={inter}"
    assert_close(y, expected, dtype, what="experts", fp8_act=is_fp8, locate=where, case=case)


def fused_moe_inputs(
    tokens: int,
    dtype: torch.dtype,
    dev: torch.device,
    gen: torch.Generator,
    fp8: bool,
    experts: int = 8,
    top_k: int = 3,
    dims: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    dm, inter = dims or ((256, 128) if fp8 else (40, 24))
    w13, w2, s13, s2 = expert_weights(experts, dm, inter, dtype, dev, gen, fp8)
    x = randn((tokens, dm), dtype, dev, gen)
    ids = random_ids(tokens, top_k, experts, gen).to(dev)
    weights = torch.rand((tokens, top_k), generator=gen).to(dev)
    return x, weights, ids, w13, w2, s13, s2  # type: ignore[return-value]


@pytest.mark.parametrize("quant", ["float", "fp8"])
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_fused_moe(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, tokens: int
) -> None:
    run_fused_moe(backend, dtype, gen, quant == "fp8", tokens)


@pytest.mark.parametrize("quant", ["float", "fp8"])
@pytest.mark.parametrize("tokens", [16, 128], ids=lambda t: f"aligned-T{t}")
def test_fused_moe_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, tokens: int
) -> None:
    """Hidden 256, intermediate 128, 8 experts, top-2: aligned GEMM shapes after routing."""
    run_fused_moe(backend, dtype, gen, quant == "fp8", tokens, top_k=2, dims=(256, 128))


def run_fused_moe(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    is_fp8: bool,
    tokens: int,
    top_k: int = 3,
    dims: tuple[int, int] | None = None,
) -> None:
    if is_fp8 and not backend.capabilities.supports_fp8:
        pytest.skip(f"backend {backend.name!r} does not claim FP8")
    x, weights, ids, w13, w2, s13, s2 = fused_moe_inputs(
        tokens, dtype, backend.device.device(), gen, is_fp8, top_k=top_k, dims=dims
    )
    y = backend.moe.fused_moe(x, weights, ids, w13, w2, s13, s2)
    rx, rids = oracle(x), ids.cpu()
    x_sorted, src_to_dst, counts = ref_moe.permute(rx, rids, w13.shape[0])
    h = ref_moe.experts(x_sorted, counts, oracle(w13), oracle(w2), to_ref(s13), to_ref(s2))
    expected = ref_moe.unpermute(h, src_to_dst, oracle(weights))
    assert y.dtype == dtype and y.shape == x.shape
    where = index_locator(tuple(y.shape), ("token", "column"))
    case = (
        f"{'FP8' if is_fp8 else 'float'} weights, T={tokens} E={w13.shape[0]} top-{top_k}, "
        f"Dm={x.shape[1]} I={w2.shape[2]}"
    )
    assert_close(y, expected, dtype, what="fused_moe", fp8_act=is_fp8, locate=where, case=case)


@pytest.mark.parametrize("quant", ["float", "fp8"])
@pytest.mark.parametrize("experts,top_k", [(1, 1), (4, 1), (3, 3)], ids=["E1-K1", "E4-K1", "E3-K3"])
def test_fused_moe_edge_routing(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, experts: int, top_k: int
) -> None:
    """One expert, top-1 routing, and every token sent to every expert."""
    is_fp8 = quant == "fp8"
    if is_fp8 and not backend.capabilities.supports_fp8:
        pytest.skip(f"backend {backend.name!r} does not claim FP8")
    dev = backend.device.device()
    x, weights, ids, w13, w2, s13, s2 = fused_moe_inputs(5, dtype, dev, gen, is_fp8, experts, top_k)
    y = backend.moe.fused_moe(x, weights, ids, w13, w2, s13, s2)
    x_sorted, src_to_dst, counts = ref_moe.permute(oracle(x), ids.cpu(), experts)
    h = ref_moe.experts(x_sorted, counts, oracle(w13), oracle(w2), to_ref(s13), to_ref(s2))
    expected = ref_moe.unpermute(h, src_to_dst, oracle(weights))
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, expected, dtype, what="fused_moe", fp8_act=is_fp8)


def clamped_experts_oracle(
    x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float
) -> torch.Tensor:
    """float64 expert MLPs with DeepSeek-V4's SwiGLU: silu(min(gate, limit)) * clamp(up, +-limit)."""
    out = x_sorted.new_zeros((x_sorted.shape[0], w2.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):
        h = x_sorted[start : start + n] @ w13[e].T
        gate, up = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        out[start : start + n] = act @ w2[e].T
        start += n
    return out


@pytest.mark.parametrize("quant", ["float", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 9, 30])
def test_fused_moe_clamped_swiglu(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, quant: str, tokens: int
) -> None:
    """DeepSeek-V4's routed experts: fused_moe with swiglu_limit (clamped SwiGLU between the two
    products), float or MXFP4 weights (packed e2m1, UE8M0 scales per 32 values; Dm and I even);
    1, 9 and 30 tokens of top-3 over 8 experts cover decode-sized and grouped paths. The limit
    (0.75) clamps a good share of the O(1) gate and up values; experts() alike on the sorted rows."""
    from deepinfer.testing.conformance.test_gemm import mxfp4_oracle

    dev = backend.device.device()
    experts, top_k, dm, inter, limit = 8, 3, 64, 48, 0.75
    if quant == "mxfp4":
        w13, s13 = mxfp4_weight((experts, 2 * inter, dm), dev, gen, dm**-0.5)
        w2, s2 = mxfp4_weight((experts, dm, inter), dev, gen, inter**-0.5)
        r13, r2 = mxfp4_oracle(w13, s13, dm), mxfp4_oracle(w2, s2, inter)
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (s13, s2)
    else:
        w13, w2, *_ = expert_weights(experts, dm, inter, dtype, dev, gen, False)
        r13, r2, scales = oracle(w13), oracle(w2), (None, None)
    x = randn((tokens, dm), dtype, dev, gen)
    ids = random_ids(tokens, top_k, experts, gen).to(dev)
    weights = torch.rand((tokens, top_k), generator=gen).to(dev)
    y = backend.moe.fused_moe(x, weights, ids, w13, w2, *scales, swiglu_limit=limit)
    x_sorted, src_to_dst, counts = ref_moe.permute(oracle(x), ids.cpu(), experts)
    h = clamped_experts_oracle(x_sorted, counts, r13, r2, limit)
    expected = ref_moe.unpermute(h, src_to_dst, oracle(weights))
    assert y.dtype == dtype and y.shape == x.shape
    case = f"{quant} weights, T={tokens} E={experts} top-{top_k}, Dm={dm} I={inter}, limit {limit}"
    where = index_locator(tuple(y.shape), ("token", "column"))
    assert_close(y, expected, dtype, what="fused_moe (clamped SwiGLU)", locate=where, case=case)
    xs = x_sorted.to(dtype).to(dev)
    z = backend.moe.experts(xs, counts.to(dev), w13, w2, *scales, swiglu_limit=limit)
    assert_close(z, h, dtype, what="experts (clamped SwiGLU)", case=case)


# Routers fed exactly tied scores: (config, experts, with a correction bias)
TIE_ROUTERS = {
    "softmax_greedy": (RouterConfig("softmax", top_k=6), 64, False),
    "sigmoid_bias_no_groups": (RouterConfig("sigmoid", top_k=4, renormalize=True), 24, True),
    "softmax_group_max": (V2, 32, False),
    "sigmoid_top2_sum_bias": (V3, 64, True),
    "sqrtsoftplus_bias": (V4, 40, True),
}


def tied_logits(tokens: int, config: RouterConfig, experts: int, gen: torch.Generator) -> torch.Tensor:
    """(T, E) float32 logits on a coarse grid (steps of 0.5 in [-1, 1]: many exact ties, distinct
    values far apart). With groups, every group holds a permutation of one row of values, shifted
    up by 1 in a random subset of groups: group scores tie exactly within each subset. Row 0 is
    all zeros (every score tied)."""
    g = config.num_groups
    per = experts // g
    base = (torch.randint(-2, 3, (tokens, 1, per), generator=gen) * 0.5).expand(tokens, g, per)
    perms = torch.stack([torch.randperm(per, generator=gen) for _ in range(tokens * g)]).view(tokens, g, per)
    x = base.gather(2, perms) + torch.randint(0, 2, (tokens, g, 1), generator=gen).float()
    x = x.reshape(tokens, experts)
    if tokens:
        x[0] = 0.0
    return x


def tied_choice(logits: torch.Tensor, config: RouterConfig, bias: torch.Tensor | None) -> list[list[int]]:
    """The contract's tie rule, brute force in float64: groups by (-group score, group id), then
    experts of the kept groups by (-selection score, expert id)."""
    scores = ref_moe.scores_of(logits.double(), config.scoring)
    sel = scores if bias is None else scores + bias.double()
    g, per = config.num_groups, logits.shape[1] // config.num_groups
    out = []
    for row in sel.tolist():
        groups = [row[i * per : (i + 1) * per] for i in range(g)]
        if config.group_score == "top2_sum":
            gscore = [sum(sorted(v, reverse=True)[:2]) for v in groups]
        else:
            gscore = [max(v) for v in groups]
        kept = sorted(range(g), key=lambda i: (-gscore[i], i))[: config.topk_groups] if g > 1 else [0]
        cands = [e for e in range(len(row)) if e // per in kept]
        out.append(sorted(sorted(cands, key=lambda e: (-row[e], e))[: config.top_k]))
    return out


def clear_of_near_ties(logits: torch.Tensor, chosen: list[int], config: RouterConfig) -> bool:
    """Whether every chosen and every unchosen candidate (expert, or group) differ in float64
    selection score either not at all or by more than ROUTER_TIE: a tie there is exact."""
    sel = ref_moe.scores_of(logits.double()[None], config.scoring)[0].tolist()
    g, per = config.num_groups, len(sel) // config.num_groups
    top2 = config.group_score == "top2_sum"
    gscore = [sum(sorted(sel[i * per : (i + 1) * per], reverse=True)[: 2 if top2 else 1]) for i in range(g)]
    kept = {e // per for e in chosen}
    pairs = [(gscore[a], gscore[b]) for a in kept for b in range(g) if b not in kept]
    rest = [f for f in range(len(sel)) if f // per in kept and f not in chosen]
    pairs += [(sel[e], sel[f]) for e in chosen for f in rest]
    return all(a == b or abs(a - b) > ROUTER_TIE for a, b in pairs)


def assert_tied_choice(
    ids: torch.Tensor,
    want: list[list[int]],
    config: RouterConfig,
    experts: int,
    rows: list[int] | None = None,
) -> None:
    """ids (T, K + S) the op's: each row's routed set equals `want`, the failure naming the row
    (its index in the op's input: `rows` maps the rows compared to it) and the stage (group: the
    chosen experts lie in other groups; expert: same groups)."""
    got = [sorted(r[: config.top_k]) for r in ids.cpu().long().tolist()]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            stage = routing_stage(g, w, config, experts)
            t = i if rows is None else rows[i]
            raise AssertionError(
                f"row {t}: tied scores chose experts {g}, the tie rule (lower group id, then lower "
                f"expert id) gives {w}: the {stage} stage breaks ties differently"
            )


@pytest.mark.parametrize("name", list(TIE_ROUTERS))
@pytest.mark.parametrize("tokens", [1, 13, 70])
def test_route_tied_scores(backend: Backend, gen: torch.Generator, name: str, tokens: int) -> None:
    """Exactly tied scores (and tied groups): the experts the tie rule picks (RouterConfig), the
    weights of the reference. The bias, where given, is one value for every expert (ties stay)."""
    config, experts, with_bias = TIE_ROUTERS[name]
    dev = backend.device.device()
    logits = tied_logits(tokens, config, experts, gen)
    bias = torch.full((experts,), 0.25) if with_bias else None
    weights, ids = backend.moe.route(logits.to(dev), config, None if bias is None else bias.to(dev))
    want = tied_choice(logits, config, bias)
    assert_tied_choice(ids, want, config, experts)
    ref_w, ref_ids = ref_moe.route(oracle(logits), config, to_ref(bias))
    assert [sorted(r) for r in ref_ids.long().tolist()] == want, "the reference breaks the tie rule"
    w, _ = by_expert(weights, ids)
    rw, _ = by_expert(ref_w, ref_ids)
    assert_close(w, rw, torch.float32, what="router weights")


@pytest.mark.parametrize("name", list(TIE_ROUTERS))
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_select_experts_tied_scores(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str, tokens: int
) -> None:
    """The whole router on ties from x: token 0's hidden state is zero (every logit 0), and the
    gate's rows come in identical pairs (each pair's logits tie exactly): the tie rule's experts."""
    config, experts, with_bias = TIE_ROUTERS[name]
    dm = 136
    dev = backend.device.device()
    x = randn((tokens, dm), dtype, dev, gen)
    x[0] = 0
    half = randn((experts // 2, dm), torch.float32, dev, gen, 2.0 * dm**-0.5)
    gate = half.repeat_interleave(2, dim=0)  # experts 2i and 2i + 1 score the same
    bias = torch.full((experts,), 0.25) if with_bias else None
    _, ids = backend.moe.select_experts(x, gate, config, None if bias is None else bias.to(dev))
    logits = oracle(x) @ oracle(gate).T
    want = tied_choice(logits, config, bias)
    # besides the exact ties, a chosen and an unchosen score may differ within float32 rounding:
    # such rows are left out (row 0 never is)
    clear = [t == 0 or clear_of_near_ties(r, w, config) for t, (r, w) in enumerate(zip(logits, want))]
    assert sum(clear) >= 0.5 * tokens, f"only {sum(clear)}/{tokens} rows clear of near-ties"
    rows = torch.tensor(clear, device=ids.device)
    kept = [t for t, c in enumerate(clear) if c]
    assert_tied_choice(ids[rows], [want[t] for t in kept], config, experts, kept)

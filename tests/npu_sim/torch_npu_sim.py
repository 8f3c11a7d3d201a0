"""The simulated `torch_npu` module: exactly the ops the ascend backend calls, on the CPU.

Semantics and argument rules follow op-plugin's function schemas and docs
(docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md); each check's message quotes the rule. Where
the NPU's behaviour is undefined (e.g. a fully masked attention row without row-invalid
correction, padding rows of BSND outputs) the simulation returns NaN so that a backend relying on
it fails. Features the backend does not use raise SimError("... not modelled ...").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from . import runtime as npu  # torch_npu.npu is torch.npu
from .mc2 import npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2  # noqa: F401
from .runtime import unrecorded
from .state import STATE, check, fail

IS_SIMULATION = True
__version__ = "2.10.0.post4+sim"
_deepinfer_device_type = "cpu"  # the simulated NPU is the CPU (see deepinfer_ascend.npu)

INT_MAX = 2147483647
FLOAT8_E4M3FN = 292  # torch_npu's enum for float8_e4m3fn
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def get_soc_version() -> int:
    return STATE.soc_version


npu.get_soc_version = get_soc_version  # type: ignore[attr-defined]


def _is_host_int_list(v: Any) -> bool:
    return isinstance(v, list | tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# =========================================================================== attention

_FIA = "npu_fused_infer_attention_score_v2"
_UNMODELLED_FIA = (
    "pse_shift",
    "dequant_scale_query",
    "dequant_scale_key",
    "dequant_offset_key",
    "dequant_scale_value",
    "dequant_offset_value",
    "dequant_scale_key_rope",
    "quant_scale_out",
    "quant_offset_out",
    "quant_scale_p",
    "query_dtype",
    "key_dtype",
    "value_dtype",
    "query_rope_dtype",
    "key_rope_dtype",
    "key_shared_prefix_dtype",
    "value_shared_prefix_dtype",
    "dequant_scale_query_dtype",
    "dequant_scale_key_dtype",
    "dequant_scale_value_dtype",
    "dequant_scale_key_rope_dtype",
    "out_dtype",
)


class _Batch:
    """One batch entry of an FIA call in a layout-free form."""

    def __init__(self, q_rows: list[int], q_len: int, kv_len: int) -> None:
        self.q_rows = q_rows  # flat output row index of each valid query row
        self.q_len = q_len
        self.kv_len = kv_len


def _fia_checks_and_plan(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any]
) -> dict[str, Any]:
    """Validate an FIA v2 call against the documented constraints; return what compute needs."""
    op = _FIA
    layout = kw["input_layout"]
    q_rope, k_rope = kw["query_rope"], kw["key_rope"]
    block_table = kw["block_table"]
    paged = block_table is not None
    mla = q_rope is not None or k_rope is not None

    for name in _UNMODELLED_FIA:
        if kw.get(name) is not None:
            fail(op, f"{name} is not modelled by the simulation")
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        check(kw[name] == 0, op, f"{name} (quantised attention) is not modelled by the simulation")

    check(query.dtype in _HALF, op, "query: dtype float16 or bfloat16", str(query.dtype))
    check(key.dtype in _HALF and value.dtype == key.dtype, op, "key/value: float16 or bfloat16, equal dtypes")
    check(key.dtype == query.dtype, op, "query and key dtypes must match outside quantised modes")
    for name, t in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("query_rope", q_rope),
        ("key_rope", k_rope),
    ):
        if t is not None:
            check(
                t.is_contiguous(),
                op,
                f"{name}: non-contiguous tensors are not supported (不支持非连续的Tensor)",
            )
    check(tuple(key.shape) == tuple(value.shape), op, "key and value shapes must be identical")
    check(
        (q_rope is None) == (k_rope is None),
        op,
        "query_rope and key_rope must be given together (不支持只配置其中一个)",
    )
    for name in ("actual_seq_qlen", "actual_seq_kvlen"):
        v = kw[name]
        check(
            v is None or _is_host_int_list(v),
            op,
            f"{name} is a host int list (List[int]), not a tensor",
            type(v).__name__,
        )
    check(isinstance(kw["block_size"], int), op, "block_size is a host int")
    check(kw["inner_precise"] in (0, 1, 2, 3), op, "inner_precise must be 0, 1, 2 or 3")
    check(
        kw["atten_mask"] is None or kw["atten_mask"].dtype in (torch.bool, torch.int8, torch.uint8),
        op,
        "atten_mask dtype: bool, int8 or uint8 (1 = masked)",
    )

    qlen_arg, kvlen_arg = kw["actual_seq_qlen"], kw["actual_seq_kvlen"]
    n_q = kw["num_query_heads"]
    # ---- layout: query rows per batch
    if layout == "TND":
        check(query.dim() == 3, op, "TND query is (T, N, D)")
        t, qn, d = query.shape
        check(
            qlen_arg is not None and kvlen_arg is not None,
            op,
            "TND: actual_seq_qlen and actual_seq_kvlen must be given",
        )
        check(len(qlen_arg) <= 4096, op, "TND: at most 4096 batches")
        check(
            all(b >= a for a, b in zip([0, *qlen_arg], qlen_arg)),
            op,
            "TND: actual_seq_qlen is CUMULATIVE (non-decreasing, each entry the sum up to that batch)",
            str(list(qlen_arg)),
        )
        check(
            bool(qlen_arg) and qlen_arg[-1] == t,
            op,
            "TND: the last cumulative actual_seq_qlen equals T",
            f"{list(qlen_arg)} vs T={t}",
        )
        starts = [0, *qlen_arg[:-1]]
        qlens = [b - a for a, b in zip(starts, qlen_arg)]
        nb = len(qlens)
        q_rows = [list(range(s, s + n)) for s, n in zip(starts, qlens)]
        s_q = max(qlens)
    elif layout == "BSND":
        check(query.dim() == 4, op, "BSND query is (B, S, N, D)")
        nb, s_q, qn, d = query.shape
        if qlen_arg is None:
            qlens = [s_q] * nb
        else:
            check(len(qlen_arg) == 1 or len(qlen_arg) >= nb, op, "actual_seq_qlen: length 1 or >= B")
            qlens = list(qlen_arg) * nb if len(qlen_arg) == 1 else list(qlen_arg[:nb])
            check(
                all(0 <= n <= s_q for n in qlens),
                op,
                "actual_seq_qlen (non-TND) holds PER-BATCH lengths, each <= the query S",
                f"{qlens} vs S={s_q}",
            )
        q_rows = [[b * s_q + i for i in range(n)] for b, n in enumerate(qlens)]
    else:
        fail(op, f"input_layout {layout!r} is not modelled by the simulation (TND, BSND are)")
    check(n_q == qn, op, "num_query_heads must equal the query's N", f"{n_q} vs {qn}")
    kvn = kw["num_key_value_heads"] or qn
    check(qn % kvn == 0, op, "num_query_heads must be divisible by num_key_value_heads")

    # ---- MLA / D rules
    if mla:
        check(d in (512, 128), op, "with query_rope/key_rope the query D must be 512 or 128", str(d))
        check(
            q_rope.dtype == query.dtype and k_rope.dtype == key.dtype,
            op,
            "query_rope/key_rope dtype follow query/key",
        )
        check(q_rope.shape[-1] == 64 and k_rope.shape[-1] == 64, op, "query_rope/key_rope D must be 64")
        check(
            tuple(q_rope.shape[:-1]) == tuple(query.shape[:-1]),
            op,
            "query_rope: other dims equal the query's",
        )
        check(tuple(k_rope.shape[:-1]) == tuple(key.shape[:-1]), op, "key_rope: other dims equal the key's")
        if d == 512:
            check(
                _pow2(qn) and qn <= 128,
                op,
                "MLA D=512: query N must be 1/2/4/8/16/32/64/128 (pad heads to a power of two)",
                str(qn),
            )
            check(kvn == 1, op, "MLA D=512: key N must be 1")
            check(
                kw["sparse_mode"] in (0, 3, 4),
                op,
                "MLA D=512: sparse_mode must be 0, 3 or 4 (9 not modelled)",
            )
            check(kw["learnable_sink"] is None, op, "learnable_sink: value D must be <= 128")
            check(query.numel() > 0, op, "MLA D=512: empty tensors are not supported")
        else:
            fail(op, "MLA with query D=128 is not modelled by the simulation")
    else:
        check(d <= 512, op, "query D must be <= 512")
        check(d % 16 == 0, op, "float16/bfloat16 inputs: D must be a multiple of 16 (D轴需16对齐)", str(d))
        if layout == "TND":
            check(d in (128, 192), op, "TND without rope: Q_D and K_D must be 128 or 192", str(d))
        check(qn // kvn <= 64, op, "num_query_heads / num_key_value_heads must be <= 64", f"{qn}/{kvn}")

    # ---- keys: per batch lengths and where they live
    dv = value.shape[-1]
    if paged:
        check(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table: 2-D int32")
        check(
            block_table.shape[0] == nb,
            op,
            "block_table's first dim must equal B",
            f"{block_table.shape[0]} vs {nb}",
        )
        check(kvlen_arg is not None, op, "page attention: actual_seq_kvlen must be given")
        bs = kw["block_size"]
        check(bs > 0, op, "page attention: block_size must be given")
        check(
            key.dim() == 4 and key.shape[1] == kvn and key.shape[2] == bs,
            op,
            "paged key is (blocknum, KV_N, blocksize, D) here (3-D BSH caches not modelled)",
            str(tuple(key.shape)),
        )
        if mla and d == 512:
            check(
                bs % 16 == 0 and bs <= 1024,
                op,
                "MLA D=512 page attention: block_size a multiple of 16, <= 1024",
                str(bs),
            )
        elif s_q > 1:
            check(
                bs % 128 == 0 and 128 <= bs <= 512,
                op,
                "page attention, Q_S > 1: block_size in 128..512, a multiple of 128",
                str(bs),
            )
        else:
            check(
                bs % 16 == 0 and bs <= 512,
                op,
                "page attention, Q_S = 1: block_size 16-aligned for fp16/bf16",
                str(bs),
            )
        if layout == "TND":
            check(
                mla and d == 512,
                op,
                "TND page attention without 512-wide MLA is not modelled by the simulation",
            )
            check(
                len(kvlen_arg) == nb,
                op,
                "TND + page attention + D=512: actual_seq_kvlen has one PER-REQUEST length per batch "
                "(not cumulative)",
                f"{len(kvlen_arg)} entries for {nb} batches",
            )
            kvlens = list(kvlen_arg)
        else:
            check(len(kvlen_arg) == 1 or len(kvlen_arg) >= nb, op, "actual_seq_kvlen: length 1 or >= B")
            kvlens = list(kvlen_arg) * nb if len(kvlen_arg) == 1 else list(kvlen_arg[:nb])
        cap = block_table.shape[1] * bs
        check(
            all(0 <= n <= cap for n in kvlens),
            op,
            "actual_seq_kvlen: each length fits the block table (block_table width x block_size)",
            f"{kvlens} vs {cap}",
        )
        with unrecorded():
            for b, n in enumerate(kvlens):
                used = block_table[b, : math.ceil(n / bs)]
                if used.numel():
                    check(
                        int(used.min()) >= 0 and int(used.max()) < key.shape[0],
                        op,
                        "block_table ids must index the cache's blocks",
                        f"batch {b}",
                    )
    else:
        if layout == "TND":
            check(key.dim() == 3 and key.shape[1] == kvn, op, "TND key is (T_kv, KV_N, D)")
            check(len(kvlen_arg) == nb, op, "TND: one actual_seq_kvlen entry per batch")
            check(
                all(b >= a for a, b in zip([0, *kvlen_arg], kvlen_arg)) and kvlen_arg[-1] == key.shape[0],
                op,
                "TND: actual_seq_kvlen is CUMULATIVE, the last entry equals T_kv",
                str(list(kvlen_arg)),
            )
            kvlens = [b - a for a, b in zip([0, *kvlen_arg[:-1]], kvlen_arg)]
        else:
            check(
                key.dim() == 4 and key.shape[0] == nb and key.shape[2] == kvn,
                op,
                "BSND key is (B, S_kv, KV_N, D)",
            )
            s_kv = key.shape[1]
            if kvlen_arg is None:
                kvlens = [s_kv] * nb
            else:
                check(len(kvlen_arg) == 1 or len(kvlen_arg) >= nb, op, "actual_seq_kvlen: length 1 or >= B")
                kvlens = list(kvlen_arg) * nb if len(kvlen_arg) == 1 else list(kvlen_arg[:nb])
                check(
                    all(0 <= n <= s_kv for n in kvlens),
                    op,
                    "actual_seq_kvlen (non-TND) holds PER-BATCH lengths, each <= the key S",
                    f"{kvlens} vs S={s_kv}",
                )

    # ---- sparse mode and masks
    sparse, mask = kw["sparse_mode"], kw["atten_mask"]
    ignores_sparse = s_q == 1 and not mla  # "Q_S为1且不带rope输入时该参数无效"; pre/next too
    check(
        kw["inner_precise"] in ((0, 1) if s_q == 1 else (0, 1, 2, 3)),
        op,
        "Q_S = 1: inner_precise must be 0 or 1",
    )
    if not ignores_sparse:
        check(
            sparse in (0, 1, 2, 3, 4), op, "sparse_mode must be 0, 1, 2, 3 or 4 (9 not modelled)", str(sparse)
        )
        if sparse in (2, 3, 4):
            check(
                mask is not None, op, f"sparse_mode {sparse}: the compressed 2048x2048 atten_mask is required"
            )
            check(
                tuple(mask.shape) in ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)),
                op,
                f"sparse_mode {sparse}: atten_mask shape must be (2048, 2048)",
                str(tuple(mask.shape)),
            )
            with unrecorded():
                want = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
                check(
                    torch.equal(mask.reshape(2048, 2048).bool(), want),
                    op,
                    "sparse_mode 2/3/4: atten_mask must be the lower-triangular causal mask "
                    "(1 = masked above the diagonal)",
                )
        if sparse == 1:
            check(mask is not None, op, "sparse_mode 1 needs a full atten_mask")
        if sparse == 4:
            check(kw["pre_tokens"] >= 0 or kw["next_tokens"] >= 0, op, "sparse_mode 4: an empty band")
    if mask is not None and (ignores_sparse or sparse in (0, 1)):
        s_kv_mask = key.shape[1] if layout == "BSND" and not paged else None
        ok = mask.dim() == 4 and mask.shape[0] == nb and mask.shape[1] == 1 and mask.shape[2] == s_q
        if s_kv_mask is not None:
            ok = ok and mask.shape[3] == s_kv_mask
        check(
            ok,
            op,
            "full atten_mask shape (B, 1, Q_S, KV_S) (the forms this simulation models)",
            str(tuple(mask.shape)),
        )

    sink = kw["learnable_sink"]
    if sink is not None:
        check(layout in ("TND", "NTD_TND"), op, "learnable_sink: only TND / NTD_TND layouts")
        check(dv <= 128, op, "learnable_sink: value D must be <= 128")
        check(
            sink.dtype == torch.bfloat16 and tuple(sink.shape) == (qn,),
            op,
            "learnable_sink: bfloat16, shape (Q_N,)",
        )

    return dict(
        layout=layout,
        nb=nb,
        qlens=qlens,
        kvlens=kvlens,
        q_rows=q_rows,
        s_q=s_q,
        qn=qn,
        kvn=kvn,
        d=d,
        dv=dv,
        paged=paged,
        mla=mla,
        ignores_sparse=ignores_sparse,
    )


def _visible(plan: dict[str, Any], kw: dict[str, Any], b: int, n: int, L: int) -> torch.Tensor:
    """(n, L) bool: query row i of batch b may see key j."""
    i = torch.arange(n)[:, None]
    j = torch.arange(L)[None, :]
    vis = torch.ones((n, L), dtype=torch.bool)
    mask = kw["atten_mask"]
    if plan["ignores_sparse"]:
        if mask is not None:
            vis &= ~mask[b, 0, :n, :L].bool()
        return vis
    sparse = kw["sparse_mode"]
    diag = L - n  # right-down alignment
    if sparse == 0:
        if mask is not None:
            vis &= ~mask[b, 0, :n, :L].bool()
            vis &= (j - i <= kw["next_tokens"]) & (i - j <= kw["pre_tokens"])
    elif sparse == 1:
        vis &= ~mask[b, 0, :n, :L].bool()
    elif sparse == 2:
        vis &= j <= i
    elif sparse == 3:
        vis &= j <= i + diag
    elif sparse == 4:
        vis &= (j <= i + diag + kw["next_tokens"]) & (j >= i + diag - kw["pre_tokens"])
    return vis


def _fia_compute(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict[str, Any], plan: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    layout, qn, kvn, dv = plan["layout"], plan["qn"], plan["kvn"], plan["dv"]
    group = qn // kvn
    q_flat = query.reshape(-1, qn, query.shape[-1])  # rows in output order
    qr_flat = None if kw["query_rope"] is None else kw["query_rope"].reshape(-1, qn, 64)
    out = torch.full((q_flat.shape[0], qn, dv), float("nan"), dtype=torch.float32)
    lse = torch.full((q_flat.shape[0], qn), float("nan"), dtype=torch.float32)
    bs = kw["block_size"]
    kv_start = 0
    for b, (rows, n, L) in enumerate(zip(plan["q_rows"], plan["qlens"], plan["kvlens"])):
        if n == 0:
            kv_start += L
            continue
        ridx = torch.tensor(rows)
        if plan["paged"]:
            nblk = math.ceil(L / bs)
            ids = kw["block_table"][b, :nblk].long()
            k = key.index_select(0, ids).transpose(1, 2).reshape(-1, kvn, key.shape[-1])[:L]
            v = value.index_select(0, ids).transpose(1, 2).reshape(-1, kvn, dv)[:L]
            kr = None
            if kw["key_rope"] is not None:
                kr = kw["key_rope"].index_select(0, ids).transpose(1, 2).reshape(-1, kvn, 64)[:L]
        elif layout == "TND":
            k, v = key[kv_start : kv_start + L], value[kv_start : kv_start + L]
            kr = None if kw["key_rope"] is None else kw["key_rope"][kv_start : kv_start + L]
        else:
            k, v = key[b, :L], value[b, :L]
            kr = None if kw["key_rope"] is None else kw["key_rope"][b, :L]
        kv_start += L
        q = q_flat.index_select(0, ridx).float()  # (n, N, D)
        k = k.float().repeat_interleave(group, dim=1)  # (L, N, D)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k)
        if kr is not None and qr_flat is not None:
            qr = qr_flat.index_select(0, ridx).float()
            scores = scores + torch.einsum("nhd,lhd->hnl", qr, kr.float().repeat_interleave(group, dim=1))
        scores = scores * kw["softmax_scale"]
        vis = _visible(plan, kw, b, n, L)  # (n, L)
        scores = scores.masked_fill(~vis[None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # (N, n)
        denom = row_lse
        if kw["learnable_sink"] is not None:
            sink = kw["learnable_sink"].float()[:, None].expand_as(row_lse)
            denom = torch.logaddexp(row_lse, sink)
        probs = torch.exp(scores - denom[..., None])
        o = torch.einsum("hnl,lhd->nhd", probs, v)
        dead = ~vis.any(dim=-1)  # rows that see no key (no host sync: graphs may record this)
        fill = 0.0 if kw["inner_precise"] in (2, 3) else float("nan")  # no row-invalid correction: undefined
        o = torch.where(dead[:, None, None], torch.full((), fill), o)
        out[ridx] = o
        lse[ridx] = row_lse.transpose(0, 1)
    out = out.to(query.dtype)
    if layout == "BSND":
        out = out.view(plan["nb"], plan["s_q"], qn, dv)
        lse_out = lse.view(plan["nb"], plan["s_q"], qn).transpose(1, 2).unsqueeze(-1).contiguous()
    else:
        lse_out = lse.unsqueeze(-1)
    if not kw["return_softmax_lse"]:
        lse_out = torch.zeros(1, dtype=torch.float32)
    return out, lse_out


def _fia_kwargs(**kw: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = dict(
        query_rope=None,
        key_rope=None,
        atten_mask=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        block_table=None,
        learnable_sink=None,
        num_query_heads=1,
        num_key_value_heads=0,
        softmax_scale=1.0,
        pre_tokens=INT_MAX,
        next_tokens=INT_MAX,
        input_layout="BSH",
        sparse_mode=0,
        block_size=0,
        query_quant_mode=0,
        key_quant_mode=0,
        value_quant_mode=0,
        inner_precise=0,
        return_softmax_lse=False,
    )
    for name in _UNMODELLED_FIA:
        defaults[name] = None
    unknown = set(kw) - set(defaults)
    if unknown:
        raise TypeError(f"{_FIA}() got unexpected keyword arguments {sorted(unknown)}")
    return {**defaults, **kw}


class _FusedInferAttentionScoreV2:
    """torch_npu.npu_fused_infer_attention_score_v2 (and its `.out` form used in graph capture)."""

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kw = _fia_kwargs(**kwargs)
        with unrecorded():
            plan = _fia_checks_and_plan(query, key, value, kw)
        return _fia_compute(query, key, value, kw, plan)

    def out(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        out: Sequence[torch.Tensor],
        workspace: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Sequence[torch.Tensor]:
        o, lse = self(query, key, value, **kwargs)
        check(len(out) == 2, _FIA + ".out", "out is [attention_out, softmax_lse]")
        check(
            tuple(out[0].shape) == tuple(o.shape) and out[0].dtype == o.dtype,
            _FIA + ".out",
            "attention_out buffer shape/dtype",
            f"{tuple(out[0].shape)} vs {tuple(o.shape)}",
        )
        out[0].copy_(o)
        if tuple(out[1].shape) == tuple(lse.shape):
            out[1].copy_(lse)
        return out


npu_fused_infer_attention_score_v2 = _FusedInferAttentionScoreV2()


# =========================================================================== KV writes


def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    op = "npu_scatter_nd_update_"
    with unrecorded():
        check(indices.dtype in (torch.int32, torch.int64), op, "indices: int32 or int64")
        check(
            indices.dim() == 2 and indices.shape[1] == 1,
            op,
            "indices (N, 1) index input's first dim (the form modelled)",
        )
        check(
            updates.dtype == input.dtype,
            op,
            "updates dtype must equal input dtype",
            f"{updates.dtype} vs {input.dtype}",
        )
        check(
            tuple(updates.shape) == (indices.shape[0], *input.shape[1:]),
            op,
            "updates shape = indices.shape[:-1] + input.shape[1:]",
            f"{tuple(updates.shape)}",
        )
        if indices.numel():
            check(
                int(indices.min()) >= 0 and int(indices.max()) < input.shape[0],
                op,
                "indices must lie in [0, input.shape[0]) (no -1 padding slots)",
            )
    input.index_copy_(0, indices.view(-1).long(), updates)
    return input


# =========================================================================== MoE


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: Any = None,
    tid2eid: Any = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "npu_moe_gating_top_k"
    with unrecorded():
        check(x.dim() == 2 and x.dtype in _FLOATS, op, "x: 2-D float16/bfloat16/float32")
        e = x.shape[1]
        check(e <= 2048, op, "x's last dim (experts) must be <= 2048")
        check(
            input_ids is None and tid2eid is None,
            op,
            "hash mode (input_ids / tid2eid) is not modelled by the simulation",
        )
        if bias is not None:
            check(
                bias.dim() == 1 and bias.shape[0] == e and bias.dtype == x.dtype,
                op,
                "bias: 1-D, x's last dim, same dtype as x",
                f"{bias.dtype} vs {x.dtype}",
            )
        check(
            group_count > 0 and e % group_count == 0 and e // group_count > 2,
            op,
            "group_count: x_shape[-1] divisible by it with a quotient > 2",
            f"E={e}, group_count={group_count}",
        )
        check(
            math.ceil(e // group_count / 32) * 32 * group_count <= 2048,
            op,
            "align32(E/group_count)*group_count <= 2048",
        )
        check(1 <= k_group <= group_count, op, "1 <= k_group <= group_count")
        check(1 <= k <= e // group_count * k_group, op, "1 <= k <= x_shape[-1] / group_count * k_group")
        check(renorm == 0, op, "renorm: only 0 is supported")
        check(
            norm_type in (0, 1) and group_select_mode in (0, 1),
            op,
            "norm_type and group_select_mode are 0 or 1",
        )
    xf = x.float()
    scores = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    sel = scores if bias is None else scores + bias.float()
    t = x.shape[0]
    if group_count > 1:
        g = sel.view(t, group_count, -1)
        gs = g.amax(dim=-1) if group_select_mode == 0 else g.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :k_group]
        drop = torch.ones_like(gs, dtype=torch.bool).scatter_(1, keep, False)
        sel = g.masked_fill(drop[..., None], float("-inf")).view(t, -1)
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = scores if out_flag else torch.empty(0, dtype=torch.float32)
    return y.to(x.dtype), idx.to(torch.int32), norm_out


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: Any = None,
    offset: Any = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, ...]:
    op = "npu_moe_init_routing_v2"
    with unrecorded():
        check(
            x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0],
            op,
            "x (NUM_ROWS, H) and expert_idx (NUM_ROWS, K)",
        )
        check(expert_idx.dtype == torch.int32, op, "expert_idx dtype must be int32", str(expert_idx.dtype))
        check(
            scale is None and offset is None and quant_mode == -1,
            op,
            "quantised routing is not modelled by the simulation",
        )
        check(drop_pad_mode == 0, op, "drop_pad mode is not modelled by the simulation")
        check(active_num >= 0, op, "active_num must be >= 0 (0 = dropless)")
        check(
            expert_tokens_num_type in (0, 1),
            op,
            "expert_tokens_num_type 0 (cumsum) or 1 (count) are modelled",
        )
        check(row_idx_type in (0, 1), op, "row_idx_type is 0 (gather) or 1 (scatter)")
        check(0 < expert_num <= 10240, op, "expert_num must be given (<= 10240)")
        rng = list(active_expert_range) or [0, expert_num]
        check(
            len(rng) == 2 and 0 <= rng[0] < rng[1] <= expert_num,
            op,
            "active_expert_range [start, end), end <= expert_num",
        )
        if expert_idx.numel():
            check(
                int(expert_idx.min()) >= 0 and int(expert_idx.max()) < expert_num,
                op,
                "expert ids must be < expert_num",
            )
    k = expert_idx.shape[1]
    start, end = rng
    flat = expert_idx.reshape(-1).long()
    key = torch.where(flat < start, torch.full_like(flat, INT_MAX), flat)
    key = torch.where(key >= end, torch.full_like(flat, INT_MAX), key)
    order = torch.sort(key, stable=True).indices  # TOKEN-MAJOR source ids sorted by expert
    avail = int(((flat >= start) & (flat < end)).sum())
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
    else:
        row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32)
        row_idx[order[:avail]] = torch.arange(avail, dtype=torch.int32)
    n = avail if active_num == 0 else min(active_num, avail)
    expanded_x = x.index_select(0, order[:n] // k)
    counts = torch.bincount(flat[(flat >= start) & (flat < end)] - start, minlength=end - start).to(
        torch.int64
    )
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    if not expert_tokens_num_flag:
        tokens = torch.empty(0, dtype=torch.int64)
    return expanded_x, row_idx, tokens, torch.empty(0, dtype=torch.float32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Any = None,
) -> torch.Tensor:
    op = "npu_moe_token_unpermute"
    with unrecorded():
        check(
            permuted_tokens.dim() == 2 and permuted_tokens.dtype in _FLOATS, op, "permuted_tokens: 2-D float"
        )
        check(
            sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32, op, "sorted_indices: 1-D int32"
        )
        check(not padded_mode and restore_shape is None, op, "padded_mode: only False is supported")
        n = sorted_indices.numel()
        top_k = 1 if probs is None else probs.shape[-1]
        if probs is not None:
            check(
                probs.dim() == 2 and probs.dtype in _FLOATS and probs.shape[0] * top_k == n,
                op,
                "probs: 2-D (tokens, topK) with tokens * topK = sorted_indices' length",
            )
        check(top_k <= 512, op, "topK_num must be <= 512")
        check(permuted_tokens.shape[0] >= n, op, "permuted_tokens must hold tokens * topK rows")
        if n:
            check(
                int(sorted_indices.min()) >= 0 and int(sorted_indices.max()) < n,
                op,
                "sorted_indices values in [0, tokens * topK - 1]",
            )
            check(torch.unique(sorted_indices).numel() == n, op, "sorted_indices: no repeated index")
    y = permuted_tokens.index_select(0, sorted_indices.long()).float()
    if probs is None:
        return y.to(permuted_tokens.dtype)
    y = y.view(probs.shape[0], top_k, -1) * probs.float()[..., None]
    return y.sum(dim=1).to(permuted_tokens.dtype)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: Any = None,
    scale: Any = None,
    offset: Any = None,
    antiquant_scale: Any = None,
    antiquant_offset: Any = None,
    per_token_scale: Any = None,
    group_list: torch.Tensor | None = None,
    activation_input: Any = None,
    activation_quant_scale: Any = None,
    activation_quant_offset: Any = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    tuning_config: Any = None,
    output_dtype: Any = None,
) -> list[torch.Tensor]:
    op = "npu_grouped_matmul"
    with unrecorded():
        check(
            isinstance(x, list | tuple) and isinstance(weight, list | tuple),
            op,
            "x and weight are lists of tensors (Tensor[])",
        )
        check(group_type is not None, op, "Requires manual passing group_type")
        for name, v in (
            ("bias", bias),
            ("scale", scale),
            ("offset", offset),
            ("antiquant_scale", antiquant_scale),
            ("per_token_scale", per_token_scale),
            ("activation_input", activation_input),
        ):
            check(v is None, op, f"{name} is not modelled by the simulation")
        check(
            act_type == 0 and output_dtype is None,
            op,
            "act_type / output_dtype are not modelled by the simulation",
        )
        check(
            len(x) == 1 and len(weight) == 1 and group_type == 0 and split_item in (2, 3),
            op,
            "the modelled form: x=[h (M, K)], weight=[W (E, K, N)], group_type=0, split_item 2/3",
        )
        h, w = x[0], weight[0]
        check(h.dim() == 2 and w.dim() == 3 and h.shape[1] == w.shape[1], op, "x (M, K) and weight (E, K, N)")
        check(h.dtype == w.dtype and h.dtype in _FLOATS, op, "x and weight: the same float dtype")
        check(
            w.is_contiguous() or w.transpose(1, 2).is_contiguous(),
            op,
            "weight: contiguous (E, K, N) or the transposed view of a contiguous (E, N, K)",
        )
        check(
            group_list is not None and group_list.dim() == 1 and group_list.shape[0] == w.shape[0],
            op,
            "group_list: 1-D, one entry per weight group",
        )
        assert group_list is not None
        check(group_list.dtype == torch.int64, op, "group_list dtype int64")
        check(group_list_type in (0, 1), op, "group_list_type 0 (cumsum) or 1 (counts)")
        gl = group_list.tolist()
        if group_list_type == 1:
            check(
                min(gl) >= 0 and sum(gl) == h.shape[0],
                op,
                "group_list_type 1: counts summing to M",
                f"{gl} vs M={h.shape[0]}",
            )
        else:
            check(
                all(b >= a for a, b in zip([0, *gl], gl)) and gl[-1] == h.shape[0],
                op,
                "group_list_type 0: a non-decreasing cumsum ending at M",
                str(gl),
            )
    assert group_list is not None
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    rows_group = torch.repeat_interleave(torch.arange(w.shape[0]), counts, output_size=h.shape[0])  # (M,)
    out = torch.einsum("mk,mkn->mn", h.float(), w.float().index_select(0, rows_group))
    return [out.to(h.dtype)]


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    op = "npu_swiglu"
    with unrecorded():
        check(x.dtype in _FLOATS, op, "x: float16/bfloat16/float32")
        check(x.shape[dim] % 2 == 0, op, "the split dim must be even")
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_clipped_swiglu(
    x: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    dim: int = -1,
    alpha: float = 1.702,
    limit: float = 7.0,
    bias: float = 1.0,
    interleaved: bool = True,
) -> torch.Tensor:
    """aclnnClippedSwiglu: A, B = halves of x along dim (interleaved: even / odd columns);
    A = min(A, limit), B = clamp(B, -limit, limit); y = A * sigmoid(alpha * A) * (B + bias)."""
    op = "npu_clipped_swiglu"
    with unrecorded():
        check(group_index is None, op, "group_index (MoE groups) is not modelled")
        check(x.dtype in _FLOATS, op, "x: float16/bfloat16/float32")
        check(x.is_contiguous(), op, "x must be contiguous")
        check(x.numel() > 0, op, "empty tensors are not supported")
        check(x.shape[dim] % 2 == 0, op, "the split dim must be even")
    xf = x.float()
    if interleaved:
        a, b = xf.movedim(dim, -1)[..., 0::2], xf.movedim(dim, -1)[..., 1::2]
        a, b = a.movedim(-1, dim), b.movedim(-1, dim)
    else:
        a, b = xf.chunk(2, dim=dim)
    a = a.clamp(max=limit)
    b = b.clamp(-limit, limit)
    return (a * torch.sigmoid(alpha * a) * (b + bias)).to(x.dtype)


# =========================================================================== lightning indexer

_LI_SPARSE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)
_LI_DEFAULT_TOKENS = 2**63 - 1


def npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_key: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = _LI_DEFAULT_TOKENS,
    next_tokens: int = _LI_DEFAULT_TOKENS,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: score[j] = sum_h weights[h] * relu(query[h] . key[j]) over the keys the mask
    lets through, -> the ids of the sparse_count best (descending), -1 past the visible keys.
    Modelled: layout_query "TND", layout_key "PA_BSND" (the paged form the backend calls).
    query (T1, N1, 128), key (block_count, block_size, 1, 128) -> (T1, 1, sparse_count) int32.
    Ties: the doc is silent; the simulation keeps the lower key id first (stable sort)."""
    op = "npu_lightning_indexer"
    with unrecorded():
        check(
            layout_query == "TND" and layout_key == "PA_BSND", op, "only TND query / PA_BSND key are modelled"
        )
        check(query.dtype in _HALF, op, "query: bfloat16/float16", str(query.dtype))
        check(key.dtype == query.dtype, op, "query and key must have the same dtype")
        check(
            weights.dtype == torch.float32 or weights.dtype == query.dtype,
            op,
            "weights: float32, or the dtype of query and key",
        )
        for name, t in (("query", query), ("key", key), ("weights", weights)):
            check(t.is_contiguous(), op, f"{name}: non-contiguous tensors are not supported")
        check(query.dim() == 3, op, "TND query is (T1, N1, D)", str(tuple(query.shape)))
        t1, n1, d = query.shape
        check(n1 <= 64, op, "query N1 <= 64", str(n1))
        check(key.dim() == 4 and key.shape[2] == 1, op, "PA_BSND key is (block_count, block_size, N2 = 1, D)")
        check(d == 128 and key.shape[3] == 128, op, "D of query and key must both be 128")
        bs = key.shape[1]
        check(bs % 16 == 0 and 0 < bs <= 1024, op, "block_size a multiple of 16, at most 1024", str(bs))
        check(tuple(weights.shape) == (t1, n1), op, "TND weights are (T, N1)", str(tuple(weights.shape)))
        check(
            1 <= sparse_count <= 2048 or sparse_count in _LI_SPARSE_COUNTS,
            op,
            "sparse_count in [1, 2048] or 3072..8192 by 1024",
        )
        check(sparse_mode in (0, 3), op, "sparse_mode 0 (no mask) or 3 (right-down causal)")
        check(
            pre_tokens == next_tokens == _LI_DEFAULT_TOKENS, op, "pre_tokens / next_tokens: only the default"
        )
        check(not return_value, op, "return_value is training-only and not for PA_BSND")
        for name, lens in (
            ("actual_seq_lengths_query", actual_seq_lengths_query),
            ("actual_seq_lengths_key", actual_seq_lengths_key),
        ):
            check(isinstance(lens, torch.Tensor), op, f"{name}: required (TND / PA_BSND), an int32 tensor")
            assert isinstance(lens, torch.Tensor)
            check(lens.dtype == torch.int32 and lens.dim() == 1, op, f"{name}: 1-D int32 tensor")
        assert actual_seq_lengths_query is not None and actual_seq_lengths_key is not None
        cq = actual_seq_lengths_query.tolist()
        kv = actual_seq_lengths_key.tolist()
        check(len(cq) == len(kv), op, "both length tensors have B entries")
        check(
            all(b >= a for a, b in zip([0, *cq], cq)) and (not cq or cq[-1] == t1),
            op,
            "TND actual_seq_lengths_query is CUMULATIVE (non-decreasing, ending at T1)",
            str(cq),
        )
        check(all(n >= 0 for n in kv), op, "actual_seq_lengths_key >= 0 (per request for PA_BSND)")
        check(isinstance(block_table, torch.Tensor), op, "PA_BSND needs block_table")
        assert block_table is not None
        check(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table: 2-D int32")
        check(block_table.shape[0] == len(kv), op, "block_table's first dim = B")
        need = max([-(-n // bs) for n in kv], default=0)
        check(block_table.shape[1] >= need, op, "block_table's second dim >= the most blocks a request uses")
    out = torch.full((t1, 1, sparse_count), -1, dtype=torch.int32, device=query.device)
    flat_key = key.view(-1, d)
    start = 0
    for b, (end, n_kv) in enumerate(zip(cq, kv)):
        rows, start = list(range(start, end)), end
        if not rows or n_kv == 0:
            continue
        pos = torch.arange(n_kv)
        with unrecorded():
            blocks = block_table[b, : -(-n_kv // bs)].long()
            check(int(blocks.min()) >= 0 and int(blocks.max()) < key.shape[0], op, "block ids inside key")
        k = flat_key.index_select(0, blocks[pos // bs] * bs + pos % bs).float()  # (S2, D)
        q = query[rows[0] : end].float()  # (S1, N1, D)
        w = weights[rows[0] : end].float()
        scores = (torch.relu(torch.einsum("snd,kd->snk", q, k)) * w[..., None]).sum(dim=1)  # (S1, S2)
        if sparse_mode == 3:  # query i sees key j iff j <= i + S2 - S1
            s1 = len(rows)
            seen = pos[None, :] <= torch.arange(s1)[:, None] + n_kv - s1
            scores = scores.masked_fill(~seen, float("-inf"))
        top = scores.sort(dim=-1, descending=True, stable=True)
        n = min(sparse_count, n_kv)
        ids = torch.where(torch.isfinite(top.values[:, :n]), top.indices[:, :n], -1)
        out[rows[0] : end, 0, :n] = ids.to(torch.int32)
    return out, query.new_empty(0)


# =========================================================================== fusion attention (FA)


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX,
    next_tockens: int = INT_MAX,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """torch_npu.npu_fusion_attention, the TND (varlen) layout without a mask only (what the
    backend calls): per batch entry b, rows actual_seq_qlen[b-1]..actual_seq_qlen[b] (CUMULATIVE
    lengths, "TND: actual_seq_qlen/actual_seq_kvlen需传值") attend to the same range of keys, no
    mask (sparse_mode 0, atten_mask None: every key). Returns (attention_out, softmax_max,
    softmax_sum, softmax_out, seed, offset, mask_length); only attention_out is modelled."""
    op = "npu_fusion_attention"
    with unrecorded():
        check(input_layout == "TND", op, "only input_layout TND is modelled by the simulation", input_layout)
        for name, t in (("pse", pse), ("padding_mask", padding_mask), ("atten_mask", atten_mask)):
            check(t is None, op, f"{name} is not modelled by the simulation")
        check(prefix is None and keep_prob == 1.0, op, "prefix / dropout are not modelled by the simulation")
        check(sparse_mode == 0, op, "only sparse_mode 0 (no mask) is modelled by the simulation")
        check(query.dtype in _FLOATS, op, "query: FLOAT16, BFLOAT16 or FLOAT32", str(query.dtype))
        check(key.dtype == query.dtype and value.dtype == query.dtype, op, "query, key, value of one dtype")
        check(query.dim() == 3 and key.dim() == 3, op, "TND tensors are (T, N, D)")
        check(tuple(key.shape) == tuple(value.shape), op, "value's shape must equal key's")
        check(query.shape[1] == head_num and key.shape[1] == head_num, op, "N == head_num (no GQA modelled)")
        check(query.shape[2] == key.shape[2], op, "query and key share D")
        check(query.shape[2] % 16 == 0 and query.shape[2] <= 512, op, "D a multiple of 16, at most 512")
        for name, t in (("query", query), ("key", key), ("value", value)):
            check(
                t.is_contiguous(),
                op,
                f"{name}: non-contiguous tensors are not supported (不支持非连续的Tensor)",
            )
        for name, v in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
            check(_is_host_int_list(v), op, f"{name} is a host int list (List[int]) in TND")
        assert actual_seq_qlen is not None and actual_seq_kvlen is not None
        check(
            list(actual_seq_qlen) == list(actual_seq_kvlen), op, "self-attention here: q and kv lengths equal"
        )
        cum = [0, *actual_seq_qlen]
        check(
            all(b > a for a, b in itertools.pairwise(cum)),
            op,
            "cumulative lengths strictly increasing (no empty batch)",
        )
        check(cum[-1] == query.shape[0] == key.shape[0], op, "the last cumulative length is T")
    out = torch.empty_like(query)
    for a, b in itertools.pairwise(cum):
        s = torch.einsum("qnd,knd->nqk", query[a:b].float(), key[a:b].float()) * scale
        out[a:b] = torch.einsum("nqk,knd->qnd", torch.softmax(s, dim=-1), value[a:b].float()).to(query.dtype)
    empty = torch.empty(0)
    return out, empty, empty, empty, 0, 0, 0


# =========================================================================== norms, rope


def npu_rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_rms_norm"
    with unrecorded():
        check(
            x.dtype in _FLOATS and gamma.dtype == x.dtype,
            op,
            "x float16/bfloat16/float32, gamma of the same dtype",
        )
        check(
            tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]), op, "gamma matches x's last dims"
        )
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "npu_add_rms_norm"
    with unrecorded():
        check(x1.shape == x2.shape and x1.dtype == x2.dtype, op, "x1 and x2: same shape and dtype")
        check(x1.dtype in _FLOATS and gamma.dtype == x1.dtype, op, "gamma dtype equals x1's")
        check(
            tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim() :]), op, "gamma matches x's last dims"
        )
    h = x1.float() + x2.float()
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(x1.dtype), rstd, h.to(x1.dtype)


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate: Any = None
) -> torch.Tensor:
    op = "npu_rotary_mul"
    with unrecorded():
        check(rotate is None, op, "rotate is not modelled by the simulation")
        modes = ("half", "interleave") + (("quarter", "interleave-half") if STATE.soc_version >= 260 else ())
        check(rotary_mode in modes, op, f"rotary_mode must be one of {modes}", rotary_mode)
        check(
            rotary_mode in ("half", "interleave"),
            op,
            f"rotary_mode {rotary_mode} is not modelled by the simulation",
        )
        check(input.dim() in (3, 4), op, "input is 3-D or 4-D")
        check(
            input.dtype in _FLOATS and r1.dtype == input.dtype and r2.dtype == input.dtype,
            op,
            "input, r1, r2: float16/bfloat16/float32 of one dtype",
        )
        d = input.shape[-1]
        check(d % 2 == 0 and d < 896, op, "D must be even and < 896", str(d))
        check(r1.shape == r2.shape and r1.shape[-1] == d, op, "r1 and r2: equal shapes with input's D")
        if input.dim() == 3:  # TND: r1/r2 T1D (interleave) or T1D / TND (half)
            t, n, _ = input.shape
            ok = {(t, 1, d)} | ({(t, n, d)} if rotary_mode == "half" else set())
            check(
                tuple(r1.shape) in ok,
                op,
                f"TND input: r1/r2 shape {'T1D or TND' if rotary_mode == 'half' else 'T1D'}",
                str(tuple(r1.shape)),
            )
        if r1.numel():
            check(
                float(r1.abs().max()) <= 1.0 + 1e-3 and float(r2.abs().max()) <= 1.0 + 1e-3,
                op,
                "r1/r2 (cos/sin) values in [-1, 1]",
            )
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * r1.float() + rot * r2.float()).to(input.dtype)


# =========================================================================== FP8 (Ascend 950)


def _fp8_dtype_ok(dst: Any) -> bool:
    return dst in (torch.float8_e4m3fn, FLOAT8_E4M3FN)


def npu_dynamic_block_quant(
    x: torch.Tensor,
    *,
    min_scale: float = 0.0,
    round_mode: str = "rint",
    dst_type: Any = 1,
    row_block_size: int = 1,
    col_block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_dynamic_block_quant"
    with unrecorded():
        check(
            STATE.soc_version >= 260,
            op,
            "float8 outputs need an Ascend 950 (SoC 260)",
            f"SoC {STATE.soc_version}",
        )
        check(_fp8_dtype_ok(dst_type), op, "dst_type float8_e4m3fn is the modelled FP8 output")
        check(x.dim() == 2 and x.dtype in _HALF, op, "x: 2-D float16/bfloat16")
        check(x.numel() > 0, op, "empty inputs are not modelled by the simulation")
        check(row_block_size == 1 and col_block_size == 128, op, "block sizes (1, 128) are the modelled form")
        check(round_mode == "rint", op, "round_mode 'rint' is the modelled form")
    m, k = x.shape
    pad = -k % 128
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, 128)
    scale = (xf.abs().amax(dim=-1) / 448.0).clamp(min=min_scale)
    y = torch.where(scale[..., None] > 0, xf / scale.clamp(min=1e-30)[..., None], torch.zeros_like(xf))
    return y.clamp(-448, 448).view(m, -1)[:, :k].to(torch.float8_e4m3fn), scale


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: Any = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: Any = None,
    output_dtype: Any = None,
    x1_dtype: Any = None,
    x2_dtype: Any = None,
    pertoken_scale_dtype: Any = None,
    scale_dtype: Any = None,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    op = "npu_quant_matmul"
    with unrecorded():
        check(
            STATE.soc_version >= 260,
            op,
            "FP8 inputs need an Ascend 950 (SoC 260)",
            f"SoC {STATE.soc_version}",
        )
        check(
            x1.dtype == torch.float8_e4m3fn and x2.dtype == x1.dtype,
            op,
            "x1 and x2: float8_e4m3fn (the modelled form)",
        )
        check(
            offset is None and bias is None and scale_dtype is None,
            op,
            "offset / bias / scale_dtype are not modelled",
        )
        check(
            list(group_sizes or []) == [1, 128, 128],
            op,
            "group_sizes [1, 128, 128] (block scales) is the modelled form",
        )
        check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], op, "x1 (M, K), x2 (K, N)")
        m, k = x1.shape
        n = x2.shape[1]
        check(
            x2.t().is_contiguous(),
            op,
            "x2 is the transposed view of a contiguous (N, K) weight (transpose strides are checked)",
        )
        check(
            tuple(scale.shape) == (math.ceil(k / 128), math.ceil(n / 128)) and scale.dtype == torch.float32,
            op,
            "scale: float32 (ceil(K/128), ceil(N/128))",
            str(tuple(scale.shape)),
        )
        check(
            scale.t().is_contiguous(),
            op,
            "scale is the transposed view of the weight's (N/128, K/128) scales",
        )
        check(
            pertoken_scale is not None
            and tuple(pertoken_scale.shape) == (m, math.ceil(k / 128))
            and pertoken_scale.dtype == torch.float32,
            op,
            "pertoken_scale: float32 (M, ceil(K/128))",
        )
        check(
            output_dtype in (torch.bfloat16, torch.float16),
            op,
            "output_dtype: bfloat16 or float16",
            str(output_dtype),
        )
    assert pertoken_scale is not None
    k, n = x2.shape
    xs = pertoken_scale.repeat_interleave(128, dim=1)[:, :k]
    ws = scale.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    return ((x1.float() * xs) @ (x2.float() * ws)).to(output_dtype)

"""Mutants of the reference backend: copies with one op subtly wrong, each the kind of slip a
real port could ship, and the conformance cases that must catch it. The conformance suite must
FAIL each one (tests/test_conformance_mutations.py, ci/mutation_run.py). Engine mutants
(ENGINE_MUTANT_LIST) break a policy of the engine instead, and the tests of docs/policies.md
must fail them.

Each mutant replaces one part of the reference backend by a subclass that overrides one op.
They are registered with the suite through `--deepinfer-plugin deepinfer.testing.mutants:MUTANTS`
(importable in the suite's process and in the processes its collective cases spawn), and each
run selects only the cases that concern it (-k, `Mutant.select`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.backend import (
    NO_MODIFIERS,
    Availability,
    Backend,
    BackendInfo,
    BackendOptions,
    MoeOps,
    SmallOps,
    hookimpl,
)
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import moe as ref_moe
from deepinfer.reference import small as ref_small
from deepinfer.reference import v4 as ref_v4
from deepinfer.reference.backend import (
    ReferenceAttention,
    ReferenceCollectives,
    ReferenceGemm,
    create_reference_backend,
)

ROOT = Path(__file__).resolve().parents[2]  # the tree deepinfer is imported from
PLUGIN_SPEC = "deepinfer.testing.mutants:MUTANTS"


# --------------------------------------------------------------------------- the mutants


def filter_dropping_crossing_token(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The reference filter with the classic top-p slip: keep tokens whose cumulative mass
    INCLUDING themselves is <= top_p, so the token that crosses top_p is dropped."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(dim=-1) > top_p[:, None]  # the bug: the reference tests the mass BEFORE
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def race(
    logits: torch.Tensor, filtered: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    sampled = (torch.softmax(filtered, dim=-1) / noise).argmax(dim=-1)
    return torch.where(temperature <= 0, logits.argmax(dim=-1), sampled)


class TopPDropsCrossingToken(SmallOps):
    def sample(self, logits, temperature, top_k, top_p, min_p, exp_noise):  # type: ignore[no-untyped-def]
        logits = logits.float()
        scaled = logits / torch.where(temperature <= 0, 1.0, temperature)[:, None]
        return race(
            logits, filter_dropping_crossing_token(scaled, top_k, top_p, min_p), temperature, exp_noise
        )


class TemperatureAfterFilters(SmallOps):
    def sample(self, logits, temperature, top_k, top_p, min_p, exp_noise):  # type: ignore[no-untyped-def]
        logits = logits.float()
        filtered = ref_small.filter_logits(logits, top_k, top_p, min_p)  # the bug: filters first
        tempered = filtered / torch.where(temperature <= 0, 1.0, temperature)[:, None]
        return race(logits, tempered, temperature, exp_noise)


class RmsNormWithoutEps(SmallOps):
    def rms_norm(self, x, weight, eps):  # type: ignore[no-untyped-def]
        h = x.float()
        y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True)) * weight.float()  # the bug: no eps
        return y.to(x.dtype)


class RmsNormEpsDoubled(SmallOps):
    def rms_norm(self, x, weight, eps):  # type: ignore[no-untyped-def]
        return ref_small.rms_norm(x, weight, 2 * eps)  # the bug: eps read twice


class RouterTopkTies(MoeOps):
    """Selection by torch.topk, whose tie order is unspecified (the reference's before the tie
    rule was stated): right on every untied score."""

    def route(self, logits, config, correction_bias=None, hash_ids=None):  # type: ignore[no-untyped-def]
        scores = ref_moe.scores_of(logits, config.scoring)
        if hash_ids is not None:
            return super().route(logits, config, correction_bias, hash_ids)
        sel = scores if correction_bias is None else scores + correction_bias.float()
        if config.num_groups > 1:
            t, e = sel.shape
            groups = sel.view(t, config.num_groups, e // config.num_groups)
            if config.group_score == "top2_sum":
                group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = groups.amax(dim=-1)
            keep = group_scores.topk(config.topk_groups, dim=-1).indices
            mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            sel = groups.masked_fill(mask[..., None], float("-inf")).view(t, e)
        ids = sel.topk(config.top_k, dim=-1).indices.to(torch.int32)
        return super().route(logits, config, correction_bias, ids)  # weights at those experts


class NoOpCollectives(ReferenceCollectives):
    """Every op returns its input (or a copy): exactly right in a world of one."""

    def all_reduce(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        return t.clone()

    def reduce_scatter(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        return t.clone()

    def all_to_all_single(
        self,
        t: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        group: Any = None,
    ) -> torch.Tensor:
        return t.clone()

    def broadcast(self, t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
        return t

    def barrier(self, group: Any = None) -> None:
        pass


class AttentionIgnoresScale(ReferenceAttention):
    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):  # type: ignore[no-untyped-def]
        return super().prefill(q, cache, meta, scale=q.shape[-1] ** -0.5, v_dim=v_dim, modifiers=modifiers)


class AttentionScaleOnePercent(ReferenceAttention):
    """The softmax scale 1% too large (a folded constant, a YaRN factor applied once too often):
    inside bfloat16's elementwise budget on random inputs."""

    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):  # type: ignore[no-untyped-def]
        return super().prefill(q, cache, meta, scale=scale * 1.01, v_dim=v_dim, modifiers=modifiers)


class RmsNormWeightOnePercent(SmallOps):
    """The norm weight read 1% too large (e.g. a (1 + w) convention applied to a rescaled w)."""

    def rms_norm(self, x, weight, eps):  # type: ignore[no-untyped-def]
        return ref_small.rms_norm(x, weight.float() * 1.01, eps)


class RopeOnePercent(SmallOps):
    """The rotary output 1% too large (a cos/sin table scaled by a stray mscale)."""

    def rope(self, x, positions, cos_sin_cache, interleaved):  # type: ignore[no-untyped-def]
        return ref_small.rope(x, positions, cos_sin_cache * 1.01, interleaved)


class AttentionNaNWhenNoKey(ReferenceAttention):
    """The classic 0/0: a query row whose top-k list names no visible key gets NaN (an empty
    softmax) instead of the edge rule's zeros."""

    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):  # type: ignore[no-untyped-def]
        out = super().prefill(q, cache, meta, scale=scale, v_dim=v_dim, modifiers=modifiers)
        if modifiers.topk_indices is None:
            return out
        start = 0
        for kv_len, n in zip(meta.seq_lens.tolist(), meta.query_start_loc.diff().tolist()):
            positions = torch.arange(kv_len - n, kv_len)
            topk = modifiers.topk_indices[start : start + n].cpu()
            seen = ref_attention.visible_mask(positions, kv_len, modifiers.window, topk).any(dim=-1)
            out[start : start + n][~seen] = float("nan")
            start += n
        return out


class AttentionWindowOffByOne(ReferenceAttention):
    """p - j <= window instead of < window: one key too many."""

    def prefill(self, q, cache, meta, *, scale, v_dim, modifiers=NO_MODIFIERS):  # type: ignore[no-untyped-def]
        if modifiers.window is not None:
            modifiers = dataclasses.replace(modifiers, window=modifiers.window + 1)
        return super().prefill(q, cache, meta, scale=scale, v_dim=v_dim, modifiers=modifiers)


class MlaQueryRopeLayoutFixed(ReferenceAttention):
    """MLA's query with the rope layout of one checkpoint family, whatever `interleaved` says."""

    def mla_query(self, q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved):  # type: ignore[no-untyped-def]
        return super().mla_query(q_nope, q_pe, w_uk, positions, cos_sin_cache, False)


class CompressedAttentionIgnoresTopk(ReferenceAttention):
    """DeepSeek-V4 CSA: every visible compressed entry attended, the indexer's choice dropped."""

    def compressed_attention(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["modifiers"] = dataclasses.replace(kwargs.get("modifiers", NO_MODIFIERS), topk_indices=None)
        return super().compressed_attention(*args, **kwargs)


class CompressedAttentionSharedTables(ReferenceAttention):
    """DeepSeek-V4: the compressed entries read through the token cache's block tables, the
    entry group's own tables (compressed_block_tables) dropped."""

    def compressed_attention(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.pop("compressed_block_tables", None)
        return super().compressed_attention(*args, **kwargs)


class IndexerPicksLowest(ReferenceAttention):
    """A sign slip in the lightning indexer: the lowest-scoring entries are kept."""

    def indexer_topk(self, q, weights, keys, meta, *, ratio, topk, scale):  # type: ignore[no-untyped-def]
        return super().indexer_topk(q, -weights, keys, meta, ratio=ratio, topk=topk, scale=scale)


class VarlenAttentionAcrossImages(ReferenceAttention):
    """The vision tower's attention over the whole batch: the segments' bounds dropped, so
    each image attends to the other images' patches too."""

    def varlen_attention(self, q, k, v, cu_seqlens, max_seqlen, *, scale):  # type: ignore[no-untyped-def]
        whole = torch.stack([cu_seqlens[0], cu_seqlens[-1]])
        return super().varlen_attention(q, k, v, whole, int(q.shape[0]), scale=scale)


class CandidateBlocksIgnored(ReferenceAttention):
    """DeepSeek-V4.1's second stage picking among every visible entry, its candidate blocks
    dropped."""

    def indexer_topk_in_blocks(  # type: ignore[no-untyped-def]
        self, q, weights, keys, meta, blocks, *, ratio, topk, scale, block_size, key_format=None
    ):
        return self.quantized_indexer_topk(
            q, weights, keys, meta, ratio=ratio, topk=topk, scale=scale, key_format=key_format
        )


class IndexQueriesUnrounded(ReferenceAttention):
    """DeepSeek-V4.1's FP4 indexer scoring its MXFP4 keys with float queries (only the keys
    rounded)."""

    def quantized_indexer_topk(  # type: ignore[no-untyped-def]
        self, q, weights, keys, meta, *, ratio, topk, scale, key_format
    ):
        return ref_v4.indexer_topk(q, weights, keys, meta, ratio, topk, scale, self._row_reader(key_format))


class HyperConnectionCombTransposed(SmallOps):
    """mHC's residual mix with comb[t, k, j] for comb[t, j, k] (Sinkhorn's matrix is not symmetric)."""

    def hc_post(self, y, streams, post, comb):  # type: ignore[no-untyped-def]
        return super().hc_post(y, streams, post, comb.transpose(-1, -2))


class Fp4NibblesSwapped(ReferenceGemm):
    """MXFP4 experts read with the other packing convention: element 2j from the HIGH nibble."""

    def grouped_gemm_fp4(self, x, weight, weight_scale, group_sizes):  # type: ignore[no-untyped-def]
        return super().grouped_gemm_fp4(x, (weight >> 4) | (weight << 4), weight_scale, group_sizes)


@dataclass(frozen=True)
class Mutant:
    name: str  # the backend is mutant-<name>
    part: str  # the Backend field replaced
    make: Callable[[BackendOptions], Any]  # options -> the wrong part
    select: str  # -k expression of the cases that concern it
    caught_by: tuple[str, ...]  # test functions that must fail (others may fail too)
    message: str  # text the failure must contain
    located: tuple[str, ...] = ()  # more text it must contain: the failure's place and parameters
    dtypes: tuple[torch.dtype, ...] = ()  # the dtypes it claims (default: the reference's)

    def create(self, options: BackendOptions) -> Backend:
        ref = create_reference_backend(options)
        caps = dataclasses.replace(ref.capabilities, dtypes=self.dtypes) if self.dtypes else ref.capabilities
        return dataclasses.replace(
            ref, name=f"mutant-{self.name}", capabilities=caps, **{self.part: self.make(options)}
        )


MUTANT_LIST = [
    Mutant(
        "top-p", "small", TopPDropsCrossingToken, "test_sample", ("test_sample_distribution",),
        "(top-p keeps the token that crosses top_p): 4000 draws gave counts",
    ),
    Mutant(
        "temperature", "small", TemperatureAfterFilters, "test_sample", ("test_sample_distribution",),
        "(temperature before min-p): 4000 draws gave counts",
    ),
    Mutant(
        "rms-eps", "small", RmsNormWithoutEps, "rms_norm", ("test_rms_norm_zero_and_tiny_rows",),
        "rms_norm gave NaN/inf on rows of magnitude [0.0",
    ),
    Mutant(
        "rms-eps-doubled", "small", RmsNormEpsDoubled, "rms_norm", ("test_rms_norm_eps_magnitudes",),
        "rms_norm y", ("eps=",),
    ),
    Mutant(
        "router-ties", "moe", RouterTopkTies, "test_route", ("test_route_tied_scores",),
        "tied scores chose experts", ("row 0: ", "stage breaks ties differently"),
    ),
    Mutant(
        "collectives", "collectives", lambda o: NoOpCollectives(o, torch.device("cpu")), "collectives",
        ("test_collectives_across_two_processes",), "all_reduce (torch.float32) is wrong",
    ),
    Mutant(
        "attention-scale", "attention", AttentionIgnoresScale,
        "(test_decode or test_prefill) and float32 and (block_boundaries or window_sinks_kv512 or fresh "
        "or chunked or sinks_extreme)",
        ("test_decode", "test_prefill"), "elements outside atol",
        ("worst at request ", ", head ", ", column ", "scale="),
    ),
    # a 1% scale error in a backend that claims only bfloat16 (its elementwise budget is 2.5%)
    Mutant(
        "attention-scale-1pct", "attention", AttentionScaleOnePercent, "test_attention_scale_precision",
        ("test_attention_scale_precision",), "scale-sensitive inputs", ("worst at request ",),
        dtypes=(torch.bfloat16,),
    ),
    Mutant(
        "rms-weight-1pct", "small", RmsNormWeightOnePercent, "test_small_op_scale_precision",
        ("test_small_op_scale_precision",), "rms_norm (torch.bfloat16; x (64, 512)",
        ("a systematic scale error of +1.00%",), dtypes=(torch.bfloat16,),
    ),
    Mutant(
        "rope-1pct", "small", RopeOnePercent, "test_small_op_scale_precision",
        ("test_small_op_scale_precision",), "rope_interleaved (torch.bfloat16; x (64, 8, 64)",
        ("a systematic scale error of +1.00%",), dtypes=(torch.bfloat16,),
    ),
    # located failure messages: the place (request, query row, head) and the case's parameters
    Mutant(
        "attention-no-key-nan", "attention", AttentionNaNWhenNoKey,
        "(test_decode and float32 and topk_edge) or test_row_that_sees_no_key",
        ("test_decode", "test_row_that_sees_no_key_is_zero"),
        "32 element(s) NaN where the reference is finite, the first at request 2, query row 0 "
        "(position 39 of KV length 40), head 0, column 0",
        ("top-k 6 (edge lists", "no window", "sees no key and must output zeros (without sinks)"),
    ),
    Mutant(
        "attention-window", "attention", AttentionWindowOffByOne,
        "(test_decode or test_prefill) and float32 and window_1",
        ("test_decode", "test_prefill"), "elements outside atol",
        ("worst at request ", ", head ", "window=1,"),
    ),
    Mutant(
        "mla-query-rope-layout", "attention", MlaQueryRopeLayoutFixed, "test_mla_query and float32",
        ("test_mla_query",), "mla_query (torch.float32; T, H, N, C, R = (", ("worst at token ", ", column "),
    ),
    # a model-level failure names the first op whose output diverges
    Mutant(
        "model-attention-scale", "attention", AttentionIgnoresScale, "test_tiny_model and float32",
        ("test_tiny_model",), "logits (torch.float32)",
        ("first op whose output diverges: attention.prefill, call ",),
    ),
    # DeepSeek-V4's ops
    Mutant(
        "v4-topk-ignored", "attention", CompressedAttentionIgnoresTopk, "test_compressed_attention and csa",
        ("test_compressed_attention",), "elements outside atol", ("compressed_attention", "ratio 4"),
    ),
    Mutant(
        "v4-entry-tables-ignored", "attention", CompressedAttentionSharedTables,
        "test_compressed_attention and entry-tables", ("test_compressed_attention",), "compressed_attention",
        ("compressed_attention",),
    ),
    Mutant(
        "v4-indexer-lowest", "attention", IndexerPicksLowest, "test_indexer_topk", ("test_indexer_topk",),
        "picked",
    ),
    Mutant(
        "vision-across-images", "attention", VarlenAttentionAcrossImages, "test_varlen_attention",
        ("test_varlen_attention", "test_varlen_attention_segments_are_independent"), "varlen_attention",
        ("segments [5, 0, 17]",),
    ),
    Mutant(
        "v41-candidate-blocks-ignored", "attention", CandidateBlocksIgnored, "test_indexer_topk_in_blocks",
        ("test_indexer_topk_in_blocks",), "outside", ("row ",),
    ),
    Mutant(
        "v41-index-queries-float", "attention", IndexQueriesUnrounded, "test_quantized_indexer_topk",
        ("test_quantized_indexer_topk",), "row ",
    ),
    Mutant(
        "v4-hc-comb-transposed", "small", HyperConnectionCombTransposed, "test_hc_pre_post_head",
        ("test_hc_pre_post_head",), "hc_post",
    ),
    Mutant(
        "fp4-nibbles-swapped", "gemm", Fp4NibblesSwapped, "test_grouped_gemm_fp4 and float32",
        ("test_grouped_gemm_fp4", "test_grouped_gemm_fp4_aligned"), "grouped_gemm_fp4",
        ("group sizes [3, 0, 5, 1], K=70 N=45",),
    ),
]  # fmt: skip
MUTANTS_BY_NAME = {m.name: m for m in MUTANT_LIST}


class _MutantPlugin:
    """A deepinfer backend plugin providing one backend per mutant."""

    @hookimpl
    def deepinfer_backends(self) -> list[BackendInfo]:
        def probe() -> Availability:
            return Availability(True, "the reference backend with one op broken on purpose")

        return [BackendInfo(f"mutant-{m.name}", "0", 0, False, probe, m.create) for m in MUTANT_LIST]


MUTANTS = _MutantPlugin()


# --------------------------------------------------------------------------- engine mutants
# Product code outside the backend, patched in the pytest process of deepinfer's own tests
# (`-p deepinfer.testing.mutants --deepinfer-engine-mutant NAME`; processes the tests spawn run
# unpatched). Each is a documented policy broken in a way no output of one request shows.


def _take_most_recently_freed(take_free: Callable[..., Any]) -> Callable[..., Any]:
    """BlockManager.take_free from the tail of the free queue (LIFO) instead of its head."""

    def take(self: Any) -> Any:
        if self.free:
            self.free.move_to_end(next(reversed(self.free)), last=False)
        return take_free(self)

    return take


def _free_first_block_first(free_sequence: Callable[..., Any]) -> Callable[..., Any]:
    """BlockManager.free_sequence queueing a sequence's FIRST block first (a prefix is then
    evicted from its head: the blocks that every later prompt shares go first)."""

    def free(self: Any, seq: Any) -> None:
        if self.table < len(seq.block_tables):
            seq.block_tables[self.table].reverse()
        free_sequence(self, seq)

    return free


def _resume_at_the_back(preempt: Callable[..., Any]) -> Callable[..., Any]:
    """Scheduler._preempt putting the victim at the BACK of the waiting queue."""

    def move(self: Any, seq: Any) -> None:
        preempt(self, seq)
        self.waiting.remove(seq)
        self.waiting.append(seq)

    return move


def _top_p_before_top_k(filter_logits: Callable[..., Any]) -> Callable[..., Any]:
    """filter_logits with top-p measured over every token's probability, not over the top-k
    survivors renormalised."""

    def filtered(
        logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        full = torch.softmax(sorted_logits, dim=-1)  # the bug: before the top-k cut
        before = full.cumsum(dim=-1) - full
        ranks = torch.arange(vocab, device=logits.device)
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

    return filtered


def _gather_in_arrival_order(gather: Callable[..., Any]) -> Callable[..., Any]:
    """DataParallelEngine._gather returning the replies in the order they arrived, not by rank."""

    def arrival(self: Any, what: str, on_reply: Callable[[int], object] | None = None) -> list[Any]:
        arrived: list[int] = []

        def note(rank: int) -> None:
            arrived.append(rank)
            if on_reply is not None:
                on_reply(rank)

        replies = gather(self, what, note)
        return [replies[r] for r in arrived] + [r for i, r in enumerate(replies) if i not in arrived]

    return arrival


@dataclass(frozen=True)
class EngineMutant:
    name: str
    target: str  # "module:attribute.path" of the function replaced
    wrap: Callable[[Any], Any]  # the original -> the wrong one
    tests: tuple[str, ...]  # pytest arguments: the tests that concern it (paths under ROOT, -k)
    caught_by: tuple[str, ...]  # test functions that must fail

    def apply(self) -> None:
        module, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module)
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        setattr(owner, attr, self.wrap(getattr(owner, attr)))


POLICIES = "tests/test_engine_policies.py"
ENGINE_MUTANT_LIST = [
    EngineMutant(
        "kv-reuse-lifo", "deepinfer.engine.kv_cache:BlockManager.take_free", _take_most_recently_freed,
        (POLICIES, "-k", "reused or reuse"), ("test_freed_blocks_are_reused_least_recently_freed_first",),
    ),
    EngineMutant(
        "kv-free-first-block-first", "deepinfer.engine.kv_cache:BlockManager.free_sequence",
        _free_first_block_first, (POLICIES, "-k", "evicts or reuse"),
        ("test_prefix_cache_evicts_the_least_recently_freed_blocks_a_prefix_tail_first",),
    ),
    EngineMutant(
        "preempt-resume-at-back", "deepinfer.engine.scheduler:Scheduler._preempt", _resume_at_the_back,
        (POLICIES, "-k", "preempted"), ("test_preempted_requests_resume_at_the_front_of_the_queue",),
    ),
    EngineMutant(
        "top-p-before-top-k", "deepinfer.reference.small:filter_logits", _top_p_before_top_k,
        (POLICIES, "-k", "sampling_probabilities"),
        ("test_sampling_probabilities_match_a_float64_brute_force",),
    ),
    EngineMutant(
        "dp-gather-arrival-order", "deepinfer.entrypoints.data_parallel:DataParallelEngine._gather",
        _gather_in_arrival_order, (POLICIES, "-k", "data_parallel"),
        ("test_data_parallel_outputs_come_back_in_prompt_order_whichever_rank_answers_first",),
    ),
]  # fmt: skip
ENGINE_MUTANTS_BY_NAME = {m.name: m for m in ENGINE_MUTANT_LIST}


def pytest_addoption(parser: Any) -> None:
    """This module as a pytest plugin (-p deepinfer.testing.mutants): one engine mutant applied."""
    parser.addoption("--deepinfer-engine-mutant", default=None, choices=list(ENGINE_MUTANTS_BY_NAME))


def pytest_configure(config: Any) -> None:
    name = config.getoption("--deepinfer-engine-mutant")
    if name:
        ENGINE_MUTANTS_BY_NAME[name].apply()


# --------------------------------------------------------------------------- the runs


def suite_command(backend: str, select: str) -> list[str]:
    """The conformance suite against `backend`, the cases of -k `select` ("": every case)."""
    return [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "deepinfer.testing.plugin",
        "--pyargs", "deepinfer.testing.conformance", "--deepinfer-backend", backend,
        "--deepinfer-plugin", PLUGIN_SPEC, *(["-k", select] if select else []),
        "-q", "-rfE", "-W", "ignore::FutureWarning",
    ]  # fmt: skip


def _run(command: list[str]) -> tuple[int, str]:
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]  # this tree's deepinfer, for the plugin
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    env.pop(envs.REFERENCE_DEVICE.name, None)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def run_suite(backend: str, select: str, dtypes: str | None = None) -> tuple[int, str]:
    """Run the selected conformance cases against `backend` in a fresh process (the cases spawn
    processes and initialise torch.distributed), for `dtypes` only when given ("bfloat16");
    (exit code, output)."""
    return _run(suite_command(backend, select) + (["--deepinfer-dtypes", dtypes] if dtypes else []))


def run_engine_tests(mutant: str | None, tests: tuple[str, ...]) -> tuple[int, str]:
    """deepinfer's own tests `tests` (pytest arguments, paths under ROOT) in a fresh process with
    the engine mutant `mutant` applied (None: unmutated); (exit code, output)."""
    patch = ["-p", "deepinfer.testing.mutants", "--deepinfer-engine-mutant", mutant] if mutant else []
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *patch, *tests, "-q", "-rfE"]
    return _run(command)


def failed_tests(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]


def failed_case(line: str) -> str:
    """The case a `FAILED path::case[params] - message` line names: `case[params]`."""
    node = line.split(" ", 1)[1].split(" - ", 1)[0]
    return node.rsplit("::", 1)[-1]

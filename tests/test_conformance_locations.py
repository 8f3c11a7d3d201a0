"""Conformance failures name the place of a planted error: the KV slot, block and offset (and the
input row that wrote it), the FP8 GEMM's K block, the router's row and stage (group or expert).
Each test plants one error in a reference backend at a place chosen here and runs one conformance
case on it in this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.backend import BackendOptions, KVCacheOps, MoeOps
from deepinfer.backend.ops import Backend
from deepinfer.reference.backend import ReferenceGemm, create_reference_backend
from deepinfer.testing.conformance import test_gemm, test_memory, test_moe


def planted(**parts: object) -> Backend:
    ref = create_reference_backend()
    return dataclasses.replace(ref, name="planted", **parts)  # type: ignore[arg-type]


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(5)


class DropsOneSlot(KVCacheOps):
    """write_kv leaves one slot unwritten."""

    def __init__(self, options: BackendOptions, slot: int) -> None:
        super().__init__(options)
        self.slot = slot

    def write_kv(self, cache, kv, slot_mapping):  # type: ignore[no-untyped-def]
        keep = slot_mapping != self.slot
        super().write_kv(cache, kv[keep], slot_mapping[keep])


def test_kv_write_names_slot_block_offset_and_input_row() -> None:
    # the case writes input rows to slots [-1, 7, 0, -1, -1, 23, 6, 11, -1] of blocks of 6:
    # slot 23 is block 3, offset 5, written by input row 5
    backend = planted(kv_cache=DropsOneSlot(BackendOptions(), 23))
    with pytest.raises(AssertionError) as exc:
        test_memory.test_write_kv_strided_rows_and_padding(backend, torch.device("cpu"), torch.float32, gen())
    msg = str(exc.value)
    assert msg.startswith("write_kv (strided rows): 16/") and "elements differ bitwise" in msg, msg
    assert "the first at slot 23 (block 3, offset 5; input row 5), column 0" in msg, msg


def test_copy_blocks_names_the_slot() -> None:
    class CopiesOneBlockTooFew(KVCacheOps):
        def copy_blocks(self, cache, src, dst):  # type: ignore[no-untyped-def]
            super().copy_blocks(cache, src[:-1], dst[:-1])  # the last pair (2 -> 4) is skipped

    backend = planted(kv_cache=CopiesOneBlockTooFew(BackendOptions()))
    with pytest.raises(AssertionError) as exc:
        test_memory.test_copy_blocks_fork(backend, torch.device("cpu"), gen())
    # blocks of 5: block 4 starts at slot 20
    assert "copy_blocks [2, 2, 5, 2] -> [0, 3, 6, 4]: " in str(exc.value)
    assert "the first at slot 20 (block 4, offset 0), column 0" in str(exc.value), str(exc.value)


class LastKBlockScaleDoubled(ReferenceGemm):
    """fp8_gemm reading the last K block's weight scales twice as large."""

    def fp8_gemm(self, xq, x_scale, weight, weight_scale, out_dtype, block=128):  # type: ignore[no-untyped-def]
        ws = weight_scale.clone()
        ws[:, -1] *= 2
        return super().fp8_gemm(xq, x_scale, weight, ws, out_dtype, block=block)


@pytest.mark.parametrize("case", [(7, 384, 256, 2), (5, 128, 136, 0)], ids=["K384", "K128"])
def test_fp8_gemm_names_the_k_block(case: tuple[int, int, int, int]) -> None:
    backend = planted(gemm=LastKBlockScaleDoubled(BackendOptions()))
    with pytest.raises(AssertionError) as exc:
        test_gemm.test_fp8_gemm_one_block_scale_perturbed(backend, None, torch.float32, gen(), case)
    msg = str(exc.value)
    last = case[1] // 128 - 1
    assert (
        f"K block(s) wrong alone, error / budget: K block {last} (columns {128 * last}..{128 * last + 127}): "
        in msg
    )
    assert f"(of {last + 1} K blocks of 128)" in msg, msg
    assert not any(f"K block {j} (" in msg for j in range(last)), msg  # the other blocks agree


def test_linear_fp8_names_the_k_block() -> None:
    backend = planted(gemm=LastKBlockScaleDoubled(BackendOptions()))
    with pytest.raises(AssertionError) as exc:
        test_gemm.test_linear_fp8(backend, None, torch.float32, gen(), (5, 384, 256), False)
    msg = str(exc.value)
    assert msg.startswith("linear_fp8 (torch.float32; M=5 K=384 N=256, no bias)"), msg
    assert "K block 2 (columns 256..383)" in msg and "K block 0 (" not in msg and "K block 1 (" not in msg


class LastKBlockScaleDoubledGrouped(ReferenceGemm):
    """grouped_gemm_fp8 reading every expert's last K block of weight scales twice as large."""

    def grouped_gemm_fp8(self, x, weight, weight_scale, group_sizes, block=128):  # type: ignore[no-untyped-def]
        ws = weight_scale.clone()
        ws[:, :, -1] *= 2
        return super().grouped_gemm_fp8(x, weight, ws, group_sizes, block=block)


def test_grouped_gemm_fp8_names_the_k_block() -> None:
    backend = planted(gemm=LastKBlockScaleDoubledGrouped(BackendOptions()))
    sizes = test_gemm.ALIGNED_GROUPS[0]
    with pytest.raises(AssertionError) as exc:
        test_gemm.test_grouped_gemm_fp8_aligned(backend, None, torch.float32, gen(), sizes)
    msg = str(exc.value)
    assert msg.startswith("grouped_gemm_fp8 (torch.float32; group sizes"), msg
    assert "K block 1 (columns 128..255)" in msg and "K block 0 (" not in msg, msg
    assert "(of 2 K blocks of 128)" in msg and "group " in msg, msg  # the element names its group


class OneRowRoutedWrong(MoeOps):
    """route with one row's last expert replaced: by an unchosen expert of the same group
    (stage "expert") or by one of a group no chosen expert lies in (stage "group")."""

    def __init__(self, options: BackendOptions, row: int, stage: str, per_group: int) -> None:
        super().__init__(options)
        self.row, self.stage, self.per = row, stage, per_group

    def route(self, logits, config, correction_bias=None, hash_ids=None):  # type: ignore[no-untyped-def]
        weights, ids = super().route(logits, config, correction_bias, hash_ids)
        ids = ids.clone()
        chosen = ids[self.row].tolist()
        groups = {e // self.per for e in chosen}
        if self.stage == "expert":
            other = next(
                e
                for e in range(logits.shape[1])
                if e not in chosen and e // self.per == chosen[-1] // self.per
            )
        else:
            other = next(e for e in range(logits.shape[1]) if e // self.per not in groups)
        ids[self.row, -1] = other
        return weights, ids


@pytest.mark.parametrize("stage", ["expert", "group"])
def test_route_names_the_row_and_the_stage(stage: str) -> None:
    # sigmoid_top2_sum_bias: 64 experts in 8 groups of 8, top-6 of the best 4 groups
    backend = planted(moe=OneRowRoutedWrong(BackendOptions(), 7, stage, 8))
    with pytest.raises(AssertionError) as exc:
        test_moe.test_route(backend, gen(), "sigmoid_top2_sum_bias", 13)
    msg = str(exc.value)
    assert msg.startswith("selected experts differ from the reference: row 7 chose experts "), msg
    assert "(1 of 13 rows differ)" in msg and f"the {stage} stage differs" in msg, msg


def test_select_experts_names_the_row_of_the_input() -> None:
    """select_experts compares only rows clear of near-ties: the row named is the input's."""

    class SelectOneRowWrong(MoeOps):
        def select_experts(self, x, gate_weight, config, correction_bias=None, hash_ids=None):  # type: ignore[no-untyped-def]
            weights, ids = super().select_experts(x, gate_weight, config, correction_bias, hash_ids)
            ids = ids.clone()
            ids[4, 0] = next(
                e for e in range(64) if e not in ids[4].tolist() and e // 8 == int(ids[4, 0]) // 8
            )
            return weights, ids

    backend = planted(moe=SelectOneRowWrong(BackendOptions()))
    with pytest.raises(AssertionError) as exc:
        test_moe.test_select_experts(backend, torch.float32, gen(), "sigmoid_groups_bias", 5)
    assert "row 4 chose experts " in str(exc.value) and "the expert stage differs" in str(exc.value)

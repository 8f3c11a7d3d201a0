"""FP8 checkpoints (DeepSeek's format): e4m3 weights + float32 weight_scale_inv per 128x128 block.

A tiny transformers model is quantised to that format (linear and expert weights; scale shapes are
ceil(N/128) x ceil(K/128)), saved with DeepSeek's names and quantization_config, and loaded by
deepinfer, whose weights stay e4m3 and run through the FP8 GEMMs, which quantise activations per
token per 128 channels. Two oracles, both transformers on the DEQUANTISED weights:

1. with the same activation quantisation applied to every GEMM input (hooks on its linears and
   experts; kv_b_proj is absorbed in deepinfer and dequantised, so it is left unhooked): the
   arithmetic is then the same, so the logits must agree to float32 rounding (1e-4; ~3e-7 seen).
2. plain float32: the difference is deepinfer's activation quantisation alone. Bound: e4m3 keeps
   3 mantissa bits, so each quantised activation has relative error <= 2^-4, about
   2^-4 / sqrt(3) = 3.6% RMS; the per-block scale maps each 1x128 block's amax to 448, so nothing
   saturates and only elements below amax * 2^-15 (which carry almost none of a product) lose
   more. A token's path to the logits passes 3 layers x (3 quantised GEMM inputs in attention +
   2 in the MLP or MoE) = 15 quantisations whose independent errors add in quadrature:
   sqrt(15) * 3.6% = 14% RMS. Random weights can amplify that (and a perturbed router score can
   switch an expert), so we allow 2.5x: 35% relative per request (||a - b|| / ||b||); unrelated
   logits differ by ~140%, and exact logits (no quantisation) would fail the lower limit.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import build_hf_model, parity_config, rel_err
from safetensors.torch import load_file

from deepinfer.models.layers import Linear
from deepinfer.models.loader import Fp8NotSupportedError, load_model
from deepinfer.models.moe import MoE
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import FP8_QUANTIZATION_CONFIG, quantize_state_dict, write_checkpoint
from deepinfer.testing.paged_runner import PagedRunner

pytest.importorskip("transformers")

FP8_BOUND = 0.35
TIGHT = 1e-4


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """The reference activation quantisation (per token, 128 channels), dequantised again."""
    from deepinfer.reference.gemm import dequantize_act, quantize_fp8

    xq, scale = quantize_fp8(x.reshape(-1, x.shape[-1]))
    return dequantize_act(xq, scale).to(x.dtype).reshape(x.shape)


def _quantise_activations(hf: torch.nn.Module) -> None:
    """Make transformers quantise every GEMM input the way deepinfer's FP8 path does."""

    def experts_forward(self: Any, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
        out, xq = torch.zeros_like(hidden), _fake_quant(hidden)
        for e in range(self.num_experts):
            tok, pos = torch.where(ids == e)
            gate, up = torch.nn.functional.linear(xq[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(_fake_quant(self.act_fn(gate) * up), self.down_proj[e])
            out.index_add_(0, tok, y * weights[tok, pos, None])
        return out

    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(("kv_b_proj", "lm_head")):
            module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0]),))
        if type(module).__name__.endswith("Experts"):
            module.forward = experts_forward.__get__(module)


@pytest.fixture(scope="module")
def fp8_case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fp8")
    cfg = parity_config("v3-qlora-groups")
    hf = build_hf_model(cfg, seed=11)
    hf.save_pretrained(root / "float")
    state = load_file(str(root / "float" / "model.safetensors"))
    fp8_state, dequant = quantize_state_dict(state)
    config = json.loads((root / "float" / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    write_checkpoint(root / "fp8", config, fp8_state)
    # transformers on the dequantised weights (it holds experts fused: gate_up_proj, down_proj)
    plain = {k: v for k, v in dequant.items() if ".experts." not in k}
    missing, unexpected = hf.load_state_dict(plain, strict=False)
    assert not unexpected and all(".experts." in m for m in missing)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            if not hasattr(layer.mlp, "experts"):
                continue
            ex, inter = layer.mlp.experts, layer.mlp.experts.down_proj.shape[-1]
            for e in range(ex.num_experts):
                p = f"model.layers.{i}.mlp.experts.{e}"
                ex.gate_up_proj[e, :inter].copy_(dequant[f"{p}.gate_proj.weight"])
                ex.gate_up_proj[e, inter:].copy_(dequant[f"{p}.up_proj.weight"])
                ex.down_proj[e].copy_(dequant[f"{p}.down_proj.weight"])
    hf_q = copy.deepcopy(hf)
    _quantise_activations(hf_q)
    return {"root": root, "hf": hf, "hf_q": hf_q, "cfg": cfg, "fp8_state": fp8_state}


def test_fp8_checkpoint_matches_dequantised_transformers(fp8_case: dict[str, Any]) -> None:
    backend = create_reference_backend()
    calls = {"linear_fp8": 0, "grouped_fp8": 0}
    linear_fp8, experts = backend.gemm.linear_fp8, backend.moe.experts

    def count_linear(*args: Any, **kw: Any) -> torch.Tensor:
        calls["linear_fp8"] += 1
        return linear_fp8(*args, **kw)

    def count_experts(
        x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *s: Any
    ) -> Any:
        calls["grouped_fp8"] += int(w13.dtype == torch.float8_e4m3fn and s[0] is not None)
        return experts(x, counts, w13, w2, *s)

    backend.gemm.linear_fp8 = count_linear  # type: ignore[method-assign]
    backend.moe.experts = count_experts  # type: ignore[method-assign,assignment]
    model = load_model(fp8_case["root"] / "fp8", backend, dtype=torch.float32)

    # Weights stay FP8: every linear of attention / MLP / experts is e4m3 with block scales.
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.weight.dtype == torch.float8_e4m3fn, name
            assert module.weight_scale_inv is not None and module.weight_scale_inv.dtype == torch.float32
        if isinstance(module, MoE):
            assert module.w13.dtype == torch.float8_e4m3fn and module.w13_scale is not None

    gen = torch.Generator().manual_seed(0)
    vocab = fp8_case["cfg"]["vocab_size"]
    prompts = {r: torch.randint(2, vocab, (n,), generator=gen).tolist() for r, n in enumerate((6, 13))}
    runner = PagedRunner(model, backend, num_blocks=32, block_size=4)
    logits = runner.step(list(prompts.items()), all_logits=True)
    decode_tokens = {r: torch.randint(2, vocab, (4,), generator=gen).tolist() for r in prompts}
    decode_logits = [runner.step([(r, [t[i]]) for r, t in decode_tokens.items()]) for i in range(4)]
    assert calls["linear_fp8"] > 0 and calls["grouped_fp8"] > 0

    worst, worst_q, start = 0.0, 0.0, 0
    for r, p in prompts.items():
        full = torch.tensor([p + decode_tokens[r]])
        with torch.no_grad():
            want, want_q = fp8_case["hf"](full).logits[0], fp8_case["hf_q"](full).logits[0]
        got = torch.cat([logits[start : start + len(p)]] + [d[r : r + 1] for d in decode_logits])
        start += len(p)
        err_q, err = rel_err(got, want_q), rel_err(got, want)
        worst, worst_q = max(worst, err), max(worst_q, err_q)
        assert err_q <= TIGHT, f"request {r}: {err_q:.3e} vs transformers with quantised activations"
        assert 1e-3 < err <= FP8_BOUND, f"request {r}: FP8 relative error {err:.3e}"
        assert rel_err(got, want.roll(1, dims=-1)) > 0.5  # the bound is far from unrelated logits
    print(f"FP8 vs dequantised transformers: max rel {worst:.3e}; with quantised activations {worst_q:.3e}")


def test_fp8_checkpoint_refused_by_backend_without_fp8(fp8_case: dict[str, Any]) -> None:
    ref = create_reference_backend()
    no_fp8 = dataclasses.replace(
        ref, name="nofp8", capabilities=dataclasses.replace(ref.capabilities, supports_fp8=False)
    )
    with pytest.raises(Fp8NotSupportedError, match=r"backend 'nofp8' does not support FP8"):
        load_model(fp8_case["root"] / "fp8", no_fp8)


def test_fp8_scale_shapes_are_padded_up(fp8_case: dict[str, Any]) -> None:
    """48-wide hidden, 24-wide experts: one block per dimension, scales (1, 1)."""
    st = fp8_case["fp8_state"]
    assert st["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert st["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (1, 1)
    assert st["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (1, 1)
    assert st["model.embed_tokens.weight"].dtype == torch.float32  # not quantised
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in st


def test_fp8_padded_fusion_is_exact(tmp_path: Path) -> None:
    """Gate/up halves that are not block multiples are zero-padded before fusing: the result equals
    the dequantised weights' MLP exactly (up to float32 rounding)."""
    from deepinfer.models.layers import fuse_gate_up
    from deepinfer.reference.gemm import dequantize_weight, quantize_weight

    g, u, d = torch.randn(200, 96), torch.randn(200, 96), torch.randn(96, 200)
    (gq, gs), (uq, us), (dq, ds) = quantize_weight(g), quantize_weight(u), quantize_weight(d)
    w13, s13, w2, s2 = fuse_gate_up((gq, gs), (uq, us), (dq, ds))
    assert w13.shape == (512, 96) and s13 is not None and s13.shape == (4, 1)
    assert w2.shape == (96, 256) and s2 is not None
    full = dequantize_weight(w13, s13)
    torch.testing.assert_close(full[:200], dequantize_weight(gq, gs), rtol=0, atol=0)
    torch.testing.assert_close(full[256:456], dequantize_weight(uq, us), rtol=0, atol=0)
    assert full[200:256].abs().max() == 0 and full[456:].abs().max() == 0
    torch.testing.assert_close(dequantize_weight(w2, s2)[:, :200], dequantize_weight(dq, ds), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [(256, 72), (200, 72), (128, 128)])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "float"])
def test_concatenated_projections_equal_separate_ones(rows: tuple[int, int], fp8: bool) -> None:
    """MLA's q (or q_a) and kv_a projections read the same input and run as one GEMM: its output
    split by rows equals the two GEMMs', and the parts' weights become views of the fused one.
    FP8 parts concatenate only where the first part's rows fill whole 128-row scale blocks."""
    from deepinfer.models.layers import concat_linears
    from deepinfer.reference.gemm import quantize_weight

    backend = create_reference_backend()
    gen = torch.Generator().manual_seed(sum(rows))
    parts = [Linear(backend, 96, n) for n in rows]
    for p in parts:
        w = torch.randn((p.out_features, 96), generator=gen) * 96**-0.5
        p.weight, p.weight_scale_inv = quantize_weight(w) if fp8 else (w, None)
    x = torch.randn((5, 96), generator=gen)
    separate = [p(x) for p in parts]
    fused = concat_linears(backend, parts)
    if fp8 and rows[0] % 128:
        assert fused is None
        return
    assert fused is not None
    for y, p, want in zip(fused(x).split(list(rows), -1), parts, separate):
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        assert p.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(p(x), want, rtol=0, atol=0)

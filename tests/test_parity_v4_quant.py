"""DeepSeek-V4 checkpoints as DeepSeek publishes them: FP8 e4m3 linears with UE8M0 (power-of-two,
float8_e8m0fnu) block scales named `.scale`, MXFP4 routed experts (e2m1 packed two a byte in
int8, one UE8M0 scale per 32 values), DeepSeek's tensor names without the `model.` prefix and
`expert_dtype: fp4` in config.json. A tiny random transformers DeepseekV4ForCausalLM (the
configs of tests/test_parity_v4.py) is quantised to that format; the oracle is transformers on
the DEQUANTISED twin weights (float32), so the only differences left are deepinfer's
arithmetic and the activation quantisation its FP8 GEMMs do (MXFP4 experts quantise nothing).

Two oracles, as tests/test_fp8.py:
1. the twin with the same FP8 activation quantisation applied to every input of a linear that
   is FP8 in the checkpoint (hooks; wo_a's per (token, group) row where deepinfer keeps it FP8):
   the arithmetic is then the same, so deepinfer's log-probabilities (public API, float32,
   every vocabulary entry at every prompt and generated position) agree to TIGHT = 1e-2.
   float32 rounding alone gives ~5e-7, but it can also move an activation across an e4m3
   rounding tie: a run quantises ~1e5 elements, each within float32 noise (~1e-7 relative) of a
   tie with probability ~1e-6, so now and then one element moves by one e4m3 step (2^-3 of its
   binade) and everything after it in that request shifts a little: 2.7e-3 at most when it
   happened here (FP8 experts, second config). Faults injected by hand cost more: the nibble
   order swapped 3e-2 to 0.2. Where the twin's top-2 log-probability margin exceeds
   2 * TIGHT, neither side's error can swap the two, so the greedy token must be the twin's
   argmax: teacher-forcing the twin on deepinfer's own tokens makes every generated position
   comparable. (Each op's exactness is the conformance suite's: deepinfer/testing/conformance.)
2. the plain twin: the difference is the activation quantisation alone. Bound: e4m3 keeps 3
   mantissa bits, so each quantised activation has relative error <= 2^-4, 2^-4 / sqrt(3) =
   3.6% RMS (the 1x128 block scale maps the block's amax within e4m3's range, nothing
   saturates). Each layer quantises 6 distinct tensors (x for wq_a / wkv, the q residual for
   wq_b and the indexer's wq_b, the attention output for wo_a, the grouped output for wo_b, x
   and the hidden for the shared expert); 3 layers = 18 independent errors, adding in
   quadrature: sqrt(18) * 3.6% = 15% RMS on the logits. Random weights amplify unevenly (and a
   moved router score can switch an expert), so we allow 2.5x, 38% relative L2 per request on
   the centred logits (log-probabilities minus their mean: the logits up to a constant);
   unrelated logits differ by ~140%, and no activation quantisation at all would fail the
   lower limit (1e-3).
Also: bfloat16 (the default dtype of quantised checkpoints) within twice transformers' own
bfloat16 error on the same hooked twin; the weights stay FP8 / MXFP4 in memory; corrupt or
mismatched scales, MXFP4 where only FP8 or float is read, and mixed expert formats are refused
with the tensor named; random weights (`deepinfer bench --random-config ... --quantization fp8`)
come in the same format.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models_util import build_hf_v4, parity_config
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models.loader import CheckpointError, NonFiniteWeightError, ShapeMismatchError, load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.reference.gemm import dequantize_act, quantize_fp8
from deepinfer.testing.checkpoints import V4_EXPERT_DTYPE, V4_QUANTIZATION_CONFIG, quantize_v4_state_dict
from deepinfer.testing.paged_runner import PagedRunner

transformers = pytest.importorskip("transformers")

TIGHT = 1e-2  # log-probability, absolute
FP8_BOUND = 0.38
NEW_TOKENS = 6
PROMPT_LENS = (5, 19, 37)
# o_lora_rank 128: wo_a FP8 through the grouped FP8 GEMM (whole 128-row scale blocks per group);
# the second config's o_lora_rank 8 has groups sharing a block: wo_a is dequantised at load
CONFIGS = {"v4-swa-csa-hca-hash": {"o_lora_rank": 128}, "v4-hca-csa-swa-routed": {}}


def published_name(name: str) -> str:
    """transformers' save_pretrained name -> DeepSeek's published one (no `model.` prefix)."""
    name = name.replace("model.embed_tokens.", "embed.").replace("model.hc_head.hc_", "hc_head_")
    return name.removeprefix("model.")


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """The contract's activation quantisation (per row, 128 channels), dequantised again."""
    xq, scale = quantize_fp8(x.reshape(-1, x.shape[-1]))
    return dequantize_act(xq, scale).to(x.dtype).reshape(x.shape)


def quantise_activations(hf: torch.nn.Module, grouped_wo_a: bool, fp8_experts: bool = False) -> None:
    """Make transformers quantise the input of every linear the checkpoint stores in FP8 (FP8
    routed experts: their input rows and their hidden, before the down projection)."""
    fp8 = ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
           "indexer.q_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
           "shared_experts.down_proj"] + (["self_attn.o_a_proj"] if grouped_wo_a else [])  # fmt: skip
    hooked = 0
    for name, module in hf.named_modules():
        if name.endswith(tuple(fp8)):
            module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0]),))
            hooked += 1
        if fp8_experts and name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0]), *args[1:]))
            gate = module._apply_gate
            module._apply_gate = lambda gate_up, gate=gate: _fake_quant(gate(gate_up))
    assert hooked >= len(fp8)


class Case:
    def __init__(self, name: str, root: Path) -> None:
        fields = parity_config(name) | CONFIGS[name]
        self.grouped_wo_a = fields["o_lora_rank"] % 128 == 0
        hf = build_hf_v4(fields, seed=list(CONFIGS).index(name) + 5)
        hf.save_pretrained(root / "float")
        config = json.loads((root / "float" / "config.json").read_text())
        self.float_state, self.float_config = load_file(root / "float" / "model.safetensors"), config
        quantised, dequantised = quantize_v4_state_dict(self.float_state)
        self.quant = root / "quant"
        self.quant.mkdir()
        published = {published_name(n): t for n, t in quantised.items()}
        save_file(published, self.quant / "model.safetensors")
        quant_config = config | {
            "quantization_config": V4_QUANTIZATION_CONFIG,
            "expert_dtype": V4_EXPERT_DTYPE,
        }
        (self.quant / "config.json").write_text(json.dumps(quant_config))
        (root / "twin").mkdir()
        save_file(dequantised, root / "twin" / "model.safetensors")
        (root / "twin" / "config.json").write_text(json.dumps(config))
        load = transformers.DeepseekV4ForCausalLM.from_pretrained
        self.twin = load(root / "twin", dtype=torch.float32).eval()
        self.twin_q = copy.deepcopy(self.twin)
        quantise_activations(self.twin_q, self.grouped_wo_a)
        self.twin_q_bf16 = load(root / "twin", dtype=torch.bfloat16).eval()
        quantise_activations(self.twin_q_bf16, self.grouped_wo_a)
        gen = torch.Generator().manual_seed(9)
        self.prompts = [
            torch.randint(1, fields["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS
        ]
        self.published = published

    def generate(self, dtype: str, root: Path | None = None) -> list[tuple[list[int], torch.Tensor]]:
        """deepinfer through LLM.generate, greedy, on the checkpoint at root (default: the
        quantised one): per prompt (generated tokens, log-probabilities of every vocabulary entry
        at every position after the first, (L - 1 + NEW_TOKENS, V))."""
        llm = LLM(
            str(root or self.quant), backend="reference", dtype=dtype, block_size=4, max_model_len=64,
            max_logprobs=-1,
        )  # fmt: skip
        params = SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=-1, prompt_logprobs=-1
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], params, use_tqdm=False)
        result = []
        for out in outs:
            assert out.prompt_logprobs is not None and out.outputs[0].logprobs is not None
            positions = [p for p in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs] if p is not None]
            rows = [[pos[v].logprob for v in range(len(pos))] for pos in positions]
            result.append((list(out.outputs[0].token_ids), torch.tensor(rows, dtype=torch.float64)))
        return result

    def oracle(self, model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """The model's log-probabilities teacher-forced on prompt + tokens, at the positions
        deepinfer reports (every one after the first, predicting the next token)."""
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            logits: torch.Tensor = model(ids).logits[0].double()
        return logits.log_softmax(-1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def centred(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - logprobs.mean(-1, keepdim=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((centred(a) - centred(b)).norm() / centred(b).norm())


def test_weights_stay_fp8_and_mxfp4(case: Case) -> None:
    backend = create_reference_backend()
    model: Any = load_model(case.quant, backend, dtype=torch.float32)
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        for linear in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b, ffn.shared_gate_up, ffn.shared_down):
            assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale_inv is not None
            scale = linear.weight_scale_inv
            assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # UE8M0: powers of two
        assert (attn.wo_a.weight.dtype == torch.float8_e4m3fn) == case.grouped_wo_a
        assert ffn.w13.dtype == torch.uint8 and ffn.w13.shape[-1] == ffn.hidden // 2  # packed MXFP4
        assert ffn.w13_scale is not None and ffn.w13_scale.dtype == torch.uint8
        assert ffn.w2.dtype == torch.uint8 and ffn.w2_scale is not None
        assert ffn.gate_weight.dtype == torch.float32  # the router
        if attn.compressor is not None:
            assert attn.compressor.wkv.weight.dtype == torch.float32


def test_public_api_equals_the_twin_with_the_same_activation_quantisation(case: Case) -> None:
    for prompt, (tokens, ours) in zip(case.prompts, case.generate("float32"), strict=True):
        want = case.oracle(case.twin_q, prompt, tokens)
        err = float((ours - want).abs().max())
        assert err <= TIGHT, f"prompt of {len(prompt)}: log-probabilities differ by {err:.3e}"
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1] > 2 * TIGHT)[len(prompt) - 1 :]  # the generated positions
        greedy = want[len(prompt) - 1 :].argmax(-1)
        assert clear.any() and torch.equal(torch.tensor(tokens)[clear], greedy[clear]), (
            tokens,
            greedy.tolist(),
        )


def test_activation_quantisation_is_the_only_difference(case: Case) -> None:
    for prompt, (tokens, ours) in zip(case.prompts, case.generate("float32"), strict=True):
        want = case.oracle(case.twin, prompt, tokens)
        err = rel(ours, want)
        assert 1e-3 < err <= FP8_BOUND, f"prompt of {len(prompt)}: relative error {err:.3e}"
        assert rel(ours, want.roll(1, dims=-1)) > 0.5  # the bound is far from unrelated logits


def test_bfloat16_as_close_as_transformers(case: Case) -> None:
    """deepinfer in bfloat16 (the default for quantised checkpoints; norms, sinks and mixing
    weights float32) against the float32 hooked twin, as close as transformers' own bfloat16
    run of the hooked twin: within twice its relative error."""
    for prompt, (tokens, ours) in zip(case.prompts, case.generate("bfloat16"), strict=True):
        want = case.oracle(case.twin_q, prompt, tokens)
        try:
            theirs = case.oracle(case.twin_q_bf16, prompt, tokens)
        except RuntimeError as exc:  # transformers 5.17 leaks float32 activations into bf16 layers
            if "dtype" not in str(exc) and "scalar type" not in str(exc):
                raise
            pytest.skip(f"transformers {transformers.__version__} cannot run this config in bfloat16: {exc}")
        assert rel(ours, want) <= 2 * rel(theirs, want), (rel(ours, want), rel(theirs, want))


def test_storage_variants_load_the_same_model(case: Case, tmp_path: Path) -> None:
    """The same weights stored as other checkpoints store them: UE8M0 scales as uint8 exponent
    bytes and packed experts as uint8; or experts as float4_e2m1fn_x2, scales under the
    `weight_scale_inv` name and FP8 block scales in float32. Bit for bit the same logits."""
    e8m0, f4 = torch.float8_e8m0fnu, torch.float4_e2m1fn_x2
    as_bytes = {
        n: t.view(torch.uint8) if t.dtype in (e8m0, torch.int8) else t for n, t in case.published.items()
    }
    other: dict[str, torch.Tensor] = {}
    for name, t in case.published.items():
        if name.endswith(".scale"):
            fp8 = case.published[name.removesuffix("scale") + "weight"].dtype == torch.float8_e4m3fn
            other[name.removesuffix("scale") + "weight_scale_inv"] = t.float() if fp8 else t
        else:
            other[name] = t.view(f4) if t.dtype == torch.int8 else t
    backend = create_reference_backend()
    logits = []
    for root, tensors in ((case.quant, None), (tmp_path / "bytes", as_bytes), (tmp_path / "other", other)):
        if tensors is not None:
            root.mkdir()
            save_file(tensors, root / "model.safetensors")
            (root / "config.json").write_text((case.quant / "config.json").read_text())
        runner = PagedRunner(load_model(root, backend), backend, num_blocks=32, block_size=4)
        logits.append(runner.step([(0, case.prompts[1])], all_logits=True))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_fp8_experts(case: Case, tmp_path: Path) -> None:
    """V4-Flash-Base's format, FP8 routed experts (expert_dtype fp8), through grouped_gemm_fp8,
    which quantises the experts' input rows and hidden too: against the twin hooked likewise."""
    quantised, dequantised = quantize_v4_state_dict(case.float_state, expert_dtype="fp8")
    for name, tensors, config in (
        ("quant", {published_name(n): t for n, t in quantised.items()},
         case.float_config | {"quantization_config": V4_QUANTIZATION_CONFIG, "expert_dtype": "fp8"}),
        ("twin", dequantised, case.float_config),
    ):  # fmt: skip
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    model: Any = load_model(tmp_path / "quant", create_reference_backend())
    assert model.layers[0].ffn.w13.dtype == torch.float8_e4m3fn and model.layers[0].ffn.w13_scale is not None
    twin = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    quantise_activations(twin, case.grouped_wo_a, fp8_experts=True)
    for prompt, (tokens, ours) in zip(
        case.prompts, case.generate("float32", tmp_path / "quant"), strict=True
    ):
        err = float((ours - case.oracle(twin, prompt, tokens)).abs().max())
        assert err <= TIGHT, f"prompt of {len(prompt)}: log-probabilities differ by {err:.3e}"


# --------------------------------------------------------------------------- refused checkpoints


def rewritten(case: Case, root: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of the quantised checkpoint with tensors replaced (None: removed)."""
    tensors = {n: t for n, t in {**case.published, **edit}.items() if t is not None}
    root.mkdir()
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text((case.quant / "config.json").read_text())
    return root


def load_error(case: Case, root: Path, edit: dict[str, torch.Tensor | None]) -> Exception:
    """The error loading the rewritten checkpoint raises."""
    with pytest.raises((CheckpointError, ValueError)) as info:
        load_model(rewritten(case, root, edit), create_reference_backend())
    return info.value


def test_mismatched_scale_shapes_are_named(case: Case, tmp_path: Path) -> None:
    expert = "layers.1.ffn.experts.2.w1.scale"
    err = load_error(case, tmp_path / "expert", {expert: case.published[expert].repeat(1, 2)})
    assert isinstance(err, ShapeMismatchError) and repr(expert) in str(err)
    assert "one per 32 values along K of the (16, 32) MXFP4 weight" in str(err)
    dense = "layers.0.attn.wq_b.scale"
    err = load_error(case, tmp_path / "dense", {dense: case.published[dense].repeat(2, 1)})
    assert isinstance(err, ShapeMismatchError) and repr(dense) in str(err)
    assert "expected shape (1, 1) (one per 128x128 block" in str(err) and "found (2, 1)" in str(err)


def test_corrupt_scales_are_named(case: Case, tmp_path: Path) -> None:
    name = "layers.2.ffn.experts.0.w2.scale"
    nan = case.published[name].view(torch.uint8).clone()
    nan[3, 0] = 0xFF  # UE8M0's NaN
    with pytest.raises(
        NonFiniteWeightError, match=rf"'{name}'.*UE8M0 NaN byte \(0xFF; the first at index \(3, 0\)\)"
    ):
        load_model(
            rewritten(case, tmp_path / "nan", {name: nan.view(torch.float8_e8m0fnu)}),
            create_reference_backend(),
        )
    as_float = case.published[name].float()  # MXFP4 scales must be UE8M0 bytes
    err = load_error(case, tmp_path / "float", {name: as_float})
    assert repr(name) in str(err) and "MXFP4 scales are UE8M0 bytes" in str(err)


def test_mxfp4_outside_routed_experts_and_mixed_experts_are_refused(case: Case, tmp_path: Path) -> None:
    from deepinfer.backend import fp4

    shared = "layers.0.ffn.shared_experts.w1"
    packed, scale = fp4.quantize_weight(torch.randn(case.published[f"{shared}.weight"].shape))
    edit = {f"{shared}.weight": packed.view(torch.int8), f"{shared}.scale": scale.view(torch.float8_e8m0fnu)}
    err = load_error(case, tmp_path / "shared", edit)  # type: ignore[arg-type]
    assert repr(f"{shared}.weight") in str(err) and "MXFP4 for routed experts only" in str(err)
    expert = "layers.1.ffn.experts.3.w3"  # one expert in float among MXFP4 ones
    weight = fp4.dequantize_weight(case.published[f"{expert}.weight"], case.published[f"{expert}.scale"])
    err = load_error(case, tmp_path / "mixed", {f"{expert}.weight": weight, f"{expert}.scale": None})
    assert "layers.1.ffn.experts: the routed experts mix weight formats (MXFP4, float)" in str(err)


# --------------------------------------------------------------------------- random weights, config


def quantised_config(tmp_path: Path) -> Path:
    """A tiny V4 config.json naming DeepSeek's published format."""
    raw = parity_config("v4-swa-csa-hca-hash") | {"o_lora_rank": 128}
    raw |= {"quantization_config": V4_QUANTIZATION_CONFIG, "expert_dtype": V4_EXPERT_DTYPE}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_random_weights_in_the_published_format(tmp_path: Path) -> None:
    from deepinfer.testing.random_model import random_model

    model: Any = random_model(
        quantised_config(tmp_path), create_reference_backend(), fp8=True, num_hidden_layers=2
    )
    attn, ffn = model.layers[1].attn, model.layers[1].ffn
    assert attn.wq_a.weight.dtype == attn.wo_a.weight.dtype == torch.float8_e4m3fn
    assert ffn.w13.dtype == ffn.w2.dtype == torch.uint8 and ffn.w13_scale.dtype == torch.uint8
    assert attn.compressor.wkv.weight.dtype == torch.bfloat16
    assert ffn.gate_weight.dtype == torch.float32  # the router computes in float32
    assert ffn.shared_gate_up.weight.dtype == torch.float8_e4m3fn


def test_bench_random_fp8_and_mxfp4(run_deepinfer: Any, tmp_path: Path) -> None:
    """`deepinfer bench --random-config ... --quantization fp8`: a reduced-depth V4 in FP8 with
    MXFP4 experts, as the config names them."""
    out = tmp_path / "bench.json"
    proc = run_deepinfer(
        "bench", "--random-config", str(quantised_config(tmp_path)), "--num-hidden-layers", "2",
        "--quantization", "fp8", "--backend", "reference", "--num-prompts", "2", "--random-input-len", "9",
        "--random-output-len", "3", "--output-json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"].startswith("random FP8 + MXFP4 experts weights") and result["num_requests"] == 2


def test_mxfp4_experts_are_deepseek_v4_only() -> None:
    from deepinfer.models.config import ModelConfig, ModelConfigError
    from deepinfer.testing.checkpoints import tiny_config

    raw = tiny_config(quantization_config=V4_QUANTIZATION_CONFIG, expert_dtype="fp4")
    with pytest.raises(
        ModelConfigError, match="expert_dtype 'fp4' \\(MXFP4 experts\\) is supported for deepseek_v4 only"
    ):
        ModelConfig.from_dict(raw)
    v4 = parity_config("v4-swa-csa-hca-hash") | {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ModelConfigError, match="expert_dtype 'int4' is not supported; supported: fp8, fp4"):
        ModelConfig.from_dict(v4 | {"expert_dtype": "int4"})

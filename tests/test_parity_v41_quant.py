"""DeepSeek-V4.1 checkpoints in the format DeepSeek publishes: FP8 e4m3 linears with UE8M0
(float8_e8m0fnu) scales per 32 x 32 block named `.scale`, MXFP4 routed experts (e2m1 packed two
a byte in int8, one UE8M0 scale per 32 values along K), bf16 / float32 for the rest
(deepseek_v41.stored_in_fp8). A tiny random V4.1 checkpoint (testing.v41_checkpoint) is quantised
to that format (quantize_v41_tensors), beside its dequantised float32 twin; deepinfer runs the
quantised one through LLM.generate on the reference backend in float32.

The only arithmetic difference left between the quantised model and its twin is the activation
quantisation of every FP8 linear's input (per token per 32 channels, e4m3, scale amax / 448);
MXFP4 experts and wo_a where it is dequantised at load quantise nothing. Two oracles:
1. the float64 oracle (testing.v41_oracle) on the twin with that same activation quantisation
   applied to the input of every product with an FP8 weight (_Fp8Input; the oracle itself is not
   touched): log-probabilities (every vocabulary entry, every prompt and generated position)
   agree to TIGHT = 1e-2 and the greedy tokens equal the oracle's own greedy tokens. float32
   against float64 alone gives ~1e-6; TIGHT leaves room for a float32 value that lands on the
   other side of an e4m3 rounding tie than its float64 counterpart (one element moving by one
   e4m3 step, as tests/test_parity_v4_quant.py measured: 2.7e-3 at most).
2. the twin itself, through LLM.generate too: the difference is the activation quantisation
   alone. Bound: e4m3 keeps 3 mantissa bits, so a quantised activation has relative error at
   most 2^-4, RMS 2^-4 / sqrt(3) = 3.6% (the 1 x 32 scale maps each group's amax into e4m3's
   range: nothing saturates). A layer quantises up to 6 distinct tensors (x for wq_a / wkv, the
   q residual for wq_b and the indexer's wq_b, the attention output for a grouped FP8 wo_a, the
   grouped output for wo_b, x and the hidden of the shared expert); with L layers, 6L independent
   errors add in quadrature: sqrt(24) * 3.6% = 18% RMS on the logits for L = 4. Random weights
   amplify unevenly and a moved router score can switch an expert, so 2.5x: 44% relative L2 per
   request on the centred log-probabilities, compared teacher-forced on the quantised model's own
   tokens (so that a token flipped by a near tie does not compare different sequences).
   Unrelated logits differ by ~140%, and no activation quantisation at all fails the lower limit
   (1e-3). The twin's greedy tokens may differ from the quantised model's where its top two
   logits are closer than that error; the greedy tokens are checked exactly against oracle 1.
Measured (float32): 1.2e-6 .. 3.8e-5 against oracle 1 (an oracle quantising per 128 channels
instead is off by 1.2 .. 2.3), 0.11 .. 0.35 against the twin.
Also: bfloat16 (test_bfloat16_within_both_errors); the weights stay FP8 (block 32) / MXFP4 in
memory; a corrupt checkpoint (scales of the wrong shape or dtype, a weight of the wrong dtype) is
refused with the tensor named.
Engram tables as DeepSeek stores them (FP8 rows: e4m3 with a UE8M0 scale per 32 values of a row)
are dequantised by the lookup exactly (an e4m3 value times a power of two is a float32 and a
bfloat16 value), so they add no error of their own; the Engram layers' FP8 wkv adds one
quantised input per Engram layer (26 instead of 24 tensors for "engram": sqrt(26/24) = 1.04 of
the bound above, inside its 2.5x). A checkpoint whose only FP8 tensors are the Engram rows
therefore runs bit for bit as its dequantised twin: the greedy tokens are equal whatever the
margins, in float32 and bfloat16, with the tables on the device or in host memory
(test_fp8_engram_rows_equal_their_twin).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v41 import stored_in_fp8
from deepinfer.models.loader import CheckpointError, ShapeMismatchError, load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.reference.gemm import dequantize_act, quantize_fp8
from deepinfer.testing.v41_checkpoint import (
    quantize_v41_tensors,
    random_v41_tensors,
    tiny_v41_config,
    write_v41_checkpoint,
)
from deepinfer.testing.v41_oracle import V41Oracle

TIGHT = 1e-2  # log-probability, absolute
FP8_BOUND = 0.44
NEW_TOKENS = 8
PROMPT_LENS = (5, 19, 37)
MX = 32
CONFIGS: dict[str, dict[str, Any]] = {
    # o_lora_rank 12: wo_a's 32-row scale blocks span two groups, so it is dequantised at load
    "plain": dict(layers=4),
    # o_lora_rank 32: wo_a FP8 through the grouped FP8 GEMM (block 32); a shared C2 segment
    "grouped": dict(
        layers=4,
        o_lora_rank=32,
        ratios=[2, 2, 1, 1],
        kv_source_layer_ids=[0, 2, 3],
        index_k_source_layer_ids=[0, 2, 3],
        index_source_layer_ids=[0, 2, 3],
    ),
    # Engram on both encoder layers, its tables FP8 rows (rows of 32: one scale each)
    "engram": dict(
        layers=4, engram=True, engram_layer_ids=[0, 1], engram_compressed_vocab_size=None, engram_head_dim=32
    ),
}


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """The contract's activation quantisation per row per 32 channels, dequantised (in x's dtype)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, scale = quantize_fp8(rows, MX)
    return dequantize_act(xq, scale, MX).to(x.dtype).reshape(x.shape)


class _Fp8Input(torch.Tensor):
    """A weight whose products quantise their other operand first, as an FP8 linear does: x @ W.T
    (the oracle's linears and shared experts) and einsum("tgr,gdr->tgd", o, W) (its grouped wo_a,
    one quantisation per (token, group) row as batched_linear_fp8). Everything else as a tensor."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, cls) else a for a in args]
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and isinstance(args[1], cls):
            with torch._C.DisableTorchFunctionSubclass():
                return torch.matmul(_fake_quant(plain[0]), plain[1], **kwargs)
        if func is torch.einsum and isinstance(args[2], cls):
            with torch._C.DisableTorchFunctionSubclass():
                return torch.einsum(plain[0], _fake_quant(plain[1]), plain[2])
        return super().__torch_function__(func, types, args, kwargs)


def hooked_oracle(raw: dict[str, Any], twin: dict[str, torch.Tensor], grouped_wo_a: bool) -> V41Oracle:
    oracle = V41Oracle(raw, twin)
    for name in list(oracle.w):
        prefix = name.removesuffix(".weight")
        if name != prefix and stored_in_fp8(prefix) and (grouped_wo_a or not prefix.endswith(".wo_a")):
            oracle.w[name] = oracle.w[name].as_subclass(_Fp8Input)
    return oracle


class Case:
    def __init__(self, name: str, root: Path) -> None:
        knobs = CONFIGS[name]
        self.raw = tiny_v41_config(**knobs)
        self.grouped_wo_a = self.raw["text_config"]["o_lora_rank"] % MX == 0
        tensors = random_v41_tensors(self.raw, seed=11 + len(name))
        self.quantised, self.twin = quantize_v41_tensors(tensors)
        self.quant = write_v41_checkpoint(root / "quant", self.raw, self.quantised)
        twin_raw = {k: v for k, v in self.raw.items() if k != "quantization_config"} | {"dtype": "float32"}
        self.twin_root = write_v41_checkpoint(root / "twin", twin_raw, self.twin)
        self.oracle_q = hooked_oracle(self.raw, self.twin, self.grouped_wo_a)
        gen = torch.Generator().manual_seed(9)
        vocab = self.raw["text_config"]["vocab_size"]
        self.prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    def generate(
        self,
        root: Path,
        prompts: list[list[int]] | None = None,
        new_tokens: int = NEW_TOKENS,
        dtype: str = "float32",
    ) -> list[tuple[list[int], torch.Tensor]]:
        """LLM.generate, greedy, in `dtype`, on the checkpoint at root: per prompt (the generated
        tokens, log-probabilities of every vocabulary entry at every position after the first)."""
        llm = LLM(
            str(root), backend="reference", dtype=dtype, block_size=4, max_model_len=64, max_logprobs=-1,
            kv_cache_dtype="bf16",  # the weights' formats alone (the KV formats: test_parity_v41_kv.py)
        )  # fmt: skip
        params = SamplingParams(
            temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=-1, prompt_logprobs=-1
        )
        prompts = prompts or self.prompts
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = []
        for out in outs:
            assert out.prompt_logprobs is not None and out.outputs[0].logprobs is not None
            positions = [p for p in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs] if p is not None]
            rows = [[pos[v].logprob for v in range(len(pos))] for pos in positions]
            result.append((list(out.outputs[0].token_ids), torch.tensor(rows, dtype=torch.float64)))
        return result


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def quant_runs(case: Case) -> list[tuple[list[int], torch.Tensor]]:
    return case.generate(case.quant)


def centred(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - logprobs.mean(-1, keepdim=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((centred(a) - centred(b)).norm() / centred(b).norm())


def test_weights_stay_fp8_and_mxfp4(case: Case) -> None:
    model: Any = load_model(case.quant, create_reference_backend(), dtype=torch.float32)
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        for linear in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b, ffn.shared_gate_up, ffn.shared_down):
            assert linear.weight.dtype == torch.float8_e4m3fn and linear.block == MX
            scale = linear.weight_scale_inv
            assert scale is not None and scale.shape == (
                -(-linear.weight.shape[0] // MX),
                -(-linear.in_features // MX),
            )
            assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # UE8M0: powers of two
        assert (attn.wo_a.weight.dtype == torch.float8_e4m3fn) == case.grouped_wo_a
        assert ffn.w13.dtype == torch.uint8 and ffn.w13.shape[-1] == ffn.hidden // 2  # packed MXFP4
        assert ffn.w13_scale is not None and ffn.w13_scale.dtype == torch.uint8
        assert ffn.gate_weight.dtype == torch.float32
        if attn.compressor is not None:
            assert attn.compressor.wkv.weight.dtype == torch.float32 and not attn.compressor.wkv.is_fp8
        if attn.indexer is not None:
            assert attn.indexer.wq_b.is_fp8 and not attn.indexer.weights_proj.is_fp8


def test_engram_tables_stay_fp8_rows(case: Case) -> None:
    model: Any = load_model(case.quant, create_reference_backend(), dtype=torch.float32)
    engrams = [layer.engram for layer in model.layers if layer.engram is not None]
    assert bool(engrams) == (case.raw["text_config"].get("engram_layer_ids") is not None)
    for e in engrams:
        assert e.table.dtype == torch.float8_e4m3fn and e.table.shape == (e.rows, e.head_dim)
        assert e.scales is not None and e.scales.dtype == torch.uint8
        assert e.scales.shape == (e.rows, e.head_dim // MX)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("host", [False, True], ids=["device-tables", "host-tables"])
def test_fp8_engram_rows_equal_their_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, host: bool
) -> None:
    """A float checkpoint whose Engram tables are FP8 rows against the same checkpoint with the
    rows dequantised: the same greedy tokens (the lookup's dequantisation is exact: the bound
    is 0), and in float32 the float64 oracle on the twin's weights gives them too."""
    if host:
        monkeypatch.setenv("DEEPINFER_ENGRAM_HOST_TABLES", "1")
    raw = tiny_v41_config(**CONFIGS["engram"])
    raw.pop("quantization_config")
    raw["dtype"] = "float32"
    tensors = random_v41_tensors(raw, seed=5)
    quantised, dequantised = quantize_v41_tensors(tensors)
    rows = [n for n in tensors if n.endswith("engram.embed.weight")]
    assert len(rows) == 2 and all(not torch.equal(dequantised[n], tensors[n]) for n in rows)
    fp8 = (
        tensors
        | {n: quantised[n] for n in rows}
        | {n.replace("weight", "scale"): quantised[n.replace("weight", "scale")] for n in rows}
    )
    twin = tensors | {n: dequantised[n] for n in rows}
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (3, 11, 29)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for name, weights in (("fp8", fp8), ("twin", twin)):
        root = write_v41_checkpoint(tmp_path / name, raw, weights)
        llm = LLM(
            str(root), backend="reference", dtype=dtype, block_size=4, max_model_len=64, kv_cache_dtype="bf16"
        )  # the oracle's exact KV
        engrams = [b.engram for b in llm.llm_engine.model.layers if b.engram is not None]
        assert all((e.table.dtype == torch.float8_e4m3fn) == (name == "fp8") for e in engrams)
        assert all(e.host_table == host for e in engrams)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1]
    if dtype == "float32":
        oracle = V41Oracle(raw, twin)
        assert runs[0] == [oracle.greedy(p, NEW_TOKENS) for p in prompts]


def test_equals_the_oracle_with_the_same_activation_quantisation(
    case: Case, quant_runs: list[tuple[list[int], torch.Tensor]]
) -> None:
    for prompt, (tokens, ours) in zip(case.prompts, quant_runs, strict=True):
        want = case.oracle_q.logits(prompt + tokens[:-1]).log_softmax(-1)  # after each prefix
        err = float((ours - want).abs().max())
        assert err <= TIGHT, f"prompt of {len(prompt)}: log-probabilities differ by {err:.3e}"
        assert tokens == case.oracle_q.greedy(prompt, NEW_TOKENS), f"prompt of {len(prompt)}"


def test_activation_quantisation_is_the_only_difference(
    case: Case, quant_runs: list[tuple[list[int], torch.Tensor]]
) -> None:
    """Against the dequantised twin through LLM.generate, teacher-forced on the quantised model's
    tokens (the twin's prompt is the quantised run's prompt + tokens, one token generated)."""
    forced = [p + t[:-1] for p, (t, _) in zip(case.prompts, quant_runs, strict=True)]
    twin = case.generate(case.twin_root, forced, new_tokens=1)
    for prompt, (_, ours), (_, theirs) in zip(case.prompts, quant_runs, twin, strict=True):
        theirs = theirs[: ours.shape[0]]  # the prompt positions: the forced sequence
        err = rel(ours, theirs)
        assert 1e-3 < err <= FP8_BOUND, f"prompt of {len(prompt)}: relative error {err:.3e}"
        assert rel(ours, theirs.roll(1, dims=-1)) > 0.5  # the bound is far from unrelated logits


def test_bfloat16_within_both_errors(case: Case) -> None:
    """bfloat16, the default dtype of a quantised checkpoint (norms, sinks, mixing weights stay
    float32), against the float64 oracle on the plain twin, teacher-forced on its own tokens. Its
    error is the activation quantisation's (<= FP8_BOUND, the float32 test's bound) plus bfloat16
    rounding; the latter is measured as the twin's own bfloat16 run against the same oracle (same
    weights and shapes: 2% to 20% on these random models), doubled because quantising bf16
    activations moves e4m3 rounding decisions that float32 keeps. Measured: 0.20 .. 0.34 against
    limits of 0.47 .. 0.84."""
    plain = V41Oracle(case.raw, case.twin)
    ours_runs = case.generate(case.quant, dtype="bfloat16")
    forced = [p + t[:-1] for p, (t, _) in zip(case.prompts, ours_runs, strict=True)]
    twin_runs = case.generate(case.twin_root, forced, new_tokens=1, dtype="bfloat16")
    for seq, (_, ours), (_, twin) in zip(forced, ours_runs, twin_runs, strict=True):
        want = plain.logits(seq).log_softmax(-1)
        limit = FP8_BOUND + 2 * rel(twin, want)
        assert rel(ours, want) <= limit, (len(seq), rel(ours, want), limit)


# --------------------------------------------------------------------------- corrupt checkpoints


def rewritten(case: Case, root: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    state = load_file(case.quant / "model.safetensors")
    for name, t in edit.items():
        if t is None:
            del state[name]
        else:
            state[name] = t
    root.mkdir(parents=True, exist_ok=True)
    save_file(state, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(case.raw))
    return root


def load_error(case: Case, root: Path, edit: dict[str, torch.Tensor | None]) -> Exception:
    with pytest.raises(CheckpointError) as info:
        load_model(rewritten(case, root, edit), create_reference_backend(), dtype=torch.float32)
    return info.value


def test_wrong_scale_shapes_are_named(case: Case, tmp_path: Path) -> None:
    """wq_b (H*D = 96, 16): 32-blocks give (3, 1); a 128-block scale (1, 1) is refused."""
    name = "layers.0.attn.wq_b.scale"
    assert tuple(case.quantised[name].shape) == (3, 1)
    err = load_error(case, tmp_path / "a", {name: case.quantised[name][:1].contiguous()})
    assert isinstance(err, ShapeMismatchError) and repr(name) in str(err)
    assert "expected shape (3, 1) (one per 32x32 block" in str(err) and "found (1, 1)" in str(err)
    expert = "layers.1.ffn.experts.0.w2.scale"  # MXFP4 (N, K/32)
    err = load_error(case, tmp_path / "b", {expert: case.quantised[expert][:, :0].contiguous()})
    assert isinstance(err, ShapeMismatchError) and repr(expert) in str(err) and "per 32 values" in str(err)


def test_wrong_dtypes_are_named(case: Case, tmp_path: Path) -> None:
    scale, weight = "layers.2.attn.wo_b.scale", "layers.2.attn.wo_b.weight"
    err = load_error(case, tmp_path / "a", {scale: case.quantised[scale].view(torch.uint8).to(torch.int32)})
    assert repr(scale) in str(err) and "I32" in str(err) and "UE8M0" in str(err)
    err = load_error(case, tmp_path / "b", {weight: case.twin[weight].to(torch.bfloat16)})
    assert weight in str(err) and "not float8_e4m3fn" in str(err)
    packed = "layers.0.ffn.experts.1.w1.weight"  # an MXFP4 expert whose scale is FP8 e4m3
    err = load_error(
        case, tmp_path / "c", {packed.replace("weight", "scale"): torch.ones(16, 1).to(torch.float8_e4m3fn)}
    )
    assert "layers.0.ffn.experts.1.w1.scale" in str(err) and "UE8M0" in str(err)
    err = load_error(case, tmp_path / "d", {"layers.0.attn.wq_a.scale": None})  # FP8 without its scale
    assert "layers.0.attn.wq_a" in str(err) and "scale" in str(err)


def test_wrong_engram_rows_are_named(tmp_path: Path) -> None:
    """FP8 Engram rows: a scale of the wrong dtype or shape, float rows beside a scale, and FP8
    rows without their scale are refused with the tensor named."""
    case = Case("engram", tmp_path / "case")
    table, scale = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"
    rows, groups = case.quantised[scale].shape
    err = load_error(case, tmp_path / "a", {scale: case.quantised[scale].view(torch.uint8).to(torch.int32)})
    assert repr(scale) in str(err) and "I32" in str(err) and "UE8M0" in str(err)
    err = load_error(case, tmp_path / "b", {scale: case.quantised[scale][:, :0].contiguous()})
    assert isinstance(err, ShapeMismatchError) and repr(scale) in str(err)
    assert f"expected shape ({rows}, {groups}) (one per 32 values of each row" in str(err)
    err = load_error(case, tmp_path / "c", {table: case.twin[table].to(torch.bfloat16)})
    assert repr(table) in str(err) and "must be FP8 rows (F8_E4M3), but it is BF16" in str(err)
    err = load_error(case, tmp_path / "d", {scale: None})
    assert repr(table) in str(err) and "is FP8 but has no layers.1.engram.embed" in str(err)


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("embed.weight", torch.int32),
        ("layers.0.attn_norm.weight", torch.uint8),
        ("layers.1.attn.attn_sink", torch.float8_e4m3fn),
        ("layers.1.hc_attn_fn", torch.int16),
        ("layers.1.attn.compressor.wgate.weight", torch.int8),
        ("layers.2.attn.indexer.weights_proj.weight", torch.float8_e4m3fn),
        ("layers.3.ffn.gate.weight", torch.int64),
        ("layers.0.engram.q_weight", torch.uint8),
        ("layers.0.engram.embed.weight", torch.int8),
        ("head.weight", torch.float8_e5m2),
    ],
)
def test_every_stored_dtype_outside_the_format_is_named(
    tmp_path: Path, name: str, dtype: torch.dtype
) -> None:
    """Tensors the published format stores as floats (bf16 / float32), given an integer or FP8
    dtype with no scale: refused with the tensor named."""
    case = Case("engram", tmp_path / "case")
    t = case.quantised[name]
    bad = t.to(dtype) if dtype.is_floating_point else t.float().round().clamp(-100, 100).to(dtype)
    err = load_error(case, tmp_path / "bad", {name: bad})
    assert f"tensor {name!r}" in str(err), str(err)
    if dtype == torch.float8_e4m3fn:
        assert "is FP8" in str(err)
    elif name.endswith("engram.embed.weight"):
        assert "must be FP8 rows (F8_E4M3)" in str(err)
    else:
        assert "a weight must be floating point" in str(err), str(err)

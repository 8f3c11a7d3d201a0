"""End-to-end decode throughput of DeepSeek-V4: deepinfer in two weight formats against transformers
and against the roofline of the bytes each format reads, one run.

Model: model/deepseek-v4-flash/config.json with num_hidden_layers cut to --num-hidden-layers (4:
the first layers of its schedule, HCA, HCA, HCA, CSA with the first three MoE layers hash-routed)
and its MTP layers left out; random weights, the same ones for every engine:

  * transformers' DeepseekV4ForCausalLM built on the GPU in bf16 with its own init (_init_weights:
    N(0, initializer_range^2), norms 1, sinks and position biases 0), experts_implementation
    "grouped_mm" (bench_e2e.build_hf_model; its generate's switch to batched_mm for decode is
    turned off as bench_e2e does), every hash layer's tid2eid table filled with K distinct
    uniformly drawn experts per token id (transformers' init leaves it 0: every token on expert 0);
  * "bf16": deepinfer's DeepseekV4ForCausalLM loaded from that model's tensors under DeepSeek's
    names (transformers' own revert_weight_conversion, what save_pretrained writes; the routed
    experts as views of its fused gate_up_proj / down_proj) through deepinfer's checkpoint reader
    (StateDictSource: models.loader.CheckpointReader over the in-memory tensors, no file written);
    tensors whose device and dtype match are shared, and the routed experts deepinfer stacks are
    swapped for transformers' own fused tensors (equal, checked), so both fit one GPU;
  * "fp8_fp4": DeepSeek's published format made from the same bf16 weights by the project's
    quantiser (testing.checkpoints.quantize_v4_state_dict, one tensor at a time on the
    device): FP8 e4m3 linears with UE8M0 128x128 block scales (all but the compressors, the
    indexer's weights_proj and the router: deepseek_v4.stored_in_fp8), MXFP4 routed experts
    (e2m1 packed two a byte, a UE8M0 scale per 32 values); embedding, head, norms, mixing
    parameters as they are. Loaded through the same reader (its FP8 / MXFP4 paths) on a backend
    of its own.

Workload per batch B (1, 8, 32, 64, 128, 256): B random prompts of 128 token ids in [2, vocab)
(the same for every engine), 64 output tokens each, greedy, EOS ignored. tok/s = B * 64 / wall
time of one whole generate call (prefill included). deepinfer: a warm-up generate of the same
batch with --warmup-len (8) new tokens (every decode step of a batch replays its bucket's graph,
so a short warm-up captures and compiles what the timed calls run), then the median of --repeats
(3) timed calls (fewer where the warm-up shows the time budget would not hold them: the row's
`repeats`). transformers: bf16 only, batches up to --hf-max-batch, a warm-up of --hf-warmup-len
(8) new tokens, one timed call. The engines run batch by batch (bf16, fp8_fp4, transformers), so
a run cut short by its time budget keeps every format's small batches. The copy rate (2 GiB
device-to-device copy, bytes read + written over time) and the dense bf16 matmul rate (cuBLAS
8192^3) are measured in the same run (bench_e2e.measure_copy / measure_matmul).

Roofline (per format and batch B; P = 128 input, N = 64 output tokens; bw = copy bytes/s,
mm = matmul FLOP/s; byte counts are the real sizes of the format's tensors under DeepSeek's names):

  W_dense   = bytes of every weight a step reads whole: attention (wq_a, wq_b, wkv, wo_a, wo_b,
              sinks, norms), compressors, indexer, shared experts, routers, mHC parameters, and
              FP8 scales (1 byte per 128x128 block), in the format's dtypes
  W_head    = bytes of the LM head (bf16 in both formats)
  W_exp[l]  = bytes of ONE routed expert of MoE layer l (w1 + w2 + w3; MXFP4: K/2 bytes a row +
              K/32 scale bytes)
  W_row     = bytes per token of its embedding row and its tid2eid rows (hash layers)
  hit(n)    = E * (1 - (1 - K/E)^n)  expected distinct routed experts n tokens touch in one MoE
              layer under uniform routing, hash-routed layers too (E = 256, K = 6)
  weights(n)= W_dense + W_head + sum_l hit(n) * W_exp[l] + n * W_row
  cache_read(L), per request at cache length L (e = bytes of a cache value, the model dtype;
              D = head_dim 512, Di = index_head_dim 128, Wn = sliding_window 128, topk = 512),
              summed over the layers, m a layer's compression ratio:
                every layer    min(L, Wn) * D                     its window (the ring)
                CSA (m = 4)    min(topk, L//m) * D + (L//m) * Di  entries attended, index keys scored
                               + 8 D + 8 Di                       compressor and indexer state
                                                                  pooled when an entry closes
                                                                  (2m rows of 4D / 4Di per m tokens)
                HCA (m = 128)  (L//m) * D + 2 D                   every entry, state pooled
              times e
  cache_write = per token, summed over the layers: D (window) + CSA 4D + 4Di + D/m + Di/m,
              HCA 2D + D/m (state rows and closed entries), times e
  F_tok     = 2 * (parameters of W_dense + sum_l K * parameters of one expert)   FLOPs per token
  F_head    = 2 * V * hidden                                   per sampled row
  F_attn(L) = sum over layers of 4 * H * D * (min(L, Wn) + CSA min(topk, L//m) | HCA L//m)
              + CSA 2 * Hi * Di * (L//m)                       per query at cache length L
  prefill   = C * max((weights(B*P / C) + B*P / C * cache_write) / bw,
                      (F_tok * B*P + F_head * B + B * sum_{L=1..P} F_attn(L)) / C / mm)
              C = ceil(B*P / max_num_batched_tokens) chunks (the engine's prefill steps)
  decode_j  = max((weights(B) + B * cache_write + B * cache_read(P + j)) / bw,
                  ((F_tok + F_head) * B + B * F_attn(P + j)) / mm)     j = 1 .. N-1
  roofline_tok_s = B * N / (prefill + sum_j decode_j)

The prefill samples the first output token, so N tokens take the prefill and N - 1 decode steps.
The compute bound uses the bf16 matmul rate for both formats (SM90 has no FP4 tensor cores: MXFP4
is dequantised to bf16). FP8 linears could run at up to twice that rate, so where fp8_fp4's
roofline is compute-bound (the prefill from batch 32 or 64 on) it is a little low.
Uniform routing is an assumption: greedy decoding of random weights may repeat tokens,
and then hash-routed layers touch fewer experts than hit(B) (`decode_distinct_tokens_mean` in
each row says how many distinct tokens a decode step of the batch fed), so deepinfer can exceed
this roofline.

Memory (the JSON's "memory"): each format's weight bytes, what each engine allocated (KV pool,
step buffers, graph pool), the allocated bytes after each build and the peak of every section
(`h200_memory_needed_gib`: the run's peak). At 4 layers: 51.1 GiB of bf16 weights (one copy:
transformers' model and deepinfer's bf16 model share it) and 15.3 GiB in the published format;
building deepinfer's bf16 model peaks near 107 GiB (it stacks every layer's routed experts, 12 GiB
a layer, before they are swapped for transformers' own), the fp8_fp4 build near 80 GiB, and the
rows run in about 70 GiB, so one 141 GB H200 holds the run. Where memory is short,
run the formats apart: --formats fp8_fp4 --skip-transformers frees transformers' model once the
weights are quantised (only the tensors the published format keeps as they are stay).

    python bench/bench_e2e_v4.py --out bench/results/DIR     # H200: about 5 minutes (run_v4_e2e_h200.sh)
    python bench/bench_e2e_v4.py --smoke --out /tmp/e2e_v4  # the whole logic on the CPU, tiny V4, ~20 s

--smoke: testing.checkpoints.tiny_v4_config (a sliding-window, a CSA and an HCA layer, the
first MoE hash-routed), the reference backend, float32, batches 1 and 2, 4 output tokens, and
transformers' indexer top-k made tie-stable (exact ties to the lower entry id, deepinfer's
contract) so that its greedy tokens must equal deepinfer's bf16-row tokens (`greedy_tokens_equal`).

Files: DIR/e2e_v4.json ({"rows": [{"format", "batch", "deepinfer_tok_s", "transformers_tok_s"
(bf16 rows), "roofline_tok_s", ...}], "memory", "ceilings", "roofline_model", "info", "notes",
"errors"}), DIR/e2e_v4.md (the table), DIR/e2e_v4.png (the plot); all rewritten after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as e2e  # the helpers this script shares with the V2 benchmark

from deepinfer import envs
from deepinfer.models.loader import CheckpointReader, MissingTensorError
from deepinfer.testing.transformers_ties import stable_indexer_topk

REPO = e2e.REPO
FLASH = REPO / "model" / "deepseek-v4-flash" / "config.json"
FORMATS = ("bf16", "fp8_fp4")
log, sync, free_memory, gib = e2e.log, e2e.sync, e2e.free_memory, e2e.gib
# safetensors' dtype names, as CheckpointReader.dtype_of reports them
SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
    torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
}  # fmt: skip


# --------------------------------------------------------------------------- weights


class StateDictSource(CheckpointReader):
    """deepinfer's checkpoint reader (models.loader.CheckpointReader: shape checks, FP8 weights
    with UE8M0 block scales, packed MXFP4 experts, hash tables) over an in-memory state dict under
    DeepSeek's names instead of safetensors files. Tensors are served as they are, so the reader's
    `.to(device, dtype)` shares every one whose device and dtype already match."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device, allow_fp8: bool, backend: str):
        # No files to list or open: the attributes CheckpointReader.__init__ sets, over `state`.
        self.root, self.device = Path("<memory>"), device
        self.allow_fp8, self.backend_name = allow_fp8, backend
        self.check_weights = False  # made here, finite
        self.unfused = envs.read().model_unfused  # as load_model reads DEEPINFER_MODEL_UNFUSED
        self.fp8_dtype = torch.float8_e4m3fn
        self.fp8_block = 128  # DeepSeek-V3 / V4's 128 x 128 scale blocks
        self.files, self.index_map, self._handles = [], {}, {}
        self.state = state
        self.location = dict.fromkeys(state, "<memory>")
        self._read: set[str] = set()
        self.progress: Any = None
        self.bytes_read = 0

    def _read_raw(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise MissingTensorError(f"tensor {name!r} is not in the in-memory state dict")
        self._read.add(name)
        t = self.state[name].detach()
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype_of(self, name: str) -> str:
        return SAFETENSORS_DTYPES[self.state[name].dtype]


def deepseek_state(hf: Any) -> dict[str, torch.Tensor]:
    """transformers' tensors under DeepSeek's names (model.layers.{i}.attn.wq_a.weight, ...: what
    its save_pretrained writes, by its own revert_weight_conversion), every one the model's own
    storage: the routed experts as per-expert views (w1 / w3 the halves of gate_up_proj, w2 of
    down_proj) instead of the copies the revert would make."""
    from transformers.core_model_loading import revert_weight_conversion

    state = hf.state_dict()
    fused = {k: v for k, v in state.items() if ".mlp.experts." in k}
    out: dict[str, torch.Tensor] = revert_weight_conversion(
        hf, {k: v for k, v in state.items() if k not in fused}
    )
    for name, t in fused.items():
        prefix, kind = name.rsplit(".mlp.experts.", 1)
        if kind == "gate_up_proj":  # (E, 2I, Dm) = [gate; up] per expert
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif kind == "down_proj":  # (E, Dm, I)
            for e in range(t.shape[0]):
                out[f"{prefix}.ffn.experts.{e}.w2.weight"] = t[e]
        else:
            raise ValueError(f"unexpected transformers expert tensor {name!r}")
    return out


def fill_hash_tables(hf: Any, seed: int) -> int:
    """Every hash layer's tid2eid (V, K): K distinct experts per token id, uniformly drawn (the
    routing the roofline assumes). Returns the number of tables filled."""
    n = 0
    for name, buf in hf.named_buffers():
        if name.endswith("tid2eid"):
            g = torch.Generator(device=buf.device).manual_seed(seed + n)
            vocab, k = buf.shape
            draws = torch.rand((vocab, hf.config.n_routed_experts), generator=g, device=buf.device)
            buf.copy_(draws.argsort(dim=-1)[:, :k])
            n += 1
    return n


def build_v4(config: Any, state: dict[str, torch.Tensor], backend: Any, dtype: torch.dtype) -> Any:
    """deepinfer's DeepseekV4ForCausalLM from `state` through its own load_weights; every tensor
    of `state` must be read."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(config, backend, dtype)
    reader = StateDictSource(state, backend.device.device(), backend.capabilities.supports_fp8, backend.name)
    with torch.no_grad():
        model.load_weights(reader)
    unread = reader.unread()
    if unread:
        raise RuntimeError(f"deepinfer did not read {len(unread)} tensors: {[n for n, _ in unread[:8]]}")
    return model.eval()


def share_experts(model: Any, hf: Any) -> int:
    """Swap the routed experts deepinfer stacked (w13 = [w1; w3] per expert, w2) for transformers'
    fused tensors where they are equal (same dtype and device: the bf16 model), freeing the copies.
    Returns the number of tensors swapped."""
    swapped = 0
    for block, layer in zip(model.layers, hf.model.layers):
        ffn, experts = block.ffn, layer.mlp.experts
        for mine, theirs in (("w13", experts.gate_up_proj), ("w2", experts.down_proj)):
            w, t = getattr(ffn, mine), theirs.detach()
            if w.dtype == t.dtype and w.device == t.device and w.shape == t.shape and torch.equal(w, t):
                setattr(ffn, mine, t)
                swapped += 1
    return swapped


def quantize_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's published V4 format of `state` (quantize_v4_state_dict, one tensor at a time so
    that its float32 dequantised copy of each is dropped at once; tensors it keeps are shared)."""
    from deepinfer.testing.checkpoints import quantize_v4_state_dict

    out: dict[str, torch.Tensor] = {}
    for name in list(state):
        quantized, _ = quantize_v4_state_dict({name: state[name]})
        out.update(quantized)
    return out


# --------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class FormatBytes:
    """One format's weight bytes, classified as the roofline reads them (module docstring)."""

    dense: float
    head: float
    expert: tuple[float, ...]  # one routed expert, per MoE layer
    row: float  # per token: embedding row + tid2eid rows
    total: float

    @staticmethod
    def of(state: dict[str, torch.Tensor], experts: int, vocab: int) -> FormatBytes:
        dense = head = row = total = 0.0
        per_layer: dict[int, float] = {}
        for name, t in state.items():
            nb = float(t.numel() * t.element_size())
            total += nb
            if ".ffn.experts." in name:
                layer = int(name.split("layers.")[1].split(".")[0])
                per_layer[layer] = per_layer.get(layer, 0.0) + nb
            elif name in ("head.weight", "lm_head.weight"):
                head += nb
            elif name.endswith(("embed_tokens.weight", "embed.weight", "tid2eid")):
                row += nb / vocab
            else:
                dense += nb
        expert = tuple(per_layer[k] / experts for k in sorted(per_layer))
        return FormatBytes(dense, head, expert, row, total)


@dataclass(frozen=True)
class V4Shape:
    """What the roofline needs of the config: layers' ratios, cache widths, FLOP counts."""

    ratios: tuple[int, ...]
    csa: int
    window: int
    topk: int
    d: int
    di: int
    heads: int
    index_heads: int
    experts: int
    top_k: int
    vocab: int
    hidden: int
    cache_elt: int  # bytes of a cache value (the model dtype)
    dense_params: float  # parameters of W_dense (the bf16 state dict)
    expert_params: tuple[float, ...]  # of one routed expert, per MoE layer

    def hit(self, n: float) -> float:
        return self.experts * (1 - (1 - self.top_k / self.experts) ** n)

    def weights(self, f: FormatBytes, n: float) -> float:
        return f.dense + f.head + sum(self.hit(n) * e for e in f.expert) + n * f.row

    def cache_read(self, length: int) -> float:
        d, di, total = self.d, self.di, 0.0
        for m in self.ratios:
            total += min(length, self.window) * d
            if m == self.csa:
                total += min(self.topk, length // m) * d + (length // m) * di + 8 * d + 8 * di
            elif m:
                total += (length // m) * d + 2 * d
        return total * self.cache_elt

    def cache_write(self) -> float:
        d, di, total = self.d, self.di, 0.0
        for m in self.ratios:
            total += d
            if m == self.csa:
                total += 4 * d + 4 * di + d / m + di / m
            elif m:
                total += 2 * d + d / m
        return total * self.cache_elt

    def token_flops(self) -> float:
        return 2 * (self.dense_params + sum(self.top_k * p for p in self.expert_params))

    def head_flops(self) -> float:
        return 2.0 * self.vocab * self.hidden

    def attn_flops(self, length: int) -> float:
        total = 0.0
        for m in self.ratios:
            keys = min(length, self.window) + (
                min(self.topk, length // m) if m == self.csa else length // m if m else 0
            )
            total += 4 * self.heads * self.d * keys
            if m == self.csa:
                total += 2 * self.index_heads * self.di * (length // m)
        return total

    def roofline(
        self, f: FormatBytes, b: int, p: int, n: int, step_tokens: int, bw: float, mm: float
    ) -> dict[str, Any]:
        chunks = -(-b * p // step_tokens)
        per_chunk = b * p / chunks
        pre_bytes = self.weights(f, per_chunk) + per_chunk * self.cache_write()
        pre_flops = self.token_flops() * b * p + self.head_flops() * b
        pre_flops += b * sum(self.attn_flops(length) for length in range(1, p + 1))
        prefill = chunks * max(pre_bytes / bw, pre_flops / chunks / mm)
        decode, bound = 0.0, {"memory": 0, "compute": 0}
        for j in range(1, n):
            nbytes = self.weights(f, b) + b * (self.cache_write() + self.cache_read(p + j))
            flops = (self.token_flops() + self.head_flops()) * b + b * self.attn_flops(p + j)
            decode += max(nbytes / bw, flops / mm)
            bound["memory" if nbytes / bw >= flops / mm else "compute"] += 1
        step_bytes = self.weights(f, b) + b * (self.cache_write() + self.cache_read(p + n // 2))
        return {
            "roofline_tok_s": b * n / (prefill + decode),
            "roofline_prefill_ms": prefill * 1e3,
            "roofline_prefill_chunks": chunks,
            "roofline_prefill_bound": "memory" if pre_bytes / bw >= pre_flops / chunks / mm else "compute",
            "roofline_decode_ms": decode * 1e3,
            "roofline_decode_step_ms": decode * 1e3 / max(1, n - 1),
            "roofline_decode_bound": max(bound, key=lambda k: bound[k]),
            "roofline_mid_step_bytes": step_bytes,  # at cache length P + N/2
            "roofline_mid_step_cache_bytes": b * self.cache_read(p + n // 2),
            "expected_experts_hit": self.hit(b),
        }


def v4_shape(config: Any, bf16: dict[str, torch.Tensor], cache_elt: int) -> V4Shape:
    v4 = config.v4
    e = config.n_routed_experts
    dense_params = 0.0
    expert_params: dict[int, float] = {}
    for name, t in bf16.items():
        if ".ffn.experts." in name:
            layer = int(name.split("layers.")[1].split(".")[0])
            expert_params[layer] = expert_params.get(layer, 0.0) + t.numel() / e
        elif (
            t.is_floating_point()
            and t.dim() == 2
            and not name.endswith(("head.weight", "embed_tokens.weight", "embed.weight"))
        ):
            dense_params += t.numel()
    return V4Shape(
        ratios=tuple(v4.compress_ratios), csa=v4.csa_ratio, window=v4.sliding_window, topk=v4.index_topk,
        d=v4.head_dim, di=v4.index_head_dim, heads=config.num_attention_heads,
        index_heads=v4.index_n_heads, experts=e, top_k=config.num_experts_per_tok,
        vocab=config.vocab_size, hidden=config.hidden_size, cache_elt=cache_elt,
        dense_params=dense_params, expert_params=tuple(expert_params[k] for k in sorted(expert_params)),
    )  # fmt: skip


# --------------------------------------------------------------------------- the run


class V4Bench(e2e.Bench):
    """The run: the models, the rows by (format, batch), the files written after every row.
    Reuses bench_e2e.Bench's environment, ceilings, sections, make_llm, di_generate and timed."""

    def __init__(self, args: argparse.Namespace) -> None:  # the attributes Bench's methods read
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        self.config_file = args.config  # the source, for the record
        self.tmp = tempfile.TemporaryDirectory(prefix="e2e_v4_")
        self.config_dir = Path(self.tmp.name)  # the reduced config.json the engines are given
        self.raw = reduced_config(args)
        (self.config_dir / "config.json").write_text(json.dumps(self.raw, indent=1))
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.memory: dict[str, Any] = {}
        self.notes: list[str] = []
        self.sections: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[str, Any] = {"reduced_config": self.raw}
        self.outputs: dict[tuple[str, int], list[list[int]]] = {}
        self.formats: dict[str, dict[str, Any]] = {}  # format -> model, backend, llm, bytes
        self.hf: Any = None
        self.max_batch = max([*args.batches, *args.profile_batches])
        import random

        rng = random.Random(args.seed)
        vocab = self.raw["vocab_size"]
        self.prompts = [
            [rng.randrange(2, vocab) for _ in range(args.input_len)] for _ in range(self.max_batch)
        ]

    # ------------------------------------------------------------------ setup

    def build_transformers(self) -> None:
        from deepinfer.models.config import ModelConfig

        t = time.time()
        self.hf = e2e.build_hf_model(
            self.config_dir / "config.json", self.device, self.dtype, self.args.init_std, self.args.seed,
            self.notes,
        )  # fmt: skip
        self.info["hash_tables_filled"] = fill_hash_tables(self.hf, self.args.seed)
        self.state = deepseek_state(self.hf)
        self.info["hf_build_s"] = time.time() - t
        self.info["experts_implementation"] = e2e.hf_experts_implementation(self.hf)
        self.info["initializer_range"] = self.hf.config.initializer_range
        self.config = ModelConfig.from_dict(self.raw)
        self.bytes = {
            "bf16": FormatBytes.of(self.state, self.config.n_routed_experts, self.config.vocab_size)
        }
        self.shape = v4_shape(self.config, self.state, torch.empty((), dtype=self.dtype).element_size())
        self.memory["bf16_weight_bytes"] = self.bytes["bf16"].total
        log(
            f"transformers {type(self.hf).__name__} ({self.config.num_hidden_layers} layers, ratios "
            f"{list(self.shape.ratios)}): {gib(self.bytes['bf16'].total)} of weights, experts "
            f"{self.info['experts_implementation']}, built in {self.info['hf_build_s']:.1f} s"
        )
        self.checksum_before = e2e.weights_checksum(self.hf.state_dict())

    def build_bf16(self) -> None:
        t = time.time()
        backend = e2e.make_backend(self.args.backend)
        model = build_v4(self.config, self.state, backend, self.dtype)
        swapped = share_experts(model, self.hf)
        free_memory(self.device)
        hf_ptrs = {v.untyped_storage().data_ptr() for v in self.hf.state_dict().values()}
        mine = {b.untyped_storage().data_ptr() for b in model.buffers() if b.device.type != "meta"}
        self.info["bf16_tensors_shared_with_transformers"] = f"{len(mine & hf_ptrs)} of {len(mine)}"
        self.info["bf16_experts_swapped"] = swapped
        self.info["bf16_build_s"] = time.time() - t
        self.formats["bf16"] = {"model": model, "backend": backend}
        log(
            f"deepinfer bf16 on {backend.name}: built in {self.info['bf16_build_s']:.1f} s, "
            f"{len(mine & hf_ptrs)} of {len(mine)} tensors shared with transformers ({swapped} expert "
            "tensors swapped for its own)"
        )
        self.record_memory("after_bf16_model")

    def build_fp8_fp4(self) -> None:
        t = time.time()
        quantized = quantize_published(self.state)
        self.bytes["fp8_fp4"] = FormatBytes.of(
            quantized, self.config.n_routed_experts, self.config.vocab_size
        )
        self.memory["fp8_fp4_weight_bytes"] = self.bytes["fp8_fp4"].total
        self.info["fp8_fp4_quantize_s"] = time.time() - t
        if "bf16" not in self.args.formats and self.args.skip_transformers:
            self.drop_transformers()  # nothing else reads the bf16 weights: only what fp8_fp4 shares stays
        backend = e2e.make_backend(self.args.backend)
        model = build_v4(self.config, quantized, backend, self.dtype)
        quantized.clear()
        free_memory(self.device)
        formats = sorted({str(b.dtype).replace("torch.", "") for b in model.buffers() if b.dim() >= 2})
        self.info["fp8_fp4_buffer_dtypes"] = formats
        self.info["fp8_fp4_build_s"] = time.time() - t
        self.formats["fp8_fp4"] = {"model": model, "backend": backend}
        log(
            f"deepinfer fp8_fp4: {gib(self.bytes['fp8_fp4'].total)} of weights in the published format, "
            f"quantised and built in {self.info['fp8_fp4_build_s']:.1f} s (buffer dtypes {formats})"
        )
        self.record_memory("after_fp8_fp4_model")

    def engines(self) -> None:
        for fmt, entry in self.formats.items():
            before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            # every request slot at full length (the V2 byte count misses the ring's per-slot rows)
            blocks = self.max_batch * -(-(self.args.input_len + self.args.output_len) // 64)
            llm, init_s = self.make_llm(
                entry["model"], entry["backend"], self.max_batch, num_gpu_blocks_override=blocks
            )
            entry["llm"] = llm
            self.info[f"{fmt}_engine_init_s"] = init_s
            if self.device.type == "cuda":  # its KV pool, step buffers and graph pool
                self.memory[f"{fmt}_engine_bytes"] = torch.cuda.memory_allocated(self.device) - before
            log(f"{fmt} engine created in {init_s:.1f} s (max_num_seqs {self.max_batch})")
        self.record_memory("after_engines")

    def record_memory(self, label: str) -> None:
        if self.device.type == "cuda":
            self.memory.setdefault("allocated_bytes", {})[label] = torch.cuda.memory_allocated(self.device)

    def drop_transformers(self) -> None:
        self.hf, self.state, self.checksum_before = None, {}, None
        free_memory(self.device)

    # ------------------------------------------------------------------ runs

    def measure(self, run: Any, batch: int, warmup: int, repeats: int) -> tuple[float, list[list[int]], int]:
        """(median seconds, the last call's tokens, timed calls made): a warm-up of `warmup` new
        tokens, then up to `repeats` timed calls of --output-len, as many as the time budget holds
        by the warm-up's pace (at least one; none: TimeoutError)."""
        n = self.args.output_len
        warm_s, _ = self.timed(functools.partial(run, batch, warmup), None)
        estimate = warm_s * n / max(1, warmup)  # a conservative guess of one timed call
        left = self.args.time_budget - (time.time() - e2e.T0)
        fits = min(repeats, int(left // max(estimate, 1e-9)))
        if fits < 1:
            raise TimeoutError(f"one call would take about {estimate:.1f} s, {left:.0f} s of the budget left")
        times, tokens = [], []
        for _ in range(fits):
            secs, tokens = self.timed(functools.partial(run, batch, n), n)
            times.append(secs)
        return sorted(times)[len(times) // 2], tokens, fits

    def run_batch(self, b: int) -> None:
        """Batch b: each deepinfer format, then transformers where b <= --hf-max-batch."""
        a = self.args
        for fmt, entry in self.formats.items():
            if self.over_budget(f"{fmt} batch {b}"):
                return
            llm = entry["llm"]
            try:
                secs, tokens, reps = self.measure(
                    lambda batch, k, llm=llm: self.di_generate(llm, batch, k), b, a.warmup_len, a.repeats
                )
            except TimeoutError as exc:
                self.notes.append(f"{fmt} batch {b}: skipped, {exc}")
                log(self.notes[-1])
                return
            self.outputs[(fmt, b)] = tokens
            row = self.row(fmt, b)
            row.update(deepinfer_tok_s=b * a.output_len / secs, deepinfer_s=secs, repeats=reps)
            row["decode_distinct_tokens_mean"] = distinct_per_step(tokens)
            if fmt != "bf16":
                row["greedy_common_prefix_vs_bf16_mean"] = common_prefix(
                    tokens, self.outputs.get(("bf16", b))
                )
            self.fill(row)
            log(
                f"deepinfer {fmt:7s} B={b:4d}: {secs:7.3f} s, {row['deepinfer_tok_s']:9.1f} tok/s "
                f"({row['deepinfer_over_roofline']:.2f} of its roofline; median of {reps})"
            )
            self.write()
        wanted = self.hf is not None and not a.skip_transformers and b <= a.hf_max_batch
        if wanted and not self.over_budget(f"transformers batch {b}"):
            self.run_transformers_batch(b)

    def run_transformers_batch(self, b: int) -> None:
        a, seen = self.args, set()

        def run(batch: int, k: int) -> list[list[int]]:
            return e2e.hf_generate(self.hf, self.prompts[:batch], k, self.device)

        try:
            with (
                e2e.hf_decode_switch(self.hf, allow=False),
                stable_indexer_topk() if a.hf_stable_topk else contextlib.nullcontext(),
                e2e.experts_seen(self.hf, seen),
            ):
                secs, tokens, _ = self.measure(run, b, a.hf_warmup_len, 1)
        except TimeoutError as exc:
            self.notes.append(f"transformers batch {b}: skipped, {exc}")
            log(self.notes[-1])
            return
        except torch.cuda.OutOfMemoryError as exc:
            self.row("bf16", b)["transformers_error"] = f"out of memory: {exc}"[:200]
            free_memory(self.device)
            return
        self.outputs[("transformers", b)] = tokens
        row = self.row("bf16", b)
        row.update(transformers_tok_s=b * a.output_len / secs, transformers_s=secs)
        row["transformers_experts_seen"] = sorted(seen)
        di = self.outputs.get(("bf16", b))
        if di is not None:
            row["greedy_tokens_equal"] = di == tokens
            row["greedy_common_prefix_mean"] = common_prefix(di, tokens)
        self.fill(row)
        log(
            f"transformers    B={b:4d}: {secs:7.3f} s, {row['transformers_tok_s']:9.1f} tok/s; greedy "
            f"tokens equal deepinfer bf16: {row.get('greedy_tokens_equal')} (mean common prefix "
            f"{row.get('greedy_common_prefix_mean', float('nan')):.1f} of {a.output_len})"
        )
        self.write()

    def row(self, fmt: str, b: int) -> dict[str, Any]:
        return self.rows.setdefault((fmt, b), {"format": fmt, "batch": b})

    def fill(self, row: dict[str, Any]) -> None:
        fmt, b = row["format"], row["batch"]
        if "roofline_tok_s" not in row and fmt in self.bytes:
            a = self.args
            bw = self.extra["copy"]["gbs"] * 1e9
            mm = self.extra["matmul"]["tflops"] * 1e12
            row.update(
                self.shape.roofline(
                    self.bytes[fmt], b, a.input_len, a.output_len, a.max_num_batched_tokens, bw, mm
                )
            )
        for key in ("deepinfer", "transformers"):
            if f"{key}_tok_s" in row and "roofline_tok_s" in row:
                row[f"{key}_over_roofline"] = row[f"{key}_tok_s"] / row["roofline_tok_s"]
        if "deepinfer_tok_s" in row and "transformers_tok_s" in row:
            row["deepinfer_over_transformers"] = row["deepinfer_tok_s"] / row["transformers_tok_s"]

    def check_weights(self) -> None:
        if self.hf is None or self.checksum_before is None:
            return
        same = e2e.weights_checksum(self.hf.state_dict()) == self.checksum_before
        self.info["weights_unchanged"] = same
        log(f"transformers' weights checksum unchanged by deepinfer's runs: {same}")

    # ------------------------------------------------------------------ report

    def write(self) -> None:
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        if self.device.type == "cuda":
            peaks = self.info.get("max_memory_allocated", {})
            self.memory["peak_allocated_bytes_by_section"] = peaks
            self.memory["peak_allocated_bytes"] = max(peaks.values(), default=0)
            self.memory["h200_memory_needed_gib"] = self.memory["peak_allocated_bytes"] / 2**30
            self.memory["gpu_memory_total"] = self.info.get("gpu_memory_total")
        doc = {
            "rows": [self.rows[k] for k in sorted(self.rows, key=lambda k: (FORMATS.index(k[0]), k[1]))],
            "memory": self.memory,
            "ceilings": {"copy": self.extra.get("copy"), "matmul": self.extra.get("matmul")},
            "roofline_model": {
                "shape": asdict(self.shape) if hasattr(self, "shape") else None,
                "bytes": {k: asdict(v) for k, v in getattr(self, "bytes", {}).items()},
            },
            "info": self.info,
            "notes": self.notes,
            "errors": self.errors,
            "sections_s": self.sections,
            "profiles": self.extra.get("profiles", {}),
        }
        (out / "e2e_v4.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (out / "e2e_v4.md").write_text(self.markdown())
        try:
            self.plot(out / "e2e_v4.png")
        except Exception as exc:  # matplotlib missing or broken: the table still stands
            self.errors["plot"] = f"{type(exc).__name__}: {exc}"

    def markdown(self) -> str:
        i, a = self.info, self.args
        copy, mm = self.extra.get("copy", {}), self.extra.get("matmul", {})
        layers = self.raw.get("num_hidden_layers")
        out = [
            f"# DeepSeek-V4 end-to-end decode: deepinfer (bf16, fp8_fp4) vs transformers vs roofline "
            f"({i.get('gpu', '?')})",
            "",
            f"{i.get('date', '')}; torch {i.get('torch')}, triton {i.get('triton')}, transformers "
            f"{i.get('transformers')}, Python {i.get('python')}"
            + (f", commit {i['commit']}" if i.get("commit") else "")
            + ".",
            "",
            f"`{i.get('command', '')}`",
            "",
            f"Model: `{i.get('config')}` at {layers} layers (compression ratios "
            f"{list(self.shape.ratios) if hasattr(self, 'shape') else '?'}"
            f", no MTP layer), random weights (transformers' init, std {i.get('initializer_range')}; "
            "uniform hash tables): bf16 "
            f"{gib(self.memory.get('bf16_weight_bytes', 0))} shared by transformers and deepinfer's bf16 "
            f"model; fp8_fp4 (FP8 UE8M0-block linears, MXFP4 routed experts, by quantize_v4_state_dict) "
            f"{gib(self.memory.get('fp8_fp4_weight_bytes', 0))}. deepinfer backend `{a.backend}`; "
            f"transformers experts `{i.get('experts_implementation', '?')}`, eager attention, dynamic cache.",
            "",
            f"Workload per batch B: B random prompts of {a.input_len} tokens, {a.output_len} output tokens "
            f"each, greedy, EOS ignored; tok/s = B x {a.output_len} / wall time of one generate call "
            f"(prefill included) after a warm-up of {a.warmup_len} tokens at the same batch (deepinfer: the "
            f"median of up to {a.repeats} calls; transformers: one, batches up to {a.hf_max_batch}).",
            "",
            f"Measured in this run: copy {copy.get('gbs', float('nan')):.0f} GB/s (read + write), "
            f"{mm.get('dtype', '')} matmul {mm.get('n', '')}^3 {mm.get('tflops', float('nan')):.1f} TFLOP/s. "
            "Roofline: the prefill's chunks plus N-1 decode steps, each max(bytes / copy rate, FLOPs / "
            "matmul rate); bytes = the format's dense + head weights + expected distinct experts "
            "E(1-(1-K/E)^B) per MoE layer + window, compressed entries, index keys read (the script's "
            "docstring).",
            "",
            "| format | batch | deepinfer tok/s | transformers tok/s | roofline tok/s | deepinfer / roofline "
            "| deepinfer / transformers | roofline step ms (bound) | step MB at P+N/2 | experts hit "
            "| distinct tokens / step | greedy vs transformers |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]

        def f(r: dict[str, Any], key: str, fmt: str) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""

        for k in sorted(self.rows, key=lambda k: (FORMATS.index(k[0]), k[1])):
            r = self.rows[k]
            step = (
                f"{r['roofline_decode_step_ms']:.3f} ({r['roofline_decode_bound'][0]})"
                if "roofline_decode_step_ms" in r
                else ""
            )
            agree = (
                f"{'equal' if r['greedy_tokens_equal'] else 'differ'}, prefix "
                f"{r['greedy_common_prefix_mean']:.1f}"
                if "greedy_tokens_equal" in r
                else r.get("transformers_error", "")
            )
            out.append(
                f"| {r['format']} | {r['batch']} | {f(r, 'deepinfer_tok_s', '.1f')} | "
                f"{f(r, 'transformers_tok_s', '.1f')} | {f(r, 'roofline_tok_s', '.1f')} | "
                f"{f(r, 'deepinfer_over_roofline', '.3f')} | {f(r, 'deepinfer_over_transformers', '.2f')} | "
                f"{step} | {r.get('roofline_mid_step_bytes', 0) / 1e6:.1f} | "
                f"{f(r, 'expected_experts_hit', '.1f')} | {f(r, 'decode_distinct_tokens_mean', '.1f')} | "
                f"{agree} |"
            )
        mem = self.memory
        meta = [
            f"engine creation: bf16 {i.get('bf16_engine_init_s', float('nan')):.1f} s, fp8_fp4 "
            f"{i.get('fp8_fp4_engine_init_s', float('nan')):.1f} s",
            f"bf16 tensors shared with transformers: {i.get('bf16_tensors_shared_with_transformers')}",
            f"weights unchanged by deepinfer: {i['weights_unchanged']}" if "weights_unchanged" in i else "",
            f"memory: peak allocated {gib(mem['peak_allocated_bytes'])} "
            f"(of {gib(mem.get('gpu_memory_total') or 0)})"
            if mem.get("peak_allocated_bytes")
            else "",
            f"max_num_batched_tokens {a.max_num_batched_tokens} (the prefill of B x {a.input_len} tokens in "
            f"ceil(B x {a.input_len} / {a.max_num_batched_tokens}) steps, as the roofline counts it)",
        ]
        out += ["", "## Notes", ""] + [f"- {m}" for m in meta if m] + [f"- {n}" for n in self.notes]
        if self.errors:
            out += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in self.errors.items()]
        if self.sections:
            out += [
                "",
                "Section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.sections.items()) + ".",
            ]
        return "\n".join(out) + "\n"

    def plot(self, path: Path) -> None:
        if not self.rows:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        lines = [
            ("bf16", "roofline_tok_s", "roofline bf16", "k--"),
            ("fp8_fp4", "roofline_tok_s", "roofline fp8_fp4", "k:"),
            ("bf16", "deepinfer_tok_s", f"deepinfer bf16 ({self.args.backend})", "o-"),
            ("fp8_fp4", "deepinfer_tok_s", f"deepinfer fp8_fp4 ({self.args.backend})", "^-"),
            ("bf16", "transformers_tok_s", "transformers bf16", "s-"),
        ]
        for fmt, key, label, style in lines:
            pts = [
                (b, r[key])
                for (f, b), r in sorted(self.rows.items())
                if f == fmt and isinstance(r.get(key), float)
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(
            f"DeepSeek-V4, {self.raw.get('num_hidden_layers')} layers, {self.args.input_len} in / "
            f"{self.args.output_len} out, {self.info.get('gpu', '')}",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def common_prefix(a: list[list[int]] | None, b: list[list[int]] | None) -> float:
    """Mean length of the common prefix of a's and b's rows (nan where one is missing)."""
    if a is None or b is None:
        return float("nan")
    total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        total += n
    return total / max(1, len(a))


def distinct_per_step(tokens: list[list[int]]) -> float:
    """Mean number of distinct tokens across the batch per decode step (the tokens hash-routed
    layers route by: fewer than the batch when greedy outputs repeat)."""
    steps = min(len(t) for t in tokens) - 1  # the last token sampled is never fed back
    if steps < 1:
        return float("nan")
    return sum(len({t[j] for t in tokens}) for j in range(steps)) / steps


# --------------------------------------------------------------------------- main


def reduced_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config the engines run: --config's at --num-hidden-layers layers, no MTP layer, no
    quantization_config (the bf16 model's; the fp8_fp4 model reads its format from its tensors)."""
    if args.smoke:
        from deepinfer.testing.checkpoints import tiny_v4_config

        raw = tiny_v4_config()
    else:
        raw = json.loads(args.config.read_text())
    drop = ("quantization_config", "expert_dtype", "auto_map", "_deepinfer_status")
    raw = {k: v for k, v in raw.items() if k not in drop}
    n = args.num_hidden_layers or raw["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types", "compress_ratios"):
        if isinstance(raw.get(key), list):
            raw[key] = raw[key][:n]
    raw |= {"num_hidden_layers": n, "num_nextn_predict_layers": 0, "torch_dtype": args.dtype}
    return raw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for e2e_v4.json, e2e_v4.md, e2e_v4.png")
    p.add_argument(
        "--smoke", action="store_true", help="the whole logic on the CPU: tiny V4, reference backend"
    )
    p.add_argument("--config", type=Path, default=FLASH, help="a V4 config.json (default V4-Flash's)")
    p.add_argument(
        "--num-hidden-layers", type=int, default=None, help="default 4 (smoke: the tiny config's 3)"
    )
    p.add_argument("--batches", type=ints, default=None, help="default 1,8,32,64,128,256 (smoke 1,2)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (smoke 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed deepinfer calls per row: the median")
    p.add_argument("--warmup-len", type=int, default=None, help="deepinfer warm-up new tokens (8; smoke 2)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--hf-max-batch", type=int, default=None, help="transformers rows up to this batch (32)")
    p.add_argument(
        "--hf-warmup-len", type=int, default=None, help="transformers warm-up new tokens (8; smoke 2)"
    )
    p.add_argument(
        "--hf-stable-topk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="transformers' indexer top-k with exact ties to the lower entry id (default: on in --smoke)",
    )
    p.add_argument("--formats", default="bf16,fp8_fp4", help="comma-separated, of bf16, fp8_fp4")
    p.add_argument("--backend", default=None, help="deepinfer backend (default cuda; smoke reference)")
    p.add_argument("--dtype", default=None, help="bfloat16 (smoke float32)")
    p.add_argument("--init-std", type=float, default=None, help="weight std (default the config's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later rows skipped (300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile-batches", type=ints, default=[],
        help="after the rows, each format's decode steps under torch.profiler at these batches "
        "(kernels per step, the top kernels by exposed time; trace_{format}_b{B}.json.gz)",
    )  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=8, help="profiled decode steps")
    p.add_argument("--profile-lead-steps", type=int, default=4, help="decode steps before the profiled ones")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults: dict[str, Any] = {
        "num_hidden_layers": None if smoke else 4,
        "batches": [1, 2] if smoke else [1, 8, 32, 64, 128, 256],
        "output_len": 4 if smoke else 64,
        "warmup_len": 2 if smoke else 8,
        "hf_max_batch": 32,
        "hf_warmup_len": 2 if smoke else 8,
        "hf_stable_topk": smoke,
        "backend": "reference" if smoke else "cuda",
        "dtype": "float32" if smoke else "bfloat16",
        "time_budget": 300.0,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.config.is_dir():
        args.config = args.config / "config.json"
    args.config = args.config.resolve()
    if not smoke and not args.config.is_file():
        p.error(f"no config file {args.config}")
    if args.output_len < 2:
        p.error("--output-len must be at least 2")
    if args.dtype not in ("bfloat16", "float32"):
        p.error(f"--dtype {args.dtype!r}: bfloat16 or float32")
    args.formats = [f for f in args.formats.split(",") if f]
    if bad := sorted(set(args.formats) - set(FORMATS)):
        p.error(f"--formats: unknown {bad}; known {list(FORMATS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    bench = V4Bench(args)
    with bench.section("setup"):
        bench.environment()
        bench.info["config"] = str(
            args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config
        )
        if args.smoke:
            bench.info["config"] = "deepinfer.testing.checkpoints.tiny_v4_config()"
        bench.ceilings()
        bench.build_transformers()
        if "bf16" in args.formats:
            bench.build_bf16()
    if "setup" in bench.errors:
        return 1
    if "fp8_fp4" in args.formats:
        with bench.section("fp8_fp4_setup"):
            bench.build_fp8_fp4()
    with bench.section("engines"):
        bench.engines()
    if "engines" in bench.errors:
        return 1
    for b in args.batches:
        with bench.section(f"batch_{b}"):
            bench.run_batch(b)
    for b in args.profile_batches:
        for fmt, entry in bench.formats.items():
            with bench.section(f"profile_{fmt}_b{b}"):
                res = bench.profile_steps(entry["llm"], b, f"{fmt}_b{b}")
                bench.extra.setdefault("profiles", {}).setdefault(fmt, {})[str(b)] = res
                bench.write()
    with bench.section("weights_check"):
        bench.check_weights()
    print(bench.markdown(), flush=True)
    log(f"done; files in {args.out}")
    return 1 if set(bench.errors) - {"plot"} else 0


if __name__ == "__main__":
    sys.exit(main())

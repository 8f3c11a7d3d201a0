"""End-to-end decode throughput: deepinfer against transformers and against the roofline, one run.

One process, one GPU, the same random DeepSeek-V2-Lite-shaped weights for both engines:

  * transformers' DeepseekV2ForCausalLM is built on the GPU in bf16 with random init (on-device,
    transformers' own _init_weights: N(0, initializer_range^2 = 0.02^2), norms 1; the router gate
    is float32 in transformers 5.24 and bf16 in 5.17, and deepinfer reads it as float32 either
    way, the same values), experts_implementation="grouped_mm" (its generate() would switch the
    decode loop to batched_mm on a GPU: that switch is turned off, and a forward hook records
    which implementation actually ran);
  * deepinfer's model is built from that model's state dict through deepinfer's own loading code
    (`DeepseekForCausalLM.load_weights`), fed by an in-memory reader (StateDictReader) that serves
    transformers' tensors as they are: no file is written, and tensors whose device and dtype
    already match are shared, not copied (a float64 checksum of every weight before and after the
    deepinfer runs shows that nothing wrote to them);
  * the copy bandwidth (a 2 GiB device-to-device copy, bytes read + written over time) and the
    dense bf16 matmul rate (cuBLAS, 8192^3, random data) are measured in the same run.

Workload per batch B (1, 8, 32, 128, 256): B random prompts of 128 token ids in [2, vocab) (the
same ids for both engines), 64 output tokens each, greedy, EOS ignored (transformers: do_sample=False,
min_new_tokens = max_new_tokens = 64). Output tokens per second = B * 64 / wall time of the whole
generate call (prefill included), measured after a warm-up generate of the same batch size
(deepinfer: the same call; transformers: the same batch with --hf-warmup-len new tokens), so
Triton compilation and graph capture happen at engine creation / warm-up, never in the timed call.
deepinfer's figure is the median of --repeats (3) timed calls; transformers' one call (seconds
long at every batch).

Roofline (per batch B; P = input length, N = output length; bw = copy GB/s, mm = matmul FLOP/s;
every byte count is the real size of the tensors in the transformers state dict):

  W_dense  = bytes of every weight outside the routed experts, the embedding and the LM head
             (attention projections, dense MLPs, shared experts, routers, norms)
  W_head   = bytes of the LM head;  W_exp = bytes of ONE routed expert (gate + up + down)
  hit(n)   = E * (1 - (1 - K/E)^n)   expected distinct routed experts that n tokens touch in one
             MoE layer under uniform routing (E routed experts, K per token)
  bytes(n) = W_dense + W_head + L_moe * hit(n) * W_exp + n * Dm * elt   (embedding rows, tiny)
  C_tok    = 2 * (params of W_dense + L_moe * K * params of one expert)   FLOPs per token
  kv_row   = (kv_lora_rank + qk_rope_head_dim) * elt * num_layers   latent cache bytes per token
  prefill  = max( (bytes(B*P) + B*P*kv_row) / bw,
                  (C_tok * B*P + 2 * head params * B
                   + num_layers * B * H * 2 * (qk_head_dim + v_head_dim) * P(P+1)/2) / mm )
             (one pass over all B*P prompt tokens, attention causal and not absorbed, logits only
             for the B last tokens, cache written once)
  decode_j = max( (bytes(B) + B * L_j * kv_row) / bw,
                  ((C_tok + 2 * head params) * B + num_layers * B * H * L_j * 2 * (R + Rv)) / mm )
             for j = 1 .. N-1, L_j = P + j the cache length step j attends over, R = kv_lora_rank
             + qk_rope_head_dim and Rv = kv_lora_rank (MLA decode in the absorbed form)
  roofline_tok_s = B * N / (prefill + sum_j decode_j)

The prefill samples the first output token, so N output tokens take one prefill and N - 1 decode
steps (cache lengths P+1 .. P+N-1; the issue's sketch "64 decode steps, 128..192" counts the
prefill's token as a step, 1.6% apart). Reading weights at the copy's (read + write) rate is
the convention of bench/bench_cuda.py.

Also in the same run (e2e_extra.json and e2e.md; --skip-extra leaves them out):
  (a) GPU idle share between decode steps at batch 64: torch.profiler (CUDA activity only) over
      10 decode steps driven one engine.step() at a time after the prefill and a few steps;
      busy = union of kernel / memcpy / memset intervals, window = first start .. last end,
      idle share = 1 - busy / window; kernels per decode step = kernels / steps; the largest idle
      gaps, each named by the activities that end before it and start after it. The trace is
      kept as trace_b64.json.gz;
  (b) batch-invariant mode at batch 32 (a fresh backend with BackendOptions(batch_invariant=True)
      and the model rebuilt on it) against the default at the same length, and whether prompt 0's
      tokens are the same at batch 1 and 32 in each mode. It is slow (on an H200, 2026-12-01: a
      generate of 32 x (128 + 16) tokens took about 75 s, nearly all of it the prefill, against
      0.2 s by default), so it runs last, with --invariant-output-len (default 16) tokens after
      a --invariant-warmup-len (4) token warm-up at the same batch, and skips its timed call when
      the warm-up shows that the time budget would not hold it;
  (c) ablations at batch 1, 32 and 256, one change each: enforce_eager=True (a fresh LLMEngine on
      the same model and backend), async_scheduling=False, DEEPINFER_CUDA_UNFUSED=1 (the backend's
      fused kernels), DEEPINFER_MODEL_UNFUSED=1 (the model's fusions: MLA's q + kv_a GEMM, the
      shared experts in the routed grouped GEMM), DEEPINFER_CUDA_MOE_DECODE=0 (the cuda
      backend's decode-sized MoE kernels), DEEPINFER_CUDA_SKINNY=0 (its skinny GEMM),
      DEEPINFER_CUDA_PDL=0 (programmatic dependent launch of the decode step's kernels),
      DEEPINFER_CUDA_MOE_EARLY=0 (the shared experts computed while the router runs),
      DEEPINFER_CUDA_EARLY_INPUTS=0 (MLA's decode kernels read the step inputs, and the
      attention its first cache tile, while the kernel before them runs),
      DEEPINFER_CUDA_ARGMAX=0 (the greedy draw as two torch reductions, not one launch),
      DEEPINFER_CUDA_WIDE_QUERY=0 (MLA's query in its 16-row tiles, with the cache write in the
      same launch, up to 64 rows instead of 128), DEEPINFER_CUDA_KERNEL_COPIES=0 (the step's
      sampled tokens and inputs by the copy engine, not by a kernel),
      DEEPINFER_CUDA_MOE_DECODE_TILES=64,128,4,3,64,128,4,3,1,32 (one token's decode down kernel
      in the tiles of larger steps, not ONE_TOKEN_CONFIG's 32 columns and 5 stages) (each a
      fresh backend and the model rebuilt on it: the rebuild shares transformers' tensors, so it
      takes well under a second). They run
      --ablation-output-len tokens (default: --output-len); the default engine is measured again
      at that length beside them, as it is for (b). --only-switches KEYS runs only the named
      cuda-switch rows (SWITCHES_OFF keys, comma-separated; "" none) and none of the others.

    python bench/bench_e2e.py --out bench/results/DIR        # on the GPU (4 to 5 minutes on an H200)
    python bench/bench_e2e.py --smoke --out /tmp/e2e_smoke    # the whole logic on the CPU, tiny model

Files: DIR/e2e.json (one row per batch), DIR/e2e_extra.json, DIR/e2e.md, DIR/e2e.png; all are
rewritten after every section, so a run stopped by a time limit still leaves its results.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs

REPO = Path(__file__).resolve().parents[1]
T0 = time.time()
CUDA_UNFUSED = envs.CUDA_UNFUSED.name  # read by the cuda backend when it is created
MOE_DECODE = envs.CUDA_MOE_DECODE.name  # 0: the cuda backend's decode-sized MoE kernels off
SKINNY = envs.CUDA_SKINNY.name  # 0: decode-sized float linears on cuBLAS, not the skinny kernel
PDL = envs.CUDA_PDL.name  # 0: the cuda backend's kernels launched the ordinary way
MOE_EARLY = envs.CUDA_MOE_EARLY.name  # 0: the shared experts' copies wait for the router
EARLY_INPUTS = envs.CUDA_EARLY_INPUTS.name  # 0: MLA's decode kernels read step inputs after the wait
ARGMAX = envs.CUDA_ARGMAX.name  # 0: the greedy draw as the contract's two reductions
WIDE_QUERY = envs.CUDA_WIDE_QUERY.name  # 0: MLA's query in 16-row tiles up to 64 rows, not 128
KERNEL_COPIES = envs.CUDA_KERNEL_COPIES.name  # 0: the step's small host copies by the copy engine
MOE_DECODE_TILES = envs.CUDA_MOE_DECODE_TILES.name  # the decode MoE kernels' tiles, at every size
MODEL_UNFUSED = envs.MODEL_UNFUSED.name  # read when a model is loaded (CheckpointReader.unfused)
# the ablations that set one of the cuda backend's variables, read when the backend is created
# (deepinfer.envs): (row key, variable, value); "0" switches a feature off
SWITCHES_OFF = [
    ("no_decode_moe", MOE_DECODE, "0"),
    ("no_skinny", SKINNY, "0"),
    ("no_pdl", PDL, "0"),
    ("no_early_shared", MOE_EARLY, "0"),
    ("no_early_inputs", EARLY_INPUTS, "0"),
    ("no_argmax", ARGMAX, "0"),
    ("no_wide_query", WIDE_QUERY, "0"),
    ("no_kernel_copies", KERNEL_COPIES, "0"),
    ("no_one_token_tiles", MOE_DECODE_TILES, "64,128,4,3,64,128,4,3,1,32"),
]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# --------------------------------------------------------------------------- hardware ceilings


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of fn: CUDA events around each call on a GPU, a host clock otherwise."""
    for _ in range(3):
        fn()
    sync(device)
    times: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(float(a.elapsed_time(b)))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure_copy(device: torch.device, smoke: bool) -> dict[str, float]:
    n = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 per buffer on the GPU
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, 20)
    moved = 2 * src.numel() * src.element_size()
    src = dst = torch.empty(0)
    free_memory(device)
    gbs = moved / ms / 1e6
    log(f"copy: {moved / 1e9:.2f} GB read + written in {ms:.3f} ms = {gbs:.0f} GB/s")
    return {"bytes": moved, "ms": ms, "gbs": gbs}


def measure_matmul(device: torch.device, smoke: bool) -> dict[str, Any]:
    n = 256 if smoke else 8192
    dtype = torch.float32 if smoke else torch.bfloat16
    x = torch.randn((n, n), device=device, dtype=dtype)
    y = torch.randn((n, n), device=device, dtype=dtype)
    ms = time_ms(lambda: x @ y, device, 20)
    x = y = torch.empty(0)
    free_memory(device)
    tflops = 2 * n**3 / ms / 1e9
    log(f"{str(dtype).replace('torch.', '')} matmul {n}^3: {ms:.3f} ms = {tflops:.1f} TFLOP/s")
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": ms, "tflops": tflops}


# --------------------------------------------------------------------------- transformers model

HF_CLASSES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),  # bench/bench_e2e_v4.py
}


def build_hf_model(
    config_file: Path,
    device: torch.device,
    dtype: torch.dtype,
    std: float | None,
    seed: int,
    notes: list[str],
) -> Any:
    """A random transformers model of config_file on `device` in `dtype`, initialised there
    (transformers' own _init_weights: N(0, initializer_range^2), norms 1), grouped_mm experts."""
    import transformers

    raw = json.loads(config_file.read_text())
    raw.pop("auto_map", None)  # DeepSeek's remote code: never used
    model_type = raw.get("model_type")
    if model_type not in HF_CLASSES:
        raise ValueError(f"{config_file}: model_type {model_type!r} has no transformers class here")
    config_cls = getattr(transformers, HF_CLASSES[model_type][0])
    model_cls = getattr(transformers, HF_CLASSES[model_type][1])
    if std is not None:
        raw["initializer_range"] = std
    try:
        config = config_cls.from_dict({**raw, "experts_implementation": "grouped_mm"})
    except (TypeError, ValueError) as exc:
        notes.append(
            f"transformers rejected experts_implementation='grouped_mm' ({exc}); its default is used"
        )
        log(notes[-1])
        config = config_cls.from_dict(raw)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = model_cls._from_config(config, dtype=dtype)
        except (TypeError, ValueError) as exc:
            if "experts_implementation" not in str(exc) and "grouped_mm" not in str(exc):
                raise
            notes.append(f"grouped_mm experts unavailable here ({exc}); transformers' default is used")
            log(notes[-1])
            config = config_cls.from_dict(raw)
            model = model_cls._from_config(config, dtype=dtype)
    model.eval()
    impl = getattr(model.config, "_experts_implementation", None)
    if impl is None:
        notes.append(
            f"transformers {transformers.__version__} has no experts_implementation option: "
            "its only MoE experts code path ran"
        )
        log(notes[-1])
    elif impl != "grouped_mm":
        notes.append(f"transformers experts implementation: {impl} (grouped_mm was asked for)")
        log(notes[-1])
    return model


def hf_experts_implementation(model: Any) -> str:
    return str(getattr(model.config, "_experts_implementation", None) or "n/a (no option)")


@contextlib.contextmanager
def experts_seen(model: Any, seen: set[str]) -> Iterator[None]:
    """Record the experts implementation the model's config names each time its first MoE experts
    module runs (what transformers' experts dispatch reads at that moment)."""
    experts = next((m for m in model.modules() if type(m).__name__.endswith("Experts")), None)
    if experts is None:
        yield
        return

    def hook(module: Any, inputs: Any) -> None:
        seen.add(str(getattr(model.config, "_experts_implementation", None) or "n/a"))

    handle = experts.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def hf_decode_switch(model: Any, allow: bool) -> Iterator[None]:
    """transformers 5.x generate() switches grouped_mm experts to batched_mm for the decode loop on
    a GPU (GenerationMixin._optimize_model_for_decode); batched_mm gathers a copy of every
    selected expert's weights per token. Unless `allow`, that switch is turned off on the instance
    so that decode runs grouped_mm too."""
    if allow or not hasattr(model, "_optimize_model_for_decode"):
        yield
        return
    model._optimize_model_for_decode = contextlib.nullcontext
    try:
        yield
    finally:
        del model._optimize_model_for_decode


def hf_generate(
    model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> list[list[int]]:
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
    )
    tokens: list[list[int]] = out[:, ids.shape[1] :].tolist()
    return tokens


def weights_checksum(state: dict[str, torch.Tensor]) -> float:
    """float64 sum of every weight (a full read; detects any write into shared tensors)."""
    total = 0.0
    with torch.no_grad():
        for t in state.values():
            total += float(torch.sum(t.detach(), dtype=torch.float64))
    return total


# --------------------------------------------------------------------------- deepinfer model


class StateDictReader:
    """Stands in for deepinfer.models.loader.CheckpointReader over an in-memory state dict
    (transformers' names and layout: its fused experts.gate_up_proj / experts.down_proj are read as
    they are by deepinfer's MoE loader). Tensors are detached and moved / cast only when needed, so
    matching ones are shared with the source model."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.state, self.device = state, device
        self.fp8_dtype = torch.float8_e4m3fn
        self.fp8_block = 128  # DeepSeek-V3 / V4's 128 x 128 scale blocks
        self.location = dict.fromkeys(state, "<memory>")
        self._read: set[str] = set()
        self.unfused = envs.read().model_unfused  # as load_model reads DEEPINFER_MODEL_UNFUSED

    def has(self, name: str) -> bool:
        return name in self.state

    def skip(self, name: str) -> None:
        self._read.add(name)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"tensor {name!r} is not in the transformers state dict")
        t = self.state[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r}: deepinfer expects {tuple(shape)}, transformers has {tuple(t.shape)}"
            )
        self._read.add(name)
        return t.detach().to(device=self.device, dtype=dtype or t.dtype)

    def linear(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return self.get(f"{prefix}.weight", shape, dtype), None

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return self.get(f"{prefix}.weight", shape, dtype)

    def unread(self) -> list[tuple[str, str]]:
        return sorted((n, "<memory>") for n in self.state if n not in self._read)


def build_deepinfer_model(
    config_file: Path, state: dict[str, torch.Tensor], backend: Any, dtype: torch.dtype
) -> Any:
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.deepseek import DeepseekForCausalLM

    model = DeepseekForCausalLM(ModelConfig.from_file(config_file), backend, dtype)
    reader = StateDictReader(state, backend.device.device())
    with torch.no_grad():
        model.load_weights(reader)  # type: ignore[arg-type]
    unread = reader.unread()
    if unread:
        raise RuntimeError(f"deepinfer did not read {len(unread)} tensors: {[n for n, _ in unread[:8]]}")
    return model.eval()


def make_backend(name: str, batch_invariant: bool = False, max_model_len: int | None = None) -> Any:
    from deepinfer.backend.registry import get_backend
    from deepinfer.backend.types import BackendOptions

    return get_backend(name, BackendOptions(batch_invariant=batch_invariant, max_model_len=max_model_len))


def kv_cache_bytes(model: Any, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """Exactly what max_num_seqs requests of max_model_len tokens can use (the engine's own cap)."""
    spec = model.kv_cache_spec(1, block_size)
    per_block = spec.bytes_per_token * block_size * model.num_kv_layers
    return int(per_block * max_num_seqs * -(-max_model_len // block_size))


class Bench:
    """The run: arguments, the two models, results, and the files written after every section."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            args.dtype
        ]
        self.config_file = args.config
        self.config_dir = args.config.parent
        self.rows: dict[int, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.notes: list[str] = []
        self.sections: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[str, Any] = {}
        self.outputs: dict[tuple[str, int], list[list[int]]] = {}  # (engine, batch) -> tokens
        rng = random.Random(args.seed)
        singles = [args.profile_batch, args.invariant_batch]
        self.max_batch = max([*args.batches, *args.profile_batches, *args.ablation_batches, *singles])
        self.vocab = json.loads(self.config_file.read_text())["vocab_size"]
        self.prompts = [
            [rng.randrange(2, self.vocab) for _ in range(args.input_len)] for _ in range(self.max_batch)
        ]

    # ------------------------------------------------------------------ bookkeeping

    def over_budget(self, what: str) -> bool:
        if time.time() - T0 > self.args.time_budget:
            msg = f"{what}: skipped, the time budget of {self.args.time_budget:.0f} s is spent"
            self.notes.append(msg)
            log(msg)
            return True
        return False

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        t = time.time()
        log(f"== {name}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except Exception as exc:
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"{name}: FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
            free_memory(self.device)
        finally:
            self.sections[name] = time.time() - t
            if self.device.type == "cuda":
                self.info.setdefault("max_memory_allocated", {})[name] = torch.cuda.max_memory_allocated()
            log(f"[{name} took {self.sections[name]:.1f} s]")
            self.write()

    def write(self) -> None:
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        rows = [self.rows[b] for b in sorted(self.rows)]
        (out / "e2e.json").write_text(json.dumps(rows, indent=1) + "\n")
        extra = {
            **self.extra,
            "info": self.info,
            "notes": self.notes,
            "errors": self.errors,
            "sections_s": self.sections,
        }
        (out / "e2e_extra.json").write_text(json.dumps(extra, indent=1, default=str) + "\n")
        (out / "e2e.md").write_text(self.markdown())
        try:
            self.plot(out / "e2e.png")
        except Exception as exc:  # matplotlib missing or broken: the tables still stand
            self.errors["plot"] = f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ setup

    def environment(self) -> None:
        import transformers

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        commit = ""
        with contextlib.suppress(Exception):
            commit = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        self.info.update(
            gpu=torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else (platform.processor() or platform.machine() or "cpu"),
            torch=torch.__version__,
            triton=triton_version,
            transformers=transformers.__version__,
            python=platform.python_version(),
            commit=commit,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            command="python " + " ".join([sys.argv[0], *sys.argv[1:]]),
            config=str(
                self.config_file.relative_to(REPO)
                if self.config_file.is_relative_to(REPO)
                else self.config_file
            ),
            backend=self.args.backend,
            dtype=self.args.dtype,
            input_len=self.args.input_len,
            output_len=self.args.output_len,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
        )
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            self.info["gpu_memory_total"] = total

    def ceilings(self) -> None:
        self.extra["copy"] = measure_copy(self.device, self.args.smoke)
        self.extra["matmul"] = measure_matmul(self.device, self.args.smoke)

    def build_models(self) -> None:
        t = time.time()
        self.hf = build_hf_model(
            self.config_file, self.device, self.dtype, self.args.init_std, self.args.seed, self.notes
        )
        self.state = {k: v for k, v in self.hf.state_dict().items()}
        self.info["hf_build_s"] = time.time() - t
        self.info["experts_implementation"] = hf_experts_implementation(self.hf)
        self.info["initializer_range"] = self.hf.config.initializer_range
        n_bytes = sum(v.numel() * v.element_size() for v in self.state.values())
        self.info["weight_bytes"] = n_bytes
        log(
            f"transformers {type(self.hf).__name__}: {gib(n_bytes)} of weights, experts "
            f"{self.info['experts_implementation']}, built in {self.info['hf_build_s']:.1f} s"
        )
        self.checksum_before = weights_checksum(self.state)
        t = time.time()
        self.backend = make_backend(self.args.backend)
        self.model = build_deepinfer_model(self.config_file, self.state, self.backend, self.dtype)
        self.info["deepinfer_build_s"] = time.time() - t
        shared = {v.untyped_storage().data_ptr() for v in self.state.values()}
        mine = {b.untyped_storage().data_ptr() for b in self.model.buffers() if b.device.type != "meta"}
        self.info["deepinfer_tensors_shared_with_transformers"] = len(mine & shared)
        self.info["deepinfer_tensors"] = len(mine)
        if self.device.type == "cuda":
            self.info["memory_after_models"] = torch.cuda.memory_allocated(self.device)
        log(
            f"deepinfer model on backend {self.backend.name}: built in "
            f"{self.info['deepinfer_build_s']:.1f} s, "
            f"{len(mine & shared)} of {len(mine)} weight tensors shared with transformers"
        )
        self.roofline_inputs()

    def make_llm(self, model: Any, backend: Any, max_num_seqs: int, **overrides: Any) -> tuple[Any, float]:
        """LLM.from_engine around a fresh LLMEngine on `model` (engine options in `overrides`)."""
        from deepinfer.api import LLM
        from deepinfer.config import EngineConfig
        from deepinfer.engine.llm_engine import LLMEngine

        a = self.args
        max_model_len = a.input_len + a.output_len
        config = EngineConfig(
            model=str(self.config_dir),
            backend=backend.name,
            dtype=a.dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            kv_cache_memory_bytes=kv_cache_bytes(model, 64, max_num_seqs, max_model_len),
            block_size=64,
            seed=a.seed,
            **overrides,
        )
        t = time.time()
        engine = LLMEngine(config, model=model, backend=backend)
        sync(self.device)
        return LLM.from_engine(engine), time.time() - t

    # ------------------------------------------------------------------ runs

    def di_generate(self, llm: Any, batch: int, new_tokens: int) -> list[list[int]]:
        from deepinfer.api import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts[:batch]], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def timed(
        self, fn: Callable[[], list[list[int]]], new_tokens: int | None
    ) -> tuple[float, list[list[int]]]:
        sync(self.device)
        t = time.perf_counter()
        tokens = fn()
        sync(self.device)
        elapsed = time.perf_counter() - t
        bad = [len(x) for x in tokens if new_tokens is not None and len(x) != new_tokens]
        if bad:
            raise RuntimeError(
                f"expected {new_tokens} output tokens per request, got lengths {sorted(set(bad))}"
            )
        return elapsed, tokens

    def di_throughput(
        self, llm: Any, batch: int, new_tokens: int, warmup_tokens: int | None = None
    ) -> tuple[float, float, list[list[int]]]:
        """(tok/s, seconds, tokens) after a warm-up of the same batch: the median of --repeats
        timed generates (each the same prompts; the last one's tokens)."""
        self.di_generate(llm, batch, warmup_tokens or new_tokens)
        times = []
        for _ in range(max(1, self.args.repeats)):
            secs, tokens = self.timed(lambda: self.di_generate(llm, batch, new_tokens), new_tokens)
            times.append(secs)
        secs = sorted(times)[len(times) // 2]
        return batch * new_tokens / secs, secs, tokens

    def run_deepinfer(self) -> None:
        a = self.args
        self.llm, init_s = self.make_llm(self.model, self.backend, self.max_batch)
        self.info["engine_init_s"] = init_s
        log(f"engine created in {init_s:.1f} s (max_num_seqs {self.max_batch})")
        for b in a.batches:
            if self.over_budget(f"deepinfer batch {b}"):
                break
            tok_s, secs, tokens = self.di_throughput(self.llm, b, a.output_len)
            self.outputs[("deepinfer", b)] = tokens
            row = self.rows.setdefault(b, {"batch": b})
            row.update(deepinfer_tok_s=tok_s, deepinfer_s=secs)
            self.fill_ratios(row)
            log(
                f"deepinfer B={b:4d}: {secs:7.3f} s, {tok_s:9.1f} tok/s "
                f"({row['deepinfer_over_roofline']:.2f} of roofline)"
            )
            self.write()

    def run_transformers(self) -> None:
        a = self.args
        hf_batched_mm = [
            b for b in a.batches if b <= a.hf_batched_mm_max_batch and self.device.type == "cuda"
        ]
        if hasattr(self.hf, "_optimize_model_for_decode"):
            self.notes.append(
                "transformers' generate() switches grouped_mm experts to batched_mm for its decode loop "
                "on a GPU; that switch was turned off so that the transformers column runs grouped_mm "
                "throughout"
                + (
                    f" (transformers_batched_mm_tok_s: its own default, batch <= {a.hf_batched_mm_max_batch})"
                    if hf_batched_mm
                    else ""
                )
            )
        for b in a.batches:
            if self.over_budget(f"transformers batch {b}"):
                break
            seen: set[str] = set()
            try:
                with hf_decode_switch(self.hf, allow=False):
                    hf_generate(self.hf, self.prompts[:b], a.hf_warmup_len, self.device)
                    with experts_seen(self.hf, seen):
                        secs, tokens = self.timed(
                            functools.partial(
                                hf_generate, self.hf, self.prompts[:b], a.output_len, self.device
                            ),
                            a.output_len,
                        )
            except torch.cuda.OutOfMemoryError as exc:
                self.rows.setdefault(b, {"batch": b})["transformers_error"] = f"out of memory: {exc}"[:200]
                log(f"transformers B={b}: out of memory")
                free_memory(self.device)
                continue
            self.outputs[("transformers", b)] = tokens
            row = self.rows.setdefault(b, {"batch": b})
            row.update(
                transformers_tok_s=b * a.output_len / secs,
                transformers_s=secs,
                transformers_experts_seen=sorted(seen),
            )
            self.fill_ratios(row)
            self.agreement(b)
            log(f"transformers B={b:4d}: {secs:7.3f} s, {row['transformers_tok_s']:9.1f} tok/s")
            self.write()
        for b in hf_batched_mm:
            if self.over_budget(f"transformers batched_mm batch {b}"):
                break
            seen = set()
            with hf_decode_switch(self.hf, allow=True):
                hf_generate(self.hf, self.prompts[:b], a.hf_warmup_len, self.device)
                with experts_seen(self.hf, seen):
                    secs, _ = self.timed(
                        functools.partial(hf_generate, self.hf, self.prompts[:b], a.output_len, self.device),
                        a.output_len,
                    )
            row = self.rows.setdefault(b, {"batch": b})
            row["transformers_batched_mm_tok_s"] = b * a.output_len / secs
            row["transformers_batched_mm_experts_seen"] = sorted(seen)
            log(
                f"transformers (decode batched_mm, its default) B={b:4d}: "
                f"{b * a.output_len / secs:9.1f} tok/s"
            )
        self.check_weights()

    def agreement(self, b: int) -> None:
        """Greedy tokens of deepinfer against transformers at batch b (the same prompts)."""
        di, hf = self.outputs.get(("deepinfer", b)), self.outputs.get(("transformers", b))
        if di is None or hf is None:
            return
        prefixes = []
        for x, y in zip(di, hf):
            n = 0
            while n < len(x) and n < len(y) and x[n] == y[n]:
                n += 1
            prefixes.append(n)
        row = self.rows[b]
        row["greedy_first_token_agree"] = sum(p > 0 for p in prefixes) / len(prefixes)
        row["greedy_common_prefix_mean"] = sum(prefixes) / len(prefixes)
        if b == min(self.args.batches):
            k = min(8, self.args.output_len)
            self.extra["greedy_check"] = {
                "batch": b,
                "deepinfer_first_tokens": di[0][:k],
                "transformers_first_tokens": hf[0][:k],
                "first_k_agree": di[0][:k] == hf[0][:k],
                "common_prefix": prefixes[0],
                "of": self.args.output_len,
            }
            log(
                f"greedy check B={b}: deepinfer {di[0][:k]} transformers {hf[0][:k]} "
                f"(common prefix {prefixes[0]} of {self.args.output_len})"
            )

    # ------------------------------------------------------------------ roofline

    def roofline_inputs(self) -> None:
        """Byte and parameter counts from the transformers state dict (exact sizes)."""
        cfg = json.loads(self.config_file.read_text())
        e, k = cfg.get("n_routed_experts") or 0, cfg.get("num_experts_per_tok") or 0
        dense_b = dense_p = head_b = head_p = exp_b = exp_p = 0
        moe_layers: set[str] = set()
        embed_elt = 2
        for name, t in self.state.items():
            nb, n = t.numel() * t.element_size(), t.numel()
            if ".mlp.experts." in name:
                moe_layers.add(name.split(".mlp.experts.")[0])
                exp_b += nb
                exp_p += n
            elif name == "lm_head.weight":
                head_b, head_p = nb, n
            elif name == "model.embed_tokens.weight":
                embed_elt = t.element_size()
            else:
                dense_b += nb
                dense_p += n
        if cfg.get("tie_word_embeddings") and not head_b:
            t = self.state["model.embed_tokens.weight"]
            head_b, head_p = t.numel() * t.element_size(), t.numel()
        layers = cfg["num_hidden_layers"]
        n_moe = len(moe_layers)
        self.roof = {
            "dense_bytes": dense_b,
            "dense_params": dense_p,
            "head_bytes": head_b,
            "head_params": head_p,
            "expert_bytes": exp_b / max(1, n_moe * e),
            "expert_params": exp_p / max(1, n_moe * e),
            "moe_layers": n_moe,
            "experts": e,
            "top_k": k,
            "hidden": cfg["hidden_size"],
            "embed_elt": embed_elt,
            "layers": layers,
            "heads": cfg["num_attention_heads"],
            "kv_row_bytes": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
            * torch.empty((), dtype=self.dtype).element_size()
            * layers,
            "latent": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
            "latent_v": cfg["kv_lora_rank"],
            "qk_head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            "v_head_dim": cfg["v_head_dim"],
        }
        self.extra["roofline_model"] = self.roof
        log(
            "roofline model: dense {:.2f} GB, head {:.2f} GB, one expert {:.1f} MB x {} experts "
            "x {} MoE layers".format(dense_b / 1e9, head_b / 1e9, self.roof["expert_bytes"] / 1e6, e, n_moe)
        )

    def hit(self, n: int) -> float:
        e, k = self.roof["experts"], self.roof["top_k"]
        return float(e * (1 - (1 - k / e) ** n)) if e else 0.0

    def step_bytes(self, n: int) -> float:
        r = self.roof
        return float(
            r["dense_bytes"]
            + r["head_bytes"]
            + r["moe_layers"] * self.hit(n) * r["expert_bytes"]
            + n * r["hidden"] * r["embed_elt"]
        )

    def token_flops(self) -> float:
        r = self.roof
        return float(2 * (r["dense_params"] + r["moe_layers"] * r["top_k"] * r["expert_params"]))

    def roofline(self, b: int) -> dict[str, Any]:
        r, a = self.roof, self.args
        bw = self.extra["copy"]["gbs"] * 1e9
        mm = self.extra["matmul"]["tflops"] * 1e12
        p, n = a.input_len, a.output_len
        t = b * p
        pre_bytes = self.step_bytes(t) + t * r["kv_row_bytes"]
        attn = r["layers"] * b * r["heads"] * 2 * (r["qk_head_dim"] + r["v_head_dim"]) * p * (p + 1) / 2
        pre_flops = self.token_flops() * t + 2 * r["head_params"] * b + attn
        prefill = max(pre_bytes / bw, pre_flops / mm)
        decode, bound = 0.0, {"memory": 0, "compute": 0}
        for j in range(1, n):
            length = p + j
            nbytes = self.step_bytes(b) + b * length * r["kv_row_bytes"]
            flops = (self.token_flops() + 2 * r["head_params"]) * b + r["layers"] * b * r[
                "heads"
            ] * length * 2 * (r["latent"] + r["latent_v"])
            decode += max(nbytes / bw, flops / mm)
            bound["memory" if nbytes / bw >= flops / mm else "compute"] += 1
        return {
            "roofline_tok_s": b * n / (prefill + decode),
            "roofline_prefill_ms": prefill * 1e3,
            "roofline_prefill_bound": "memory" if pre_bytes / bw >= pre_flops / mm else "compute",
            "roofline_decode_ms": decode * 1e3,
            "roofline_decode_step_ms": decode * 1e3 / max(1, n - 1),
            "roofline_decode_bound": max(bound, key=lambda x: bound[x]),
            "roofline_step_bytes": self.step_bytes(b),
            "expected_experts_hit": self.hit(b),
        }

    def fill_ratios(self, row: dict[str, Any]) -> None:
        if "roofline_tok_s" not in row and "copy" in self.extra and hasattr(self, "roof"):
            row.update(self.roofline(row["batch"]))
        if "deepinfer_tok_s" in row and "roofline_tok_s" in row:
            row["deepinfer_over_roofline"] = row["deepinfer_tok_s"] / row["roofline_tok_s"]
        if "deepinfer_tok_s" in row and "transformers_tok_s" in row:
            row["deepinfer_over_transformers"] = row["deepinfer_tok_s"] / row["transformers_tok_s"]
        if "transformers_tok_s" in row and "roofline_tok_s" in row:
            row["transformers_over_roofline"] = row["transformers_tok_s"] / row["roofline_tok_s"]

    # ------------------------------------------------------------------ extra: (a) idle share

    def profile_decode(self) -> None:
        """(a) the default engine's decode steps under the profiler at each --profile-batches
        batch; the one at --profile-batch is the idle-share row."""
        a = self.args
        for b in sorted({a.profile_batch, *a.profile_batches}):
            if self.over_budget(f"profile at batch {b}"):
                break
            tok_s, secs, _ = self.di_throughput(self.llm, b, a.output_len)  # also the warm-up
            res: dict[str, Any] = {"batch": b, "steps": a.profile_steps, "deepinfer_tok_s": tok_s}
            res["deepinfer_s"] = secs
            roof = self.roofline(b)
            res["roofline_tok_s"] = roof["roofline_tok_s"]
            res["roofline_decode_step_ms"] = roof["roofline_decode_step_ms"]
            log(f"deepinfer B={b}: {tok_s:.1f} tok/s; profiling {a.profile_steps} decode steps")
            res.update(self.profile_steps(self.llm, b, f"b{b}"))
            if a.profile_prefill:
                res["prefill_profile"] = self.profile_prefill(self.llm, b)
            self.extra.setdefault("profiles", {})[str(b)] = res
            if b == a.profile_batch:
                self.extra["idle"] = res

    def profile_steps(self, llm: Any, b: int, label: str) -> dict[str, Any]:
        """--profile-steps decode steps of b requests driven with engine.step() under
        torch.profiler (after the prefill and --profile-lead-steps steps): idle share, kernels
        per step, the top kernels; the trace is kept as trace_{label}.json.gz."""
        from deepinfer.api import SamplingParams

        a = self.args
        steps = a.profile_steps
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
        for p in self.prompts[:b]:
            engine.add(engine.make_sequence({"prompt_token_ids": p}, params))
        prefill_steps = -(-b * a.input_len // a.max_num_batched_tokens)
        lead = prefill_steps + a.profile_lead_steps
        if lead + steps >= a.output_len:
            raise ValueError(f"--output-len {a.output_len} leaves no room for {lead} + {steps} steps")
        again = steps if lead + 2 * steps < a.output_len else 0  # unprofiled steps, where there is room
        try:
            sync(self.device)
            t = time.perf_counter()
            for _ in range(prefill_steps):
                engine.step()
            sync(self.device)
            prefill_wall = time.perf_counter() - t
            for _ in range(lead - prefill_steps):
                engine.step()
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CUDA] if self.device.type == "cuda" else [ProfilerActivity.CPU]
            sync(self.device)
            with warnings.catch_warnings(), profile(activities=acts) as prof:
                warnings.simplefilter("ignore")
                t = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                sync(self.device)
                wall = time.perf_counter() - t
            t = time.perf_counter()  # as many steps again, without the profiler
            with host_waits(engine) as waits:
                for _ in range(again):
                    engine.step()
                sync(self.device)
            unprofiled = time.perf_counter() - t
            host = None
            if again and lead + 3 * steps < a.output_len:  # as many again under cProfile
                host = cprofile_rows(lambda: [engine.step() for _ in range(again)], self.device)
            while engine.has_unfinished():
                engine.step()
        except BaseException:
            engine.abort_all()
            raise
        res: dict[str, Any] = {
            "steps": steps,
            "host_wall_per_step_ms_profiled": wall * 1e3 / steps,
            # where a generate call's time goes: its prefill step(s) and its decode steps, unprofiled
            "prefill_wall_ms": prefill_wall * 1e3,
            "decode_wall_per_step_ms": unprofiled * 1e3 / again if again else float("nan"),
            # of which the host waited for the device's tokens (the rest it worked: a step whose
            # wait is near 0 is bound by the host, not by the GPU)
            "decode_host_wait_per_step_ms": sum(waits) * 1e3 / again if again else float("nan"),
        }
        if host is not None:
            res["decode_host_profile"] = {"steps": again, **host}
            log(
                f"   {label} host: {again} decode steps under cProfile, {host['wall_ms']:.2f} ms; "
                "most own time:"
            )
            for r in host["by_own"][:12]:
                log(f"      {r['own_ms']:8.2f} ms  x{r['calls']:<5d} {r['function'][:90]}")
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            res.update(analyse_trace(json.loads(path.read_text()), steps))
            with open(path, "rb") as src, gzip.open(a.out / f"trace_{label}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        if "idle_share" in res:
            log(
                f"{label}: GPU idle {res['idle_share']:.1%} of the decode window, "
                f"{res['kernels_per_step']:.0f} kernels/step, "
                f"{res['window_per_step_ms']:.3f} ms/step on the GPU "
                f"(busy {res['busy_per_step_ms']:.3f} ms; "
                f"host {res['host_wall_per_step_ms_profiled']:.3f} ms); unprofiled: prefill "
                f"{res['prefill_wall_ms']:.2f} ms, decode {res['decode_wall_per_step_ms']:.3f} ms/step "
                f"(the host waiting for tokens {res['decode_host_wait_per_step_ms']:.3f} ms of it)"
            )
            for k in res["top_kernels"]:
                log(
                    f"   {k['exposed_ms_per_step']:.4f} ms exposed ({k['ms_per_step']:.4f} own)  "
                    f"x{k['calls_per_step']:.0f}  {k['name'][:90]}"
                )
            for g in res["top_gaps"]:
                log(f"   idle {g['us_per_step']:.1f} us/step x{g['count_per_step']:.1f}  {g['between']}")
        else:
            log(f"{label}: {res.get('note')}")
        return res

    def profile_prefill(self, llm: Any, b: int) -> dict[str, Any]:
        """--profile-prefill: the prefill step(s) of b fresh requests under torch.profiler (the
        requests are aborted after it): device busy time and the top kernels."""
        from torch.profiler import ProfilerActivity, profile

        from deepinfer.api import SamplingParams

        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=self.args.output_len, ignore_eos=True)
        for p in self.prompts[:b]:
            engine.add(engine.make_sequence({"prompt_token_ids": p}, params))
        steps = -(-b * self.args.input_len // self.args.max_num_batched_tokens)
        acts = [ProfilerActivity.CUDA] if self.device.type == "cuda" else [ProfilerActivity.CPU]
        try:
            sync(self.device)
            with warnings.catch_warnings(), profile(activities=acts) as prof:
                warnings.simplefilter("ignore")
                for _ in range(steps):
                    engine.step()
                sync(self.device)
        finally:
            engine.abort_all()
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            res = analyse_trace(json.loads(path.read_text()), steps)
        for k in res.get("top_kernels", [])[:8]:
            log(f"   prefill B={b}: {k['ms_per_step']:.3f} ms  x{k['calls_per_step']:.0f}  {k['name'][:80]}")
        res["host_profile"] = self.host_profile_prefill(llm, b)
        return res

    def host_profile_prefill(self, llm: Any, b: int, top: int = 30) -> dict[str, Any]:
        """The prefill step(s) of b fresh requests under cProfile (the host's side: where a step
        whose device work is shorter than its launches spends its time): wall time without and
        with the profiler, and the functions with the most own time and the most total time."""
        import cProfile

        from deepinfer.api import SamplingParams

        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=self.args.output_len, ignore_eos=True)
        steps = -(-b * self.args.input_len // self.args.max_num_batched_tokens)
        walls = []
        prof = cProfile.Profile()
        for profiled in (False, True):
            for p in self.prompts[:b]:
                engine.add(engine.make_sequence({"prompt_token_ids": p}, params))
            try:
                sync(self.device)
                t = time.perf_counter()
                if profiled:
                    prof.enable()
                for _ in range(steps):
                    engine.step()
                sync(self.device)
                prof.disable()
                walls.append((time.perf_counter() - t) * 1e3)
            finally:
                prof.disable()
                engine.abort_all()
        by_own, by_total = profile_tables(prof, top)
        log(f"   prefill B={b} host: {walls[0]:.2f} ms ({walls[1]:.2f} ms under cProfile); most own time:")
        for r in by_own[:12]:
            log(f"      {r['own_ms']:8.2f} ms  x{r['calls']:<5d} {r['function'][:90]}")
        return {"wall_ms": walls[0], "wall_ms_profiled": walls[1], "by_own": by_own, "by_total": by_total}

    # ------------------------------------------------------------------ extra: (b), (c)

    def defaults_again(self) -> None:
        """The default engine again at the lengths the ablations and the batch-invariant row run
        (so each of those compares with the default at its own length), then release it."""
        a = self.args
        n = a.ablation_output_len
        rows = self.extra.setdefault("ablations", {"output_len": n, "rows": {}})["rows"]
        for b in a.ablation_batches:
            if self.over_budget(f"default at {n} tokens, batch {b}"):
                break
            tok_s, _, _ = self.di_throughput(self.llm, b, n)
            rows.setdefault(str(b), {"batch": b})["default_tok_s"] = tok_s
            log(f"default B={b}: {tok_s:.1f} tok/s ({n} tokens)")
        b, n = a.invariant_batch, a.invariant_output_len
        if b > 0 and not self.over_budget(f"default at {n} tokens, batch {b}"):
            tok_s, _, tokens = self.di_throughput(self.llm, b, n)
            self.extra["batch_invariant"] = {"batch": b, "output_len": n, "default_tok_s": tok_s}
            self.outputs[("default_invariant_len", b)] = tokens
            log(f"default B={b}: {tok_s:.1f} tok/s ({n} tokens)")
        self.llm = None
        free_memory(self.device)

    def ablations(self) -> None:
        """(c) one engine option switched off at a time: enforce_eager=True on the same model and
        backend (a fresh LLMEngine), async_scheduling=False on a fresh backend with the model
        rebuilt (the cuda backend keeps one graph memory pool handle for its lifetime, and a second
        graph-capturing engine on it, once the first engine's graphs are freed, failed in
        CUDACachingAllocator: `it->second->use_count > 0`)."""
        a = self.args
        n = a.ablation_output_len
        rows = self.extra.setdefault("ablations", {"output_len": n, "rows": {}})["rows"]
        max_seqs = max(a.ablation_batches)
        for label, overrides in (
            ("enforce_eager", {"enforce_eager": True}),
            ("no_prefill_graphs", {"max_prefill_graph_tokens": 0}),
            ("no_async_scheduling", {"async_scheduling": False}),
        ):
            if self.over_budget(label):
                return
            model, backend = self.model, self.backend
            if label != "enforce_eager":
                backend, model = self.rebuilt(batch_invariant=False)
            try:
                llm, init_s = self.make_llm(model, backend, max_seqs, **overrides)
            except Exception as exc:
                self.errors[label] = f"{type(exc).__name__}: {exc}"
                log(f"{label}: engine FAILED {exc}")
                continue
            self.extra["ablations"].setdefault("engine_init_s", {})[label] = init_s
            warm = min(a.eager_warmup_len, n) if label == "enforce_eager" else None
            for b in a.ablation_batches:
                if self.over_budget(f"{label} batch {b}"):
                    break
                tok_s, _, _ = self.di_throughput(llm, b, n, warm)
                rows.setdefault(str(b), {"batch": b})[f"{label}_tok_s"] = tok_s
                log(f"{label} B={b}: {tok_s:.1f} tok/s")
                self.write()
            llm = model = backend = None
            free_memory(self.device)
        self.model = None  # the default model is done with: its own (unshared) tensors go
        free_memory(self.device)

    def rebuilt(self, batch_invariant: bool) -> tuple[Any, Any]:
        a = self.args  # the engines' max_model_len (make_llm), as an engine would pass it
        max_model_len = a.input_len + a.output_len
        backend = make_backend(a.backend, batch_invariant=batch_invariant, max_model_len=max_model_len)
        return backend, build_deepinfer_model(self.config_file, self.state, backend, self.dtype)

    def batch_invariant(self) -> None:
        """(b) a batch-invariant backend and the model rebuilt on it: --invariant-batch requests of
        --invariant-output-len tokens (after a warm-up of --invariant-warmup-len tokens at that
        batch), against the default at the same length; then prompt 0 alone, whose tokens must
        be those it got in the batch."""
        a = self.args
        b, n = a.invariant_batch, a.invariant_output_len
        res: dict[str, Any] = self.extra.setdefault("batch_invariant", {"batch": b, "output_len": n})
        backend, model = self.rebuilt(batch_invariant=True)
        llm, init_s = self.make_llm(model, backend, b, batch_invariant=True)
        res["engine_init_s"] = init_s
        warm_s, _ = self.timed(lambda: self.di_generate(llm, b, min(a.invariant_warmup_len, n)), None)
        res["warmup_s"] = warm_s
        log(f"batch-invariant B={b}: warm-up ({min(a.invariant_warmup_len, n)} tokens) took {warm_s:.1f} s")
        if time.time() - T0 + 1.5 * warm_s > a.time_budget:
            msg = (
                f"batch-invariant timed run skipped: its warm-up took {warm_s:.1f} s, the time budget is near"
            )
            self.notes.append(msg)
            log(msg)
            return
        secs, tokens = self.timed(lambda: self.di_generate(llm, b, n), n)
        tok_s = b * n / secs
        res.update(batch_invariant_tok_s=tok_s, batch_invariant_s=secs)
        if "default_tok_s" in res:
            res["cost"] = 1 - tok_s / res["default_tok_s"]
        self.write()
        log(
            f"batch-invariant B={b}: {tok_s:.1f} tok/s ({n} tokens; "
            f"default {res.get('default_tok_s', 0):.1f})"
        )
        if not a.skip_invariant_profile:
            res["profile"] = self.profile_steps(llm, b, f"invariant_b{b}")
        if a.profile_prefill:
            res["prefill_profile"] = self.profile_prefill(llm, b)
        k = n  # prompt 0 alone for the whole length
        one = self.di_generate(llm, 1, k)
        res["batch_invariant_prompt0_same_at_1_and_b"] = one[0] == tokens[0][:k]
        d1, db = (
            self.outputs.get(("deepinfer", min(a.batches))),
            self.outputs.get(("default_invariant_len", b)),
        )
        if d1 is not None and db is not None and min(a.batches) == 1:
            res["default_prompt0_same_at_1_and_b"] = d1[0][:k] == db[0][:k]
        res["check_tokens"] = k
        log(
            f"batch-invariant: prompt 0's first {k} tokens the same at batch 1 and {b}: "
            f"{one[0] == tokens[0][:k]}"
        )
        llm = model = backend = None
        free_memory(self.device)

    def unfused(self, var: str, key: str, value: str = "1") -> None:
        """(c) `var`=`value`, read when the backend and the model are built (DEEPINFER_CUDA_UNFUSED=1:
        the backend's fused kernels; DEEPINFER_MODEL_UNFUSED=1: the model's fusions; each of
        SWITCHES_OFF's variables set to 0: one cuda feature off): a fresh backend + model, its
        rows under `key`_tok_s."""
        a = self.args
        n = a.ablation_output_len
        rows = self.extra.setdefault("ablations", {"output_len": n, "rows": {}})["rows"]
        if var == CUDA_UNFUSED and not backend_reads_env(a.backend, var):
            self.notes.append(
                f"backend {a.backend!r}'s source never mentions {var}: the {key} row changes nothing"
            )
            log(self.notes[-1])
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            backend, model = self.rebuilt(batch_invariant=False)
            llm, init_s = self.make_llm(model, backend, max(a.ablation_batches))
            self.extra["ablations"].setdefault("engine_init_s", {})[key] = init_s
            for b in a.ablation_batches:
                if self.over_budget(f"{key} batch {b}"):
                    break
                tok_s, _, _ = self.di_throughput(llm, b, n)
                rows.setdefault(str(b), {"batch": b})[f"{key}_tok_s"] = tok_s
                log(f"{key} B={b}: {tok_s:.1f} tok/s")
                self.write()
        finally:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
        llm = model = None
        free_memory(self.device)

    def check_weights(self) -> None:
        """Nothing deepinfer ran wrote into the shared weights (checked after the transformers
        runs and at the end)."""
        same = weights_checksum(self.state) == self.checksum_before
        self.info["weights_unchanged"] = same and self.info.get("weights_unchanged", True)
        log(f"weights checksum unchanged: {same}")

    # ------------------------------------------------------------------ report

    def markdown(self) -> str:
        i, a = self.info, self.args
        copy, mm = self.extra.get("copy", {}), self.extra.get("matmul", {})
        out = [
            f"# End-to-end decode throughput: deepinfer vs transformers vs roofline ({i.get('gpu', '?')})",
            "",
            f"{i.get('date', '')}; torch {i.get('torch')}, triton {i.get('triton')}, transformers "
            f"{i.get('transformers')}, Python {i.get('python')}"
            + (f", commit {i['commit']}" if i.get("commit") else "")
            + ".",
            "",
            f"`{i.get('command', '')}`",
            "",
            f"Model: random weights of `{i.get('config')}` in {a.dtype} "
            f"({gib(i.get('weight_bytes', 0))}, init std {i.get('initializer_range')}), the same tensors for "
            f"both engines (deepinfer built from transformers' state dict through its own loader). "
            f"deepinfer backend `{a.backend}`; transformers experts implementation "
            f"`{i.get('experts_implementation', '?')}`, sdpa attention, dynamic cache, eager PyTorch.",
            "",
            f"Workload per batch B: B random prompts of {a.input_len} tokens, "
            f"{a.output_len} output tokens each, "
            f"greedy, EOS ignored; tok/s = B x {a.output_len} / wall time of one generate call (prefill "
            f"included) after a warm-up generate of the same batch (deepinfer: the median of {a.repeats} "
            "calls; transformers: one).",
            "",
            f"Measured in this run: copy {copy.get('gbs', float('nan')):.0f} GB/s (read + write), "
            f"{mm.get('dtype', '')} matmul {mm.get('n', '')}^3 {mm.get('tflops', float('nan')):.1f} TFLOP/s. "
            "Roofline: one prefill pass plus N-1 decode steps, each "
            "max(bytes / copy rate, FLOPs / matmul rate); "
            "bytes = dense + head weights + expected distinct experts E(1-(1-K/E)^B) per MoE layer + latent "
            "KV read (formula in the script's docstring).",
            "",
            "| batch | deepinfer tok/s | transformers tok/s | roofline tok/s | deepinfer / roofline "
            "| deepinfer / transformers | transformers / roofline | deepinfer s | transformers s "
            "| roofline prefill + decode ms | experts hit | greedy: first token agrees, mean common prefix |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]

        def f(row: dict[str, Any], key: str, fmt: str) -> str:
            v = row.get(key)
            return (
                format(v, fmt)
                if isinstance(v, (int, float))
                else (row.get(key.replace("_tok_s", "_error"), "") or "")
            )

        for b in sorted(self.rows):
            r = self.rows[b]
            roof = (
                f"{r['roofline_prefill_ms']:.1f} + {r['roofline_decode_ms']:.1f} "
                f"({r['roofline_prefill_bound'][0]}/{r['roofline_decode_bound'][0]})"
                if "roofline_prefill_ms" in r
                else ""
            )
            agree = (
                f"{r['greedy_first_token_agree']:.2f}, {r['greedy_common_prefix_mean']:.1f}"
                if "greedy_first_token_agree" in r
                else ""
            )
            out.append(
                f"| {b} | {f(r, 'deepinfer_tok_s', '.1f')} | {f(r, 'transformers_tok_s', '.1f')} | "
                f"{f(r, 'roofline_tok_s', '.1f')} | {f(r, 'deepinfer_over_roofline', '.3f')} | "
                f"{f(r, 'deepinfer_over_transformers', '.2f')} | "
                f"{f(r, 'transformers_over_roofline', '.3f')} | "
                f"{f(r, 'deepinfer_s', '.3f')} | {f(r, 'transformers_s', '.3f')} | {roof} | "
                f"{f(r, 'expected_experts_hit', '.1f')} | {agree} |"
            )
        out += [
            "",
            "Roofline bound letters: prefill / most decode steps, m = memory (bytes / copy rate), "
            "c = compute (FLOPs / matmul rate).",
        ]
        seen = sorted({x for r in self.rows.values() for x in r.get("transformers_experts_seen", [])})
        if seen:
            out += [
                "",
                "Experts implementation transformers' config named each time its first MoE experts module "
                f"ran during the timed transformers calls (prefill and decode): {', '.join(seen)}.",
            ]
        bmm = {
            b: r["transformers_batched_mm_tok_s"]
            for b, r in self.rows.items()
            if "transformers_batched_mm_tok_s" in r
        }
        if bmm:
            out += [
                "",
                "transformers with its own default decode path (generate() switches grouped_mm to batched_mm "
                "for decode on a GPU): "
                + ", ".join(f"B={b}: {v:.1f} tok/s" for b, v in sorted(bmm.items()))
                + ".",
            ]
        g = self.extra.get("greedy_check")
        if g:
            out += [
                "",
                f"Greedy check, batch {g['batch']}, prompt 0: deepinfer {g['deepinfer_first_tokens']}, "
                "transformers "
                f"{g['transformers_first_tokens']}: first {len(g['deepinfer_first_tokens'])} "
                f"{'agree' if g['first_k_agree'] else 'differ'}; common prefix {g['common_prefix']} "
                f"of {g['of']} "
                f"tokens ({a.dtype}: the two engines round differently, so long greedy runs may part).",
            ]
        out += self.markdown_extra()
        meta = [
            f"engine creation {i['engine_init_s']:.1f} s" if "engine_init_s" in i else "",
            f"weights unchanged by deepinfer: {i['weights_unchanged']}" if "weights_unchanged" in i else "",
            f"{i['deepinfer_tensors_shared_with_transformers']} of {i['deepinfer_tensors']} deepinfer weight "
            "tensors share transformers' storage"
            if "deepinfer_tensors" in i
            else "",
            f"max_num_batched_tokens {a.max_num_batched_tokens} (prefill of B x {a.input_len} tokens in "
            f"ceil(B x {a.input_len} / {a.max_num_batched_tokens}) steps)",
            f"transformers warm-up: {a.hf_warmup_len} new tokens at the same batch",
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

    def markdown_extra(self) -> list[str]:
        out: list[str] = []
        idle = self.extra.get("idle")
        if idle:
            out += ["", f"## GPU idle time between decode steps (batch {idle['batch']})", ""]
            if "idle_share" in idle:
                out += [
                    f"torch.profiler over {idle['steps']} decode steps driven with engine.step(): GPU busy "
                    f"{idle['busy_per_step_ms']:.3f} ms of a {idle['window_per_step_ms']:.3f} ms step window "
                    f"(host wall {idle['host_wall_per_step_ms_profiled']:.3f} ms per step under the "
                    "profiler): "
                    f"**idle share {idle['idle_share']:.1%}**; {idle['kernels_per_step']:.1f} kernels and "
                    f"{idle['memcpy_per_step']:.1f} memcpy/memset per decode step. Roofline decode step "
                    "at this "
                    f"batch: {idle['roofline_decode_step_ms']:.3f} ms. Whole generate at this batch: "
                    f"{idle['deepinfer_tok_s']:.1f} tok/s (roofline {idle['roofline_tok_s']:.1f}).",
                    "",
                    *KERNEL_TABLE_HEAD,
                ]
                out += [kernel_row(k) for k in idle["top_kernels"]]
            else:
                out += [
                    f"{idle.get('note')} (host wall "
                    f"{idle['host_wall_per_step_ms_profiled']:.3f} ms per step)."
                ]
        others = [
            (f"default engine, batch {b}", r)
            for b, r in self.extra.get("profiles", {}).items()
            if r is not idle and "idle_share" in r
        ]
        bi = self.extra.get("batch_invariant")
        if bi and "idle_share" in bi.get("profile", {}):
            others.append((f"batch-invariant engine, batch {bi['batch']}", bi["profile"]))
        for title, r in others:
            out += [
                "",
                f"## Decode-step profile: {title}",
                "",
                f"{r['steps']} steps: GPU busy {r['busy_per_step_ms']:.3f} ms of a "
                f"{r['window_per_step_ms']:.3f} ms window (idle {r['idle_share']:.1%}), host wall "
                f"{r['host_wall_per_step_ms_profiled']:.3f} ms per step under the profiler; "
                f"{r['kernels_per_step']:.1f} kernels per step. Without the profiler: the prefill "
                f"step {r.get('prefill_wall_ms', float('nan')):.2f} ms, decode steps "
                f"{r.get('decode_wall_per_step_ms', float('nan')):.3f} ms each, of which the host "
                f"waited {r.get('decode_host_wait_per_step_ms', float('nan')):.3f} ms for the "
                "device's tokens (near 0: the host, not the GPU, bounds the step).",
                "",
                *KERNEL_TABLE_HEAD,
            ]
            out += [kernel_row(k) for k in r["top_kernels"]]
        if bi and "batch_invariant_tok_s" in bi:
            out += [
                "",
                f"## Batch-invariant mode (batch {bi['batch']}, {bi['output_len']} output tokens)",
                "",
                f"batch_invariant=True: {bi['batch_invariant_tok_s']:.1f} tok/s"
                + (
                    f" against {bi['default_tok_s']:.1f} by default at the same length: cost {bi['cost']:.1%}"
                    if "cost" in bi
                    else ""
                )
                + f". Prompt 0's first {bi.get('check_tokens', '?')} tokens equal at batch 1 and "
                f"{bi['batch']}: "
                f"batch-invariant {bi.get('batch_invariant_prompt0_same_at_1_and_b', 'n/a')}, default "
                f"{bi.get('default_prompt0_same_at_1_and_b', 'n/a')}. Engine creation "
                f"{bi['engine_init_s']:.1f} s; warm-up "
                f"({min(self.args.invariant_warmup_len, bi['output_len'])} "
                f"tokens at the same batch) {bi.get('warmup_s', float('nan')):.1f} s, timed generate "
                f"{bi.get('batch_invariant_s', float('nan')):.1f} s.",
            ]
        ab = self.extra.get("ablations")
        if ab and ab.get("rows"):
            n = ab["output_len"]
            out += [
                "",
                f"## Ablations ({n} output tokens per request, the default measured again at that length)",
                "",
                "Each column switches one thing off: CUDA graphs (enforce_eager=True, a fresh engine on the "
                "same model), async scheduling (async_scheduling=False), the backend's fused kernels "
                "(DEEPINFER_CUDA_UNFUSED=1), the model's fusions (DEEPINFER_MODEL_UNFUSED=1: MLA's q + kv_a "
                "GEMM, shared experts in the routed grouped GEMM), the decode-sized MoE kernels "
                "(DEEPINFER_CUDA_MOE_DECODE=0), the skinny GEMM (DEEPINFER_CUDA_SKINNY=0), programmatic "
                "dependent launch (DEEPINFER_CUDA_PDL=0), the shared experts computed while the router "
                "runs (DEEPINFER_CUDA_MOE_EARLY=0), the step inputs' reads before the wait "
                "(DEEPINFER_CUDA_EARLY_INPUTS=0), the one-launch greedy draw (DEEPINFER_CUDA_ARGMAX=0), "
                "the 128-row query tile (DEEPINFER_CUDA_WIDE_QUERY=0), the small host copies by a kernel "
                "(DEEPINFER_CUDA_KERNEL_COPIES=0), one token's decode down tiles "
                "(DEEPINFER_CUDA_MOE_DECODE_TILES pinned to the larger steps' tiles); all but the first "
                "each on a fresh backend with the model rebuilt. "
                f"Same prompts, {self.args.input_len} input tokens, tok/s of the whole generate call"
                + (
                    f"; enforce_eager warm-ups generate {min(self.args.eager_warmup_len, n)} tokens"
                    if self.args.eager_warmup_len < n
                    else ""
                )
                + ".",
                "",
                "| batch | default tok/s | enforce_eager | max_prefill_graph_tokens=0 "
                "| async_scheduling=False | DEEPINFER_CUDA_UNFUSED=1 | DEEPINFER_MODEL_UNFUSED=1 | "
                + " | ".join(f"{var}={value}" for _, var, value in SWITCHES_OFF)
                + " |",
                "| --- " * (7 + len(SWITCHES_OFF)) + "|",
            ]
            for key in sorted(ab["rows"], key=int):
                r = ab["rows"][key]
                base = r.get("default_tok_s")

                def cell(k: str, r: dict[str, Any] = r, base: Any = base) -> str:
                    v = r.get(k)
                    if v is None:
                        return ""
                    return f"{v:.1f} ({v / base:.2f}x)" if base else f"{v:.1f}"

                out.append(
                    f"| {key} | {base or 0:.1f} | {cell('enforce_eager_tok_s')} "
                    f"| {cell('no_prefill_graphs_tok_s')} | {cell('no_async_scheduling_tok_s')} "
                    f"| {cell('unfused_tok_s')} | {cell('model_unfused_tok_s')} | "
                    + " | ".join(cell(f"{name}_tok_s") for name, _, _ in SWITCHES_OFF)
                    + " |"
                )
            if ab.get("engine_init_s"):
                out += [
                    "",
                    "Engine creation: "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in ab["engine_init_s"].items())
                    + ".",
                ]
        return out

    def plot(self, path: Path) -> None:
        if not self.rows:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        for key, label, style in (
            ("roofline_tok_s", "roofline (copy bw + matmul, same run)", "k--"),
            ("deepinfer_tok_s", f"deepinfer ({self.args.backend})", "o-"),
            ("transformers_tok_s", f"transformers ({self.info.get('experts_implementation', '?')})", "s-"),
        ):
            pts = [(b, r[key]) for b, r in sorted(self.rows.items()) if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(
            f"{self.info.get('config', '')}, {self.args.input_len} in / {self.args.output_len} out, "
            f"{self.info.get('gpu', '')}",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def profile_tables(prof: Any, top: int = 30) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A cProfile.Profile's functions with the most own time and the most total time."""
    import pstats

    stats = pstats.Stats(prof)
    rows = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": int(nc),
            "own_ms": tt * 1e3,
            "total_ms": ct * 1e3,
        }
        for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top], sorted(rows, key=lambda r: -r["total_ms"])[:top]


def cprofile_rows(fn: Callable[[], object], device: torch.device, top: int = 30) -> dict[str, Any]:
    """fn() under cProfile, the device synchronised after it: its wall time and profile_tables."""
    import cProfile

    prof = cProfile.Profile()
    sync(device)
    t = time.perf_counter()
    prof.enable()
    try:
        fn()
        sync(device)
    finally:
        prof.disable()
    wall = (time.perf_counter() - t) * 1e3
    by_own, by_total = profile_tables(prof, top)
    return {"wall_ms": wall, "by_own": by_own, "by_total": by_total}


@contextlib.contextmanager
def host_waits(engine: Any) -> Iterator[list[float]]:
    """Seconds the engine's host loop spends blocked on each step's sampled tokens (the
    OutputProcessor's wait on the step's event), collected while the block runs."""
    processor = engine.outputs
    process = processor.process
    waits: list[float] = []

    def timed(step: Any) -> Any:
        t = time.perf_counter()
        step.ready.synchronize()
        waits.append(time.perf_counter() - t)
        return process(step)

    processor.process = timed
    try:
        yield waits
    finally:
        del processor.process


def switch_keys(value: str) -> list[str]:
    """--only-switches: comma-separated keys of SWITCHES_OFF."""
    keys = [k for k in value.split(",") if k]
    known = [k for k, _, _ in SWITCHES_OFF]
    if unknown := sorted(set(keys) - set(known)):
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known {known}")
    return keys


def backend_reads_env(name: str, var: str) -> bool:
    """Whether backend `name` reads `var` (deepinfer.envs says which backend reads each switch): a
    guard against an ablation that silently changes nothing."""
    switch = envs.BY_NAME.get(var)
    return switch is not None and switch.backend == name


KERNEL_TABLE_HEAD = [
    "| kernel (top by exposed time) | exposed ms per step | ms per step (own duration) | calls per step |",
    "| --- | --- | --- | --- |",
]


def kernel_row(k: dict[str, Any]) -> str:
    """One row of KERNEL_TABLE_HEAD's table (exposed time: analyse_trace)."""
    exposed = k.get("exposed_ms_per_step", float("nan"))
    return f"| `{k['name'][:80]}` | {exposed:.3f} | {k['ms_per_step']:.3f} | {k['calls_per_step']:.1f} |"


def analyse_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Idle share of the device between the first and last device activity of a chrome trace."""
    dev_cats = ("kernel", "gpu_memcpy", "gpu_memset")
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in dev_cats and "dur" in e
    ]
    if not events:
        return {"note": "no device activity in the trace (CPU run: no kernels to measure)"}
    named = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "?"))[:48]) for e in events
    )
    start, end = named[0][0], max(e for _, e, _ in named)
    # idle gaps, each named by the activity that ended last before it and the one after it
    gaps: dict[str, list[float]] = {}
    busy, cur_s, cur_e, last = 0.0, named[0][0], named[0][1], named[0][2]
    for s, e, name in named[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.setdefault(f"{last} -> {name}", []).append(s - cur_e)
            cur_s, cur_e = s, e
        if e >= cur_e:
            cur_e, last = e, name
    busy += cur_e - cur_s
    window = max(end - start, 1e-9)
    kernels = [e for e in events if e["cat"] == "kernel"]
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e.get("name", "?"), []).append(float(e["dur"]))
    # Exposed time: what each kernel adds past everything that started before it. A kernel
    # launched with programmatic dependent launch starts while its predecessor runs and waits
    # inside, so its own duration double-counts that overlap; the exposed times add up to the
    # busy time, the step's critical path by kernel.
    exposed: dict[str, float] = {}
    reach = float("-inf")
    for e in sorted(kernels, key=lambda e: float(e["ts"])):
        s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        name = e.get("name", "?")
        exposed[name] = exposed.get(name, 0.0) + max(0.0, t - max(s, reach))
        reach = max(reach, t)
    top = sorted(per_name.items(), key=lambda kv: -exposed[kv[0]])[:30]
    return {
        "window_per_step_ms": window / 1e3 / steps,
        "busy_per_step_ms": busy / 1e3 / steps,
        "idle_share": 1 - busy / window,
        "kernels_per_step": len(kernels) / steps,
        "memcpy_per_step": (len(events) - len(kernels)) / steps,
        "top_gaps": [
            {"between": k, "us_per_step": sum(v) / steps, "count_per_step": len(v) / steps}
            for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]
        ],
        "top_kernels": [
            {
                "name": n,
                "ms_per_step": sum(d) / 1e3 / steps,
                "exposed_ms_per_step": exposed[n] / 1e3 / steps,
                "calls_per_step": len(d) / steps,
            }
            for n, d in top
        ],
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", type=Path, required=True, help="folder for e2e.json, e2e_extra.json, e2e.md, e2e.png"
    )
    p.add_argument(
        "--smoke", action="store_true", help="the whole logic on the CPU: tiny config, reference backend"
    )
    p.add_argument("--config", type=Path, default=None, help="config.json (default model/deepseek-v2-lite)")
    p.add_argument("--batches", type=ints, default=None, help="default 1,8,32,128,256 (smoke 1,2)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (smoke 4)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-extra", action="store_true", help="no idle profile, batch-invariant or ablations")
    p.add_argument(
        "--only-switches",
        type=switch_keys,
        default=None,
        help="ablations: only these SWITCHES_OFF rows (comma-separated keys, e.g. no_pdl)",
    )
    p.add_argument("--backend", default=None, help="deepinfer backend (default cuda; smoke reference)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (smoke float32)")
    p.add_argument(
        "--init-std", type=float, default=None, help="weight std (default: the config's initializer_range)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed deepinfer generates per row, after its warm-up: the median",
    )
    p.add_argument(
        "--hf-warmup-len", type=int, default=None, help="transformers warm-up new tokens (default 8)"
    )
    p.add_argument(
        "--hf-batched-mm-max-batch",
        type=int,
        default=8,
        help="also time transformers' own default decode path (batched_mm) up to this batch (0: never)",
    )
    p.add_argument("--profile-batch", type=int, default=None, help="default 64 (smoke 2)")
    p.add_argument(
        "--profile-batches", type=ints, default=[], help="more batches to profile (kernel tables), e.g. 1,32"
    )
    p.add_argument(
        "--skip-invariant-profile", action="store_true", help="no profile of the batch-invariant engine"
    )
    p.add_argument("--profile-steps", type=int, default=None, help="default 10 (smoke 1)")
    p.add_argument(
        "--profile-prefill", action="store_true", help="also profile the prefill at each profiled batch"
    )
    p.add_argument(
        "--profile-lead-steps", type=int, default=None, help="decode steps before the profile (default 4)"
    )
    p.add_argument("--invariant-batch", type=int, default=None, help="default 32 (smoke 2); 0: no row")
    p.add_argument(
        "--invariant-output-len", type=int, default=None, help="batch-invariant row tokens (default 16)"
    )
    p.add_argument("--invariant-warmup-len", type=int, default=4, help="its warm-up tokens")
    p.add_argument("--ablation-batches", type=ints, default=None, help="default 1,32,256 (smoke 1,2)")
    p.add_argument("--ablation-output-len", type=int, default=None, help="default: --output-len")
    p.add_argument("--eager-warmup-len", type=int, default=8, help="warm-up tokens of the enforce_eager rows")
    p.add_argument(
        "--time-budget", type=float, default=None, help="seconds; later sections are skipped (480)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults: dict[str, Any] = {
        "config": REPO / "model" / ("tiny" if smoke else "deepseek-v2-lite") / "config.json",
        "batches": [1, 2] if smoke else [1, 8, 32, 128, 256],
        "output_len": 4 if smoke else 64,
        "backend": "reference" if smoke else "cuda",
        "dtype": "float32" if smoke else "bfloat16",
        "hf_warmup_len": 2 if smoke else 8,
        "profile_batch": 2 if smoke else 64,
        "profile_steps": 1 if smoke else 10,
        "profile_lead_steps": 1 if smoke else 4,
        "invariant_batch": 2 if smoke else 32,
        "ablation_batches": [1, 2] if smoke else [1, 32, 256],
        "invariant_output_len": 4 if smoke else 16,
        "time_budget": 300.0 if smoke else 480.0,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.ablation_output_len is None:
        args.ablation_output_len = args.output_len
    if args.config.is_dir():
        args.config = args.config / "config.json"
    args.config = args.config.resolve()
    if not args.config.is_file():
        p.error(f"no config file {args.config}")
    if args.output_len < 2:
        p.error("--output-len must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    bench = Bench(args)
    torch.set_grad_enabled(False)
    with bench.section("setup"):
        bench.environment()
        bench.ceilings()
        bench.build_models()
    if "setup" in bench.errors:
        return 1
    with bench.section("deepinfer"):
        bench.run_deepinfer()
    if not args.skip_transformers:
        with bench.section("transformers"):
            bench.run_transformers()
    if not args.skip_extra and getattr(bench, "llm", None) is not None:
        with bench.section("idle_profile"):
            if not bench.over_budget("idle profile"):
                bench.profile_decode()
        with bench.section("defaults_again"):
            bench.defaults_again()
    bench.llm = None
    free_memory(bench.device)
    if not args.skip_extra:
        if args.only_switches is None:
            with bench.section("ablations"):
                bench.ablations()
        bench.model = None
        free_memory(bench.device)
        if args.only_switches is None:
            with bench.section("unfused"):
                if not bench.over_budget("unfused"):
                    bench.unfused(CUDA_UNFUSED, "unfused")
            with bench.section("model_unfused"):
                if not bench.over_budget("model unfused"):
                    bench.unfused(MODEL_UNFUSED, "model_unfused")
        switches = [s for s in SWITCHES_OFF if args.only_switches is None or s[0] in args.only_switches]
        for key, var, value in switches:  # each cuda variable set, where the backend reads it
            with bench.section(key):
                if not bench.over_budget(key.replace("_", " ")) and backend_reads_env(args.backend, var):
                    bench.unfused(var, key, value)
        with bench.section("batch_invariant"):  # last: the slowest
            if args.invariant_batch > 0 and not bench.over_budget("batch-invariant"):
                bench.batch_invariant()
    with bench.section("weights_check"):
        bench.check_weights()
    print(bench.markdown(), flush=True)
    log(f"done; files in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

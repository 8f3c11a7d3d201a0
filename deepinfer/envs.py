"""Every DEEPINFER_* environment variable, in one typed table, read into one frozen snapshot.

A switch is read when the thing it changes is created, never at each kernel launch: the
registry when it selects a backend, a backend's factory when it builds the backend (the cuda
backend hands its parts the values they use), the loader when it loads a model, the logger when
it is configured. Each of them calls `read()` and passes the fields it needs on explicitly, so a
process that changes a variable sees the change in the next backend, model or engine it
creates, and in nothing already built (a captured graph keeps the launches it was captured with).

Audience: `user` switches are part of the interface (documented, kept); `benchmark` switches
turn one optimisation off (or pin a tuning) so that a benchmark can measure what it buys;
`test` switches steer the test suite only.

docs/environment.md is this table (`python -m deepinfer.envs` prints it; tests/test_envs.py
checks that the page, the table and the code agree).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

Audience = Literal["user", "benchmark", "test"]
# how a value is parsed: flag (1 / 0), text, choice (one of `choices`), names (a comma-separated
# subset of `choices`, or 1 / all for every one), ints (comma-separated integers, one per entry of
# `choices`), int, float
Kind = Literal["flag", "text", "choice", "names", "ints", "int", "float"]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MODEL_FUSIONS = ("qkv_a", "shared_experts", "compressor")


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, the Env field that holds its value, how it is parsed,
    its default (the value when it is unset or empty), one line of meaning, its audience and
    who reads it (`backend`: the backend package that reads it, None for deepinfer itself)."""

    name: str
    attr: str
    kind: Kind
    default: Any
    meaning: str
    audience: Audience
    read_when: str
    backend: str | None = None
    choices: tuple[str, ...] = ()
    what: str = ""  # choice: what the value names ("a log level"), for the error message

    def parse(self, raw: str | None) -> Any:
        """The value of `raw` (the variable's text, None when unset); ValueError naming the
        variable and what it takes when the text is not a valid value."""
        text = (raw or "").strip()
        if not text:
            return self.default
        if self.kind == "flag":
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise ValueError(f"{self.name}={raw!r}: expected 1 or 0 (true / false, yes / no, on / off)")
        if self.kind == "text":
            return text
        if self.kind == "choice":
            if text.upper() not in self.choices:
                raise ValueError(
                    f"{self.name}={raw!r} is not {self.what}; choose one of {', '.join(self.choices)}"
                )
            return text.upper()
        if self.kind == "names":
            names = {v.strip().lower() for v in text.split(",")} - {"", "0"}
            unknown = names - {*self.choices, "1", "all"}
            if unknown:
                raise ValueError(
                    f"{self.name}={raw!r}: unknown {', '.join(sorted(unknown))}; "
                    f"name any of {', '.join(self.choices)}, or 1 / all"
                )
            return frozenset(self.choices) if names & {"1", "all"} else frozenset(names)
        try:
            if self.kind == "ints":
                values = tuple(int(v) for v in text.split(","))
                if len(values) != len(self.choices):
                    raise ValueError
                return values
            return int(text) if self.kind == "int" else float(text)
        except ValueError:
            expected = f"{','.join(self.choices)} (integers)" if self.kind == "ints" else f"an {self.kind}"
            raise ValueError(f"{self.name}={raw!r}: expected {expected}") from None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """This switch's value in `environ` (default: os.environ)."""
        return self.parse((os.environ if environ is None else environ).get(self.name))


_CUDA = "when the cuda backend is created"

# deepinfer itself
BACKEND = Switch(
    name="DEEPINFER_BACKEND",
    attr="backend",
    kind="text",
    default=None,
    meaning="the backend to create when the caller names none (or names auto); unset: the best available",
    audience="user",
    read_when="when a backend is selected",
)
LOG_LEVEL = Switch(
    name="DEEPINFER_LOG_LEVEL",
    attr="log_level",
    kind="choice",
    default=None,
    meaning="the deepinfer logger's level; unset: WARNING for the library, INFO for the command line",
    audience="user",
    read_when="when logging is configured (engine creation, the command line)",
    choices=LOG_LEVELS,
    what="a log level",
)
CONFIGURE_LOGGING = Switch(
    name="DEEPINFER_CONFIGURE_LOGGING",
    attr="configure_logging",
    kind="flag",
    default=True,
    meaning="0: leave the deepinfer logger alone (no handler, no level; records propagate as usual)",
    audience="user",
    read_when="when logging is configured (engine creation, the command line)",
)
SKIP_WEIGHT_CHECK = Switch(
    name="DEEPINFER_SKIP_WEIGHT_CHECK",
    attr="skip_weight_check",
    kind="flag",
    default=False,
    meaning="1: load weights without checking them for NaN / Inf (load_model(check_weights=None))",
    audience="user",
    read_when="when a model is loaded",
)
ENGRAM_HOST_TABLES = Switch(
    name="DEEPINFER_ENGRAM_HOST_TABLES",
    attr="engram_host_tables",
    kind="flag",
    default=False,
    meaning=(
        "1: DeepSeek-V4.1's Engram tables stay in pinned host memory, each step's rows gathered from "
        "there by the lookup kernel (backends with Capabilities.reads_host_tables); 0: on the device"
    ),
    audience="user",
    read_when="when a model is loaded",
)
ENGRAM_PREFETCH = Switch(
    name="DEEPINFER_ENGRAM_PREFETCH",
    attr="engram_prefetch",
    kind="flag",
    default=False,
    meaning=(
        "1: DeepSeek-V4.1's Engram rows of every layer fetched at the start of the forward "
        "(small.engram_prefetch; cuda: on a side stream, overlapping the layers before each Engram "
        "layer); 0: each Engram layer looks its rows up itself"
    ),
    audience="user",
    read_when="when a model is loaded",
)
MODEL_UNFUSED = Switch(
    name="DEEPINFER_MODEL_UNFUSED",
    attr="model_unfused",
    kind="names",
    default=frozenset(),
    meaning=(
        "model-level fusions to switch off (qkv_a: MLA's q + kv_a GEMM; shared_experts: the shared "
        "experts in the routed grouped GEMM; compressor: DeepSeek-V4's wkv + wgate GEMM), "
        "comma-separated, or 1 / all"
    ),
    audience="benchmark",
    read_when="when a model is loaded",
    choices=MODEL_FUSIONS,
)
CONFORMANCE_HEAVY = Switch(
    name="DEEPINFER_CONFORMANCE_HEAVY",
    attr="conformance_heavy",
    kind="flag",
    default=False,
    meaning="1: the conformance suite also runs its heavy (larger) cases (--deepinfer-heavy)",
    audience="user",
    read_when="when the conformance plugin adds its options",
)
# the reference backend
REFERENCE_DEVICE = Switch(
    name="DEEPINFER_REFERENCE_DEVICE",
    attr="reference_device",
    kind="text",
    default="cpu",
    meaning="the torch device the reference backend runs on (cuda:0, ...; no index: the device_index)",
    audience="user",
    read_when="when the reference backend is created (and probed)",
    backend="reference",
)
# the cuda backend
CUDA_UNFUSED = Switch(
    name="DEEPINFER_CUDA_UNFUSED",
    attr="cuda_unfused",
    kind="flag",
    default=False,
    meaning=(
        "1: the backend's fused kernels replaced by the compositions they replace (routing, expert "
        "sort, MLA cache write and query, noise, DeepSeek-V4's ops)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_MOE_DECODE = Switch(
    name="DEEPINFER_CUDA_MOE_DECODE",
    attr="cuda_moe_decode",
    kind="flag",
    default=True,
    meaning="0: decode-sized MoE layers take the grouped GEMM path, not the two decode kernels",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_MOE_EARLY = Switch(
    name="DEEPINFER_CUDA_MOE_EARLY",
    attr="cuda_moe_early",
    kind="flag",
    default=True,
    meaning="0: the decode MoE kernels' shared-expert copies wait for the router like the routed ones",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_EARLY_INPUTS = Switch(
    name="DEEPINFER_CUDA_EARLY_INPUTS",
    attr="cuda_early_inputs",
    kind="flag",
    default=True,
    meaning=(
        "0: the decode step's MLA kernels read the step inputs and older cache rows only after "
        "waiting for the previous kernel"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_ARGMAX = Switch(
    name="DEEPINFER_CUDA_ARGMAX",
    attr="cuda_argmax",
    kind="flag",
    default=True,
    meaning="0: the greedy draw as the contract's two reductions, not the one-launch kernel",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_WIDE_QUERY = Switch(
    name="DEEPINFER_CUDA_WIDE_QUERY",
    attr="cuda_wide_query",
    kind="flag",
    default=True,
    meaning="0: MLA's query with the cache write in one launch up to 64 rows (16-row tiles), not 128",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_KERNEL_COPIES = Switch(
    name="DEEPINFER_CUDA_KERNEL_COPIES",
    attr="cuda_kernel_copies",
    kind="flag",
    default=True,
    meaning="0: the step's small host copies (sampled tokens, step inputs) by the copy engine, not a kernel",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_SKINNY = Switch(
    name="DEEPINFER_CUDA_SKINNY",
    attr="cuda_skinny",
    kind="flag",
    default=True,
    meaning="0: decode-sized float linears on cuBLAS, not the skinny Triton GEMM",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_V4_DECODE = Switch(
    name="DEEPINFER_CUDA_V4_DECODE",
    attr="cuda_v4_decode",
    kind="flag",
    default=True,
    meaning=(
        "0: DeepSeek-V4's FP8 linears and MXFP4 experts on the paths before its decode kernels (no "
        "FP8 skinny GEMM, no MXFP4 decode MoE kernels, no nibble-pair decode in the MXFP4 grouped GEMM)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_V4_STEP = Switch(
    name="DEEPINFER_CUDA_V4_STEP",
    attr="cuda_v4_step",
    kind="flag",
    default=True,
    meaning=(
        "0: DeepSeek-V4's per-step entry slots, rope tails and compressor bias on the contract's "
        "torch compositions (no compressed_entries, rope_tail or compressor_pool kernels)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_V4_SMALL_GRID = Switch(
    name="DEEPINFER_CUDA_V4_SMALL_GRID",
    attr="cuda_v4_small_grid",
    kind="flag",
    default=False,
    meaning=(
        "1: DeepSeek-V4's compressed attention on grids of under 64 whole-head programs (decode "
        "below 64 requests) in 16-row head tiles and splits down to one key tile (not yet timed)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_MX_FP4 = Switch(
    name="DEEPINFER_CUDA_MX_FP4",
    attr="cuda_mx_fp4",
    kind="flag",
    default=True,
    meaning=(
        "0: the MXFP4 grouped GEMM (MoE experts past the decode kernels' copies, bf16 activations) "
        "always on the nibble-pair kernel, not on Triton's microscaled product (tl.dot_scaled), which "
        "it takes from 4 token copies an expert (gemm.MX_MIN_ROWS_PER_GROUP)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_FP4_DECODE = Switch(
    name="DEEPINFER_CUDA_FP4_DECODE",
    attr="cuda_fp4_decode",
    kind="choice",
    default="PAIR",
    meaning=(
        "how the MXFP4 decode MoE kernels decode and multiply the experts' nibbles (kernels/moe.py "
        "FP4_DECODE): PAIR (float32, scale per value), GROUP (float32, scale per 32-value group on "
        "the partial sums), MMA (bf16 weights on the tensor cores, token rows as the B operand), ASM "
        "(MMA with an inline-assembly nibble decode), SCALED (Triton's microscaled product, tl.dot_scaled)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
    choices=("PAIR", "GROUP", "MMA", "ASM", "SCALED"),
    what="an MXFP4 decode",
)
CUDA_FP8_HALF_READ = Switch(
    name="DEEPINFER_CUDA_FP8_HALF_READ",
    attr="cuda_fp8_half_read",
    kind="flag",
    default=False,
    meaning=(
        "1: MLA attention over FP8 latent caches reads the rows in float16 (e4m3 pairs to float16, "
        "float16 MMAs, kernels/kv_fp8.py) instead of dequantising them to bfloat16; off until timed "
        "on a GPU (bench/run_fp8kv_h200.sh)"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_PDL = Switch(
    name="DEEPINFER_CUDA_PDL",
    attr="cuda_pdl",
    kind="flag",
    default=True,
    meaning="0: the decode path's kernels launched the ordinary way, without programmatic dependent launch",
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_MOE_DECODE_TILES = Switch(
    name="DEEPINFER_CUDA_MOE_DECODE_TILES",
    attr="cuda_moe_decode_tiles",
    kind="ints",
    default=None,
    meaning=(
        "the decode MoE kernels' tiles at every size and their copy limit "
        "(bench/bench_moe_decode.py prints the best); unset: the tuned tiles by size"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
    choices=(
        "UP_N",
        "UP_K",
        "UP_WARPS",
        "UP_STAGES",
        "DOWN_N",
        "DOWN_K",
        "DOWN_WARPS",
        "DOWN_STAGES",
        "FUSED_COMBINE",
        "MAX_COPIES",
    ),
)
CUDA_INVARIANT_TILE = Switch(
    name="DEEPINFER_CUDA_INVARIANT_TILE",
    attr="cuda_invariant_tile",
    kind="ints",
    default=None,
    meaning=(
        "one tile for the batch-invariant matmul at every M (bench/bench_invariant_tiles.py); "
        "unset: the tiles by M"
    ),
    audience="benchmark",
    read_when=_CUDA,
    backend="cuda",
    choices=("BM", "BN", "BK", "WARPS", "STAGES"),
)
CUDA_VENDOR = Switch(
    name="DEEPINFER_CUDA_VENDOR",
    attr="cuda_vendor",
    kind="flag",
    default=True,
    meaning="0: never call the vendor kernels (FlashMLA, DeepGEMM) even where they are installed",
    audience="user",
    read_when=_CUDA,
    backend="cuda",
)
CUDA_EXPERT_EXCHANGE = Switch(
    name="DEEPINFER_CUDA_EXPERT_EXCHANGE",
    attr="cuda_expert_exchange",
    kind="choice",
    default="ALL_TO_ALL",
    meaning=(
        "the expert-parallel MoE exchange: ALL_TO_ALL (torch.distributed), or DEEPEP (DeepEP >= 2.5's "
        "EPBuffer; an error where it is not installed or does not fit)"
    ),
    audience="user",
    read_when=_CUDA,
    backend="cuda",
    choices=("ALL_TO_ALL", "DEEPEP"),
    what="an expert exchange",
)
CUDA_DEEPEP_TOKENS = Switch(
    name="DEEPINFER_CUDA_DEEPEP_TOKENS",
    attr="cuda_deepep_tokens",
    kind="int",
    default=8192,
    meaning=(
        "with DEEPEP: the most tokens one rank sends in one MoE exchange (EPBuffer's "
        "num_max_tokens_per_rank); at least max_num_batched_tokens"
    ),
    audience="user",
    read_when=_CUDA,
    backend="cuda",
)
# the test suite
TEST_BACKEND = Switch(
    name="DEEPINFER_TEST_BACKEND",
    attr="test_backend",
    kind="text",
    default=None,
    meaning="the backend the engine graph tests run on (cuda: real CUDA graphs); unset: by the machine",
    audience="test",
    read_when="when those test modules are collected",
)
TEST_SUBPROCESS_TIMEOUT = Switch(
    name="DEEPINFER_TEST_SUBPROCESS_TIMEOUT",
    attr="test_subprocess_timeout",
    kind="float",
    default=2400.0,
    meaning="seconds tests/test_cuda_interpret.py gives its interpreter subprocess",
    audience="test",
    read_when="when that test module is collected",
)
SIMULATED_SOC = Switch(
    name="DEEPINFER_NPU_SIM_SOC",
    attr="simulated_soc",
    kind="int",
    default=220,
    meaning="the SoC the torch_npu CPU simulation pretends to be (220-225 A2, 250-255 A3, 260 Ascend 950)",
    audience="test",
    read_when="when the simulation is installed",
)

SWITCHES: tuple[Switch, ...] = (
    BACKEND,
    LOG_LEVEL,
    CONFIGURE_LOGGING,
    SKIP_WEIGHT_CHECK,
    ENGRAM_HOST_TABLES,
    ENGRAM_PREFETCH,
    MODEL_UNFUSED,
    CONFORMANCE_HEAVY,
    REFERENCE_DEVICE,
    CUDA_UNFUSED,
    CUDA_MOE_DECODE,
    CUDA_MOE_EARLY,
    CUDA_EARLY_INPUTS,
    CUDA_ARGMAX,
    CUDA_WIDE_QUERY,
    CUDA_KERNEL_COPIES,
    CUDA_SKINNY,
    CUDA_V4_DECODE,
    CUDA_V4_STEP,
    CUDA_V4_SMALL_GRID,
    CUDA_MX_FP4,
    CUDA_FP4_DECODE,
    CUDA_FP8_HALF_READ,
    CUDA_PDL,
    CUDA_MOE_DECODE_TILES,
    CUDA_INVARIANT_TILE,
    CUDA_VENDOR,
    CUDA_EXPERT_EXCHANGE,
    CUDA_DEEPEP_TOKENS,
    TEST_BACKEND,
    TEST_SUBPROCESS_TIMEOUT,
    SIMULATED_SOC,
)
BY_NAME: dict[str, Switch] = {s.name: s for s in SWITCHES}


@dataclass(frozen=True)
class Env:
    """Every switch's value at one moment (`read()`); field names are the table's `attr`s."""

    backend: str | None
    log_level: str | None
    configure_logging: bool
    skip_weight_check: bool
    engram_host_tables: bool
    engram_prefetch: bool
    model_unfused: frozenset[str]
    conformance_heavy: bool
    reference_device: str
    cuda_unfused: bool
    cuda_moe_decode: bool
    cuda_moe_early: bool
    cuda_early_inputs: bool
    cuda_argmax: bool
    cuda_wide_query: bool
    cuda_kernel_copies: bool
    cuda_skinny: bool
    cuda_v4_decode: bool
    cuda_v4_step: bool
    cuda_v4_small_grid: bool
    cuda_mx_fp4: bool
    cuda_fp4_decode: str
    cuda_fp8_half_read: bool
    cuda_pdl: bool
    cuda_moe_decode_tiles: tuple[int, ...] | None
    cuda_invariant_tile: tuple[int, ...] | None
    cuda_vendor: bool
    cuda_expert_exchange: str
    cuda_deepep_tokens: int
    test_backend: str | None
    test_subprocess_timeout: float
    simulated_soc: int


assert [f.name for f in fields(Env)] == [s.attr for s in SWITCHES], "Env and SWITCHES list the same fields"


def read(environ: Mapping[str, str] | None = None) -> Env:
    """Every switch's value in `environ` (default: os.environ), parsed; ValueError naming the
    first variable whose text is not a valid value."""
    return Env(**{s.attr: s.read(environ) for s in SWITCHES})


DEFAULTS = read({})


def markdown() -> str:
    """docs/environment.md: the table, one section per audience."""
    out = [
        "# Environment variables",
        "",
        "Generated from `deepinfer/envs.py` (`python -m deepinfer.envs > docs/environment.md`);",
        "tests/test_envs.py checks that this page, the table and the code agree.",
        "",
        "Each variable is read when what it changes is created (the backend, the model, the",
        "logger), never at each kernel launch: set it before creating the `LLM` (or the backend).",
        "Flags take 1 / 0 (also true / false, yes / no, on / off); an empty value is the default.",
    ]
    titles = {
        "user": "For users",
        "benchmark": "For benchmarks (each turns one optimisation off, or pins a tuning)",
        "test": "For the test suite",
    }
    for audience, title in titles.items():
        out += [
            "",
            f"## {title}",
            "",
            "| variable | type | default | read | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for s in SWITCHES:
            if s.audience == audience:
                kind = {
                    "ints": ",".join(s.choices),
                    "choice": " / ".join(s.choices),
                    "names": "names: " + ", ".join(s.choices),
                }.get(s.kind, s.kind)
                out.append(f"| `{s.name}` | {kind} | {_shown(s.default)} | {s.read_when} | {s.meaning} |")
    return "\n".join(out) + "\n"


def _shown(default: Any) -> str:
    if default is None or default == frozenset():
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return f"`{default}`"


if __name__ == "__main__":
    print(markdown(), end="")

"""Engine configuration: frozen dataclasses built from the arguments of `LLM(...)`.

EngineConfig is the one definition of the engine's arguments: each field carries its help text
and its check in its metadata (`engine_arg`). `LLM(**kwargs)` is validated against these fields,
and the command line's engine options are generated from them (deepinfer.engine.args), so the
API, the config and the CLI cannot drift apart.

The model's own configuration (from config.json) is `deepinfer.models.config.ModelConfig`.
Runtime state that depends on the model and the device (the resolved max_model_len, the number
of KV blocks) lives in the engine, never written back here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """ "auto" / None -> None (the checkpoint's dtype); a name or torch.dtype -> that dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


MAX_SPECULATIVE_TOKENS = 8
SPECULATIVE_METHODS = ("mtp", "deepseek_mtp", "dspark", "dflash")
SPECULATIVE_KEYS = (
    "method", "num_speculative_tokens", "min_draft_confidence", "confidence_scheduling", "schedule",
    "step_token_budget",
)  # fmt: skip
# confidence scheduling's policies: "measured" (expected tokens per ms on the step times measured
# at start-up, deepinfer.engine.step_times) or "budget" (a fixed step_token_budget)
SCHEDULE_POLICIES = ("measured", "budget")
DEFAULT_STEP_TOKEN_BUDGET = 64  # tokens a decode step may hold with confidence scheduling
# Tokens per KV block: Ascend's fused paged MLA attention (npu_fused_infer_attention_score)
# takes blocks of at most 1024 tokens; the CUDA (Triton) and reference kernels take any size, and
# larger blocks only waste memory (a request holds at least one block).
MAX_BLOCK_SIZE = 1024
QUANTIZATIONS = ("fp8",)  # checkpoint formats `quantization` may name (None: the checkpoint's own)
# kv_cache_dtype: auto = the model's default; fp8 / fp8_e4m3 (vLLM's names) = FP8 latent rows for
# MLA models, FP8 main KV for DeepSeek-V4.1; bf16 / fp4: DeepSeek-V4.1 (each model checks its own)
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp8_e4m3", "fp4")
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a directory holding a generation_config.json

Check = Callable[[str, Any], None]


# --------------------------------------------------------------------------- checks
# Each takes (field name, value) and raises ValueError naming both.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _integer(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _non_negative_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _string(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _optional_string(name: str, value: Any) -> None:
    if value is not None:
        _string(name, value)


def _dtype(name: str, value: Any) -> None:
    parse_dtype(value)


def _unit_share(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _block_size(name: str, value: Any) -> None:
    _positive_int(name, value)
    if value > MAX_BLOCK_SIZE:
        raise ValueError(
            f"{name} must be in 1..{MAX_BLOCK_SIZE} tokens (Ascend's fused paged MLA attention "
            f"takes blocks of at most {MAX_BLOCK_SIZE}), got {value}"
        )


def _seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _quantization(name: str, value: Any) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(
            f"{name}={value!r} is not supported; choose None (the checkpoint's own format) or "
            f"{', '.join(repr(q) for q in QUANTIZATIONS)} (an FP8 checkpoint); deepinfer does not "
            "quantize weights when it loads them"
        )


def _kv_cache_dtype(name: str, value: Any) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, KV_CACHE_DTYPES))}"
        )


def _generation_config(name: str, value: Any) -> None:
    _string(name, value)


def _max_logprobs(name: str, value: Any) -> None:
    if not _is_int(value) or value < -1:
        raise ValueError(f"{name} must be an integer >= 0, or -1 for no limit, got {value!r}")


def _speculative_config(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (deepinfer.parallel.eplb), vLLM's EPLBConfig names."""

    window_size: int = 1000  # steps whose counts the plan uses
    step_interval: int = 3000  # steps between two rearrangements
    num_redundant_experts: int = 0  # R: physical slots beyond the E logical experts
    log_balancedness: bool = False  # log the busiest rank's share at each rearrangement

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> EplbConfig:
        """ValueError naming the key for an unknown key or a bad value."""
        value = dict(value or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"eplb_config: unknown keys {unknown}; known: {known}")
        for name in ("window_size", "step_interval", "num_redundant_experts"):
            v = value.get(name)
            low = 0 if name == "num_redundant_experts" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"eplb_config: {name} must be an integer >= {low}, got {v!r}")
        flag = value.get("log_balancedness")
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"eplb_config: log_balancedness must be true or false, got {flag!r}")
        return cls(**value)


def _eplb_config(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    EplbConfig.from_dict(value)


def _mm_limits(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict like {{'image': 2}}, got {type(value).__name__}")
    for key, n in value.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name}[{key!r}] must be a non-negative int, got {n!r}")
        if key != "image" and n:
            raise ValueError(
                f"{name}: {key!r} inputs are not supported (images only); set it to 0 or leave it out"
            )


def _chunked_prefill(name: str, value: Any) -> None:
    if value is None or value is True:
        return
    if value is False:
        raise ValueError(
            f"{name}=False is not supported: deepinfer always prefills a prompt longer than what "
            "is left of a step's token budget in chunks (max_num_batched_tokens per step), and the "
            "outputs do not depend on the chunking; leave it True (or None)"
        )
    _boolean(name, value)


def _tensor_parallel_size(name: str, value: Any) -> None:
    _positive_int(name, value)
    if value != 1:
        raise ValueError(
            f"{name}={value} is not supported: deepinfer spreads a model over several devices with "
            "attention data parallelism and MoE expert parallelism instead (data_parallel_size=N with "
            "enable_expert_parallel=True: one process per device); use tensor_parallel_size=1"
        )


EXECUTOR_BACKENDS = ("mp", "external_launcher")  # distributed_executor_backend (None: mp when needed)


def _executor_backend(name: str, value: Any) -> None:
    if value is not None and value not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"{name}={value!r} is not supported; choose None, 'mp' (the engine starts one worker "
            "process per data-parallel rank) or 'external_launcher' (every rank runs the same script "
            "under torchrun)"
        )


def _trust_remote_code(name: str, value: Any) -> None:
    _boolean(name, value)
    if value:
        raise ValueError(
            f"{name}=True is not supported: deepinfer never runs code that ships with a checkpoint; it "
            "reads config.json, the safetensors weights and tokenizer.json itself, so every DeepSeek "
            f"checkpoint it supports loads with {name}=False (the default)"
        )


def engine_arg(default: Any, help: str, check: Check, **cli: Any) -> Any:
    """An EngineConfig field: its default, its help (the CLI's too), its check, and argparse
    settings for its generated command-line option (e.g. choices=..., type=..., aliases=[...])."""
    return field(default=default, metadata={"help": help, "check": check, "cli": cli})


def _json_object(text: str) -> dict[str, Any]:
    """A command-line value holding a JSON object (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValueError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked of the engine, with vLLM's argument names. Each field's help is in
    its metadata (`deepinfer generate --help` prints them; docs/vllm.md compares with vLLM).

    Cross-field rules: speculative_config with data_parallel_size > 1 needs
    enable_expert_parallel, and with it neither enable_two_batch_overlap nor enable_eplb;
    external_launcher needs enable_expert_parallel.
    """

    model: str = field(
        metadata={
            "help": "checkpoint directory (config.json, safetensors, tokenizer.json), or the id of a "
            "Hugging Face repo in the local hub cache (e.g. deepseek-ai/DeepSeek-V2-Lite; never "
            "downloaded)",
            "check": _string,
            "cli": {"skip": True},  # each subcommand defines --model with its own default
        }
    )
    tokenizer: str | None = engine_arg(
        None,
        "tokenizer directory (tokenizer.json, tokenizer_config.json) or cached hub repo id; default: "
        "the model's; it must hold the model's vocabulary",
        _optional_string,
    )
    revision: str | None = engine_arg(
        None,
        "hub revision (branch, tag or commit) of a repo id given as model; default: main",
        _optional_string,
    )
    backend: str = engine_arg(
        "auto", "backend name, or auto (an explicit choice, else DEEPINFER_BACKEND, else the best available "
        "accelerator, else reference; see `deepinfer backends`)", _string,
    )  # fmt: skip
    dtype: str | torch.dtype = engine_arg(  # noqa: RUF009 - engine_arg returns a dataclasses.field
        "auto",
        "model dtype; auto keeps the checkpoint's (bfloat16 for FP8 checkpoints)",
        _dtype,
        choices=["auto", *DTYPES],
    )
    quantization: str | None = engine_arg(
        None,
        "weight format: None = whatever the checkpoint is; fp8 = the checkpoint must be an FP8 one "
        "(e4m3 with 128x128 block scales); weights are never quantized on load",
        _quantization,
        choices=list(QUANTIZATIONS),
    )
    kv_cache_dtype: str = engine_arg(
        "auto",
        "KV cache rows: auto = the model's default (its dtype; DeepSeek-V4.1: its published FP8 window "
        "rings and FP4 main KV and index keys); fp8 (or fp8_e4m3) = DeepSeek-V2 / V3 latents in FlashMLA's "
        "FP8 rows (e4m3 with a float32 scale per 128 values, bf16 rope: 656 bytes a token against 1152, "
        "about 1.75x the tokens in the same memory), DeepSeek-V4.1's main KV in FP8; DeepSeek-V4.1 also "
        "takes bf16 (unquantised, the model dtype) and fp4 (= auto)",
        _kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
    )
    max_model_len: int | None = engine_arg(
        None, "longest prompt + output in tokens; default: the model's max_position_embeddings", _positive_int
    )
    max_num_seqs: int = engine_arg(256, "most requests in one step", _positive_int)
    max_num_batched_tokens: int = engine_arg(
        8192,
        "token budget of one step; longer prompts are prefilled in chunks over several steps",
        _positive_int,
    )
    enable_chunked_prefill: bool | None = engine_arg(
        True, "chunked prefill; always on in deepinfer (False is an error)", _chunked_prefill
    )
    gpu_memory_utilization: float = engine_arg(
        0.9,
        "share of the device's memory the engine may use in all; the KV cache gets what is left of it "
        "once the model is loaded",
        _unit_share,
    )
    num_gpu_blocks_override: int | None = engine_arg(
        None, "KV cache size in blocks (instead of gpu_memory_utilization)", _positive_int
    )
    kv_cache_memory_bytes: int | None = engine_arg(
        None, "KV cache size in bytes (instead of gpu_memory_utilization)", _positive_int
    )
    block_size: int = engine_arg(64, f"tokens per KV block, 1..{MAX_BLOCK_SIZE}", _block_size)
    seed: int = engine_arg(0, "seeds the generators of requests that have no seed of their own", _integer)
    enable_prefix_caching: bool = engine_arg(
        False, "reuse the KV blocks of identical prompt prefixes (hashed per full block)", _boolean
    )
    prefix_ring_blocks: int | None = engine_arg(
        None,
        "prefix caching of a model with a window ring (DeepSeek-V4): blocks that keep the ring rows "
        "(window and compressor state) of cached token blocks; default: as many bytes as the "
        "compressed entries' pools",
        _positive_int,
    )
    batch_invariant: bool = engine_arg(
        False,
        "ask the backend for batch-invariant ops: a request's tokens do not depend on the other "
        "requests in its batch",
        _boolean,
    )
    speculative_config: dict[str, Any] | None = engine_arg(  # noqa: RUF009 - a dataclasses.field
        None,
        'speculative decoding: {"method": "mtp", "num_speculative_tokens": k} drafts k tokens per step '
        'with the checkpoint\'s MTP head (run k times in a chain, as vLLM does; "deepseek_mtp" is accepted '
        'too), "method": "dspark" with the block drafter saved beside the model (drafter.safetensors, '
        'k tokens in one pass), "method": "dflash" with DeepSeek\'s DSpark drafter saved in DIR/dflash/ '
        "(conditioned on the model by KV injection, a block of k <= B drafts in one pass); drafts are "
        "verified in the next step and outputs are those of plain "
        'decoding. "min_draft_confidence": p verifies only the drafts whose confidence (the chance '
        'that they and the drafts before them are accepted) is >= p; "confidence_scheduling": true '
        "chooses per step the drafts that maximise expected tokens per ms on the step times measured at "
        'start-up ("schedule": "measured", the default), or ("schedule": "budget", the default when '
        '"step_token_budget" is given) caps them at "step_token_budget" (default 64) minus the tokens the '
        "step computes anyway (docs/speculative.md)",
        _speculative_config,
        type=_json_object,
        metavar="JSON",
    )
    limit_mm_per_prompt: dict[str, int] | None = engine_arg(  # noqa: RUF009 - a dataclasses.field
        None,
        "most multi-modal items per prompt, {\"image\": n} (vLLM's); default: no limit but the step's "
        "token budget (an image's span is computed in one step)",
        _mm_limits,
        type=_json_object,
        metavar="JSON",
    )
    enable_expert_parallel: bool = engine_arg(
        False,
        "shard the routed experts over the data-parallel ranks (data_parallel_size worker processes the "
        "engine starts, or the ranks of torch.distributed's default group: torchrun, or a group the "
        "caller made); each rank serves its own requests with the whole attention (attention data "
        "parallelism); ranks started outside the engine must call generate the same number of times",
        _boolean,
    )
    tensor_parallel_size: int = engine_arg(
        1,
        "1 only: deepinfer shards with enable_expert_parallel instead",
        _tensor_parallel_size,
        aliases=["-tp"],
    )
    data_parallel_size: int = engine_arg(
        1,
        "attention data-parallel ranks (one device each): the engine starts one worker process per "
        "rank, balances the requests over them and gathers the outputs in prompt order "
        "(deepinfer.entrypoints.data_parallel); with enable_expert_parallel each holds 1/N of the routed "
        "experts, else a whole copy of the model. Under torchrun: the world size, with "
        "distributed_executor_backend='external_launcher'",
        _positive_int,
        aliases=["-dp"],
    )
    distributed_executor_backend: str | None = engine_arg(
        None,
        "how data-parallel ranks start: mp = worker processes the engine spawns (the default); "
        "external_launcher = each rank is a process of its own that runs the same script (torchrun, "
        "several nodes included) and serves the prompts it is given",
        _executor_backend,
        choices=list(EXECUTOR_BACKENDS),
    )
    enable_two_batch_overlap: bool = engine_arg(
        False,
        "with expert parallelism, split each MoE layer's tokens into two micro-batches so that one's "
        "all-to-all runs while the other's experts compute (same tokens); in eager steps (decode "
        "graphs exchange fixed-size buffers, unsplit)",
        _boolean,
    )
    enable_eplb: bool = engine_arg(
        False,
        "with expert parallelism, balance the routed experts' load over the ranks (EPLB): count each "
        "expert's tokens over a window of steps, give the hottest redundant replicas and move the "
        "weights so that the busiest rank's load falls (deepinfer.parallel.eplb; same tokens)",
        _boolean,
    )
    eplb_config: dict[str, Any] | None = engine_arg(  # noqa: RUF009 - a dataclasses.field
        None,
        'EPLB settings, vLLM\'s names: {"window_size": 1000, "step_interval": 3000, '
        '"num_redundant_experts": 0, "log_balancedness": false} (those are the defaults)',
        _eplb_config,
        type=_json_object,
        metavar="JSON",
    )
    distributed_timeout_s: float = engine_arg(
        300.0,
        "with expert parallelism, the longest a rank waits for the others at the status exchange that "
        "starts each call and each step (so also the longest skew between the ranks' generate calls, and "
        "the longest step); past it every rank raises RuntimeError naming the late rank "
        "(deepinfer.parallel.rank_sync). A failure a rank raises reaches every rank at the next step",
        _seconds,
    )
    disable_log_stats: bool = engine_arg(
        True,
        "vLLM's: False also logs each generate call's request and token throughput at INFO; the "
        "counters LLM.get_metrics() reads are kept either way",
        _boolean,
    )
    enforce_eager: bool = engine_arg(
        False,
        "never capture graphs; by default decode steps replay graphs captured per batch-size bucket "
        "where the backend has them (expert-parallel ranks: a bucket they agree on each step)",
        _boolean,
    )
    max_prefill_graph_tokens: int = engine_arg(
        1024,
        "prefill steps of at most this many tokens (a few requests, each padded to a power of two of "
        "at least 16 tokens) replay graphs too, so a short prompt's prefill is not bound by kernel "
        "launches; 0 = prefill steps run eagerly (models with several KV cache groups, expert "
        "parallelism and speculative decoding always prefill eagerly)",
        _non_negative_int,
    )
    async_scheduling: bool = engine_arg(
        True,
        "schedule and prepare step n+1 on the host while the device runs step n (same outputs as "
        "synchronous scheduling); speculative steps run synchronously",
        _boolean,
    )
    generation_config: str = engine_arg(
        "auto",
        "default sampling parameters of a generate() call without any: auto = the model's "
        "generation_config.json, vllm = SamplingParams() defaults, or a directory holding a "
        "generation_config.json",
        _generation_config,
    )
    max_logprobs: int = engine_arg(
        20,
        "most log-probabilities a request may ask for (SamplingParams.logprobs); -1 = no limit",
        _max_logprobs,
    )
    trust_remote_code: bool = engine_arg(
        False, "False only: deepinfer never runs code shipped with a checkpoint", _trust_remote_code
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        _ = self.num_speculative_tokens, self.min_draft_confidence  # validate speculative_config
        if self.speculative_config is not None:
            if self.data_parallel_size > 1 and not self.enable_expert_parallel:
                raise ValueError(
                    "speculative_config with data_parallel_size > 1 needs enable_expert_parallel=True: "
                    "replicas without expert parallelism do not serve speculative decoding yet"
                )
            for name in ("enable_two_batch_overlap", "enable_eplb"):
                if getattr(self, name):
                    raise ValueError(
                        f"speculative_config cannot be combined with {name} yet (expert parallelism "
                        f"with speculative decoding runs without {name})"
                    )
        if self.enable_two_batch_overlap and not self.enable_expert_parallel:
            raise ValueError(
                "enable_two_batch_overlap needs enable_expert_parallel=True (it splits the MoE exchanges)"
            )
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel=True (it balances the experts' ranks)")
        if self.eplb_config is not None and not self.enable_eplb:
            raise ValueError("eplb_config is given but enable_eplb is False: set enable_eplb=True")
        if self.distributed_executor_backend == "external_launcher" and not self.enable_expert_parallel:
            raise ValueError(
                "distributed_executor_backend='external_launcher' serves one rank of an expert-parallel "
                "group: set enable_expert_parallel=True (replicas without it need no launcher: start "
                "independent processes)"
            )

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (model always), e.g. for a log line."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.default is MISSING or getattr(self, f.name) != f.default
        }

    @property
    def eplb(self) -> EplbConfig | None:
        """EPLB's settings when enable_eplb is on."""
        return EplbConfig.from_dict(self.eplb_config) if self.enable_eplb else None

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0: no speculative decoding)."""
        spec = self.speculative_config
        if spec is None:
            return 0
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        unknown = set(spec) - set(SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {SPECULATIVE_KEYS}")
        method = spec.get("method", "mtp")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method {method!r} is not supported; use 'mtp', 'dspark' or 'dflash'"
            )
        scheduling = spec.get("confidence_scheduling", False)
        if not isinstance(scheduling, bool):
            raise ValueError(
                f"speculative_config: confidence_scheduling must be true or false, got {scheduling!r}"
            )
        policy = spec.get("schedule", "measured")
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"speculative_config: schedule must be one of {SCHEDULE_POLICIES}, got {policy!r}"
            )
        budget = spec.get("step_token_budget", DEFAULT_STEP_TOKEN_BUDGET)
        if not _is_int(budget) or budget < 0:
            raise ValueError(f"speculative_config: step_token_budget must be an integer >= 0, got {budget!r}")
        k = spec.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        return k

    @property
    def speculative_method(self) -> str | None:
        """The drafter: "mtp" (the checkpoint's MTP head), "dspark" (the block drafter), "dflash"
        (DeepSeek's DSpark drafter, KV injection: deepinfer.models.dflash), None."""
        if self.speculative_config is None:
            return None
        method = self.speculative_config.get("method", "mtp")
        return "mtp" if method == "deepseek_mtp" else str(method)

    @property
    def schedule_policy(self) -> str | None:
        """Confidence scheduling's policy: "measured" (step times), "budget" (step_token_budget),
        None (no scheduling: every confident draft is verified). "budget" is the default when
        step_token_budget is given, else "measured"."""
        spec = self.speculative_config or {}
        if not spec.get("confidence_scheduling", False):
            return None
        return str(spec.get("schedule", "budget" if "step_token_budget" in spec else "measured"))

    @property
    def step_token_budget(self) -> int | None:
        """With the budget policy, the tokens a decode step may hold, verified drafts included
        (None: no cap)."""
        spec = self.speculative_config or {}
        if self.schedule_policy != "budget":
            return None
        return int(spec.get("step_token_budget", DEFAULT_STEP_TOKEN_BUDGET))

    @property
    def min_draft_confidence(self) -> float:
        """Smallest confidence of a draft worth verifying (0: every draft)."""
        p = (self.speculative_config or {}).get("min_draft_confidence", 0.0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative_config: min_draft_confidence must be in [0, 1], got {p!r}")
        return float(p)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)


def engine_fields() -> list[Field[Any]]:
    """EngineConfig's fields: the engine arguments of LLM(...) and of the command line."""
    return list(fields(EngineConfig))

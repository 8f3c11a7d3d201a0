"""The engine arguments, from their one definition (deepinfer.config.EngineConfig's fields):

- `engine_config(model, kwargs)`: LLM(**kwargs) checked against the fields; an unknown name is
  an UnknownArgumentError naming it and the nearest supported one (and, for a vLLM argument
  deepinfer does not have, why).
- `add_engine_arguments(parser)` / `engine_kwargs(args)`: the command line's engine options,
  one per field (`--max-num-seqs`, `--enforce-eager` / `--no-enforce-eager`, ...).
- `resolve_engine_config(config)`: the checks that read files, before anything is loaded: the
  model (a directory or a cached hub repo id), the tokenizer (same vocabulary as the model),
  generation_config, quantization against the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from deepinfer.config import GENERATION_CONFIG_MODES, EngineConfig, engine_fields
from deepinfer.models.hub import resolve_model_dir


class UnknownArgumentError(TypeError, ValueError):
    """An engine argument deepinfer does not have (a TypeError, as Python's own, and a
    ValueError, as every other bad engine argument)."""


# vLLM engine arguments deepinfer does not have, and what to do instead.
VLLM_ONLY: dict[str, str] = {
    "pipeline_parallel_size": "spread a model over devices with enable_expert_parallel=True",
    "cpu_offload_gb": "weights stay on the device",
    "swap_space": "preempted requests are recomputed, never swapped",
    "load_format": "deepinfer reads safetensors only",
    "download_dir": "models are never downloaded; set HF_HUB_CACHE / HF_HOME to the cache that holds them",
    "hf_token": "models are never downloaded",
    "tokenizer_mode": "the checkpoint's tokenizer.json is always used",
    "skip_tokenizer_init": "a checkpoint without tokenizer.json takes prompt_token_ids",
    "tokenizer_revision": "give the tokenizer as a directory",
    "max_seq_len_to_capture": "decode graphs cover batch sizes up to max_num_seqs",
    "compilation_config": "graph capture is on unless enforce_eager=True",
    "disable_custom_all_reduce": "collectives are the backend's",
    "hf_overrides": "config.json is read as it is",
}


def _nearest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    return close[0] if close else known[0]


def check_engine_kwargs(kwargs: Mapping[str, Any], where: str = "LLM()") -> None:
    """UnknownArgumentError for the first name that is not an engine argument."""
    known = [f.name for f in engine_fields() if f.name != "model"]
    for name in kwargs:
        if name in known:
            continue
        why = f" (vLLM's {name} is not supported: {VLLM_ONLY[name]})" if name in VLLM_ONLY else ""
        raise UnknownArgumentError(
            f"{where} got an unknown argument {name!r}{why}; the nearest supported one is "
            f"{_nearest(name, known)!r} (all of them: docs/vllm.md, or `deepinfer generate --help`)"
        )


def engine_config(model: Any, kwargs: Mapping[str, Any], where: str = "LLM()") -> EngineConfig:
    """EngineConfig(model, **kwargs), its names checked first. No file is read."""
    check_engine_kwargs(kwargs, where)
    return EngineConfig(model=str(model), **kwargs)


# --------------------------------------------------------------------------- command line


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def human_readable_int(text: str) -> int:
    """An integer option as vLLM reads one: "2048", or with a suffix, decimal k / m / g / t
    (10**3 ..., "25.6k" = 25600) or binary K / M / G / T (2**10 ..., whole numbers only: "1K"
    = 1024). ValueError naming the text otherwise."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(
                f"invalid integer {text!r}: give a whole number, or one with a suffix "
                "(k, m, g, t = 10**3 ... 10**12; K, M, G, T = 2**10 ... 2**40), e.g. 1k or 32K"
            ) from None
    number, suffix = match.groups()
    power = "kmgt".find(suffix.lower()) + 1
    if suffix.islower():
        value = Decimal(number) * 10 ** (3 * power)
        if value != value.to_integral_value():
            raise ValueError(f"invalid integer {text!r}: {value} is not a whole number")
        return int(value)
    if "." in number:
        raise ValueError(
            f"invalid integer {text!r}: binary suffixes ({suffix}) take whole numbers; "
            f"did you mean {number}{suffix.lower()}?"
        )
    return int(number) << (10 * power)


def _cli_type(annotation: Any) -> Callable[[str], Any]:
    """int (human_readable_int: "1k", "32K"), float or str: the first of them in the field's
    annotation (`int | None` -> int)."""
    args = typing.get_args(annotation) or (annotation,)
    if int in args:
        return human_readable_int
    for t in (float, str):
        if t in args:
            return t
    return str


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field (those not marked cli skip), with its help and default."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (LLM(...) arguments, vLLM's names)")
    for f in engine_fields():
        cli = dict(f.metadata["cli"])
        if cli.pop("skip", False):
            continue
        flags = [_flag(f.name), *cli.pop("aliases", [])]
        help_text = f.metadata["help"].replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        if bool in args:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] += f" (default: {'on' if f.default else 'off'})"
        else:
            kwargs["type"] = _argparse_type(cli.pop("type", _cli_type(hints[f.name])))
            if f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        kwargs.update(cli)
        group.add_argument(*flags, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of parsed command-line options (add_engine_arguments)."""
    return {
        f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name) and f.name != "model"
    }


# --------------------------------------------------------------------------- file checks


def _vocab(directory: Path) -> dict[str, int]:
    """token -> id of the tokenizer.json in `directory`, added tokens included."""
    from tokenizers import Tokenizer as HFTokenizer

    file = directory / "tokenizer.json"
    try:
        vocab: dict[str, int] = HFTokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{file} is not a valid tokenizer file: {exc}") from exc
    return vocab


def check_tokenizer(model_dir: Path, tokenizer_dir: Path, name: str, config_file: Path | None = None) -> None:
    """ValueError unless the tokenizer holds the model's vocabulary: no token id past the model's
    vocab_size (config_file, default model_dir/config.json), and, when the model ships a
    tokenizer.json, the same token -> id map."""
    from deepinfer.models.config import ModelConfig

    if tokenizer_dir.resolve() == model_dir.resolve():
        return
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer {name!r} has no tokenizer.json ({tokenizer_dir})")
    theirs = _vocab(tokenizer_dir)
    vocab_size = ModelConfig.from_file(config_file or model_dir / "config.json").vocab_size
    top = max(theirs.values(), default=-1)
    if top >= vocab_size:
        raise ValueError(
            f"tokenizer {name!r} has token ids up to {top}, past the model's vocab_size {vocab_size}: "
            "it is not this model's vocabulary"
        )
    if not (model_dir / "tokenizer.json").is_file():
        return
    ours = _vocab(model_dir)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        token = differ[0][0]
        raise ValueError(
            f"tokenizer {name!r} does not hold the model's vocabulary ({len(theirs)} tokens against the "
            f"model's {len(ours)}; token {token!r} is id {theirs.get(token)} there and "
            f"{ours.get(token)} in {model_dir / 'tokenizer.json'})"
        )


def check_quantization(config: EngineConfig, config_file: Path) -> None:
    """quantization="fp8" needs an FP8 checkpoint (None takes whatever the checkpoint is)."""
    if config.quantization is None:
        return
    from deepinfer.models.config import ModelConfig

    if ModelConfig.from_file(config_file).quantization is None:
        raise ValueError(
            f"quantization={config.quantization!r}, but {config.model} is not an FP8 checkpoint (its "
            "config.json has no quantization_config with quant_method 'fp8'); deepinfer does not "
            "quantize weights when it loads them: leave quantization=None"
        )


def _generation_config_source(value: str) -> str:
    if value in GENERATION_CONFIG_MODES:
        return value
    path = Path(value).expanduser()
    if path.is_file() and path.suffix == ".json":
        return str(path)
    if (path / "generation_config.json").is_file():
        return str(path)
    raise FileNotFoundError(
        f"generation_config={value!r}: no generation_config.json there; choose 'auto' (the model's), "
        "'vllm' (SamplingParams() defaults), or a directory holding a generation_config.json"
    )


def resolve_engine_config(config: EngineConfig, config_file: Path | None = None) -> EngineConfig:
    """The config with model and tokenizer as directories (hub repo ids resolved from the local
    cache) and generation_config checked; quantization checked against the checkpoint. Raises
    FileNotFoundError / ValueError naming the argument.

    config_file: the model's config.json when it is not config.model/config.json (random
    weights from a config file: config.model is then the directory that may hold a tokenizer)."""
    if config_file is None:
        model_dir = resolve_model_dir(config.model, config.revision)
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {config.model!r} has no config.json ({model_dir})")
    else:
        model_dir = Path(config.model)
    tokenizer = None
    if config.tokenizer is not None:
        tokenizer_dir = resolve_model_dir(config.tokenizer, what="tokenizer")
        check_tokenizer(model_dir, tokenizer_dir, config.tokenizer, config_file)
        tokenizer = str(tokenizer_dir)
    check_quantization(config, config_file)
    return dataclasses.replace(
        config,
        model=str(model_dir),
        tokenizer=tokenizer,
        generation_config=_generation_config_source(config.generation_config),
    )


def backend_choice_reason(requested: str) -> str:
    """Why the selection rule (deepinfer.backend.registry) picked the backend it did."""
    from deepinfer import envs
    from deepinfer.backend.registry import ENV_VAR, BackendRegistry

    if requested not in (None, "auto"):
        return f"asked for (backend={requested!r})"
    env = envs.read().backend
    if env and env != "auto":
        return f"asked for ({ENV_VAR}={env})"
    registry = BackendRegistry.discover()  # probes never initialise a device
    try:
        chosen = registry.select("auto")
    except Exception as exc:  # the engine has its backend: this is only the log line
        return f"auto ({exc})"
    if chosen.is_accelerator:
        return f"the highest-priority available accelerator (priority {chosen.priority})"
    missing = [
        f"{e.info.name}: {e.availability.reason}"
        for e in registry.entries()
        if e.info.is_accelerator and not e.availability.available
    ]
    why = "; ".join(missing) if missing else "none is installed"
    return f"no accelerator backend is available ({why}); {chosen.name} is the fallback"


class EngineArgs:
    """vLLM's EngineArgs: the engine arguments as one object, checked at construction (the
    names as LLM(...) checks them, the values by EngineConfig), for LLMEngine.from_engine_args.
    Each argument reads as an attribute (`EngineArgs(model=M).max_model_len`); the object is
    read-only: make a new one to change an argument."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        object.__setattr__(self, "config", engine_config(model, kwargs, "EngineArgs()"))

    config: EngineConfig

    def __getattr__(self, name: str) -> Any:
        # only the engine arguments' names; anything else is Python's AttributeError
        if name != "config" and name in EngineConfig.__dataclass_fields__:
            return getattr(self.config, name)
        raise AttributeError(f"EngineArgs has no argument {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"EngineArgs is read-only: make a new one, EngineArgs(model, ..., {name}={value!r})"
        )

    def __repr__(self) -> str:
        return f"EngineArgs({', '.join(f'{k}={v!r}' for k, v in self.config.changed().items())})"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """--model and one option per engine argument (add_engine_arguments); the parser back."""
        parser.add_argument("--model", required=True, help="checkpoint directory or cached hub repo id")
        add_engine_arguments(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(args.model, **engine_kwargs(args))

    def create_engine_config(self) -> EngineConfig:
        """The checked configuration, the model and tokenizer resolved (resolve_engine_config)."""
        return resolve_engine_config(self.config)

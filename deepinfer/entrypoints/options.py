"""What the subcommands that run a model share: the engine options, the default model, errors.

The engine options (`deepinfer generate | bench | run-batch`) are generated from the engine
arguments' one definition (EngineConfig's fields, deepinfer.engine.args): the same names,
defaults, help and checks as `LLM(...)`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from deepinfer.backend.registry import BackendError
from deepinfer.engine.args import add_engine_arguments, engine_kwargs
from deepinfer.models.hub import REPO_MODEL_DIR

DEFAULT_MODEL = REPO_MODEL_DIR / "tiny"


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine arguments (one option per EngineConfig field) and the shortcut
    --num-speculative-tokens K (= --speculative-config '{"method": "mtp", "num_speculative_tokens": K}')."""
    add_engine_arguments(p)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens per step from the checkpoint's MTP head (speculative decoding, 0 = off)",
    )


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from the parsed engine options."""
    kwargs = engine_kwargs(args)
    k = getattr(args, "num_speculative_tokens", 0)
    if k:
        if kwargs.get("speculative_config") is not None:
            raise ValueError("give --num-speculative-tokens or --speculative-config, not both")
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return kwargs


def fail(exc: Exception) -> int:
    """One line on stderr, exit status 2."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"error: {message}", file=sys.stderr)
    return 2


# What a user's input (arguments, files, checkpoint) can cause: a one-line error, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OSError, BackendError)


def check_writable(path_arg: str, flag: str) -> Path:
    """The output path, or OSError saying why it cannot be written (checked before a long run)."""
    path = Path(path_arg)
    parent = path.parent
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path_arg}: is a directory")
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path_arg}: directory {parent} does not exist")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise PermissionError(f"{flag} {path_arg}: {target} is not writable")
    return path

"""deepinfer's log: the standard `logging` module, logger "deepinfer" (every module logs to a
child of it, `logging.getLogger(__name__)`).

Level: DEEPINFER_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR, CRITICAL) when set; else WARNING for
the library (quiet in tests and scripts) and INFO for the command line. Records go to stderr
through one handler of our own, and not on to the root logger (as vLLM does), so a program that
configures logging itself sees each line once; DEEPINFER_CONFIGURE_LOGGING=0 leaves the
"deepinfer" logger alone (no handler, no level; records then propagate as usual).

What is logged at INFO: the backend and why it was chosen, the engine arguments that differ
from the defaults, the weights' load time, the KV-cache size in tokens, graph capture (and, with
disable_log_stats=False, each call's throughput). At DEBUG also: the graph plan and each graph
captured, how the KV cache was sized, every step the scheduler plans, preemptions and
prefix-cache hits.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from deepinfer import envs

LOGGER_NAME = "deepinfer"
FORMAT = "%(levelname)s %(asctime)s [%(module)s] %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to sys.stderr as it is at each record (pytest and others swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(default_level: str | None = None) -> logging.Logger:
    """Set up the "deepinfer" logger; cheap, and safe to call again (the engine calls it).

    The level is DEEPINFER_LOG_LEVEL when set, else default_level when given (the CLI passes
    INFO), else WARNING at the first call and left as it is afterwards. Reads the environment
    (deepinfer.envs) at each call; ValueError when a DEEPINFER_* variable has a bad value."""
    logger = logging.getLogger(LOGGER_NAME)
    env = envs.read()
    if not env.configure_logging:
        return logger
    first = not any(isinstance(h, _StderrHandler) for h in logger.handlers)
    if first:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    name = env.log_level or default_level
    level = None if name is None else int(getattr(logging, name))
    if level is None and first and logger.level == logging.NOTSET:
        level = logging.WARNING  # the library's quiet default; a level the application set stays
    if level is not None:
        logger.setLevel(level)
    return logger


def progress_bar(use_tqdm: bool | Callable[..., Any], total: int, desc: str) -> Any:
    """generate()'s progress bar, as vLLM's use_tqdm reads: True = a tqdm bar, False = none (a
    disabled bar), a callable = the bar it returns for (total=..., desc=..., dynamic_ncols=True),
    e.g. a tqdm subclass or functools.partial(tqdm, file=...). TypeError for anything else."""
    from tqdm.auto import tqdm

    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, dynamic_ncols=True)
    if not isinstance(use_tqdm, bool):
        raise TypeError(
            f"use_tqdm must be a bool or a callable that makes a tqdm bar, got {type(use_tqdm).__name__}"
        )
    return tqdm(total=total, desc=desc, disable=not use_tqdm, dynamic_ncols=True)


class TokenRates:
    """A generate() bar's postfix as vLLM's: "est. speed input: X toks/s, output: Y toks/s", the
    prompt and output tokens of the finished requests over the bar's elapsed time. done(seqs)
    counts finished sequences (prompt tokens once per request: its first completion) and
    updates the bar by one per sequence."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.input_tokens = 0
        self.output_tokens = 0

    def done(self, seqs: list[Any]) -> None:
        for seq in seqs:
            self.input_tokens += seq.num_prompt_tokens if seq.index == 0 else 0
            self.output_tokens += seq.num_output_tokens
        elapsed = getattr(self.bar, "format_dict", {}).get("elapsed") or 0.0
        if elapsed > 0:
            self.bar.postfix = (
                f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                f"output: {self.output_tokens / elapsed:.2f} toks/s"
            )
        self.bar.update(len(seqs))

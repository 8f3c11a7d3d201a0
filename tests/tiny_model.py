"""The random-weight tiny model the engine tests run on.

`TINY` is a directory holding the checkpoint model/tiny/make_tiny.py builds (fixed seed: the same
weights and tokenizer every time), written once per test process into a temporary directory and
removed at exit. Tests use it instead of model/tiny, which ships a trained model that may be
retrained or replaced without touching any test.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path

MAKE_TINY = Path(__file__).resolve().parents[1] / "model" / "tiny" / "make_tiny.py"


def build_random_tiny() -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny", MAKE_TINY)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {MAKE_TINY}")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    out = Path(tempfile.mkdtemp(prefix="deepinfer-tiny-")) / "tiny"
    atexit.register(shutil.rmtree, out.parent, ignore_errors=True)
    make_tiny.build(out)
    return out


TINY = build_random_tiny()

"""Model ids: a checkpoint directory, or a Hugging Face repo id found in the local hub cache.

deepinfer runs offline: a repo id (e.g. "deepseek-ai/DeepSeek-V2-Lite") resolves to its
snapshot in the hub cache (huggingface_hub's layout, `models--ORG--NAME/snapshots/COMMIT`), and
is never downloaded. The cache is the one huggingface_hub uses: HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub (read at each call, so a changed environment counts).

Every file deepinfer opens in a checkpoint directory goes through checkpoint_file: a relative
name without "..", whose resolved path stays inside the directory (symlinks resolved). A
directory inside the hub cache may hold symlinks into the cache (the hub's snapshots link
their files to ../../blobs): those resolve against the hub cache root instead.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# the repository's model/ folder: architecture configs (model/NAME/config.json), the tiny checkpoint
REPO_MODEL_DIR = Path(__file__).resolve().parents[2] / "model"
# huggingface_hub's repo id rule: NAMESPACE/NAME, letters, digits, "-", "_", "." (no "--", "..").
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory huggingface_hub would use now."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


class CheckpointPathError(ValueError):
    """A checkpoint file name that leads outside the checkpoint directory."""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def checkpoint_file(root: str | Path, name: str, what: str = "") -> Path:
    """root / name, after checking that it stays inside the checkpoint directory `root` once
    every symlink is resolved (inside the hub cache, for a directory in the hub cache).
    CheckpointPathError naming the file (and `what` names it: e.g. "the index lists") otherwise.
    The path returned is root / name (not resolved), so messages show the checkpoint's names."""
    root = Path(root)
    who = f"{what} " if what else ""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointPathError(f"{who}{name!r}: not a file name inside checkpoint {root}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointPathError(
            f"{who}{name!r}, a path outside checkpoint {root}: checkpoint files must be named relative "
            "to the checkpoint directory, without '..'"
        )
    path = root / rel
    real_root = root.resolve()
    real = path.resolve()
    if _inside(real, real_root):
        return path
    cache = hub_cache_dir().resolve()
    if _inside(real_root, cache) and _inside(real, cache):
        return path  # a hub snapshot's link into the cache's blobs
    raise CheckpointPathError(
        f"{who}{name!r} in checkpoint {root} is a symlink to {real}, outside the checkpoint directory"
        + (" and the hub cache" if _inside(real_root, cache) else "")
        + "; deepinfer reads nothing outside it"
    )


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and "--" not in name and ".." not in name


def resolve_model_dir(name: str, revision: str | None = None, what: str = "model") -> Path:
    """The directory `name` stands for: itself if it is a directory, else the cached snapshot of
    the hub repo `name` at `revision` (default: main). FileNotFoundError naming the id and the
    cache when it is neither; NotADirectoryError for a file."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(
            f"{what} {name!r} is a file; expected a checkpoint directory or a hub repo id"
        )
    if not is_repo_id(name):
        raise FileNotFoundError(f"{what} directory {name!r} does not exist")
    cache = hub_cache_dir()
    at = f" at revision {revision!r}" if revision else ""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # a dependency of transformers, so normally installed
        raise FileNotFoundError(
            f"{what} directory {name!r} does not exist, and huggingface_hub is not installed to look "
            "the name up as a hub repo id"
        ) from exc
    try:
        snapshot = snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=True)
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError, HFValidationError, ...
        raise FileNotFoundError(
            f"{what} directory {name!r} does not exist, and the Hugging Face repo {name!r}{at} is not in "
            f"the hub cache {cache} (deepinfer runs offline and never downloads: fetch it first, e.g. "
            f"`hf download {name}`, or point HF_HOME / HF_HUB_CACHE at the cache that holds it)"
        ) from exc
    resolved = Path(str(snapshot))
    logger.info("%s %s%s: the hub cache's snapshot %s", what, name, at, resolved)
    return resolved

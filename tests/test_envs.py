"""deepinfer.envs: the one table of DEEPINFER_* switches agrees with the code and with
docs/environment.md, and its values parse as documented."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from deepinfer import envs

ROOT = Path(__file__).resolve().parents[1]
# code: every file that can read or set a switch (recorded results and patches are not code)
CODE_DIRS = ("deepinfer", "backends", "bench", "tests", "train", "ci")
CODE_SUFFIXES = (".py", ".sh", ".toml", ".yml", ".yaml")
NAME = re.compile(r"DEEPINFER_[A-Z0-9_]*[A-Z0-9]")


def _code_files() -> list[Path]:
    files = [ROOT / "pyproject.toml"]
    for top in CODE_DIRS:
        files += [
            p
            for p in (ROOT / top).rglob("*")
            if p.suffix in CODE_SUFFIXES and "results" not in p.parts and p.is_file()
        ]
    return files


def test_every_name_in_the_code_is_in_the_table() -> None:
    found: dict[str, str] = {}
    for path in _code_files():
        for name in NAME.findall(path.read_text(errors="ignore")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: where for n, where in found.items() if n not in envs.BY_NAME}
    assert not unknown, f"DEEPINFER_* names missing from deepinfer/envs.py: {unknown}"


def test_every_switch_is_read_through_its_field() -> None:
    """Each table entry's Env field is read (`env.<field>` or `read().<field>`) somewhere outside
    the table (and this test)."""
    own = {ROOT / "deepinfer" / "envs.py", Path(__file__).resolve()}
    text = "\n".join(p.read_text(errors="ignore") for p in _code_files() if p not in own)
    unread = [s.name for s in envs.SWITCHES if not re.search(rf"(\benv|read\(\))\.{s.attr}\b", text)]
    assert not unread, f"switches in the table that nothing reads: {unread}"


def test_only_the_table_spells_a_name_as_a_string() -> None:
    """deepinfer and the backends read switches through deepinfer.envs, never os.environ."""
    quoted = re.compile(r"[\"']DEEPINFER_[A-Z0-9_]+")
    bad = [
        str(p.relative_to(ROOT))
        for top in ("deepinfer", "backends")
        for p in (ROOT / top).rglob("*.py")
        if p != ROOT / "deepinfer" / "envs.py" and quoted.search(p.read_text())
    ]
    assert not bad, f"read these switches through deepinfer.envs: {bad}"


def test_the_page_is_the_table() -> None:
    page = (ROOT / "docs" / "environment.md").read_text()
    assert page == envs.markdown(), "regenerate it: python -m deepinfer.envs > docs/environment.md"


def test_the_snapshot_holds_every_switch_and_the_defaults() -> None:
    assert [f.name for f in fields(envs.Env)] == [s.attr for s in envs.SWITCHES]
    assert len(envs.BY_NAME) == len(envs.SWITCHES)
    assert all(s.name.startswith("DEEPINFER_") and s.meaning for s in envs.SWITCHES)
    for s in envs.SWITCHES:
        assert getattr(envs.DEFAULTS, s.attr) == s.default
        assert getattr(envs.read({s.name: ""}), s.attr) == s.default, "empty is the default"


def test_values_parse_or_name_the_variable() -> None:
    env = envs.read(
        {
            "DEEPINFER_CUDA_PDL": "0",
            "DEEPINFER_CUDA_UNFUSED": "yes",
            "DEEPINFER_LOG_LEVEL": " info",
            "DEEPINFER_MODEL_UNFUSED": "all",
            "DEEPINFER_CUDA_INVARIANT_TILE": "16,64,128,4,3",
            "DEEPINFER_NPU_SIM_SOC": "260",
            "DEEPINFER_TEST_SUBPROCESS_TIMEOUT": "5",
        }
    )
    assert not env.cuda_pdl and env.cuda_unfused and env.log_level == "INFO"
    assert env.model_unfused == frozenset(envs.MODEL_FUSIONS)
    assert env.cuda_invariant_tile == (16, 64, 128, 4, 3)
    assert env.simulated_soc == 260 and env.test_subprocess_timeout == 5.0
    cases = {
        "DEEPINFER_CUDA_SKINNY": ("maybe", "expected 1 or 0"),
        "DEEPINFER_LOG_LEVEL": ("LOUD", "is not a log level; choose one of DEBUG"),
        "DEEPINFER_MODEL_UNFUSED": ("qkv", "unknown qkv; name any of qkv_a, shared_experts"),
        "DEEPINFER_CUDA_INVARIANT_TILE": ("16,64", "expected BM,BN,BK,WARPS,STAGES"),
        "DEEPINFER_NPU_SIM_SOC": ("A2", "expected an int"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}") + ".*" + re.escape(message)):
            envs.read({name: value})

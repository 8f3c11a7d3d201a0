"""docs/porting.md stays true: its counts (parts, ops, required ops, cases) are computed from the
contract and the suite, its defaults table names every optional op, and its rename commands
leave no trace of the template in a copy of docs/template-backend. (The verdict line it shows is
the template's own: tests/test_template_backend.py compares it with a real run.)"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from deepinfer.backend import ops

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "porting.md").read_text()
NUMBERS = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def section(number: int) -> str:
    return DOC.split(f"\n## {number}. ", 1)[1].split("\n## ", 1)[0]


def is_op(attribute: object) -> bool:
    """A method, or an abstract property (CollectiveOps.dist_backend)."""
    return inspect.isfunction(attribute) or (
        isinstance(attribute, property) and getattr(attribute, "__isabstractmethod__", False)
    )


def contract() -> dict[str, tuple[type, list[str]]]:
    """part name -> (its class, the names of its ops: the public methods)."""
    out = {}
    for f in fields(ops.Backend):
        cls = ops._PART_TYPES.get(f.name)
        if cls is None:
            continue
        names = [n for n in dir(cls) if not n.startswith("_") and is_op(inspect.getattr_static(cls, n))]
        out[f.name] = (cls, names)
    return out


def required() -> set[str]:
    return {
        f"{cls.__name__}.{n}"
        for cls, names in contract().values()
        for n in names
        if getattr(getattr(cls, n), "__isabstractmethod__", False)
    }


def test_part_and_op_counts() -> None:
    parts = contract()
    word = NUMBERS[len(parts)]
    text = section(3)
    assert text.startswith(f"The contract: {word} parts"), text[:80]
    assert f"and {word} parts: " + ", ".join(f"`{p}`" for p in parts) in " ".join(text.split())
    total = sum(len(names) for _, names in parts.values())
    need = len(required())
    assert f"of the contract's\n{total} ops, {need} are required and {total - need} optional" in text


def test_required_ops_are_the_abstract_ones() -> None:
    line = " ".join(section(3).split("Required (abstract): ", 1)[1].split(". Everything else")[0].split())
    named = set()
    for group in line.split("; "):
        first, *rest = re.findall(r"`([A-Za-z_.]+)`", group)
        cls, op = first.split(".")
        named |= {f"{cls}.{op}", *(f"{cls}.{r}" for r in rest)}
    assert named == required()


def test_defaults_table_names_every_optional_op() -> None:
    """Each row's first cell: `part.op`, then bare `op`s of the same part (`part.*`: all)."""
    named: set[tuple[str, str]] = set()
    for row in section(3).splitlines():
        if not row.startswith("| `"):
            continue
        part = None
        for name in re.findall(r"`([a-z0-9_.*]+)`", row.split("|")[1]):
            if "." in name:
                part, name = name.split(".", 1)
            if part is not None:
                named.add((part, name))
    missing = [
        f"{part}.{n}"
        for part, (cls, names) in contract().items()
        for n in names
        if f"{cls.__name__}.{n}" not in required() and (part, n) not in named and (part, "*") not in named
    ]
    assert not missing, f"optional ops missing from the defaults table of docs/porting.md: {missing}"


def test_case_counts(tmp_path: Path) -> None:
    """The number of cases the suite collects, and of heavy ones, as section 7 states them."""
    (tmp_path / "count_cases.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    heavy = sum(1 for item in session.items if 'heavy' in item.keywords)\n"
        "    print(f'CASES {len(session.items)} HEAVY {heavy}')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "deepinfer.testing.plugin"]
    cmd += ["-p", "count_cases", "--pyargs", "deepinfer.testing.conformance", "--collect-only", "-q"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r"CASES (\d+) HEAVY (\d+)", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    cases, heavy = int(found[1]), int(found[2])
    assert f"The suite collects {cases:,} cases (`--collect-only`; {heavy} of them heavy)" in section(7)


def rename_commands(text: str) -> list[str]:
    block = text.split("```\n", 2)[1]
    return [line.split("  #")[0] for line in block.splitlines() if line.startswith(("mv ", "grep -rl"))]


def test_template_renames_leave_no_template(tmp_path: Path) -> None:
    """The rename commands of section 1 (the same as the template's README), run as written on a
    copy of the template: no file or path says template, and the renamed package registers and
    creates the backend `mydev`."""
    commands = rename_commands(section(1))
    assert len(commands) == 2, commands
    assert rename_commands((ROOT / "docs" / "template-backend" / "README.md").read_text()) == commands
    copy = tmp_path / "deepinfer-mydev"
    shutil.copytree(
        ROOT / "docs" / "template-backend",
        copy,
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
    )
    for command in commands:
        subprocess.run(["bash", "-c", command], cwd=copy, check=True, timeout=60)
    left = [
        str(p.relative_to(copy)) for p in copy.rglob("*") if "template" in str(p.relative_to(copy)).lower()
    ]
    left += [
        f"{p.relative_to(copy)}:{i + 1}"
        for p in copy.rglob("*")
        if p.is_file()
        for i, line in enumerate(p.read_text().splitlines())
        if "template" in line.lower()
    ]
    assert not left, f"the renames leave 'template' in: {left}"
    pyproject = (copy / "pyproject.toml").read_text()
    assert 'name = "deepinfer-mydev"' in pyproject and 'mydev = "deepinfer_mydev.plugin"' in pyproject
    code = (
        "from deepinfer.testing.helpers import registry_with\n"
        "from deepinfer_mydev.backend import MydevAttention\n"
        "b = registry_with(['deepinfer_mydev.plugin']).create('mydev')\n"
        "print(b.name, type(b.attention) is MydevAttention)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(copy), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["mydev", "True"], proc.stdout + proc.stderr

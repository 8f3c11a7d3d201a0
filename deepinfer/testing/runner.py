"""`deepinfer conformance --backend NAME [pytest args]`: run the shipped suite with pytest."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

SUITE = "deepinfer.testing.conformance"
PLUGIN = "deepinfer.testing.plugin"


def pytest_args(backend: str, extra: list[str], heavy: bool = False) -> list[str]:
    """The pytest command line that runs the conformance suite against `backend`."""
    args = ["-p", PLUGIN, "--pyargs", SUITE, "--deepinfer-backend", backend]
    if heavy:
        args.append("--deepinfer-heavy")
    # keep runs from a source checkout free of the checkout's own pytest configuration
    return [*args, "-p", "no:cacheprovider", *extra]


def run_conformance(backend: str, extra: list[str] | None = None, heavy: bool = False) -> int:
    """Run the suite in this process; returns pytest's exit code."""
    if importlib.util.find_spec("pytest") is None:
        raise SystemExit(
            "deepinfer conformance needs pytest: pip install 'deepinfer[test]' (or pip install pytest)"
        )
    import pytest

    return int(pytest.main(pytest_args(backend, list(extra or []), heavy)))


def _cmd_conformance(args: argparse.Namespace) -> int:
    from deepinfer.backend.registry import BackendRegistry, UnknownBackendError

    try:  # a name no plugin registers: one line, before pytest collects every case against it
        BackendRegistry.discover().info(args.backend)
    except UnknownBackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_conformance(args.backend, list(args.pytest_args), args.heavy)


class _PassThroughParser(argparse.ArgumentParser):
    """Keeps the arguments it does not know, in order, for pytest (instead of rejecting them)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        ns.pytest_args = [*getattr(ns, "pytest_args", []), *extra]
        return ns, []


def add_conformance_parser(subparsers: Any) -> None:
    """Register `deepinfer conformance` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "conformance",
        help="run the backend conformance suite (pytest) against one backend",
        description="Compare every op of a backend with the float64 reference. Arguments after the "
        "options go to pytest (e.g. -x -q -k attention).",
        allow_abbrev=False,
    )
    p.__class__ = _PassThroughParser  # argparse builds subparsers itself; unknown args go to pytest
    p.add_argument(
        "--backend", required=True, help="name of the backend under test (see `deepinfer backends`)"
    )
    p.add_argument("--heavy", action="store_true", help="also run the heavy (larger) cases")
    p.set_defaults(func=_cmd_conformance, pytest_args=[])

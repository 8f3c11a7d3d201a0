"""The `deepinfer` command line (also `python -m deepinfer`).

deepinfer backends                      list discovered backends and which one would be chosen
deepinfer conformance --backend NAME    run the backend conformance suite
deepinfer generate --prompt TEXT        generate with the shipped tiny model (or --model DIR)
deepinfer run-batch -i IN -o OUT        serve a file of OpenAI batch requests (vLLM's run-batch)
deepinfer bench ...                     offline throughput benchmark
deepinfer --version

Logs go to stderr at INFO (the backend and why, the weights' load time, the KV-cache size);
DEEPINFER_LOG_LEVEL=WARNING (or DEBUG, ...) changes that.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def cmd_backends(args: argparse.Namespace) -> int:
    from deepinfer.backend.registry import BackendError, BackendRegistry

    registry = BackendRegistry.discover()
    rows = [("name", "version", "priority", "available", "selection", "reason")]
    for entry in registry.entries():
        info, avail = entry.info, entry.availability
        available = "yes" if avail.available else "no"
        rows.append((info.name, info.version, str(info.priority), available, info.selection, avail.reason))
    for plugin, error in sorted(registry.load_errors.items()):
        rows.append((plugin, "?", "-", "no", "-", f"plugin failed to load: {error}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    try:
        chosen = registry.select(args.backend).name
        print(f"\nselected: {chosen}")
    except BackendError as exc:
        print(f"\nselected: none ({exc})")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"deepinfer {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list discovered backends and the one that would be selected")
    p.add_argument("--backend", default=None, help="show what selecting this name gives (default: auto)")
    p.set_defaults(func=cmd_backends)

    from deepinfer.entrypoints.bench import add_bench_parser
    from deepinfer.entrypoints.generate import add_generate_parser
    from deepinfer.entrypoints.run_batch import add_run_batch_parser
    from deepinfer.testing.runner import add_conformance_parser

    add_conformance_parser(sub)
    add_generate_parser(sub)
    add_run_batch_parser(sub)
    add_bench_parser(sub)
    return parser


def version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("deepinfer")
    except PackageNotFoundError:
        from deepinfer import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    from deepinfer.log import configure_logging

    args = build_parser().parse_args(argv)
    try:
        configure_logging("INFO")
    except ValueError as exc:  # a DEEPINFER_LOG_LEVEL that names no level
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The `deepinfer` console script's target (pyproject.toml [project.scripts]); the command line
itself is deepinfer.entrypoints.cli. Kept here so that installed scripts keep their entry point."""

from deepinfer.entrypoints.cli import main

__all__ = ["main"]

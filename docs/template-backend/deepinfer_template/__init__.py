"""A deepinfer backend template (see docs/porting.md). Importing it imports no vendor library."""

__version__ = "0.1.0"

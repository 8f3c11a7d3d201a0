"""deepinfer: offline inference for DeepSeek-architecture models on any accelerator with a backend."""

__version__ = "0.1.0"

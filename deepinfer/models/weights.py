"""What the models load their weights from: a WeightSource, asked for each tensor by name.

Every module's `load(source, prefix, ...)` reads its own tensors through this interface, so the
models never import what implements it. Implementations:
  deepinfer.models.loader.CheckpointReader   a safetensors checkpoint on disk (checks names,
                                              shapes, dtypes and values as it reads)
  deepinfer.testing.weights.RandomSource     made-up tensors, seeded (tests, benchmarks)

Names are DeepSeek's published ones (transformers' for V4 where the checkpoint uses them);
shapes are the model's, (N, K) for a linear layer's weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class WeightSource(Protocol):
    """Tensor-by-tensor access to a model's weights, each moved to `device` as it is read."""

    @property
    def device(self) -> torch.device:
        """Where the tensors land (modules allocate buffers they fill in place there too)."""
        ...

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The dtype FP8 weights come in (float8_e4m3fn)."""
        ...

    @property
    def fp8_block(self) -> int:
        """The block of the FP8 linears' scales `linear` returns: 128 (128 x 128 blocks, DeepSeek-V3 /
        V4) or 32 (DeepSeek-V4.1); the checkpoint's quantization_config weight_block_size."""
        ...

    @property
    def unfused(self) -> frozenset[str]:
        """The model-level fusions this load leaves out (layers.fusion_enabled; load_model reads
        them from DEEPINFER_MODEL_UNFUSED)."""
        ...

    @property
    def location(self) -> Mapping[str, str]:
        """Every tensor name the source holds -> where it is stored (a file name, for messages).
        A source that makes tensors up on demand holds none: optional parts (MTP layers) are
        then found through `has`."""
        ...

    def has(self, name: str) -> bool:
        """Whether tensor `name` exists (optional tensors: biases, scales, MTP layers)."""
        ...

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """Tensor `name` of `shape`, cast to `dtype` (None: as stored)."""
        ...

    def get_ids(self, name: str, shape: tuple[int, ...], upper: int) -> torch.Tensor:
        """Integer table `name` (hash routing's token -> expert ids), values in [0, upper), int64."""
        ...

    def linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype, fp4: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Linear layer `prefix`'s weight (N, K) as stored: (weight in dtype, None), FP8 (e4m3,
        float32 scales per fp8_block x fp8_block block), or, where `fp4` allows it (routed
        experts), packed MXFP4 (uint8 (N, K/2), UE8M0 scales (N, K/32))."""
        ...

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Linear layer `prefix`'s weight (N, K) in `dtype` (FP8 dequantised)."""
        ...

    def fp8_rows(self, prefix: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Table `prefix`.weight (R, Dh) stored as FP8 rows (DeepSeek-V4.1's Engram tables): e4m3
        values with a `prefix`.scale (R, Dh / 32) of UE8M0 bytes, one per 32 values of a row ->
        (e4m3 (R, Dh), uint8 (R, Dh / 32)); None when the table is stored as floats (no scale)."""
        ...

    def skip(self, name: str) -> None:
        """Mark tensor `name` as known but unused (e.g. an MTP layer's copy of the embedding)."""
        ...

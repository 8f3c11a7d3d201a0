"""Building blocks over the backend contract: RMSNorm, Linear (float or FP8 block-scaled), the gated MLP.

Weights are buffers filled by the loader (`load` methods take a WeightSource and the tensor
name prefix DeepSeek publishes); until then they live on the meta device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.backend.fp8 import FP8_BLOCK
from deepinfer.backend.ops import Backend
from deepinfer.envs import MODEL_FUSIONS

if TYPE_CHECKING:
    from deepinfer.models.weights import WeightSource


def fusion_enabled(name: str, unfused: frozenset[str]) -> bool:
    """Whether the model-level fusion `name` (one of envs.MODEL_FUSIONS) is on, given the fusions
    a load leaves out (CheckpointReader.unfused: DEEPINFER_MODEL_UNFUSED, read by load_model, so
    that benchmarks measure what each buys)."""
    assert name in MODEL_FUSIONS, name
    return name not in unfused


def _placeholder() -> torch.Tensor:
    return torch.empty(0, device="meta")


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (backend.small.rms_norm); `add` fuses the residual add before it
    (backend.small.add_rms_norm)."""

    def __init__(self, backend: Backend, dim: int, eps: float) -> None:
        super().__init__()
        self.backend, self.dim, self.eps = backend, dim, eps
        self.register_buffer("weight", _placeholder())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.small.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        return self.backend.small.add_rms_norm(x, residual, self.weight, self.eps)

    def load(self, reader: WeightSource, name: str, dtype: torch.dtype) -> None:
        self.weight = reader.get(name, (self.dim,), dtype)


class Linear(nn.Module):
    """y = x W^T (no bias: DeepSeek has none). FP8 checkpoints keep W in e4m3 with one float32
    `weight_scale_inv` per block x block (128 x 128; DeepSeek-V4.1: 32 x 32), multiplied in by
    backend.gemm.linear_fp8, which quantises x per token per `block` channels."""

    def __init__(self, backend: Backend, in_features: int, out_features: int) -> None:
        super().__init__()
        self.backend, self.in_features, self.out_features = backend, in_features, out_features
        self.block = FP8_BLOCK  # the FP8 scale block, the reader's (WeightSource.fp8_block)
        self.register_buffer("weight", _placeholder())  # (N, K)
        self.register_buffer("weight_scale_inv", None)  # (ceil(N/b), ceil(K/b)) float32 or None

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            return self.backend.gemm.linear_fp8(x, self.weight, self.weight_scale_inv, block=self.block)
        return self.backend.gemm.linear(x, self.weight)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.weight, self.weight_scale_inv = reader.linear(
            prefix, (self.out_features, self.in_features), dtype
        )
        self.block = reader.fp8_block


def concat_linears(backend: Backend, parts: list[Linear]) -> Linear | None:
    """One Linear for projections that read the same input: x [W_0; W_1; ...]^T = [y_0 | y_1 | ...]
    along the output dimension, one GEMM instead of len(parts). The parts' weights (and scales)
    become views into it, so the weights are held once. None where the parts do not concatenate
    exactly: FP8 mixed with floating point, or an FP8 part other than the last whose rows are not
    a multiple of the 128-row scale block (its last scale row would also cover the next part)."""
    fp8, block = [p.is_fp8 for p in parts], parts[0].block
    if any(fp8) != all(fp8) or (all(fp8) and any(p.out_features % block for p in parts[:-1])):
        return None
    if any(p.block != block for p in parts):
        return None
    fused = Linear(backend, parts[0].in_features, sum(p.out_features for p in parts))
    fused.block = block
    rows = [p.out_features for p in parts]
    if all(fp8):  # e4m3 has no torch.cat kernel on every device: concatenate the bytes
        fused.weight = torch.cat([p.weight.view(torch.uint8) for p in parts]).view(parts[0].weight.dtype)
        scales = torch.cat([p.weight_scale_inv for p in parts if p.weight_scale_inv is not None])
        fused.weight_scale_inv = scales
        for p, s in zip(parts, torch.split(scales, [-(-n // block) for n in rows])):
            p.weight_scale_inv = s
    else:
        fused.weight = torch.cat([p.weight for p in parts])
    for p, w in zip(parts, torch.split(fused.weight, rows)):
        p.weight = w
    return fused


def _pad_rows_fp8(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad an e4m3 (N, K) weight to `rows` rows (through a uint8 view: byte 0 is +0.0)."""
    out = torch.zeros((rows, w.shape[1]), dtype=torch.uint8, device=w.device)
    out[: w.shape[0]] = w.view(torch.uint8)
    return out.view(w.dtype)


def _pad_cols_fp8(w: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.zeros((w.shape[0], cols), dtype=torch.uint8, device=w.device)
    out[:, : w.shape[1]] = w.view(torch.uint8)
    return out.view(w.dtype)


def padded_intermediate(inter: int, fp8: bool, block: int = FP8_BLOCK) -> int:
    """Width of the fused [gate | up] halves. FP8 block scales cover `block` rows each (128; V4.1:
    32), so gate and up are fused only along block boundaries: each half is zero-padded to a
    multiple of the block (exact: silu(0) * 0 = 0, and down_proj's padded input columns are
    zero). Published sizes need no padding."""
    return -(-inter // block) * block if fp8 else inter


def fuse_gate_up(
    gate: tuple[torch.Tensor, torch.Tensor | None],
    up: tuple[torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor | None],
    block: int = FP8_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(w13 (2I', Dm), s13, w2 (Dm, I'), s2) from gate/up (I, Dm) and down (Dm, I) with their
    scales of `block` x `block` blocks."""
    (g, gs), (u, us), (d, ds) = gate, up, down
    if gs is None or us is None or ds is None:
        if gs is not None or us is not None or ds is not None:
            raise ValueError("gate_proj, up_proj and down_proj must all be FP8 or all be floating point")
        return torch.cat([g, u]), None, d, None
    inter = padded_intermediate(g.shape[0], True, block)
    w13 = torch.cat([_pad_rows_fp8(g, inter).view(torch.uint8), _pad_rows_fp8(u, inter).view(torch.uint8)])
    return w13.view(g.dtype), torch.cat([gs, us]), _pad_cols_fp8(d, inter), ds


class MLP(nn.Module):
    """Gated SiLU MLP: down(silu(gate x) * up x), with gate and up fused into one GEMM."""

    def __init__(self, backend: Backend, hidden: int, inter: int) -> None:
        super().__init__()
        self.backend, self.hidden, self.inter = backend, hidden, inter
        self.gate_up = Linear(backend, hidden, 2 * inter)
        self.down = Linear(backend, inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down(
            self.backend.small.silu_and_mul(self.gate_up(x))
        )  # (T, 2I) -> (T, I) -> (T, Dm)
        return y

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        shape_in, shape_out = (self.inter, self.hidden), (self.hidden, self.inter)
        gate = reader.linear(f"{prefix}.gate_proj", shape_in, dtype)
        up = reader.linear(f"{prefix}.up_proj", shape_in, dtype)
        down = reader.linear(f"{prefix}.down_proj", shape_out, dtype)
        w13, s13, w2, s2 = fuse_gate_up(gate, up, down)
        self.gate_up.weight, self.gate_up.weight_scale_inv = w13, s13
        self.down.weight, self.down.weight_scale_inv = w2, s2

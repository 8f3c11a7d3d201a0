"""The one random-weight generator: a WeightSource (deepinfer.models.weights) that makes up every
tensor a model asks for, seeded, by the tensor's role.

Every random model and checkpoint is drawn here:
  deepinfer.testing.checkpoints   random_state_dict (V2 / V3 checkpoints: CHECKPOINT_INIT, drawn
                                  name by name) and write_random_v4_checkpoint (V4: V4_INIT,
                                  recorded while the model loads itself from the source)
  deepinfer.testing.random_model  random_model, the benchmarks' models of a config.json alone
                                  (BENCH_INIT, on the device, FP8 / MXFP4 as published)

The presets keep the values each of those drew before they shared this generator (tests and
recorded benchmarks depend on them): one seed gives the same tensors.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from deepinfer import envs
from deepinfer.backend.fp4 import E8M0_BIAS
from deepinfer.backend.fp4 import scale_shape as fp4_scale_shape
from deepinfer.backend.fp8 import FP8_BLOCK, FP8_DTYPE
from deepinfer.models.deepseek_v4 import stored_in_fp8

# RMS of uniformly drawn e2m1 codes, sqrt(mean(e2m1^2)), before their power-of-two scale
_E2M1_RMS = 2.93


@dataclass(frozen=True)
class WeightInit:
    """How each kind of tensor is drawn, x ~ N(0, 1) elementwise; the first rule that matches:

    norm      `*norm.weight`: 1 + norm * x (None: ones, nothing drawn)
    bias      `*correction_bias` (the router's): bias * x (None: zeros, nothing drawn)
    embed     `*embed*`: x
    vector    other 1-D tensors (V4's sinks, router biases, mixing parameters): vector * x
    matrix    other tensors: matrix * x (None: x * gain / sqrt(fan_in), fan_in = shape[1], gain
              gate_gain for router gates `*mlp.gate.weight`, else 1: logits O(1))
    distinct_ids  integer tables (V4's hash routing): distinct ids in each row (a randperm per
              row, as a checkpoint holds them), else uniform draws (fast for a vocabulary of rows)
    """

    norm: float | None
    bias: float | None
    vector: float
    matrix: float | None
    gate_gain: float = 1.0
    distinct_ids: bool = True


# V2 / V3 random checkpoints: norms 1 + N(0, 0.1^2), correction bias N(0, 0.1^2), matrices
# N(0, 1/fan_in), router gates N(0, 4/fan_in) (wider score gaps, fewer near-tied expert choices)
CHECKPOINT_INIT = WeightInit(norm=0.1, bias=0.1, vector=0.1, matrix=None, gate_gain=2.0)
# V4 random checkpoints: norms near 1, sinks / biases / mixing parameters O(0.5)
V4_INIT = WeightInit(norm=0.2, bias=0.5, vector=0.5, matrix=None)
# benchmarks' random models: norms ones, correction biases zeros, the rest N(0, 0.02^2)
BENCH_INIT = WeightInit(norm=None, bias=None, vector=0.02, matrix=0.02, distinct_ids=False)


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    init: WeightInit,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Tensor `name` of `shape`, drawn by `init`'s rule for it from `generator` (which lives on
    `device`), in `dtype`."""

    def draw() -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)

    if name.endswith("norm.weight"):
        if init.norm is None:
            return torch.ones(shape, dtype=dtype, device=device)
        return draw().mul_(init.norm).add_(1.0)
    if "correction_bias" in name:
        if init.bias is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return draw().mul_(init.bias)
    t = draw()
    if "embed" in name:
        return t
    if len(shape) == 1:
        return t.mul_(init.vector)
    if init.matrix is not None:
        return t.mul_(init.matrix)
    gain = init.gate_gain if name.endswith("mlp.gate.weight") else 1.0
    return t.mul_(gain).div_(shape[1] ** 0.5)


class RandomSource:
    """A WeightSource of random tensors drawn by random_tensor from one seeded generator, in the
    order the model asks for them.

    present: the optional tensors `has` reports (e.g. V4's MTP layers); record: keep every tensor
    drawn, float32 on the CPU, in `tensors` (to save as a checkpoint; drawn in float32, returned
    cast); fp8: linear layers a DeepSeek FP8 checkpoint quantises (fp8_linears, default
    deepseek_v4.stored_in_fp8) come as e4m3 N(0, 1) with scales of the init's matrix scale per
    fp8_block x fp8_block block; fp4_experts: routed experts
    (where the model allows MXFP4) come as uniform e2m1 codes with one power-of-two scale that
    gives them about that scale."""

    def __init__(
        self,
        init: WeightInit,
        seed: int = 0,
        device: torch.device | str = "cpu",
        present: Iterable[str] = (),
        record: bool = False,
        fp8: bool = False,
        fp4_experts: bool = False,
        fp8_block: int = FP8_BLOCK,
        fp8_linears: Callable[[str], bool] = stored_in_fp8,
        by_name: bool = False,
    ) -> None:
        if (fp8 or fp4_experts) and init.matrix is None:
            raise ValueError("quantised random weights need an init with a fixed matrix scale")
        self.init, self.device = init, torch.device(device)
        self.fp8_dtype, self.fp8_block = FP8_DTYPE, fp8_block
        self.location: dict[str, str] = {}  # made up on demand: none held
        self.present, self.record = set(present), record
        self.fp8, self.fp4_experts, self.fp8_linears = fp8, fp4_experts, fp8_linears
        self.unfused = envs.read().model_unfused  # as load_model reads DEEPINFER_MODEL_UNFUSED
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seed, self.by_name = seed, by_name
        self.tensors: dict[str, torch.Tensor] = {}

    def _gen(self, name: str) -> torch.Generator:
        """The generator tensor `name` is drawn from: the shared one, or with by_name one seeded
        by the seed and the name, so that a model loading only some tensors (an expert-parallel
        rank's experts) gets the values a whole model gets."""
        if not self.by_name:
            return self.generator
        return torch.Generator(device=self.device).manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode())
        )

    def has(self, name: str) -> bool:
        return name in self.present or (self.fp8 and name.endswith(".weight_scale_inv"))

    def skip(self, name: str) -> None:
        pass

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        dtype = dtype or torch.float32
        if not self.record:
            return random_tensor(name, shape, self.init, self._gen(name), dtype, self.device)
        t = random_tensor(name, shape, self.init, self._gen(name), torch.float32, self.device)
        self.tensors[name] = t
        return t.to(dtype)

    def get_ids(self, name: str, shape: tuple[int, ...], upper: int) -> torch.Tensor:
        gen, device = self._gen(name), self.device
        if self.init.distinct_ids:
            rows = [torch.randperm(upper, generator=gen, device=device)[: shape[1]] for _ in range(shape[0])]
            ids = torch.stack(rows)
        else:
            ids = torch.randint(upper, shape, generator=gen, device=device)
        if self.record:
            self.tensors[name] = ids
        return ids

    def linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype, fp4: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, k = shape
        std = self.init.matrix or 0.0
        if fp4 and self.fp4_experts:
            packed = torch.randint(256, (n, k // 2), generator=self._gen(prefix), device=self.device)
            exponent = E8M0_BIAS + round(math.log2(std / _E2M1_RMS))
            scale = torch.full(fp4_scale_shape(n, k), exponent, dtype=torch.uint8, device=self.device)
            return packed.to(torch.uint8), scale
        if not self.fp8 or not self.fp8_linears(prefix):
            return self.get(f"{prefix}.weight", shape, dtype), None
        # drawn in bfloat16, then cast: a float32 (N, K) would double the peak
        w = torch.randn(shape, generator=self._gen(prefix), device=self.device, dtype=torch.bfloat16)
        blocks = (-(-n // self.fp8_block), -(-k // self.fp8_block))
        return w.to(self.fp8_dtype), torch.full(blocks, std, dtype=torch.float32, device=self.device)

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return self.get(f"{prefix}.weight", shape, dtype)

    def fp8_rows(self, prefix: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP8 checkpoints (fp8): DeepSeek-V4.1's Engram tables as e4m3 N(0, 1) rows with unit
        scales (UE8M0 byte 127), rows of a multiple of 32 values (else ValueError); else None
        (the table comes through get)."""
        r, dh = shape
        if not self.fp8:
            return None
        if dh % 32:
            raise ValueError(f"{prefix}.weight: FP8 rows take one scale per 32 values; rows of {dh} do not")
        rows = torch.empty(shape, dtype=self.fp8_dtype, device=self.device)
        step = max(1, (1 << 28) // dh)  # drawn in bfloat16 a chunk at a time: V4.1-Flash's are ~1e11 values
        for i in range(0, r, step):
            n = min(step, r - i)
            chunk = torch.randn((n, dh), generator=self.generator, device=self.device, dtype=torch.bfloat16)
            rows[i : i + n] = chunk.to(self.fp8_dtype)
        scales = torch.full((r, dh // 32), E8M0_BIAS, dtype=torch.uint8, device=self.device)
        return rows, scales

"""Checkpoint loading: config.json + safetensors (sharded through model.safetensors.index.json, or one
model.safetensors), with DeepSeek's published tensor names. safetensors only: no pickle, no remote code.

Files are memory-mapped (safetensors' safe_open) and read one tensor at a time straight into the
model's buffers, so the checkpoint is never copied whole into host memory. FP8 checkpoints (e4m3
weights + float32 `weight_scale_inv` per 128x128 block) stay FP8 on backends that support it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.backend.ops import Backend
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.parallel.expert_parallel import ExpertParallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_DTYPE = torch.float8_e4m3fn


class CheckpointError(ValueError):
    """A checkpoint deepinfer cannot load, with what is wrong and where."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class Fp8NotSupportedError(CheckpointError):
    pass


def _block_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // 128), -(-shape[1] // 128))


class CheckpointReader:
    """Tensor-by-tensor access to a safetensors checkpoint; remembers which tensors were read.

    `get` / `linear` / `dense` check names and shapes and move each tensor to `device` as it is
    read. `unread()` lists what no module asked for (unexpected tensors).
    """

    def __init__(self, root: Path, device: torch.device, allow_fp8: bool, backend_name: str) -> None:
        self.root, self.device = root, device
        self.allow_fp8, self.backend_name = allow_fp8, backend_name
        self.fp8_dtype = FP8_DTYPE
        self.files = self._list_files()
        self._handles: dict[str, Any] = {}
        self.location: dict[str, str] = {}  # tensor name -> file name
        for name in self.files:
            for key in self._open(name).keys():  # noqa: SIM118 - safe_open is not iterable
                self.location[key] = name
        self._read: set[str] = set()

    def _list_files(self) -> list[str]:
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.root / f).is_file():
                    raise CheckpointError(f"{index} lists {f}, which is not in {self.root}")
            self.index_map: dict[str, str] = dict(weight_map)
            return files
        self.index_map = {}
        if (self.root / SINGLE_FILE).is_file():
            return [SINGLE_FILE]
        pickles = sorted(p.name for p in self.root.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
        raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.root}{hint}")

    def _open(self, name: str) -> Any:
        if name not in self._handles:
            try:
                self._handles[name] = safe_open(str(self.root / name), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpointError(
                    f"{self.root / name} is not a readable safetensors file (truncated or corrupt?): {exc}"
                ) from exc
        return self._handles[name]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ access

    def has(self, name: str) -> bool:
        return name in self.location

    def _file_hint(self, name: str) -> str:
        if name in self.index_map:
            return f"the index assigns it to {self.index_map[name]}, which does not hold it"
        return f"searched {', '.join(self.files)}"

    def _read_raw(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise MissingTensorError(
                f"missing tensor {name!r} in checkpoint {self.root} ({self._file_hint(name)})"
            )
        self._read.add(name)
        file = self.location[name]
        try:
            t: torch.Tensor = self._open(file).get_tensor(name)
            return t
        except SafetensorError as exc:
            raise CorruptCheckpointError(f"{self.root / file}: cannot read tensor {name!r}: {exc}") from exc

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.location[name]).get_slice(name).get_shape())

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        found = self.shape_of(name)
        if found != tuple(shape):
            raise ShapeMismatchError(
                f"tensor {name!r} in {self.location[name]}: expected shape {tuple(shape)}, found {found}"
            )

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """Tensor `name`, shape-checked, cast to `dtype` (None: keep) and moved to the device."""
        if name in self.location:
            self._check_shape(name, shape)
        t = self._read_raw(name)
        if t.dtype == FP8_DTYPE and dtype is not None and dtype != FP8_DTYPE:
            raise CheckpointError(
                f"tensor {name!r} in {self.location[name]} is FP8 but has no {name.rsplit('.', 1)[0]}"
                ".weight_scale_inv"
            )
        return t.to(device=self.device, dtype=dtype or t.dtype)

    def skip(self, name: str) -> None:
        """Mark a tensor as known but unused (e.g. the MTP layer's copies of shared weights)."""
        self._read.add(name)

    def linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`{prefix}.weight` (N, K): (weight in dtype, None), or (e4m3 weight, float32 block scales)
        when the checkpoint has `{prefix}.weight_scale_inv`."""
        scale_name = f"{prefix}.weight_scale_inv"
        if not self.has(scale_name):
            return self.get(f"{prefix}.weight", shape, dtype), None
        if not self.allow_fp8:
            raise Fp8NotSupportedError(
                f"{self.root} holds FP8 weights ({scale_name}) but backend {self.backend_name!r} does not "
                "support FP8 (capabilities.supports_fp8 is False); use a backend with FP8 GEMMs"
            )
        w = self.get(f"{prefix}.weight", shape, None)
        if w.dtype != FP8_DTYPE:
            raise CheckpointError(
                f"{prefix}.weight has a weight_scale_inv but dtype {w.dtype}, not float8_e4m3fn"
            )
        return w, self.get(scale_name, _block_scale_shape(shape), torch.float32)

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """`{prefix}.weight` in `dtype`; FP8 weights are dequantised (block * weight_scale_inv)."""
        w, s = self.linear(prefix, shape, dtype)
        if s is None:
            return w
        from deepinfer.reference.gemm import dequantize_weight

        return dequantize_weight(w, s).to(dtype)

    def unread(self) -> list[tuple[str, str]]:
        """(name, file) of every tensor no module read."""
        return sorted((n, f) for n, f in self.location.items() if n not in self._read)


def load_model(
    path: str | Path,
    backend: Backend,
    dtype: torch.dtype | None = None,
    expert_parallel: ExpertParallel | None = None,
) -> DeepseekForCausalLM:
    """Load a DeepSeek-V2 / V3 / R1 checkpoint directory onto `backend`.

    expert_parallel: read only this rank's routed experts (see deepinfer.models.moe).

    dtype: activation and floating-weight dtype; default: the checkpoint's torch_dtype (bfloat16
    for FP8 checkpoints). FP8 weights stay FP8 when backend.capabilities.supports_fp8.
    Raises ModelConfigError / CheckpointError subclasses naming the problem.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (expected a checkpoint directory with config.json)")
    if not (root / "config.json").is_file():
        raise ModelConfigError(f"no config.json in {root}")
    config = ModelConfig.from_file(root / "config.json")
    if config.quantization is not None and not backend.capabilities.supports_fp8:
        raise Fp8NotSupportedError(
            f"{root} is an FP8 checkpoint (e4m3, 128x128 block scales) but backend {backend.name!r} does "
            "not support FP8 (capabilities.supports_fp8 is False); use a backend with FP8 GEMMs"
        )
    if dtype is None:
        dtype = torch.bfloat16 if config.quantization is not None else config.torch_dtype
    if dtype not in backend.capabilities.dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in backend.capabilities.dtypes)
        raise ValueError(f"backend {backend.name!r} does not support dtype {dtype}; supported: {supported}")

    model = DeepseekForCausalLM(config, backend, dtype, expert_parallel)
    device = backend.device.device()
    with CheckpointReader(root, device, backend.capabilities.supports_fp8, backend.name) as reader:
        model.load_weights(reader)
        unread = reader.unread()
    if unread:
        shown = "; ".join(f"{n!r} in {f}" for n, f in unread[:10])
        more = f" (and {len(unread) - 10} more)" if len(unread) > 10 else ""
        raise UnexpectedTensorError(f"unexpected tensors in checkpoint {root}: {shown}{more}")
    return model.eval()

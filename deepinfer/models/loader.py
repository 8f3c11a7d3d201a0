"""Checkpoint loading: config.json + safetensors (sharded through model.safetensors.index.json, or one
model.safetensors), with DeepSeek's published tensor names. safetensors only: no pickle, no remote code.

Files are memory-mapped (safetensors' safe_open) and read one tensor at a time straight into the
model's buffers, so the checkpoint is never copied whole into host memory. FP8 checkpoints (e4m3
weights + a scale per 128x128 block: float32 `weight_scale_inv` in DeepSeek-V3's, UE8M0 bytes
`scale` in V4's) stay FP8 on backends that support it; DeepSeek-V4's MXFP4 routed experts stay
packed (deepinfer.backend.fp4).

Hostile checkpoints are refused with the tensor's name: a bool / integer / complex tensor where a
float weight belongs (always), and, in one pass over each weight as it lands on the device, NaN
or Inf values (also values a cast to the model dtype overflows, e.g. float32 -> float16), FP8
bytes that encode NaN (0x7F / 0xFF; e4m3fn has no Inf) and non-finite FP8 block scales.
The pass is one torch.aminmax per tensor on the device (NaN and Inf propagate to the min or the
max; no temporary tensor). Its cost, measured on the CPU (one thread, random weights, best of
7): 105 ms for one DeepSeek-V2-Lite MoE layer (model/deepseek-v2-lite shapes: 203 tensors,
585 M bf16 parameters, 1.09 GiB; 11 GB/s, less than copying the layer takes), 54 ms for
the same layer in e4m3 with its scales; within load_model of that layer with the embedding and
the head (1.0 B parameters) 0.33 s of a 1.4 s load. That is about 3 s per core for all of
V2-Lite's 15.7 B parameters. `load_model(check_weights=False)` or DEEPINFER_SKIP_WEIGHT_CHECK=1
skips the pass for weights you trust (the dtype checks stay: they cost nothing).

Hostile layouts are refused before a tensor is read, naming the file: a shard the index names by
an absolute path, through "..", or by a symlink out of the model directory (deepinfer.models.hub
.checkpoint_file; a hub snapshot's links into the hub cache are its own layout and load); an
index whose weight_map is not an object of tensor name -> file name; one tensor name in two
shards (the copy the index does not point at would be loaded without a word); a safetensors
header larger than MAX_HEADER_BYTES or than the file; sizes in config.json that disagree with the
tensors (num_attention_heads and the head dims, the LoRA ranks, the MLP widths, which layers are
MoE, num_hidden_layers, num_nextn_predict_layers), naming the field.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from deepinfer import envs
from deepinfer.backend.fp4 import E8M0_NAN, e8m0_to_float
from deepinfer.backend.fp4 import scale_shape as fp4_scale_shape
from deepinfer.backend.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_weight, weight_scale_shape
from deepinfer.backend.ops import Backend
from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.deepseek import DeepseekForCausalLM, DFlashDrafter
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.dflash import DIRECTORY as DFLASH_DIR
from deepinfer.models.dflash import has_dflash
from deepinfer.models.dflash import read_config as read_dflash_config
from deepinfer.models.drafter import has_drafter, load_drafter
from deepinfer.models.hub import checkpoint_file
from deepinfer.parallel.expert_parallel import ExpertParallel

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The largest safetensors header read: a shard's header lists its tensors (about 150 bytes
# each: DeepSeek-V3's largest shard holds a few hundred KB; all 91k tensors of V3 in one file
# about 14 MB). safetensors itself allows 100 MB, which it parses in full.
MAX_HEADER_BYTES = 32 * 2**20
# Floating dtypes a checkpoint may store a non-FP8 weight in (cast to the model dtype on load).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SKIP_CHECK_ENV = envs.SKIP_WEIGHT_CHECK.name
# A linear's scales, by DeepSeek's names: `weight_scale_inv` (V3; also transformers'), `scale` (V4)
SCALE_SUFFIXES = ("weight_scale_inv", "scale")
# safetensors dtypes of packed MXFP4 weights (two e2m1 values a byte; F4 counts values, not bytes)
PACKED_FP4 = ("I8", "U8", "F4")
# safetensors dtypes of UE8M0 scale bytes
E8M0_BYTES = ("F8_E8M0", "U8")
_SKIP_HINT = (
    f"(checked once at load; {SKIP_CHECK_ENV}=1 or load_model(..., check_weights=False) skips "
    "this check for weights you trust)"
)


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


class NonFiniteWeightError(CheckpointError):
    """A weight holds NaN or Inf (or FP8 NaN encodings)."""


def _index_of(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _all_finite(t: torch.Tensor) -> bool:
    """One pass: NaN and Inf propagate to aminmax's min or max."""
    if t.numel() == 0:
        return True
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):  # a device without aminmax for this dtype
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def _fp8_nan_mask(t: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_and(t.view(torch.uint8), 0x7F) == 0x7F  # S.1111.111: e4m3fn's NaN


def _has_fp8_nan(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    return int(torch.bitwise_and(t.view(torch.uint8), 0x7F).max()) == 0x7F


def _first_bad(t: torch.Tensor, bad: torch.Tensor) -> tuple[int, tuple[int, ...], str]:
    """(how many, index of the first, its value) for a bool mask `bad` of t's shape."""
    count = int(bad.sum())
    first = int(bad.flatten().nonzero()[0, 0])
    value = "NaN" if t.dtype == FP8_DTYPE else str(t.flatten()[first].item())
    return count, _index_of(first, tuple(t.shape)), value


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map, checked: an object of tensor name -> shard file name."""
    try:
        content = json.loads(index.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # Recursion: nested too deeply
        raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        got = type(weight_map).__name__ if isinstance(content, dict) and "weight_map" in content else "none"
        raise CorruptCheckpointError(
            f"{index}: 'weight_map' must be an object of tensor name -> shard file name, got {got}"
        )
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CorruptCheckpointError(
            f"{index}: weight_map[{bad[0]!r}] must be a shard file name (a string), got {bad[1]!r}"
        )
    return weight_map


def _check_header(path: Path) -> None:
    """Refuse a safetensors file whose header (8-byte little-endian length, then JSON) is
    larger than MAX_HEADER_BYTES or than the file, before safetensors parses it."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise CorruptCheckpointError(f"{path} cannot be read: {exc}") from exc
    if len(head) < 8:
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file: {size} bytes, no header")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file: its header claims {n / 1e6:.4g} MB, more than the "
            f"{MAX_HEADER_BYTES / 2**20:g} MiB any checkpoint shard needs (a header lists the tensors); "
            "the file is corrupt or hostile"
        )
    if 8 + n > size:
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): its header claims {n} "
            f"bytes but the file has {size}"
        )


class CheckpointReader:
    """Tensor-by-tensor access to a safetensors checkpoint (the WeightSource the models load from,
    deepinfer.models.weights); remembers which tensors were read.

    `get` / `linear` / `dense` check names and shapes and move each tensor to `device` as it is
    read. `unread()` lists what no module asked for (unexpected tensors).
    """

    def __init__(
        self,
        root: Path,
        device: torch.device,
        allow_fp8: bool,
        backend_name: str,
        check_weights: bool = True,
        unfused: frozenset[str] = frozenset(),
        fp8_block: int = FP8_BLOCK,
    ) -> None:
        self.root, self.device = root, device
        self.allow_fp8, self.backend_name = allow_fp8, backend_name
        self.fp8_block = fp8_block  # config.json's weight_block_size: 128, or 32 (DeepSeek-V4.1)
        self.check_weights = check_weights
        self.unfused = unfused  # the model-level fusions this load leaves out (layers.fusion_enabled)
        self.fp8_dtype = FP8_DTYPE
        self.files = self._list_files()
        self._handles: dict[str, Any] = {}
        self.location: dict[str, str] = {}  # tensor name -> file name
        for name in self.files:
            for key in self._open(name).keys():  # noqa: SIM118 - safe_open is not iterable
                if key in self.location:
                    raise CorruptCheckpointError(
                        f"checkpoint {root}: tensor {key!r} is in both {self.location[key]} and {name}; "
                        "a tensor name must be in one shard only"
                    )
                self.location[key] = name
        self._read: set[str] = set()
        self.progress: Any = None  # a tqdm bar counting the tensors read (load_model's)
        self.bytes_read = 0

    def _list_files(self) -> list[str]:
        index = self.root / INDEX_FILE
        if index.is_file():
            checkpoint_file(self.root, INDEX_FILE)
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
            for f in files:
                checkpoint_file(self.root, f, f"{index} lists shard")
                if not (self.root / f).is_file():
                    raise CheckpointError(f"{index} lists {f}, which is not in {self.root}")
            self.index_map: dict[str, str] = dict(weight_map)
            return files
        self.index_map = {}
        if (self.root / SINGLE_FILE).is_file():
            checkpoint_file(self.root, SINGLE_FILE)
            return [SINGLE_FILE]
        pickles = sorted(p.name for p in self.root.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
        raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.root}{hint}")

    def _open(self, name: str) -> Any:
        if name not in self._handles:
            _check_header(checkpoint_file(self.root, name))
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
            self.bytes_read += t.numel() * t.element_size()
            if self.progress is not None:
                self.progress.update(1)
            return t
        except SafetensorError as exc:
            raise CorruptCheckpointError(f"{self.root / file}: cannot read tensor {name!r}: {exc}") from exc

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.location[name]).get_slice(name).get_shape())

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype name of tensor `name` ("F32", "F8_E4M3", "I8", ...), unread."""
        return str(self._open(self.location[name]).get_slice(name).get_dtype())

    def _check_shape(self, name: str, shape: tuple[int, ...], what: str = "") -> None:
        found = self.shape_of(name)
        if found != tuple(shape):
            raise ShapeMismatchError(
                f"tensor {name!r} in {self.location[name]}: expected shape {tuple(shape)}{what}, "
                f"found {found}"
            )

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """Tensor `name`, shape-checked, cast to `dtype` (None: keep; only FP8 weights are read
        so) and moved to the device. A non-float tensor is refused; with check_weights, so is one
        that holds (or casts to) NaN or Inf, or FP8 NaN encodings."""
        if name in self.location:
            self._check_shape(name, shape)
        t = self._read_raw(name)
        where = f"tensor {name!r} in {self.location[name]}"
        if t.dtype == FP8_DTYPE and dtype is not None and dtype != FP8_DTYPE:
            if not name.endswith(".weight"):  # a norm, sink, bias or mixing weight: floats only
                raise CheckpointError(
                    f"{where} is FP8; only weights with a scale may be, this one is floating point"
                )
            prefix = name.removesuffix(".weight")
            raise CheckpointError(f"{where} is FP8 but has no {prefix}.weight_scale_inv or {prefix}.scale")
        if t.dtype not in (*FLOAT_DTYPES, FP8_DTYPE):
            raise CheckpointError(
                f"{where} has dtype {str(t.dtype).replace('torch.', '')}; a weight must be floating point "
                f"({', '.join(str(d).replace('torch.', '') for d in FLOAT_DTYPES)}, or float8_e4m3fn "
                "with a weight_scale_inv / scale; packed MXFP4 with its scale in routed experts only)"
            )
        out = t.to(device=self.device, dtype=dtype or t.dtype)
        if self.check_weights:
            self._check_values(where, t, out)
        return out

    def _check_values(self, where: str, src: torch.Tensor, out: torch.Tensor) -> None:
        """Refuse NaN / Inf in `out` (the tensor as loaded), naming the cause."""
        if out.dtype == FP8_DTYPE:
            if _has_fp8_nan(out):
                n, index, _ = _first_bad(out, _fp8_nan_mask(out))
                raise NonFiniteWeightError(
                    f"{where} holds {n} float8_e4m3fn NaN encoding{'s' if n > 1 else ''} (bytes 0x7F / "
                    f"0xFF; the first at index {index}); the checkpoint is corrupt {_SKIP_HINT}"
                )
            return
        if _all_finite(out):
            return
        if src.dtype != out.dtype and _all_finite(src):
            big = float(src.abs().max())
            raise NonFiniteWeightError(
                f"{where}: casting it from {str(src.dtype).replace('torch.', '')} to "
                f"{str(out.dtype).replace('torch.', '')} overflows to Inf (largest magnitude {big:.4g}); "
                "load the model in a wider dtype (dtype='bfloat16' or 'float32')"
            )
        n, index, value = _first_bad(out, ~torch.isfinite(out))
        raise NonFiniteWeightError(
            f"{where} holds {n} NaN or Inf value{'s' if n > 1 else ''} (the first, {value}, at index "
            f"{index}); the checkpoint is corrupt {_SKIP_HINT}"
        )

    def get_ids(self, name: str, shape: tuple[int, ...], upper: int) -> torch.Tensor:
        """Integer table `name` (e.g. hash routing's token -> expert ids), shape-checked, every value
        in [0, upper), as int64 on the device."""
        if name in self.location:
            self._check_shape(name, shape)
        t = self._read_raw(name)
        where = f"tensor {name!r} in {self.location[name]}"
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise CheckpointError(f"{where} has dtype {t.dtype}; expected integers")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= upper):
            low, high = int(t.min()), int(t.max())
            raise CheckpointError(f"{where} holds ids outside [0, {upper}): min {low}, max {high}")
        return t.to(device=self.device, dtype=torch.int64)

    def skip(self, name: str) -> None:
        """Mark a tensor as known but unused (e.g. the MTP layer's copies of shared weights)."""
        self._read.add(name)

    def scale_name(self, prefix: str) -> str | None:
        """The scale tensor of linear `prefix` (`{prefix}.weight_scale_inv` or `{prefix}.scale`),
        None for a floating-point weight."""
        for suffix in SCALE_SUFFIXES:
            if self.has(f"{prefix}.{suffix}"):
                return f"{prefix}.{suffix}"
        return None

    def linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype, fp4: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`{prefix}.weight` (N, K), by what the checkpoint stores:
          float              -> (weight in dtype, None)
          FP8 (e4m3 + scale) -> (e4m3 (N, K), float32 block scales (ceil(N/b), ceil(K/b)),
                                b = fp8_block: 128, or 32 for DeepSeek-V4.1)
          MXFP4 (packed int8 / uint8 / float4_e2m1fn_x2 + scale), only where `fp4` allows it
          (routed experts)   -> (uint8 (N, K/2), uint8 UE8M0 (N, ceil(K/32))): deepinfer.backend.fp4
        Scales are `{prefix}.weight_scale_inv` or `{prefix}.scale`, float32 or UE8M0 bytes
        (float8_e8m0fnu or uint8; MXFP4 scales are UE8M0 only)."""
        scale_name, weight_name = self.scale_name(prefix), f"{prefix}.weight"
        if scale_name is None:
            return self.get(weight_name, shape, dtype), None
        if self.has(weight_name) and self.dtype_of(weight_name) in PACKED_FP4:
            if not fp4:
                raise CheckpointError(
                    f"tensor {weight_name!r} in {self.location[weight_name]} is packed MXFP4 (dtype "
                    f"{self.dtype_of(weight_name)}); deepinfer reads MXFP4 for routed experts only"
                )
            return self._fp4_linear(weight_name, scale_name, shape)
        if not self.allow_fp8:
            raise Fp8NotSupportedError(
                f"{self.root} holds FP8 weights ({scale_name}) but backend {self.backend_name!r} does not "
                "support FP8 (capabilities.supports_fp8 is False); use a backend with FP8 GEMMs"
            )
        w = self.get(weight_name, shape, None)
        if w.dtype != FP8_DTYPE:
            raise CheckpointError(
                f"{weight_name} has a scale ({scale_name}) but dtype {w.dtype}, not float8_e4m3fn"
                + (" or packed MXFP4" if fp4 else "")
            )
        n, k = shape
        b = self.fp8_block
        block_scales = weight_scale_shape(n, k, b)
        what = f" (one per {b}x{b} block of the ({n}, {k}) FP8 weight {weight_name!r})"
        if self.dtype_of(scale_name) in E8M0_BYTES:  # DeepSeek-V4 / V4.1: powers of two, one byte each
            return w, e8m0_to_float(self._e8m0(scale_name, block_scales, what))
        if self.dtype_of(scale_name) not in ("F32", "BF16", "F16", "F64"):
            raise CheckpointError(
                f"tensor {scale_name!r} in {self.location[scale_name]} has dtype "
                f"{self.dtype_of(scale_name)}; FP8 block scales are float32 or UE8M0 bytes "
                "(float8_e8m0fnu or uint8)"
            )
        self._check_shape(scale_name, block_scales, what)
        return w, self.get(scale_name, block_scales, torch.float32)

    def _fp4_linear(
        self, weight_name: str, scale_name: str, shape: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = shape
        if k % 2:
            raise CheckpointError(f"tensor {weight_name!r}: MXFP4 packs two values a byte, but K={k} is odd")
        stored = (n, k) if self.dtype_of(weight_name) == "F4" else (n, k // 2)  # F4 counts values
        self._check_shape(weight_name, stored, f" (the packed MXFP4 form of an ({n}, {k}) weight)")
        w = self._read_raw(weight_name).view(torch.uint8).to(self.device)
        if self.dtype_of(scale_name) not in E8M0_BYTES:
            raise CheckpointError(
                f"tensor {scale_name!r} in {self.location[scale_name]} has dtype "
                f"{self.dtype_of(scale_name)}; MXFP4 scales are UE8M0 bytes (float8_e8m0fnu or uint8)"
            )
        what = f" (one per 32 values along K of the ({n}, {k}) MXFP4 weight {weight_name!r})"
        return w, self._e8m0(scale_name, fp4_scale_shape(n, k), what)

    def _e8m0(self, name: str, shape: tuple[int, int], what: str) -> torch.Tensor:
        """UE8M0 scale bytes `name`, shape-checked, as uint8 on the device; with check_weights,
        the NaN byte 0xFF is refused."""
        self._check_shape(name, shape, what)
        s = self._read_raw(name).view(torch.uint8).to(self.device)
        if self.check_weights and s.numel() and int(s.max()) == E8M0_NAN:
            n, index, _ = _first_bad(s, s == E8M0_NAN)
            raise NonFiniteWeightError(
                f"tensor {name!r} in {self.location[name]} holds {n} UE8M0 NaN byte{'s' if n > 1 else ''} "
                f"(0xFF; the first at index {index}); the checkpoint is corrupt {_SKIP_HINT}"
            )
        return s

    def dense(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """`{prefix}.weight` in `dtype`; FP8 weights are dequantised (block * scale)."""
        w, s = self.linear(prefix, shape, dtype)
        if s is None:
            return w
        return dequantize_weight(w, s, self.fp8_block).to(dtype)

    def fp8_rows(self, prefix: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`{prefix}.weight` (R, Dh) as FP8 rows: e4m3 with `{prefix}.scale` (R, Dh / 32) UE8M0
        bytes (float8_e8m0fnu or uint8) -> (e4m3, uint8), as stored; None without a scale."""
        weight_name, scale_name = f"{prefix}.weight", f"{prefix}.scale"
        if not self.has(scale_name):
            return None
        r, dh = shape
        where = f"tensor {weight_name!r} in {self.location.get(weight_name, self.root)}"
        if not self.has(weight_name) or self.dtype_of(weight_name) != "F8_E4M3":
            found = self.dtype_of(weight_name) if self.has(weight_name) else "missing"
            raise CheckpointError(
                f"{where} has a scale ({scale_name}), so it must be FP8 rows (F8_E4M3), but it is {found}"
            )
        if dh % 32:
            raise CheckpointError(
                f"{where}: FP8 rows take one scale per 32 values; rows of {dh} values do not divide into 32"
            )
        if self.dtype_of(scale_name) not in E8M0_BYTES:
            raise CheckpointError(
                f"tensor {scale_name!r} in {self.location[scale_name]} has dtype "
                f"{self.dtype_of(scale_name)}; FP8 rows take UE8M0 scale bytes (float8_e8m0fnu or uint8)"
            )
        table = self.get(weight_name, shape, None)
        what = f" (one per 32 values of each row of the ({r}, {dh}) FP8 table {weight_name!r})"
        return table, self._e8m0(scale_name, (r, dh // 32), what)

    def unread(self) -> list[tuple[str, str]]:
        """(name, file) of every tensor no module read."""
        return sorted((n, f) for n, f in self.location.items() if n not in self._read)


def _preflight(
    config: ModelConfig, reader: CheckpointReader, backend: Backend, ep: ExpertParallel | None
) -> None:
    """Check the sizes that decide allocations against the checkpoint and the device before
    anything is built, so that an impossible config.json is an error, not an out-of-memory kill."""
    c, root = config, reader.root
    if (
        c.v4 is not None or c.v41 is not None
    ):  # V4 / V4.1 name their tensors differently; their loaders check them
        return
    embed = "model.embed_tokens.weight"
    if reader.has(embed) and reader.shape_of(embed) != (c.vocab_size, c.hidden_size):
        raise ShapeMismatchError(
            f"config.json says vocab_size={c.vocab_size}, hidden_size={c.hidden_size}, but tensor "
            f"{embed!r} in {reader.location[embed]} has shape {reader.shape_of(embed)}"
        )
    last = f"model.layers.{c.num_hidden_layers - 1}.input_layernorm.weight"
    if not reader.has(last):
        raise MissingTensorError(
            f"config.json says num_hidden_layers={c.num_hidden_layers}, but checkpoint {root} has no "
            f"tensor {last!r}"
        )
    _check_moe_layers(c, reader)
    moe = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
    if moe and ep is None:
        prefix = f"model.layers.{moe[0]}.mlp.experts"
        fused = f"{prefix}.gate_up_proj"
        found = (
            reader.shape_of(fused)[0]
            if reader.has(fused)
            else sum(reader.has(f"{prefix}.{e}.gate_proj.weight") for e in range(c.n_routed_experts))
        )
        if found != c.n_routed_experts:
            raise CheckpointError(
                f"config.json says n_routed_experts={c.n_routed_experts}, but layer {moe[0]} of checkpoint "
                f"{root} holds {found} experts ({prefix}.*)"
            )
    _check_attention_shapes(c, reader)
    _check_mtp_layers(c, reader)
    table = c.max_position_embeddings * c.qk_rope_head_dim * 4  # the float32 cos/sin table
    free, _ = backend.device.memory_info()
    if table > free:
        raise ModelConfigError(
            f"config.json: max_position_embeddings={c.max_position_embeddings} needs a {table / 2**30:.4g} "
            f"GiB rotary table, more than the {free / 2**30:.4g} GiB of free device memory"
        )


def _check_moe_layers(c: ModelConfig, reader: CheckpointReader) -> None:
    """Which layers are MoE (n_routed_experts, first_k_dense_replace, moe_layer_freq) against the
    routers (`mlp.gate.weight`) the checkpoint holds."""
    for i in range(c.num_hidden_layers):
        has_router = reader.has(f"model.layers.{i}.mlp.gate.weight")
        if c.is_moe_layer(i) != has_router:
            raise CheckpointError(
                f"config.json says layer {i} is {'an MoE' if c.is_moe_layer(i) else 'a dense'} layer "
                f"(n_routed_experts={c.n_routed_experts}, first_k_dense_replace={c.first_k_dense_replace}, "
                f"moe_layer_freq={c.moe_layer_freq}), but checkpoint {reader.root} "
                f"{'has no' if c.is_moe_layer(i) else 'has a'} router tensor "
                f"'model.layers.{i}.mlp.gate.weight'"
            )


def _check_attention_shapes(c: ModelConfig, reader: CheckpointReader) -> None:
    """The sizes in config.json that shape the first dense and the first MoE layer (heads, head
    dims, LoRA ranks, MLP widths) against those layers' tensors, naming the fields."""
    heads = c.num_attention_heads
    attn = "model.layers.0.self_attn"
    said = f"num_attention_heads={heads}"
    checks: list[tuple[str, int, int, str, str]] = [  # (tensor, dim, size, config says, fields)
        (f"{attn}.o_proj.weight", 1, heads * c.v_head_dim, said, "num_attention_heads * v_head_dim"),
        (
            f"{attn}.kv_a_proj_with_mqa.weight", 0, c.kv_lora_rank + c.qk_rope_head_dim,
            f"kv_lora_rank={c.kv_lora_rank}", "kv_lora_rank + qk_rope_head_dim",
        ),
        (
            f"{attn}.kv_b_proj.weight", 0, heads * (c.qk_nope_head_dim + c.v_head_dim), said,
            "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
        ),
    ]  # fmt: skip
    q_fields = "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
    if c.q_lora_rank is None:
        checks.insert(0, (f"{attn}.q_proj.weight", 0, heads * c.qk_head_dim, said, q_fields))
    else:
        checks.insert(0, (f"{attn}.q_b_proj.weight", 0, heads * c.qk_head_dim, said, q_fields))
        checks.append(
            (f"{attn}.q_a_proj.weight", 0, c.q_lora_rank, f"q_lora_rank={c.q_lora_rank}", "q_lora_rank")
        )
    layers = range(c.num_hidden_layers)
    dense = next((i for i in layers if not c.is_moe_layer(i)), None)
    if dense is not None:
        checks.append(
            (
                f"model.layers.{dense}.mlp.gate_proj.weight", 0, c.intermediate_size,
                f"intermediate_size={c.intermediate_size}", "intermediate_size",
            )
        )  # fmt: skip
    moe = next((i for i in layers if c.is_moe_layer(i)), None)
    if moe is not None and c.n_shared_experts:
        checks.append(
            (
                f"model.layers.{moe}.mlp.shared_experts.gate_proj.weight", 0,
                c.moe_intermediate_size * c.n_shared_experts,
                f"moe_intermediate_size={c.moe_intermediate_size}, n_shared_experts={c.n_shared_experts}",
                "moe_intermediate_size * n_shared_experts",
            )
        )  # fmt: skip
    if moe is not None:
        checks.append(
            (
                f"model.layers.{moe}.mlp.experts.0.gate_proj.weight", 0, c.moe_intermediate_size,
                f"moe_intermediate_size={c.moe_intermediate_size}", "moe_intermediate_size",
            )
        )  # fmt: skip
    for name, dim, want, says, fields in checks:
        if not reader.has(name):
            continue
        shape = reader.shape_of(name)
        if len(shape) == 2 and shape[dim] != want:
            expected = (want, shape[1]) if dim == 0 else (shape[0], want)
            raise ShapeMismatchError(
                f"config.json says {says} ({fields} = {want}), but tensor {name!r} in "
                f"{reader.location[name]} has {shape[dim]} {'rows' if dim == 0 else 'columns'}: expected "
                f"shape {expected}, found {shape}; a size in config.json ({fields}) is wrong"
            )


def _check_mtp_layers(c: ModelConfig, reader: CheckpointReader) -> None:
    """num_nextn_predict_layers against the MTP layers the checkpoint holds: none (transformers
    drops them when it saves) or every one the config names."""
    first = f"model.layers.{c.num_hidden_layers}"
    if reader.has(f"{first}.input_layernorm.weight") and not reader.has(f"{first}.enorm.weight"):
        raise CheckpointError(
            f"config.json says num_hidden_layers={c.num_hidden_layers}, but checkpoint {reader.root} holds "
            f"decoder layer {first} (it has no {first}.enorm.weight, so it is no MTP layer); "
            "num_hidden_layers in config.json is wrong"
        )
    if c.num_nextn_predict_layers == 0 and reader.has(f"{first}.enorm.weight"):
        raise CheckpointError(
            f"config.json says num_nextn_predict_layers=0, but checkpoint {reader.root} holds MTP layer "
            f"{first}; set num_nextn_predict_layers to the number of MTP layers it holds"
        )
    found = 0
    while found < c.num_nextn_predict_layers and reader.has(
        f"model.layers.{c.num_hidden_layers + found}.input_layernorm.weight"
    ):
        found += 1
    if 0 < found < c.num_nextn_predict_layers:
        raise CheckpointError(
            f"config.json says num_nextn_predict_layers={c.num_nextn_predict_layers}, but checkpoint "
            f"{reader.root} holds {found} MTP layer{'s' if found > 1 else ''} (model.layers."
            f"{c.num_hidden_layers}..{c.num_hidden_layers + found - 1}); set num_nextn_predict_layers "
            f"to {found}"
        )


def _progress_bar(total: int, expert_parallel: ExpertParallel | None) -> Any:
    """A tqdm bar over the checkpoint's tensors, shown where deepinfer logs at INFO (the command
    line, DEEPINFER_LOG_LEVEL=INFO) and, with expert parallelism, on rank 0 only."""
    from tqdm.auto import tqdm

    show = logging.getLogger("deepinfer").isEnabledFor(logging.INFO)
    if expert_parallel is not None and expert_parallel.rank != 0:
        show = False
    return tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show, dynamic_ncols=True)


def load_model(
    path: str | Path,
    backend: Backend,
    dtype: torch.dtype | None = None,
    expert_parallel: ExpertParallel | None = None,
    check_weights: bool | None = None,
    dflash: bool = False,
) -> DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """Load a DeepSeek-V2 / V3 / R1 / V4 / V4.1 checkpoint directory onto `backend`.

    expert_parallel: read only this rank's routed experts (see deepinfer.models.moe).

    dtype: activation and floating-weight dtype; default: the checkpoint's torch_dtype (bfloat16
    for FP8 checkpoints). FP8 weights stay FP8 when backend.capabilities.supports_fp8.

    check_weights: refuse NaN / Inf weights (and FP8 NaN bytes, non-finite scales), one pass
    over each weight as it is loaded (see the module docstring for its cost); None: yes unless
    the environment sets DEEPINFER_SKIP_WEIGHT_CHECK=1.

    dflash: also load the DFlash drafter saved in DIR/dflash/ (deepinfer.models.dflash); its
    caches then follow the model's and every forward injects into them.

    Raises ModelConfigError / CheckpointError subclasses naming the problem.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (expected a checkpoint directory with config.json)")
    if not (root / "config.json").is_file():
        raise ModelConfigError(f"no config.json in {root}")
    config = ModelConfig.from_file(checkpoint_file(root, "config.json"))
    fp8_block = config.quantization.weight_block_size[0] if config.quantization is not None else FP8_BLOCK
    if config.quantization is not None and not backend.capabilities.supports_fp8:
        raise Fp8NotSupportedError(
            f"{root} is an FP8 checkpoint (e4m3, {fp8_block}x{fp8_block} block scales) but backend "
            f"{backend.name!r} does not support FP8 (capabilities.supports_fp8 is False); use a backend "
            "with FP8 GEMMs"
        )
    if dtype is None:
        dtype = torch.bfloat16 if config.quantization is not None else config.torch_dtype
    if dtype not in backend.capabilities.dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in backend.capabilities.dtypes)
        raise ValueError(f"backend {backend.name!r} does not support dtype {dtype}; supported: {supported}")
    env = envs.read()  # DEEPINFER_SKIP_WEIGHT_CHECK, DEEPINFER_MODEL_UNFUSED
    if check_weights is None:
        check_weights = not env.skip_weight_check

    device = backend.device.device()
    with CheckpointReader(
        root, device, backend.capabilities.supports_fp8, backend.name, check_weights, env.model_unfused,
        fp8_block,
    ) as reader:  # fmt: skip
        _preflight(config, reader, backend, expert_parallel)
        model: DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM
        if config.v41 is not None:
            model = DeepseekV41ForCausalLM(config, backend, dtype, root, expert_parallel, dflash=dflash)
        elif config.v4 is not None:
            model = DeepseekV4ForCausalLM(config, backend, dtype, expert_parallel)
        else:
            model = DeepseekForCausalLM(config, backend, dtype, expert_parallel)
        start = time.perf_counter()
        with _progress_bar(len(reader.location), expert_parallel) as reader.progress:
            model.load_weights(reader)
        backend.device.synchronize()
        unread = reader.unread()
        logger.info(
            "weights of %s loaded in %.2f s: %d tensors, %.1f MiB read, on %s (%s)",
            root, time.perf_counter() - start, len(reader.location) - len(unread), reader.bytes_read / 2**20,
            backend.name, str(dtype).replace("torch.", ""),
        )  # fmt: skip
    if unread:
        shown = "; ".join(f"{n!r} in {f}" for n, f in unread[:10])
        more = f" (and {len(unread) - 10} more)" if len(unread) > 10 else ""
        raise UnexpectedTensorError(f"unexpected tensors in checkpoint {root}: {shown}{more}")
    if has_drafter(root):  # a block drafter saved beside the model (deepinfer.models.drafter)
        model.drafter = load_drafter(root, backend, config, dtype)
    if dflash and not isinstance(model, DeepseekV41ForCausalLM):  # V4.1's loads with the model
        if not isinstance(model, DeepseekForCausalLM):
            raise ValueError(
                f"the DFlash drafter runs with DeepSeek-V2/V3 or V4.1 blocks; {root} is {config.model_type}, "
                "whose drafter blocks are not implemented yet"
            )
        model.dflash = load_dflash(
            root, backend, config, dtype, check_weights, cast(torch.Tensor, model.cos_sin)
        )
    return model.eval()


def load_dflash(
    root: Path,
    backend: Backend,
    config: ModelConfig,
    dtype: torch.dtype,
    check_weights: bool,
    cos_sin: torch.Tensor,
) -> DFlashDrafter:
    """The DFlash drafter of DIR/dflash/ (config.json + model.safetensors), checked tensor by
    tensor: a missing or unexpected tensor is an error naming it."""
    if not has_dflash(root):
        raise CheckpointError(
            f"speculative_config asks for the DFlash drafter but {root} has no {DFLASH_DIR}/config.json "
            "(train/train_dflash.py makes one)"
        )
    dconfig = read_dflash_config(root)
    drafter = DFlashDrafter(config, dconfig, backend, cos_sin)
    with CheckpointReader(
        root / DFLASH_DIR, backend.device.device(), False, backend.name, check_weights
    ) as reader:
        drafter.load(reader, dtype)
        unread = reader.unread()
    if unread:
        shown = "; ".join(f"{n!r} in {f}" for n, f in unread[:10])
        raise UnexpectedTensorError(f"unexpected tensors in the DFlash drafter {root / DFLASH_DIR}: {shown}")
    return drafter.eval()

# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""Helpers shared by the kernels: interpreter workarounds and small launch utilities.

Under TRITON_INTERPRET=1 (CI on a CPU) five interpreter defects are worked around, all only in
that mode (the compiled path is untouched):
  * tl.dot on bfloat16 / float16 operands returns garbage: operands are upcast to float32 first.
  * bfloat16 * bfloat16 returns garbage: kv_fp8.load_fp8_latent multiplies in float32 there.
  * float32 -> float8e4nv conversion drops the carry when rounding reaches the next binade
    (1.95 -> 1.0): values are rounded to the e4m3 grid in float32 before the cast.
  * float32 -> bfloat16 conversion truncates: `to_dtype` rounds to nearest even in float32 first.
  * tl.dot is NumPy's BLAS matmul, whose rounding of an output row depends on the row's place in
    the tile on some CPUs (OpenBLAS's AVX2 kernels): `_patch_interpreter_dot` multiplies row by
    row, so that a row's product depends on its own operands only, as an MMA's does on a GPU
    (the batch-invariance tests compare a row alone with the same row in a batch, bit for bit).
And libdevice (extern calls) does not run in the interpreter: `log` / `log1p` use NumPy's there
and libdevice's (within an ulp, like torch's) on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
IS_INTERPRET: tl.constexpr = tl.constexpr(INTERPRET)


def next_pow2(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum) (tl.arange and tl.dot need such sizes)."""
    return max(minimum, int(triton.next_power_of_2(max(int(n), 1))))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (4 stands in for the interpreter's CPU)."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def pdl_supported(device: torch.device) -> bool:
    """Whether launches may use programmatic dependent launch (SM90+; never in the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device, switch: bool = True) -> bool:
    """Whether the decode path's kernels launch with programmatic dependent launch (PDL) here:
    pdl_supported, and `switch`, the launch's `pdl` argument (the cuda backend passes its
    DEEPINFER_CUDA_PDL, read when the backend is created; graphs keep the launches they captured).

    The protocol, the same in every kernel launched this way (`launch_pdl=PDL`, the kernel's
    PDL constexpr): the kernel may start while the previous kernel on the stream still runs, and
    that one may itself still wait for ITS predecessor, so nothing written during inference is
    safe to touch early. A program first calls launch_dependents (the next kernel may start
    launching), may load weights (the caller's own tensors, never written while the engine runs;
    not a copy made for this launch), and calls
    wait_for_previous before its first load of anything else and before its first store
    (a buffer it writes may have been freed by a kernel still reading it).

    One chain goes further (kernels/moe.py): the one-launch router and the decode up kernel call
    launch_dependents AFTER their wait, so when their successor starts, every kernel two launches
    back has finished. That successor may then also load, before its own wait, what those
    kernels wrote and nothing since rewrites: the decode up kernel its shared experts' rows of x
    (written before the router), the decode down kernel the expert ids (the router's)."""
    return switch and pdl_supported(device)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """A hint that the next kernel, where it was launched with PDL (it waits for this one with
    gdc_wait before touching its outputs), may start launching now: its weight loads then overlap
    this kernel. No effect on a kernel launched the ordinary way."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under PDL: block until the previous kernel on the stream has finished and its writes are
    visible (and, as it waited for its own predecessor, every earlier one). A no-op otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def is_sm90(device: torch.device | None) -> bool:
    """An SM90 GPU: there the MMA gives a row the same bits in every tile tried
    (bench/bench_invariant_tiles.py --bits), so batch-invariant tiles may follow the rows."""
    return device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def tma_supported(device: torch.device) -> bool:
    """Whether kernels may use TMA descriptors on this device: SM90+, or the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return INTERPRET


class Semaphores:
    """int32 counters per device that the kernels' programs count themselves in on (tl.atomic_add),
    zero between launches: the program that arrives last resets its counter, so no launch zeroes
    them (graph replays included). A buffer holds at least 4096; a launch that needs more gets a
    larger one, and the smaller ones stay allocated: graphs captured with them keep using them.
    Launches that share a buffer must not run at the same time (one stream)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        bufs = self._buffers.setdefault(device, [])
        if not bufs or bufs[-1].numel() < n:
            bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        return bufs[-1]


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b with float32 accumulation (IEEE: full float32 products for float32 inputs)."""
    if IS_INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def round_to_e4m3(x):
    """x (float32, already within +-448) rounded to the nearest e4m3 value, ties to even."""
    a = tl.abs(x)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    e = tl.where(tl.exp2(e) > a, e - 1.0, e)  # fix log2 rounding near powers of two
    e = tl.where(tl.exp2(e + 1.0) <= a, e + 1.0, e)
    e = tl.maximum(e, -6.0)  # subnormal range shares the 2^-9 step
    step = tl.exp2(e - 3.0)
    y = a / step
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(x < 0, -r * step, r * step)


@triton.jit
def to_e4m3(x):
    """float32 -> float8e4nv with round-to-nearest-even on both the device and the interpreter."""
    if IS_INTERPRET:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 -> dtype (float32, bfloat16 or float16) rounding to nearest even, as torch's casts
    do, on both the device and the interpreter (whose bfloat16 cast truncates: the value is
    rounded on its float32 bits first, then the cast is exact)."""
    if IS_INTERPRET:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def log(x):
    """Natural logarithm of float32 x within an ulp, pinned to libdevice's logf on the GPU (the
    noise kernel's -log(u) matched torch's bit for bit on an H200) and NumPy's in the
    interpreter, rather than whatever tl.log lowers to."""
    if IS_INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def log1p(x):
    """log(1 + x) of float32 x, accurate for tiny x (softplus of very negative logits)."""
    if IS_INTERPRET:
        u = 1.0 + x
        # Goldberg's correction: exact log of the rounded u, rescaled by x / (u - 1)
        return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))
    else:
        return libdevice.log1p(x)


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(ndarray), which NumPy >= 2.4
    rejects for its 1-element arrays; range() over a loaded or reduced bound then fails.
    Interpreter mode only; the patch is installed into the interpreter's own patch scope."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_deepinfer_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._deepinfer_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_dot() -> None:
    """Make the interpreter's tl.dot row-independent: the product of a (..., M, K) tile and a
    (..., K, N) tile is computed as M products of one row each (the same BLAS call for every
    row, wherever it sits in the tile). Interpreter mode only."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_deepinfer_patched", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = a.data.shape[-2]
        if rows == 1:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        parts = [
            original(
                self,
                interpreter.TensorHandle(a.data[..., i : i + 1, :], a.dtype),
                b,
                interpreter.TensorHandle(d.data[..., i : i + 1, :], d.dtype),
                input_precision,
                max_num_imprecise_acc,
            ).data
            for i in range(rows)
        ]
        return interpreter.TensorHandle(np.concatenate(parts, axis=-2), d.dtype.scalar)

    create_dot._deepinfer_patched = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


if INTERPRET:
    _patch_interpreter_index()
    _patch_interpreter_dot()

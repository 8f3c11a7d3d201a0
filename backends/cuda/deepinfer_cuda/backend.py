"""The CUDA backend's factory: it assembles the parts, one module each (device.py, kv_cache.py,
attention.py, gemm.py, moe.py, collectives.py, small.py). Kernels live in deepinfer_cuda.kernels.

Device: torch.cuda (streams, events, pinned buffers, CUDA graphs). Under TRITON_INTERPRET=1 on
a machine without a GPU the same parts run the same Triton kernels in the interpreter on CPU
tensors (no streams or graphs there); that is how CI checks the kernels.

Fused decode paths (fewer launches per step): the MoE router in one kernel, the expert sort and
the grouped GEMM's tile table in one (computed once per layer, shared by both expert GEMMs),
MLA's cache write (norm + rope + store) in one, MLA's query (rope + per-head product + concat)
in one, the sampling noise in one; DeepSeek-V4's mHC weights (Sinkhorn included), mixes and head
collapse in one each, its lightning indexer (scores, then top-k) and compressed attention (window
rows + compressed entries + sinks) in Triton.
DEEPINFER_CUDA_UNFUSED=1 switches those back to the composed
paths they replace (routing in torch as the reference computes it, the torch sort and a torch
tile table per GEMM, write_mla_kv, mla_query and exponential_noise as the contract's defaults,
which run through this backend's own rms_norm / rope / write_kv / batched_linear and the
reference hash; the V4 ops as the contract's reference defaults) so that a benchmark can measure
what the fusion buys. Results agree within each op's contract either way.

Switches (deepinfer.envs, docs/environment.md): create_cuda_backend reads them once, from the
environment or the snapshot it is given, and each part keeps the values it uses; a launch reads
none, so a backend and the graphs it captured keep the switches it was created with.
"""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import BackendOptions, Capabilities
from deepinfer_cuda.attention import CudaAttention
from deepinfer_cuda.collectives import CudaCollectives
from deepinfer_cuda.device import CudaDevice
from deepinfer_cuda.gemm import CudaGemm
from deepinfer_cuda.kv_cache import CudaKVCache
from deepinfer_cuda.moe import CudaMoe
from deepinfer_cuda.plugin import interpreting
from deepinfer_cuda.small import CudaSmall


def cuda_device(options: BackendOptions) -> torch.device:
    """cuda:<device_index>, or the CPU when the kernels run in the Triton interpreter."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the cuda backend needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"
        )
    if not 0 <= options.device_index < torch.cuda.device_count():
        raise ValueError(
            f"device_index {options.device_index} out of range: {torch.cuda.device_count()} GPU(s) visible"
        )
    return torch.device("cuda", options.device_index)


def capabilities_for(device: torch.device) -> Capabilities:
    if device.type == "cuda":
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    else:
        fp8 = True  # the interpreter runs the FP8 kernels (see kernels/common.py)
    return Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        supports_fp8=fp8,
        supports_batch_invariant=True,
        supports_graphs=True,  # CUDA graphs; RerunGraph under the interpreter
        reads_host_tables=True,  # kernels/engram.py reads pinned rows through their mapped address
        supports_fp8_kv_cache=True,  # kernels/kv_fp8.py: the quantised store, dequantised in attention
    )


def create_cuda_backend(options: BackendOptions | None = None, env: envs.Env | None = None) -> Backend:
    """The cuda Backend on options.device_index; `env`: the switches (default: read from the
    environment now, deepinfer.envs), which its parts keep."""
    options = options or BackendOptions()
    env = envs.read() if env is None else env
    device = cuda_device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Backend(
        name="cuda",
        options=options,
        capabilities=capabilities_for(device),
        device=CudaDevice(options, device, env),
        kv_cache=CudaKVCache(options, env),
        attention=CudaAttention(options, env),
        gemm=CudaGemm(options, env),
        moe=CudaMoe(options, env),
        collectives=CudaCollectives(options, device, env),
        small=CudaSmall(options, env),
    )

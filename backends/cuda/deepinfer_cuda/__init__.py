"""deepinfer backend for NVIDIA GPUs (SM90 / SM100) built on Triton kernels.

Importing this package is cheap: Triton and the CUDA runtime are only touched by the factory
(deepinfer_cuda.backend.create_cuda_backend) and the kernels it loads.
"""

__version__ = "0.1.0"

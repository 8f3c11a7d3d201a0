"""Triton kernels of the CUDA backend. Each module pairs its kernels with thin torch launchers."""

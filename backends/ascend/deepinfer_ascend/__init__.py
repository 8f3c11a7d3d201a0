"""deepinfer's Ascend backend: the backend contract on torch_npu fused ops, HCCL and NPU graphs.

Importing this package never imports torch_npu; `deepinfer_ascend.npu.load()` does, lazily.
"""

__version__ = "0.1.0"

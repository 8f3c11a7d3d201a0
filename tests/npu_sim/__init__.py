"""A CPU simulation of the torch_npu ops the ascend backend calls: a test double.

`install()` puts a fake `torch_npu` module into sys.modules and a fake `torch.npu` namespace on
torch; its "NPU" is the CPU. Each op is implemented from its documented semantics and checks its
arguments as the torch_npu documentation constrains them, raising SimError (a RuntimeError, as
torch_npu raises) that names the violated constraint. Only tests install it; nothing shipped
imports it.
"""

from .state import SimError, install, installed, uninstall

__all__ = ["SimError", "install", "installed", "uninstall"]

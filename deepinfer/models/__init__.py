"""DeepSeek model code, written only against the backend contract.

    from deepinfer.models import load_model
    model = load_model("path/to/checkpoint", backend)   # DeepseekForCausalLM

Files, in DeepSeek's reference order: config.py (ModelConfig from config.json), rope.py,
layers.py (RMSNorm, Linear, MLP), attention.py (MLA, absorbed), moe.py (routers, MoE),
deepseek.py (block, model, MTP head), loader.py (safetensors checkpoints); runner_util.py and
random_checkpoint.py are small tools for tests and the conformance suite.
"""

from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.models.loader import CheckpointError, load_model

__all__ = ["CheckpointError", "DeepseekForCausalLM", "ModelConfig", "ModelConfigError", "load_model"]

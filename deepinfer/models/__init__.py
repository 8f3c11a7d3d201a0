"""DeepSeek model code, written only against the backend contract.

    from deepinfer.models import load_model
    model = load_model("path/to/checkpoint", backend)   # DeepseekForCausalLM (V4: DeepseekV4ForCausalLM)

Files, in DeepSeek's reference order: config.py (ModelConfig from config.json), rope.py,
layers.py (RMSNorm, Linear, MLP), attention.py (MLA, absorbed), moe.py (routers, MoE),
deepseek.py (block, model, MTP head), deepseek_v4.py (DeepSeek-V4: its attention, compressor,
indexer, hyper-connections, MoE and caches, in one file), weights.py (WeightSource: what the
modules read their tensors from), loader.py (safetensors checkpoints, a WeightSource). Random
checkpoints and a paged test driver are in deepinfer.testing.
"""

from deepinfer.models.config import ModelConfig, ModelConfigError
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.models.loader import CheckpointError, load_model

__all__ = ["CheckpointError", "DeepseekForCausalLM", "ModelConfig", "ModelConfigError", "load_model"]

"""The policy: a Flax NNX decoder of the Llama / Qwen2 / Qwen3 / Qwen3-MoE families (decoder.py,
its `ModelConfig` in config.py) built from the layers in layers.py and the mixture-of-experts
block in moe.py, its KV cache (kv_cache.py), and
the teacher-forced log-probs the trainer differentiates (scoring.py)."""

from ess_jax.model.config import ModelConfig
from ess_jax.model.decoder import (
    Params,
    abstract_params,
    forward,
    init_params,
    logical_axes,
    num_params,
    param_shardings,
)
from ess_jax.model.scoring import token_logprobs

__all__ = [
    "ModelConfig",
    "Params",
    "abstract_params",
    "forward",
    "init_params",
    "logical_axes",
    "num_params",
    "param_shardings",
    "token_logprobs",
]

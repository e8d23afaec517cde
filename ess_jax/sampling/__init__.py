"""The in-JAX sampler: jitted prefill and decode segments over a KV cache (decode.py), one draw
with the exact behaviour log-prob it records (draw.py), sampler precisions (precision.py), the
public `sample` (sampler.py), the rollout-engine interface the RL loops draw through and the
sampler behind it (engine.py), and pi_b re-scored for the full-vocabulary KL (rescore.py)."""

from ess_jax.sampling.engine import Generation, JaxEngine, RolloutEngine
from ess_jax.sampling.precision import PRECISIONS
from ess_jax.sampling.sampler import (
    SampleOutput,
    SamplerParams,
    SamplingConfig,
    sample,
    sample_prepared,
)

__all__ = [
    "PRECISIONS",
    "Generation",
    "JaxEngine",
    "RolloutEngine",
    "SampleOutput",
    "SamplerParams",
    "SamplingConfig",
    "sample",
    "sample_prepared",
]

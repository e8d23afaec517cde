"""The in-JAX sampler: jitted prefill and decode segments over a KV cache (decode.py), one draw
with the exact behaviour log-prob it records (draw.py), sampler precisions (precision.py), the
public `sample` (sampler.py), and pi_b re-scored for the full-vocabulary KL (rescore.py)."""

from ess_jax.sampling.precision import PRECISIONS
from ess_jax.sampling.sampler import SampleOutput, SamplingConfig, bucket_length, sample

__all__ = ["PRECISIONS", "SampleOutput", "SamplingConfig", "bucket_length", "sample"]

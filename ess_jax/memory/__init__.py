"""The memory planner: per-device bytes of a run (params, optimizer state, activations, the
sampler's copy and KV cache) from the config alone, checked against XLA's compiled memory
(planner.py; the byte counts in terms.py)."""

from ess_jax.memory.planner import Plan, plan

__all__ = ["Plan", "plan"]

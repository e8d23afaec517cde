"""ess_jax: batch-adaptive ESS (P3O) RL post-training of language models in JAX."""

__version__ = "0.1.0"

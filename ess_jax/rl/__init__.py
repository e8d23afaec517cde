"""The RL loop: rollouts with their off-policy knobs (rollout.py, dynamic_sampling.py),
advantages (advantages.py), the RL update on a rollout batch (update.py: its gradient loop in
accumulate.py, the full-vocabulary KL's inputs in full_kl.py), the jitted SFT step and scoring
(steps.py), the SFT warm start (sft.py), held-out pass@k (heldout.py), the optimizer
(optim.py), metrics and plots (metrics.py), the run's parts built from the config
(experiment.py), run-health warnings (health.py), SIGTERM and Ctrl-C handling (preemption.py),
a saved run's policy (saved_policy.py) and the loop itself (train.py).

`Run`, `run` and `validate` load on first use, so that a jax-free module of this package
(metrics.py: reading metrics.jsonl, as experiments/ does) imports without jax."""

import importlib

_LAZY = {"Run": "train", "run": "train", "validate": "experiment"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"ess_jax.rl.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ess_jax.rl' has no attribute {name!r}")


__all__ = list(_LAZY)

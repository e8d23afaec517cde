"""The RL loop: rollouts with their off-policy knobs (rollout.py, dynamic_sampling.py),
advantages (advantages.py), the jitted SFT and RL steps (steps.py), held-out pass@k
(heldout.py), the optimizer (optim.py), metrics and plots (metrics.py), the run's parts built
from the config (experiment.py) and the loop itself (train.py)."""

from ess_jax.rl.experiment import validate
from ess_jax.rl.train import Run, run

__all__ = ["Run", "run", "validate"]

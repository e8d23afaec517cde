"""Drawing batch k: the one collection both loops run (`Collector.collect`).

The synchronous loop draws batch k in the trainer's thread, the actor-learner in its sampler
thread (actor_learner.py); both go through `Collector.collect`, so the two loops draw the same
batch from the same data position with the same key, `fold_in(fold_in(key(seed), 1), k)`, and
the rollouts differ only by the params version each loop pushes to the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ess_jax.rl import dynamic_sampling
from ess_jax.rl import rollout as rollout_lib
from ess_jax.sampling.engine import RolloutEngine


@dataclasses.dataclass(frozen=True)
class Collector:
    """What a batch is drawn from, besides the engine and the params: the tokenizer (prompts
    and responses), the reward function, the rollout config (with the stop ids) and the run's
    key."""

    tokenizer: Any
    reward_fn: Callable[[str, dict], float]
    rollout_cfg: Any
    key: jax.Array  # jax.random.key(config.seed)

    def batch_key(self, k: int) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(self.key, 1), k)

    def collect(
        self,
        engine: RolloutEngine,
        batcher,
        k: int,
        version: int,
        params,
        external: RolloutEngine | None = None,
    ) -> tuple[rollout_lib.Rollout, dict]:
        """Batch k (`dynamic_sampling.collect_batch` on the batcher's next prompts), drawn by
        `engine` with `params` pushed as `version`; the engine is released afterwards, also
        when the collection raises (a signal, a failed reward)."""
        engine.update_params(version, params)
        try:
            return dynamic_sampling.collect_batch(
                engine,
                batcher,
                self.tokenizer,
                self.reward_fn,
                self.rollout_cfg,
                self.batch_key(k),
                external=external,
            )
        finally:
            engine.release()

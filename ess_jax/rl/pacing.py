"""ESS pacing of the asynchronous actor-learner (rollout.target_ess > 0, train.mode "async").

The lag budget is how many steps the sampler may run ahead of the trainer: a batch trained at
step s may come from policy version s - budget or newer. Staleness is what lowers the ESS of a
batch (pi moves away from pi_b), so the controller trades speed for ESS:

    running = 0.5 * running + 0.5 * ess           (the first step's ESS starts it)
    running <  target  ->  budget = max(floor, budget // 2)     cut fast
    running >= target  ->  budget = min(max_lag, budget + 1)    recover slowly

an additive-increase / multiplicative-decrease rule, as TCP paces a sender by its losses. The
floor is train.sync_every - 1: below it the sampler would wait for a push that never comes
(config/schema.py refuses a max_lag under it for the same reason). The budget starts at
max_lag. A checkpoint holds the controller's `state` (budget and running ESS after the last
step trained on, in its metadata: rl/train.py `Run.save`) and a resume `restore`s it, so a
resumed run paces as the uninterrupted one would (tests/test_actor_learner.py). With target 0
the budget stays max_lag (no pacing).
"""

from __future__ import annotations


class LagController:
    """The lag budget after each step's ESS (`update`); `budget` is the one in effect."""

    def __init__(self, max_lag: int, floor: int, target: float, smoothing: float = 0.5):
        if not 0 <= floor <= max_lag:
            raise ValueError(f"lag floor {floor} must be in [0, max_lag={max_lag}]")
        self.max_lag, self.floor, self.target = int(max_lag), int(floor), float(target)
        self.smoothing = float(smoothing)
        self.budget = self.max_lag
        self.running: float | None = None

    def update(self, ess: float) -> int:
        """Fold one step's ESS into the running value and return the new budget."""
        if self.target <= 0:
            return self.budget
        s = self.smoothing
        self.running = ess if self.running is None else s * self.running + (1 - s) * ess
        if self.running < self.target:
            self.budget = max(self.floor, self.budget // 2)
        else:
            self.budget = min(self.max_lag, self.budget + 1)
        return self.budget

    def state(self) -> dict:
        """What a checkpoint keeps (JSON): the budget in effect and the running ESS."""
        return {"budget": self.budget, "running": self.running}

    def restore(self, state: dict) -> None:
        """The `state` of a checkpoint; its budget clamped to [floor, max_lag] (a resume may
        change rollout.max_lag or train.sync_every)."""
        self.budget = min(self.max_lag, max(self.floor, int(state["budget"])))
        running = state.get("running")
        self.running = None if running is None else float(running)

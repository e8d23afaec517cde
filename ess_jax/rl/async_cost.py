"""Cost model of train.mode "async": seconds per RL step, queue depth and lag from four
measured terms, against the synchronous loop's seconds per step.

Terms (`Terms`), each measured alone (tools/async_cost.py takes them from an async run with
rollout.max_lag=0, where the two sides never overlap):
    sample_s   the sampler's seconds per batch on the rollout mesh
    train_s    the trainer's seconds per step on the train mesh (all its updates)
    push_s     one params push (device_put to the rollout mesh, waited for; in the two-program
               run, rl/groups.py, the trainer's params copy offered for the pull)
    pull_s     the two-program run only: the sampler group's pull of a pushed version (its
               receiver thread pulls while the sampler draws; the version is usable after it)
and the schedule's knobs: train.sync_every (k) and rollout.max_lag (L).

`simulate` plays the schedule the actor-learner runs (ess_jax/rl/actor_learner.py) with these
fixed times: batch j starts when the sampler is free and a version >= j - L has been pushed
(versions are pushed after every k-th step, at the end of that step, whose time includes the
push, and reach the sampler pull_s later); step j starts when step j - 1 is done and batch j
is ready. Its steady state gives the seconds per step; for L >= k (pull_s 0) it is
max(sample_s, train_s + push_s / k), for L = 0 (k = 1) the sum sample_s + train_s + push_s +
pull_s: the sides take turns. The sync loop's step on all the devices
is sample_s(N) + train_s(N), so the predicted speed-up of a split is

    (sync sample_s + sync train_s) / simulate(Terms measured on the split).step_s

What it leaves out: the two sides' contention for the host (CPU devices share cores, the
GIL is shared by the rewards and the dispatch), compiles, and the variance of sample_s
(response lengths): an upper bound where those matter.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Terms:
    sample_s: float
    train_s: float
    push_s: float
    sync_every: int = 1
    max_lag: int = 1
    pull_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float  # seconds per RL step, steady state
    queue_depth: float  # batches waiting when the trainer takes one (mean)
    lag_mean: float  # steps between a batch's version and the step that trains on it


def simulate(t: Terms, steps: int = 400) -> Prediction:
    """The steady state of the schedule above over the second half of `steps` steps."""
    k, lag = t.sync_every, t.max_lag
    if lag < k - 1:
        raise ValueError(
            f"max_lag {lag} < sync_every - 1 = {k - 1}: the sampler would wait forever"
        )
    pushed = {0: 0.0}  # version -> time it reached the sampler
    ready, done, version_of = [], [], []
    sampler_free = 0.0
    for j in range(steps):
        need = max(0, j - lag)
        v_need = math.ceil(need / k) * k  # the first pushed version >= need
        start = max(sampler_free, pushed[v_need])
        version_of.append(max(v for v, at in pushed.items() if at <= start))
        sampler_free = start + t.sample_s
        ready.append(sampler_free)
        begin = max(done[-1] if done else 0.0, ready[j])
        push = (j + 1) % k == 0
        done.append(begin + t.train_s + (t.push_s if push else 0.0))
        if push:
            pushed[j + 1] = done[-1] + t.pull_s
    half = steps // 2
    step_s = (done[-1] - done[half - 1]) / (steps - half)
    depth = [
        sum(1 for i in range(j + 1, steps) if ready[i] <= max(done[j - 1], ready[j]))
        for j in range(half, steps)
    ]
    lags = [j - version_of[j] for j in range(half, steps)]
    return Prediction(step_s, sum(depth) / len(depth), sum(lags) / len(lags))


def speedup(sync_sample_s: float, sync_train_s: float, t: Terms) -> float:
    """Predicted sync seconds per step over async seconds per step."""
    return (sync_sample_s + sync_train_s) / simulate(t).step_s

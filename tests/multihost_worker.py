"""One process of a run in tests/test_multihost.py: `python -m ess_jax.main` as a pod host runs
it, plus two hooks from the test (README's style): a coin-flip reward `coin` (a random policy
earns it half the time, so the updates really move the policy), and a stderr line naming the
step each process restored (`restored step N`; None for a fresh run). For tests/test_groups.py,
two faults planted by environment variables: ESS_JAX_TEST_DIE_IN_PUSH=V kills the trainer group
(SIGKILL, itself) in the middle of pushing params version V (registered for the pull, not yet
announced); ESS_JAX_TEST_DIE_ON_BUDGET=1 kills the sampler group when the first lag budget
arrives (the trainer has trained on batch 0 and goes on: its next push finds the channel
broken). Two signals: ESS_JAX_TEST_SIGTERM_ON_BATCH=1 sends the trainer SIGTERM as it takes its
first batch from the sampler group; ESS_JAX_TEST_SIGTERM_ON_BUDGET=1 sends the sampler group
SIGTERM when the first lag budget arrives.

The test sets the environment: XLA_FLAGS (fake CPU devices, one XLA thread), JAX_PLATFORMS,
and for a multi-process run JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID.
"""

import os
import signal
import sys
import zlib

import jax
from absl import app

from ess_jax import main, rewards
from ess_jax.rl import actor_learner, group_channel, groups, train


def coin_reward(text: str, example: dict) -> float:
    return float(zlib.crc32(text.encode()) % 2)


def _logged_restore(restore):
    def wrapped(self):
        step = restore(self)
        print(f"process {jax.process_index()}: restored step {step}", file=sys.stderr, flush=True)
        return step

    return wrapped


def _die_in_push(send, version: int):
    def wrapped(self, msg):
        if isinstance(msg, group_channel.Params) and msg.version == version:
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, msg)

    return wrapped


def _die_on_budget(set_budget, sig=signal.SIGKILL):
    def wrapped(self, budget):  # the trainer has trained on a batch and is going on
        os.kill(os.getpid(), sig)
        return set_budget(self, budget)

    return wrapped


def _sigterm_on_first_batch(next_batch):
    sent = []

    def wrapped(self):
        batch = next_batch(self)
        if not sent:
            sent.append(batch.index)
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    return wrapped


if __name__ == "__main__":
    rewards.REWARDS["coin"] = coin_reward
    if v := os.environ.get("ESS_JAX_TEST_DIE_IN_PUSH"):
        groups.RemoteLink._send = _die_in_push(groups.RemoteLink._send, int(v))
    if os.environ.get("ESS_JAX_TEST_DIE_ON_BUDGET"):
        actor_learner.Sampler.set_budget = _die_on_budget(actor_learner.Sampler.set_budget)
    if os.environ.get("ESS_JAX_TEST_SIGTERM_ON_BUDGET"):
        actor_learner.Sampler.set_budget = _die_on_budget(
            actor_learner.Sampler.set_budget, signal.SIGTERM
        )
    if os.environ.get("ESS_JAX_TEST_SIGTERM_ON_BATCH"):
        groups.RemoteLink.next_batch = _sigterm_on_first_batch(groups.RemoteLink.next_batch)
    train.Run.try_restore = _logged_restore(train.Run.try_restore)
    app.run(main.main, flags_parser=main._parse_flags)

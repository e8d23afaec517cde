"""One process of a run in tests/test_multihost.py: `python -m ess_jax.main` as a pod host runs
it, plus two hooks from the test (README's style): a coin-flip reward `coin` (a random policy
earns it half the time, so the updates really move the policy), and a stderr line naming the
step each process restored (`restored step N`; None for a fresh run).

The test sets the environment: XLA_FLAGS (fake CPU devices, one XLA thread), JAX_PLATFORMS,
and for a multi-process run JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID.
"""

import sys
import zlib

import jax
from absl import app

from ess_jax import main, rewards
from ess_jax.rl import train


def coin_reward(text: str, example: dict) -> float:
    return float(zlib.crc32(text.encode()) % 2)


def _logged_restore(restore):
    def wrapped(self):
        step = restore(self)
        print(f"process {jax.process_index()}: restored step {step}", file=sys.stderr, flush=True)
        return step

    return wrapped


if __name__ == "__main__":
    rewards.REWARDS["coin"] = coin_reward
    train.Run.try_restore = _logged_restore(train.Run.try_restore)
    app.run(main.main, flags_parser=main._parse_flags)

"""Entry point: `python -m ess_jax.main --config=configs/quickstart.py --workdir=runs/qs`.

Any config field can be overridden: `--config.objective.name=grpo --config.train.steps=10`.
"""

from __future__ import annotations

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints, plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> None:
    del argv
    # orbax logs every save at INFO through absl; keep the console to the progress bars
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    from ess_jax import train  # after flag parsing: jax initialises devices on import of train

    png = train.run(_CONFIG.value, _WORKDIR.value)
    print(f"done: metrics in {_WORKDIR.value}/metrics.jsonl, curves in {png}")


if __name__ == "__main__":
    app.run(main)

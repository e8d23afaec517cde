"""Entry point: `python -m ess_jax.main --config=configs/quickstart.py --workdir=runs/qs`.

Any config field can be overridden: `--config.objective.name=grpo --config.train.steps=10`.
Resuming a workdir with other values than its checkpoint's is refused except for
`workdir.SAFE_ON_RESUME` (train.steps, eval.*, ...) and `--allow_config_change=field,...`.
Errors a user can fix (a config value, a busy workdir, an unreadable checkpoint) print as one
line; `--verbose` or ESS_JAX_VERBOSE=1 shows the traceback. SIGTERM (preemption) and Ctrl-C write
a checkpoint, print one `stopped:` line and exit with 143 and 130 (`ess_jax.rl.preemption`: a
second Ctrl-C quits at once). A Ctrl-C while the run loads its model and data (nothing to
save yet) prints one `stopped:` line and exits with 130 too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from ess_jax.config import names, presets
from ess_jax.config import schema as config_checks  # no jax: a bad config fails before jax
from ess_jax.config.schema import EXIT_USER_ERROR, UserError, error_line

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints, plots.")
_ALLOW = flags.DEFINE_list(
    "allow_config_change",
    [],
    "Config fields or sections (e.g. optim.lr,rollout) that may differ from the checkpoint's "
    "when resuming; train.steps, train.checkpoint_every, eval and mesh always may.",
)
_VERBOSE = flags.DEFINE_bool("verbose", False, "Tracebacks for config/workdir/checkpoint errors.")
_ROLE = flags.DEFINE_enum(
    "role",
    None,
    ["trainer", "sampler"],
    "train.mode async in two programs (ess_jax/rl/groups.py): this one's group; sets "
    "train.async_role. Start both with the same command otherwise.",
)
flags.mark_flags_as_required(["config", "workdir"])


def _verbose(argv=()) -> bool:
    parsed = flags.FLAGS.is_parsed() and _VERBOSE.value
    return parsed or "--verbose" in argv or os.environ.get("ESS_JAX_VERBOSE", "") not in ("", "0")


def _exit(msg: str, code: int = EXIT_USER_ERROR, prefix: str = "error: ") -> None:
    print(error_line(msg, prefix), file=sys.stderr)  # one line
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: a failed orbax restore can leave asyncio tasks whose teardown at interpreter
    # exit prints "Event loop is closed" tracebacks under the one-line error. The run's own
    # cleanup (checkpoint wait, workdir lock) has already happened in train.run's finally.
    os._exit(code)


def _config_root_on_path(argv: list[str]) -> None:
    """Config files import `configs.*` (configs/mini/common.py): the `configs` package above the
    --config file goes first on sys.path, so a command run from any directory loads it."""
    root = names.config_root(names.config_file(argv) or "")
    if root and root not in sys.path:
        sys.path.insert(0, root)


def _parse_flags(argv: list[str]) -> list[str]:
    _config_root_on_path(argv)
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # flags.Error, or ml_collections' KeyError for an unknown field
        if _verbose(argv):
            raise
        _exit(names.explain_flag_error(argv, e))


def _config():
    try:
        config = _CONFIG.value
        config.to_dict  # noqa: B018 - a config file that did not load raises its OSError here
    except OSError as e:
        last = str(e).strip().splitlines()[-1].strip()
        raise config_checks.ConfigError(f"--config: {last}") from e
    return config


def main(argv) -> None:
    del argv
    # orbax logs every save at INFO through absl; keep the console to the progress bars
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    try:
        config = _config()
        if _ROLE.value:
            config.train.async_role = _ROLE.value
        config_checks.check(config)
        presets.set_memory_fraction()  # the planner's share of GPU memory, before jax starts
        if config.train.async_role == "sampler":  # draws for the trainer group; no workdir
            from ess_jax.rl import sampler_group

            reason, ok = sampler_group.serve(config)
            if not ok:
                _exit(f"{reason}; the sampler group exits")
            _exit(f"{reason}; the sampler group exits", 0, prefix="stopped: ")
        from ess_jax.rl import train  # jax initialises devices on import of train

        png = train.run(config, _WORKDIR.value, allow_config_change=_ALLOW.value)
    except UserError as e:
        if _verbose():
            raise
        _exit(str(e))
    except KeyboardInterrupt as e:  # SIGTERM or Ctrl-C (preemption.Preempted): checkpoint written
        if not getattr(e, "exit_code", None):  # Ctrl-C outside the steps' handler
            if _verbose():
                raise
            msg = "Ctrl-C while loading or closing the run; rerun the same command to resume"
            _exit(f"{msg} from the last checkpoint, if any", 128 + signal.SIGINT, "stopped: ")
        _exit(f"{e}; rerun the same command to resume", e.exit_code, prefix="stopped: ")
    print(f"done: metrics in {_WORKDIR.value}/metrics.jsonl, curves in {png}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

"""Researcher mistakes that used to run with rc 0 and learn nothing: a typo inside a config file,
an unknown `:ARM`, another framework's field name, a rollout whose every advantage is 0, and a
run whose policy has gone uniform or whose rewards stopped varying. Most tests need no jax
run; the CLI ones stop before jax is imported."""

import glob
import importlib
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from ess_jax.config import names
from ess_jax.config import schema as config_checks
from ess_jax.config.defaults import base_config
from ess_jax.config.schema import ConfigError
from ess_jax.data import RowLayout, char_tokenizer
from ess_jax.rl import advantages, health
from ess_jax.rl import rollout as rollout_lib
from ess_jax.sampling.engine import Generation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(tmp_path, config, *args):
    """(returncode, non-empty stderr lines) of the entry point; the workdir must not appear."""
    env = {k: v for k, v in os.environ.items() if k not in ("ESS_JAX_VERBOSE", "XLA_FLAGS")}
    p = subprocess.run(
        [sys.executable, "-m", "ess_jax.main", f"--config={config}", f"--workdir={tmp_path}/run"]
        + list(args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not (tmp_path / "run").exists()
    return p.returncode, [line for line in p.stderr.splitlines() if line.strip()]


def tiny(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict(overrides)
    return c


def config_modules():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        mod = importlib.import_module(name)
        if hasattr(mod, "get_config"):
            yield mod


def shipped_configs():
    """(module, arg) of every config file and arm (paper arms also on their `tiny` preset)."""
    for mod in config_modules():
        arms = getattr(mod, "ARMS", (None, "tiny"))
        paper = ".paper." in mod.__name__
        for arm in arms:
            yield mod, arm
            if paper:
                yield mod, f"{arm},tiny"


# ------------------------------------------------------------------ typo inside a config file


def test_typo_inside_a_config_file_is_refused_naming_the_closest_field(tmp_path):
    """Catches a field a config file sets that the schema does not know (`c.optim.lrr = 1`)
    running with the default lr and landing in config.json: it is refused like a command-line
    typo, in one line naming the closest field."""
    c = tiny()
    c.optim.lrr = 1.0
    msg = r"^config\.optim\.lrr: no such field; did you mean optim\.lr\?$"
    with pytest.raises(ConfigError, match=msg):
        config_checks.check(c)
    c = tiny()
    c.sampling = {"temperature": 0.7}  # a whole unknown section
    with pytest.raises(ConfigError, match=r"^config\.sampling\.temperature: no such field"):
        config_checks.check(c)
    typo = tmp_path / "typo_config.py"
    typo.write_text(
        "from configs import quickstart\n\n\n"
        "def get_config(arg=None):\n"
        "    c = quickstart.get_config('tiny')\n"
        "    c.optim.lrr = 1\n"
        "    return c\n"
    )
    rc, err = cli(tmp_path, typo)
    assert (rc, err) == (2, ["error: config.optim.lrr: no such field; did you mean optim.lr?"])


def test_every_shipped_config_sets_only_known_fields():
    """Catches the field check refusing a shipped config: the only keys a config may add are
    those of names.FREE_FORM mappings (task.difficulty's dials, e.g. {"digits": 2})."""
    seen_free_form = False
    for mod, arg in shipped_configs():
        c = mod.get_config(arg)
        config_checks.check_fields(c)
        seen_free_form |= bool(c.task.difficulty)
    assert seen_free_form  # not vacuous: some configs do add task.difficulty keys
    c = tiny()
    c.task.difficulty = {"digits": 2, "words": True}
    config_checks.check_fields(c)


# ------------------------------------------------------------------ unknown arm


@pytest.mark.parametrize("mod", list(config_modules()), ids=lambda m: m.__name__)
def test_every_config_refuses_an_unknown_arm_listing_its_arms(mod):
    """Catches a config file that ignores an arm it does not know (`quickstart.py:tyny` ran the
    full quickstart): every config raises one line naming the bad arm and the valid ones."""
    with pytest.raises(ValueError) as e:
        mod.get_config("tyny")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("unknown arm 'tyny'; this file's arms: ")
    for arm in getattr(mod, "ARMS", ("tiny",)):
        assert arm in msg


def test_unknown_arm_on_the_command_line_is_one_line(tmp_path):
    """Catches an unknown arm that runs, or that prints a traceback instead of one line."""
    rc, err = cli(tmp_path, "configs/quickstart.py:tyny")
    assert (rc, err) == (
        2,
        [
            "error: config file configs/quickstart.py:tyny: ValueError: unknown arm 'tyny'; "
            "this file's arms: tiny (none: the full run)"
        ],
    )


# ------------------------------------------------------------------ names from other frameworks


@pytest.mark.parametrize(
    "typed,meant",
    [
        ("optim.learning_rate", "optim.lr"),
        ("learning_rate", "optim.lr"),
        ("sft.learning_rate", "sft.lr"),
        ("train.num_steps", "train.steps"),
        ("max_steps", "train.steps"),
        ("sft.max_steps", "sft.steps"),
        ("data.batch_size", "data.prompts_per_step"),
        ("num_generations", "rollout.group_size"),
        ("rollout.n", "rollout.group_size"),
        ("eval.max_completion_length", "eval.max_new_tokens"),
        ("optim.grad_clip", "optim.max_grad_norm"),
        ("objective.nam", "objective.name"),  # no alias: the closest spelling, as before
    ],
)
def test_a_name_from_another_framework_suggests_the_field_it_means(typed, meant):
    """Catches `--config.optim.learning_rate` suggesting optim.weight_decay (the closest
    spelling): a common name from TRL / verl / HF Trainer suggests the field it means, in the
    section typed when that section has one (sft.learning_rate -> sft.lr)."""
    assert names.unknown_field(base_config(), typed) == (
        f"config.{typed}: no such field; did you mean {meant}?"
    )


def test_every_alias_names_a_field():
    """Catches a renamed field leaving an alias that suggests a field that does not exist."""
    for typed, target in names.ALIASES.items():
        assert target in names.known_paths(), (typed, target)
        assert typed not in names.known_paths(), typed  # an alias never shadows a field


def test_learning_rate_on_the_command_line_suggests_optim_lr(tmp_path):
    """Catches the alias table not reaching the command line's one-line error."""
    rc, err = cli(tmp_path, "configs/quickstart.py:tiny", "--config.optim.learning_rate=1e-3")
    assert (rc, err) == (
        2,
        ["error: config.optim.learning_rate: no such field; did you mean optim.lr?"],
    )


# ------------------------------------------------------------------ runs that cannot learn


@pytest.mark.parametrize("mode", advantages.MODES)
def test_groups_of_one_or_of_equal_rewards_have_zero_advantage_in_every_mode(mode):
    """The premise of the refusals below: every advantage mode centres a reward on its group's
    mean, so groups of one sample, or of equal rewards (greedy samples), give 0 everywhere.
    Catches a new mode without that property (the refusals would then refuse a run that
    learns) and pins the premise on a case that can disagree (unequal rewards: not 0)."""
    r = jnp.array([0.0, 1.0, 1.0, 0.0, 0.5, 0.2])
    assert np.all(np.asarray(advantages.group_advantages(r, 1, mode)) == 0)
    equal = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert np.all(np.asarray(advantages.group_advantages(equal, 3, mode)) == 0)
    assert np.any(np.asarray(advantages.group_advantages(r, 3, mode)) != 0)


@pytest.mark.parametrize("mode", advantages.MODES)
@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rollout.group_size": 1}, r"^config\.rollout\.group_size: 1: .*advantage is 0"),
        ({"rollout.temperature": 0.0}, r"^config\.rollout\.temperature: 0 \(greedy\) .*advantage"),
    ],
)
def test_rollouts_whose_every_advantage_is_zero_are_refused(mode, overrides, message):
    """Catches `--config.rollout.group_size=1` or `--config.rollout.temperature=0` running with
    rc 0 and learning nothing (every group-relative advantage 0), in every advantage mode."""
    with pytest.raises(ConfigError, match=message):
        config_checks.check(tiny(**{"rollout.advantage_mode": mode, **overrides}))


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout.temperature": 0.0, "rollout.external_fraction": 0.5,
         "rollout.external_checkpoint": "ext/hf"},  # external rows differ from the policy's
        {"rollout.group_size": 1, "train.steps": 0},  # SFT only: no RL step
        {"rollout.group_size": 2, "rollout.temperature": 0.1},
    ],
)  # fmt: skip
def test_rollouts_that_can_learn_are_not_refused(overrides):
    """Catches the refusals over-reaching: a greedy policy mixed with an external model's
    samples, an SFT-only run, two samples at a low temperature all can learn (or do no RL)."""
    config_checks.check(tiny(**overrides))


def test_group_size_one_on_the_command_line_is_one_line(tmp_path):
    """Catches the refusal not reaching the command line (before jax, before the workdir)."""
    rc, err = cli(tmp_path, "configs/quickstart.py:tiny", "--config.rollout.group_size=1")
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: config.rollout.group_size: 1: ")


# ------------------------------------------------------------------ run-time warnings


def row(step, entropy=1.0, constant=0.5, **extra):
    return {"step": step, "entropy_proxy": entropy, "frac_groups_constant": constant, **extra}


def test_near_uniform_policy_warns_once_per_episode():
    """Catches a policy gone uniform (lr 1e6: entropy_proxy = log V from step 1) passing without
    a word, and a warning repeated every step instead of once when the condition starts."""
    v = 56
    watch = health.HealthWatch(v)
    near = health.UNIFORM_FRACTION * math.log(v)
    warned = [watch.update(row(s, e)) for s, e in enumerate([2.0, near - 1e-3, near, 4.0, 1.0])]
    assert [len(w) for w in warned] == [0, 0, 1, 0, 0]
    assert "step 2: the policy is near uniform" in warned[2][0] and "V = 56" in warned[2][0]
    assert len(watch.update(row(5, math.log(v)))) == 1  # a new episode warns again


def test_constant_rewards_warn_after_n_steps_in_a_row():
    """Catches every group's rewards constant (all advantages 0) for many steps passing without
    a word, a warning before CONSTANT_STEPS in a row, one counted across a varying step, and
    dynamic sampling's resampled batch (ds_groups_kept > 0: it trains) counted as constant."""
    n = health.CONSTANT_STEPS
    watch = health.HealthWatch(56)
    out = [watch.update(row(s, constant=1.0)) for s in range(n - 1)]
    out.append(watch.update(row(n - 1, constant=0.75)))  # one group varied: the streak restarts
    out += [watch.update(row(n + s, constant=1.0)) for s in range(n + 1)]
    fired = [i for i, w in enumerate(out) if w]
    assert fired == [2 * n - 1]
    assert f"equal for {n} steps in a row" in out[fired[0]][0]
    watch = health.HealthWatch(56)
    refilled = [watch.update(row(s, constant=1.0, ds_groups_kept=3)) for s in range(n + 1)]
    assert not any(refilled)
    emptied = [watch.update(row(s, constant=1.0, ds_groups_kept=0)) for s in range(n)]
    assert emptied[-1] and not any(emptied[:-1])


def test_rollout_metrics_feed_the_constant_reward_warning():
    """Catches the rollout's `frac_groups_constant` computed per row or over the batch instead of
    per group, or renamed so the watcher never sees it: two prompts of 2 samples, one group
    constant -> 0.5; both constant -> 1.0 and, CONSTANT_STEPS steps in a row, the warning."""
    tok = char_tokenizer()
    texts = []

    class FixedTexts:  # a rollout engine answering with `texts`, one token repeated
        def generate(self, prompts, pmask, sampling, rng):
            layout = RowLayout(len(prompts), sampling.num_samples)
            b, t = layout.num_rows, 2
            tokens = np.array([tok.encode(x, add_special_tokens=False)[:1] * t for x in texts])
            assert tokens.shape == (b, t)
            return Generation(
                tokens=tokens,
                response_mask=np.ones((b, t), bool),
                behaviour_logp=np.zeros((b, t), np.float32),
                sequences=np.concatenate([layout.repeat(prompts), tokens], 1),
                sequence_mask=np.concatenate([layout.repeat(pmask), np.ones((b, t), bool)], 1),
                version=np.zeros((b,), np.int32),
                layout=layout,
            )

    rcfg = base_config().rollout
    rcfg.group_size, rcfg.max_new_tokens = 2, 2
    batch = {
        "prompt_tokens": np.ones((2, 3), np.int32),
        "prompt_mask": np.ones((2, 3), bool),
        "examples": [{}, {}],
    }
    reward = lambda text, example: float(text.startswith("1"))  # noqa: E731

    def collect(samples):
        texts[:] = samples
        _, m = rollout_lib.collect(FixedTexts(), batch, tok, reward, rcfg, jax.random.key(0))
        return m

    assert collect(["1", "2", "1", "1"])["frac_groups_constant"] == 0.5
    watch = health.HealthWatch(tok.vocab_size)
    constant = collect(["2", "2", "1", "1"])
    assert constant["frac_groups_constant"] == 1.0 and constant["reward_std"] > 0
    warned = [watch.update({"step": s, **constant}) for s in range(health.CONSTANT_STEPS)]
    assert warned[-1] and not any(warned[:-1])


def test_the_training_loop_logs_the_watchers_warnings(tmp_path, monkeypatch, caplog):
    """Catches the watcher not wired into the loop (or fed another row than the step's): RL
    steps whose rows say every group is constant, the policy uniform, log both warnings once.
    The steps, checkpoints and plot are stubbed: only the loop around them runs."""
    from ess_jax.rl import actor_learner, train

    def rl_step(self, step):
        v = self.trainer.learner.ucfg.model.vocab_size
        return {**row(step, math.log(v), 1.0), "reward_mean": 0.0, "ess": 1.0, "loss": 0.0}

    monkeypatch.setattr(actor_learner.SyncLoop, "step", rl_step)
    monkeypatch.setattr(train.Run, "save", lambda self, step, force=False: None)
    monkeypatch.setattr(train, "plot_run", lambda workdir: "")
    steps = {"train.steps": health.CONSTANT_STEPS, "train.checkpoint_every": 100}
    c = tiny(**{"sft.steps": 0, "eval.every": 0, **steps})
    with caplog.at_level("WARNING"):
        train.run(c, str(tmp_path / "run"))
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("the policy is near uniform" in m for m in lines) == 1, lines
    assert sum(f"equal for {health.CONSTANT_STEPS} steps in a row" in m for m in lines) == 1


@pytest.mark.parametrize("field", ["num_train", "num_test"])
def test_more_examples_than_a_synthetic_task_has_is_a_config_error(field):
    """task.num_train / num_test above what a small problem space holds stops with the field's
    name and the count found. Catches: the task's ValueError escaping as a traceback from deep
    inside data loading."""
    from ess_jax.rl import experiment

    c = base_config()
    c.task.name = c.task.reward = "addition"
    c.task.difficulty = {"digits": 1}  # 100 problems in all
    c.task[field] = 5000
    with pytest.raises(ConfigError, match=rf"^config\.task\.{field}: .*found only \d+ distinct"):
        experiment.load_examples(c.task)

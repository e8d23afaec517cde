"""Fixed-choice string fields: every string field of base_config has a domain (CHOICES) or is
listed as free-form (FREE_STRINGS), a value outside its domain is refused in one line before
anything runs, and each domain is the set of values its code implements."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from ess_jax.config import names
from ess_jax.config import schema as config_checks
from ess_jax.config.defaults import base_config
from ess_jax.config.domains import KL_ESTIMATOR_NAMES, MODEL_DTYPES
from ess_jax.config.fields import CHOICES, FREE_STRINGS
from ess_jax.config.schema import ConfigError
from ess_jax.objectives import kl
from ess_jax.objectives.config import FULL_KL, ObjectiveConfig
from ess_jax.rl import advantages, optim, sft


def tiny(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict(overrides)
    return c


def test_every_string_field_has_a_domain_or_is_free_form():
    """Catches a string field whose record declares no string domain (a `Choice` for
    CHOICES, a `Free` for FREE_STRINGS: with neither, any value of optim.schedule or
    rollout.advantage_mode would pass the checks), a field in both tables, and a default outside
    its own choices."""
    fields = {p for p, v in names.leaves(base_config().to_dict()) if isinstance(v, str)}
    assert not set(CHOICES) & set(FREE_STRINGS)
    assert fields == set(CHOICES) | set(FREE_STRINGS)
    defaults = dict(names.leaves(base_config().to_dict()))
    assert all(defaults[p] in values for p, values in CHOICES.items())


@pytest.mark.parametrize(
    "path,value",
    [
        ("optim.schedule", "linear"),
        ("optim.schedule", "Cosine"),
        ("rollout.advantage_mode", "gae"),
        ("model.dtype", "fp32"),
        ("objective.kl_estimator", "k4"),
        ("objective.aggregation", "seq_mean"),
    ],
)
def test_a_value_outside_its_domain_is_one_line_before_anything_runs(path, value):
    """Catches optim.schedule="linear" silently running cosine, and rollout.advantage_mode="gae"
    passing every check to fail at the first rollout, after the SFT warm start: the jax-free
    check that main runs first must refuse them naming the field and its values."""
    valid = ", ".join(map(repr, CHOICES[path]))
    msg = rf"^config\.{re.escape(path)}: must be one of {re.escape(valid)}, got '{value}'$"
    with pytest.raises(ConfigError, match=msg):
        config_checks.check(tiny(**{path: value}))


def test_the_optimizer_refuses_a_schedule_it_does_not_implement():
    """Catches rl/optim.py's fallback: any schedule but "constant" (a typo, or none given) ran
    cosine decay. Pins the values of both schedules after the warmup."""
    cfg = {"lr": 1.0, "warmup_steps": 2, "total_steps": 12, "final_lr_fraction": 0.1}
    for bad in ("linear", None):
        with pytest.raises(ValueError, match=r"schedule .*: one of constant, cosine$"):
            optim.make_optimizer({**cfg, "schedule": bad})
    assert CHOICES["optim.schedule"] == ("constant", "cosine")
    constant = optim.learning_rate_schedule({**cfg, "schedule": "constant"})
    cosine = optim.learning_rate_schedule({**cfg, "schedule": "cosine"})
    np.testing.assert_allclose([constant(1), constant(7), constant(12)], [0.5, 1.0, 1.0])
    # cosine from lr at the warmup's end to lr / 10 at total_steps: halfway is 0.55
    np.testing.assert_allclose([cosine(1), cosine(7), cosine(12)], [0.5, 0.55, 0.1], rtol=1e-6)


def test_the_sft_warm_start_names_its_schedule(monkeypatch):
    """Catches the SFT warm start without a schedule of its own (the optimizer has no fallback
    and refuses it), or running another schedule than its docstring's."""
    seen = []

    def record(cfg):
        seen.append(dict(cfg))
        raise StopIteration  # the optimizer's config is all this test needs

    monkeypatch.setattr(sft, "make_optimizer", record)
    config = base_config()
    config.sft.steps = 3
    with pytest.raises(StopIteration):
        sft.warm_start(config, None, None, None, [], None)
    assert seen == [
        {
            "lr": config.sft.lr,
            "warmup_steps": config.sft.warmup_steps,
            "total_steps": 3,
            "max_grad_norm": 1.0,
            "schedule": "cosine",
            "final_lr_fraction": 0.1,
        }
    ]


def test_each_domain_is_what_its_code_implements():
    """Catches a domain that drifts from its code: a value the check accepts that the code
    refuses (an advantage mode, KL estimator or objective knob only one side knows), and a
    model.dtype that is no floating dtype."""
    rewards = jnp.asarray([0.0, 1.0, 1.0, 0.0])
    for mode in CHOICES["rollout.advantage_mode"]:
        assert advantages.group_advantages(rewards, 2, mode).shape == (4,)
    with pytest.raises(ValueError, match="gae"):
        advantages.group_advantages(rewards, 2, "gae")
    assert set(KL_ESTIMATOR_NAMES) == {*kl.KL_ESTIMATORS, FULL_KL}
    for field in ("kl_estimator", "ref_kl_estimator", "aggregation", "dual_version", "is_level"):
        for value in CHOICES[f"objective.{field}"]:
            ObjectiveConfig(**{field: value})
    assert all(jnp.issubdtype(jnp.dtype(d), jnp.floating) for d in MODEL_DTYPES)

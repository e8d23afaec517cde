"""Each config field is declared once: its record (config/fields.py, objective_fields.py) carries
its default, domain and meaning; base_config is built from the records, schema.check and
ObjectiveConfig check against them, and a value outside a field's domain is refused in one
line before anything runs. No model runs here."""

import math
import os
import re
import subprocess
import sys

import pytest

from configs import quickstart
from ess_jax.config import names
from ess_jax.config import schema as config_checks
from ess_jax.config.defaults import base_config
from ess_jax.config.domains import Choice, Domain, Flag, Free, FreeForm
from ess_jax.config.fields import RECORDS, ConfigFields
from ess_jax.config.knobs import Field, records
from ess_jax.config.schema import ConfigError
from ess_jax.objectives.config import ObjectiveConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = (Domain, Choice, Free, Flag, FreeForm)


def fields_without_records(config) -> list[str]:
    """The field paths of `config` that no record declares with a default, a domain and a
    one-line meaning."""
    bad = []
    for path, _ in names.leaves(config.to_dict()):
        record = RECORDS.get(path)
        ok = record is not None and isinstance(record.domain, KINDS)
        ok = ok and bool(record.meaning.strip()) and "\n" not in record.meaning
        if not ok:
            bad.append(path)
    return bad


def outside(domain):
    """A value the domain refuses, built from the domain itself."""
    if isinstance(domain, Domain):
        if domain.lo > -math.inf:
            return domain.lo if domain.lo_open else domain.lo - 1
        return domain.hi + 1 if domain.hi < math.inf else math.nan
    return {Choice: "not-a-choice", Free: 3, Flag: "yes", FreeForm: "x"}[type(domain)]


def test_every_field_of_base_config_has_its_record():
    """Catches a field added to base_config (or a config section) without its record: no
    domain would check it and no meaning would say what it does; a planted field without a
    record must fail the walk. Also a record whose default its own domain refuses, or whose
    default base_config does not carry (None for an optional knob, the objective's own), and a
    section record whose docstring does not say which section it is."""
    config = base_config()
    assert fields_without_records(config) == []
    values = dict(names.leaves(config.to_dict()))
    assert set(values) == set(RECORDS)
    for path, record in RECORDS.items():
        default = record.default
        assert default is None or isinstance(default, record.type), path
        for v in default if isinstance(default, tuple) else (default,):
            assert v is None or record.domain.contains(v), path
        assert values[path] == (None if record.domain.optional else default), path
    sections = [r for r in records(ConfigFields) if not isinstance(r, Field)]
    assert [p for p, cls in sections if not (cls.__doc__ or "").startswith(f"{p}: ")] == []
    planted = base_config()
    planted.optim.momentum = 0.9
    assert fields_without_records(planted) == ["optim.momentum"]


@pytest.mark.parametrize("path", sorted(RECORDS))
def test_a_value_outside_each_fields_domain_is_refused_naming_it(path):
    """Catches a field whose record declares a domain that schema.check does not apply (the
    value would run, or fail deep in the run): each field, set outside its domain on the
    quickstart config, is refused in one line naming it and what it must be."""
    domain = RECORDS[path].domain
    config = quickstart.get_config("tiny").to_dict()
    section, _, field = path.rpartition(".")
    node = config
    for part in section.split(".") if section else ():
        node = node[part]
    node[field] = outside(domain)
    msg = rf"^config\.{re.escape(path)}: must be "
    with pytest.raises(ConfigError, match=msg) as err:
        config_checks.check(config)
    assert "\n" not in str(err.value)


def test_objective_config_is_its_record():
    """Catches a second copy of an objective knob's default or domain: ObjectiveConfig's fields,
    their order and defaults must be the objective section's records, and each numeric, choice
    or bool knob outside its record's domain must be refused naming the knob."""
    records = {p.split(".", 1)[1]: r for p, r in RECORDS.items() if p.startswith("objective.")}
    made = ObjectiveConfig()
    assert list(records) == [f for f in made.__dataclass_fields__]
    assert {f: getattr(made, f) for f in records} == {f: r.default for f, r in records.items()}
    for field, record in records.items():
        if isinstance(record.domain, Free):
            continue  # objective.name: the registry's (registry.check)
        with pytest.raises(ValueError, match=rf"{field}"):
            ObjectiveConfig(**{field: outside(record.domain)})


@pytest.mark.parametrize(
    "flag,line",
    [
        (
            "--config.optim.schedule=foo",
            "error: config.optim.schedule: must be one of 'constant', 'cosine', got 'foo'",
        ),
        (
            "--config.rollout.advantage_mode=gae",
            "error: config.rollout.advantage_mode: must be one of 'grpo', 'drgrpo', 'rloo', "
            "got 'gae'",
        ),
    ],
)
def test_a_choice_outside_its_record_is_one_line_before_anything_runs(tmp_path, flag, line):
    """Catches optim.schedule=foo silently running another schedule and rollout.advantage_mode=gae
    passing every check to fail at the first rollout, after the SFT warm start: the entry point
    must end in one line naming the field, exit status 2, before the workdir exists."""
    env = {k: v for k, v in os.environ.items() if k not in ("ESS_JAX_VERBOSE", "XLA_FLAGS")}
    workdir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "ess_jax.main", "--config=configs/quickstart.py:tiny"]
        + [f"--workdir={workdir}", flag],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (p.returncode, [s for s in p.stderr.splitlines() if s.strip()]) == (2, [line])
    assert not workdir.exists()

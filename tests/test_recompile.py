"""No XLA compilation after the first RL step: every later step (and eval) reuses its programs.

Compilations are counted with jax.monitoring's backend-compile event, which XLA compilation of
any jitted function or eager op emits (a hit in jit's in-memory cache emits nothing). A count,
not a timing: it holds on any machine load.
"""

import contextlib

import jax
import pytest
from test_train import coin_reward, tiny_config

from ess_jax.rl import dynamic_sampling, train

# jax._src.dispatch.BACKEND_COMPILE_EVENT; should jax rename it, the warm-up check below fails
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiled_functions():
    """The names ("jit(<fn>)") of the functions XLA compiles inside the block."""
    names = []

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE:
            names.append(kwargs.get("fun_name", "?"))

    # a hit in the persistent cache (tests/conftest.py) loads a program without the event
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", cache_on)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # P3O on-policy: one update per batch
        # a stale sampler (its params now come from the history, copied: from step 2 on,
        # versions the trainer produced) and two updates per batch
        {"rollout.lag": 1, "train.updates_per_batch": 2, "data.prompts_per_step": 4},
    ],
    ids=["p3o", "lag1_two_updates"],
)
def test_no_compilation_after_the_first_rl_step(tmp_path, monkeypatch, overrides):
    """Catches anything that makes a later step compile again: a jitted step rebuilt or keyed
    on the step (a new `jax.jit` object per call, a Python value that changes every step as a
    static argument or closure constant), an input whose shape, dtype, weak type or sharding
    drifts after the first update (e.g. a Python int put into the state, params coming back
    from the history in another layout), or eval compiling again once the policy has trained.
    A step whose prompts land in a bucket not seen before may compile (one program per
    bucket); with the addition task every prompt fits the first one."""
    c = tiny_config(**overrides)
    c.train.steps = 4  # the learning-rate schedule's length; nothing compiles on it
    prompt_lens = []
    real_collect = dynamic_sampling.collect_batch

    def collect(*args, **kwargs):
        rollout, metrics = real_collect(*args, **kwargs)
        prompt_lens.append(rollout.prompt_len)
        return rollout, metrics

    monkeypatch.setattr(dynamic_sampling, "collect_batch", collect)
    run = train.Run(c, str(tmp_path))
    run.reward_fn = coin_reward
    run.trainer.history.push(
        0, run.trainer.state.params
    )  # as Run.run does: version 0 in the train layout

    # warm-up, in Run.run's order: eval at step 0, then the first step compiles everything
    with compiled_functions() as warm:
        run.evaluate(0)
        run.rl_step(0)
    # the listener hears compiles: at least the train step's (a new jit per Run; the sampler's
    # programs and eager ops may already be cached by earlier tests in the session)
    assert warm, "no compile heard: has jax renamed its backend-compile event?"

    checked, compiles = [], {}
    for label, call in [
        ("rl_step(1)", lambda: run.rl_step(1)),
        ("rl_step(2)", lambda: run.rl_step(2)),
        ("evaluate(2)", lambda: run.evaluate(2)),
        ("rl_step(3)", lambda: run.rl_step(3)),
    ]:
        seen = set(prompt_lens)
        with compiled_functions() as names:
            call()
        if label.startswith("rl_step") and prompt_lens[-1] not in seen:
            continue  # a new prompt bucket: its programs compile once, legitimately
        checked.append(label)
        if names:
            compiles[label] = names
    assert compiles == {}, f"recompiled after the first step: {compiles}"
    assert len(checked) >= 3, prompt_lens  # not vacuous (on addition, all four are checked)

"""train.mode "async" (ess_jax/rl/actor_learner.py) on 8 fake CPU devices split 4 + 4: the
synchronous path unchanged, each row's pi_b against a re-score with its recorded version,
checkpoint / resume with the queue dropped, a sampler crash, Ctrl-C and SIGTERM; the ESS
pacing rule (ess_jax/rl/pacing.py) on a synthetic ESS sequence; the async config checks.

The runs share their compiled programs (same model, meshes and shapes): the first one compiles.
"""

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from test_train import coin_reward, tiny_config

from ess_jax import objectives as obj_lib
from ess_jax.config import schema
from ess_jax.data import char_tokenizer
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.model import scoring
from ess_jax.rl import (
    actor_learner,
    async_cost,
    device_split,
    dynamic_sampling,
    experiment,
    preemption,
    train,
)
from ess_jax.rl.metrics import read_metrics
from ess_jax.rl.pacing import LagController

VOLATILE = ("tokens_per_s", "sample_s", "step_s")
ASYNC = {
    "train.mode": "async",
    "rollout.max_lag": 2,
    "rollout.target_ess": 0.99,  # paced: the stale steps' ESS falls under it
    "train.steps": 5,
    "optim.lr": 3e-3,
}


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


# The jitted RL updates, shared by the runs of one config (`make_rl_step` is a pure function of
# the config and the mesh, and equal meshes take each other's arrays): each run would otherwise
# compile its own, about 10 s on a 2-core machine.
_STEPS: dict = {}


def _run(config, workdir, learn_hook=None, reward=coin_reward, steps_of=None):
    """A Run with the coin reward; `learn_hook(run, step, real_learn, *args)` wraps `learn`.
    `steps_of`: a config whose jitted RL steps this run's are (one that differs from `config`
    in rollout fields only: the steps do not read them)."""
    run = train.Run(config, str(workdir))
    run.reward_fn = reward
    run.trainer.learner.compiled = _STEPS.setdefault(str(steps_of or config), {})
    if learn_hook is not None:
        real = run.trainer.learn
        run.trainer.learn = lambda step, *a: learn_hook(run, step, real, *a)
    return run


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "ess_jax-sampler" and t.is_alive()]


def test_sync_rows_are_unchanged_by_the_dispatch_and_the_async_fields(tmp_path):
    """Catches the sync loop changing under train.mode: `Run.run` (through `Run.loop`, with
    every async field set to a non-default value, mode "sync") must write the rows that the
    sync step function `Run.rl_step`, called step by step, computes (timings aside)."""
    plain = tiny_config(**{"train.steps": 2})
    ref = _run(plain, tmp_path / "ref")
    ref.sft()
    ref.trainer.history.push(0, ref.trainer.state.params)
    ref_rows = [ref.rl_step(s) for s in range(2)]
    ref.close()
    knobs = {
        "train.steps": 2,
        "train.async_rollout_devices": 2,
        "train.sync_every": 2,
        "rollout.max_lag": 3,
        "rollout.target_ess": 0.5,
    }
    run = _run(tiny_config(**knobs), tmp_path / "run")
    # the same programs: the configs differ in async fields only
    run.trainer.learner.compiled = ref.trainer.learner.compiled
    assert run.rollout_mesh is None and run.mesh.size == 8
    run.run()
    rows = read_metrics(tmp_path / "run")
    assert _strip(rows) == _strip(ref_rows)


def stale_async_run(config, workdir, reward=coin_reward, steps_of=None):
    """Runs `config` (train.mode "async") with a trainer that sleeps 0.3 s per step, so that
    the sampler runs ahead to its lag budget: (model config, {version: params}, [(step,
    version, rollout)] of every batch the trainer took, the metrics rows)."""
    params, batches = {}, []

    def hook(run, step, learn, rollout, metrics, version, params_b, t0):
        if not params:
            params[step] = jax.device_get(run.trainer.state.params)  # version `step` (the start)
        time.sleep(0.3)
        batches.append((step, version, rollout))
        row = learn(step, rollout, metrics, version, params_b, t0)
        params[step + 1] = jax.device_get(run.trainer.state.params)
        return row

    run = _run(config, workdir, hook, reward, steps_of)
    assert run.mesh.size == 4 and run.rollout_mesh.size == 4
    assert not set(run.mesh.devices.flat) & set(run.rollout_mesh.devices.flat)
    run.run()
    return run.model_cfg, params, batches, read_metrics(workdir)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """`stale_async_run` of ASYNC: 5 steps, max_lag 2, ESS-paced."""
    return stale_async_run(tiny_config(**ASYNC), tmp_path_factory.mktemp("stale"))


_score = jax.jit(scoring.token_logprobs, static_argnums=0, static_argnames="start")


def max_rescore_error(cfg, params, rollout, rows=None) -> float:
    """The largest |re-scored - recorded| pi_b log-prob over the trained tokens (float32) of
    the rollout's `rows` (a bool per row; None: all)."""
    logp = _score(cfg, params, rollout.tokens, rollout.attn_mask, start=rollout.prompt_len)
    mask = np.asarray(rollout.loss_mask) > 0
    if rows is not None:
        mask = mask & np.asarray(rows)[:, None]
    return float(np.abs(np.asarray(logp) - rollout.behaviour_logp)[mask].max())


def test_each_rows_pi_b_is_its_recorded_versions_policy(stale_run):
    """Catches a row tagged with the wrong policy version (a planted off-by-one fails: the
    version before it re-scores > 1e-4 off), params pushed late or not at all, and the lag
    bound broken, and ESS pacing left unwired: every row's recorded pi_b must equal a float32
    re-score (independent: teacher-forced, one device) with the params the trainer held at that
    version, to 1e-5, and each row's lag budget the pacing rule's answer to the ESS so far."""
    cfg, params, batches, rows = stale_run
    assert [s for s, _, _ in batches] == list(range(5))
    for step, version, rollout in batches:
        (tagged,) = set(np.asarray(rollout.policy_version).tolist())
        assert max_rescore_error(cfg, params[tagged], rollout) < 1e-5, (step, tagged)
        assert tagged == version and 0 <= step - version <= ASYNC["rollout.max_lag"]
        if version >= 1:  # the planted off-by-one: the previous version must not pass
            assert max_rescore_error(cfg, params[version - 1], rollout) > 1e-4
    lags = [r["lag_max"] for r in rows]
    assert max(lags) == ASYNC["rollout.max_lag"], lags  # the sampler really ran ahead
    # the pacing is wired: each row's budget is the rule's answer to the ESS logged so far
    pacer = LagController(ASYNC["rollout.max_lag"], 0, ASYNC["rollout.target_ess"])
    budgets = [r["lag_budget"] for r in rows]
    assert budgets == [pacer.update(r["ess"]) for r in rows] and min(budgets) < max(lags)
    assert [r["policy_lag"] for r in rows] == [s - v for s, v, _ in batches]
    assert all(0 <= r["queue_depth"] <= ASYNC["rollout.max_lag"] + 1 for r in rows)
    assert not _sampler_threads()


def test_async_rows_carry_the_mismatch_of_the_trained_policy_against_pi_b(stale_run):
    """Catches async rows without the sync loop's mismatch metrics (objectives.MISMATCH_KEYS),
    non-finite ones, or ones measured against the wrong policy (e.g. pi_b against itself, 0
    at any lag): each row's logratio_max and seq_logratio_mean must equal a float64 numpy
    re-computation from an independent re-score (one device) with the params the trainer held
    at the step's start, against the batch's recorded pi_b (1e-4)."""
    cfg, params, batches, rows = stale_run
    for row, (step, _, rollout) in zip(rows, batches):
        assert all(np.isfinite(row[k]) for k in obj_lib.MISMATCH_KEYS), row
        logp = _score(
            cfg, params[step], rollout.tokens, rollout.attn_mask, start=rollout.prompt_len
        )
        mask = np.asarray(rollout.loss_mask) > 0
        log_ratio = np.where(mask, np.asarray(logp, np.float64) - rollout.behaviour_logp, 0.0)
        assert row["logratio_max"] == pytest.approx(np.abs(log_ratio).max(), abs=1e-4), step
        want = log_ratio.sum() / mask.any(-1).sum()
        assert row["seq_logratio_mean"] == pytest.approx(want, abs=1e-4), step
    assert max(r["logratio_max"] for r in rows) > 1e-3  # stale batches: pi_theta moved away


def test_a_resumed_paced_run_keeps_its_lag_budget(tmp_path, monkeypatch):
    """Catches the ESS pacing restarting from max_lag on resume (its state not in the
    checkpoint, or restored after the sampler started with the initial budget): a Ctrl-C at
    the start of step 3 checkpoints step 3; the resumed run's controller must hold the budget
    and running ESS the interrupted one had after step 2, and every row of both runs the
    budget that the rule (pacing.py), fed the ESS of every row since step 0, gives, as in an
    uninterrupted run."""
    config, seen = tiny_config(**ASYNC), {}

    def interrupt(run, step, learn, *args):
        if step == 3:
            seen["saved"] = run.pacer.state()  # after step 2's update: what step 3 starts with
            raise KeyboardInterrupt
        return learn(step, *args)

    def resume(run, step, learn, *args):
        seen.setdefault("restored", (step, run.pacer.state()))
        return learn(step, *args)

    with pytest.raises(KeyboardInterrupt):
        _run(config, tmp_path, interrupt).run()
    sampler_init = actor_learner.Sampler.__init__

    def spy(self, *args, **kwargs):  # the budget the resumed run's sampler starts drawing with
        seen.setdefault("sampler_budget", kwargs["budget"])
        sampler_init(self, *args, **kwargs)

    monkeypatch.setattr(actor_learner.Sampler, "__init__", spy)
    _run(config, tmp_path, resume).run()
    assert seen["saved"]["running"] is not None
    assert seen["restored"] == (3, seen["saved"])
    assert seen["sampler_budget"] == seen["saved"]["budget"]
    rows = read_metrics(tmp_path)
    pacer = LagController(ASYNC["rollout.max_lag"], 0, ASYNC["rollout.target_ess"])
    assert [r["step"] for r in rows] == list(range(5))
    assert [r["lag_budget"] for r in rows] == [pacer.update(r["ess"]) for r in rows]


def test_sigterm_and_ctrl_c_checkpoint_and_the_resume_loses_and_repeats_no_prompt(tmp_path):
    """Catches a checkpoint that saves the sampler's read-ahead position (the queued batches'
    prompts would be lost) or rewinds too far (trained twice), a sampler thread left running
    after the interrupt, and a missing checkpoint: a SIGTERM during step 1 and a Ctrl-C at the
    start of step 3 each stop both sides with a checkpoint, and over the three runs the trainer
    takes exactly the prompts of a fresh data stream, in order, and writes each row once."""
    config = tiny_config(**ASYNC)
    taken = []

    def make_hook(signal_at=None, ctrl_c_at=None):
        def hook(run, step, learn, rollout, *rest):
            if step == ctrl_c_at:
                raise KeyboardInterrupt  # before the update: the step is redone
            row = learn(step, rollout, *rest)
            taken.append((step, rollout.tokens[:, : rollout.prompt_len]))
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # held, raised at the step's end
            return row

        return hook

    with pytest.raises(preemption.Preempted):
        _run(config, tmp_path, make_hook(signal_at=1)).run()
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2
    assert not _sampler_threads()
    with pytest.raises(KeyboardInterrupt):
        _run(config, tmp_path, make_hook(ctrl_c_at=3)).run()
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 3
    assert not _sampler_threads()
    _run(config, tmp_path, make_hook()).run()

    examples = experiment.load_examples(config.task)[0]
    fresh = experiment.train_batcher(config, examples, char_tokenizer())
    assert [s for s, _ in taken] == list(range(5))
    group = config.rollout.group_size
    for (step, prompts), expected in zip(taken, (next(fresh) for _ in range(5))):
        np.testing.assert_array_equal(
            prompts, np.repeat(expected["prompt_tokens"], group, axis=0), err_msg=f"step {step}"
        )
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(5))


def test_a_sampler_crash_stops_the_run_with_its_traceback(tmp_path, monkeypatch):
    """Catches a crashed sampler thread leaving the trainer waiting forever on the queue (the
    run must end within the timeout) or hiding the cause: the error is a SamplerError whose
    cause is the planted exception, with its traceback."""
    real, calls = dynamic_sampling.collect_batch, []

    def collect(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("planted in the sampler")
        return real(*args, **kwargs)

    monkeypatch.setattr(dynamic_sampling, "collect_batch", collect)
    run, out = _run(tiny_config(**ASYNC), tmp_path), []

    def target():
        try:
            run.run()
        except BaseException as e:
            out.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run hangs after the sampler crashed"
    (err,) = out
    assert isinstance(err, actor_learner.SamplerError)
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert err.__cause__.__traceback__ is not None
    assert not _sampler_threads()


def test_ess_pacing_rule_on_a_synthetic_ess_sequence():
    """Catches a pacing rule that moves the wrong way, overshoots max_lag, drops under the
    floor (sync_every - 1, where the sampler would wait forever) or ignores the smoothing:
    the budgets are computed by hand from the rule in pacing.py's docstring."""
    c = LagController(max_lag=4, floor=1, target=0.9)
    ess = [0.95, 0.80, 0.80, 0.99, 0.99, 0.99, 0.99, 0.99, 0.5]
    # running: 0.95, 0.875, 0.8375, 0.91375, 0.951875, 0.97094, 0.98047, 0.98523, 0.74262
    assert [c.update(e) for e in ess] == [4, 2, 1, 2, 3, 4, 4, 4, 2]
    assert c.running == pytest.approx(0.742617, abs=1e-6)
    off = LagController(max_lag=3, floor=0, target=0.0)
    assert [off.update(e) for e in (0.1, 0.01)] == [3, 3]
    with pytest.raises(ValueError):
        LagController(max_lag=1, floor=2, target=0.5)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"train.sync_every": 3, "rollout.max_lag": 1}, "rollout.max_lag"),
        ({"rollout.lag": 1}, "rollout.lag"),
        ({"objective.kl_estimator": "full", "model.logits_chunk": 8}, "objective.kl_estimator"),
        ({"train.async_rollout_devices": 8}, "train.async_rollout_devices"),
        (
            {"train.async_rollout_devices": 3, "train.async_rollout_tensor": 2},
            "train.async_rollout_tensor",
        ),
        ({"train.mode": "overlap"}, "train.mode"),
    ],
)
def test_async_config_mistakes_are_one_line_errors(overrides, field):
    """Catches an async config that would hang (a lag budget under sync_every - 1), mix the
    sync loop's simulated lag in, need per-version params it does not keep ("full" KL), or
    leave a side with no device: a ConfigError naming the field, before anything compiles."""
    c = tiny_config(**{"train.mode": "async", **overrides})
    with pytest.raises(schema.ConfigError, match=rf"config\.{field}"):
        experiment.validate(c)


def test_async_with_several_processes_is_refused(monkeypatch):
    """Catches a multi-host async run starting (JAX's multi-controller model needs every
    process to launch the same programs in the same order): one line naming train.mode."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(schema.ConfigError, match=r"config\.train\.mode: 'async' runs on one"):
        device_split.check(tiny_config(**{"train.mode": "async"}))


def test_cost_model_schedule_on_hand_computed_cases():
    """Catches a schedule that overlaps what cannot overlap (max_lag 0: the sides take turns),
    charges the push to the wrong side or every step with sync_every > 1, or miscounts the
    lag: each case's seconds per step, lag and queue depth worked out by hand."""
    turns = async_cost.simulate(async_cost.Terms(1.0, 2.0, 0.5, sync_every=1, max_lag=0))
    assert turns.step_s == pytest.approx(3.5) and turns.lag_mean == 0  # 1 + 2 + 0.5
    trainer_bound = async_cost.simulate(async_cost.Terms(1.0, 2.0, 0.5, max_lag=1))
    # the trainer's 2.5 s is the bottleneck; batch j is drawn right after version j-1's push
    assert trainer_bound.step_s == pytest.approx(2.5) and trainer_bound.lag_mean == 1
    assert trainer_bound.queue_depth == 0
    sampler_bound = async_cost.simulate(async_cost.Terms(3.0, 2.0, 0.5, max_lag=2))
    assert sampler_bound.step_s == pytest.approx(3.0) and sampler_bound.lag_mean == 1
    # sync_every 2, max_lag 1: per two steps one draw alone, then a draw beside a step, then a
    # step alone: (1 + 1 + 1) / 2 s
    pairs = async_cost.simulate(async_cost.Terms(1.0, 1.0, 0.0, sync_every=2, max_lag=1))
    assert pairs.step_s == pytest.approx(1.5) and pairs.lag_mean == pytest.approx(0.5)
    assert async_cost.speedup(2.0, 3.0, async_cost.Terms(1.0, 2.0, 0.5, max_lag=1)) == 2.0
    with pytest.raises(ValueError, match="wait forever"):
        async_cost.simulate(async_cost.Terms(1.0, 1.0, 0.0, sync_every=3, max_lag=1))

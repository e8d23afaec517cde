"""With objective.beta_ent > 0 the RL step's entropy bonus is the policy's real full-vocabulary
entropy at each response position, with its gradient, not the -logp proxy.

Bugs caught: the trainer never passing the entropy to the objective (the bonus silently falls
back to -mean(logp)); an entropy misaligned by one position; an entropy computed without
gradient (e.g. scored once before the update like the proximal snapshot).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_offpolicy_exact import _start
from test_train import tiny_config

from ess_jax.model import decoder as model
from ess_jax.rl import update as U

BETA = 0.05


def _mean_entropy(cfg, params, mb):
    """Token-mean entropy of the policy's next-token distribution over the response tokens."""
    mask = mb["mask"] > 0
    logits = model.apply(cfg, params, mb["tokens"], mb["attn_mask"])
    logits = logits[:, mb["tokens"].shape[1] - mask.shape[1] - 1 : -1]
    logq = jax.nn.log_softmax(logits, axis=-1)
    ent = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    return jnp.sum(jnp.where(mask, ent, 0.0)) / mask.sum()


def test_entropy_bonus_is_the_real_entropy_with_its_gradient(tmp_path, monkeypatch):
    run = _start(tiny_config(**{"objective.beta_ent": BETA}), tmp_path)
    real_make, real_loss_and_grad, seen = U.make_rl_step, U.step_loss_and_grad, {}

    def make_rl_step(*args, **kwargs):
        step_fn = real_make(*args, **kwargs)

        def recorded(state, mb):
            seen["params"], seen["mb"] = jax.device_get(state.params), jax.device_get(mb)
            new_state, metrics = step_fn(state, mb)
            seen["metrics"] = jax.device_get(metrics)
            return new_state, metrics

        return recorded

    def step_loss_and_grad(logp_fn, *args, **kwargs):
        seen["logp_fn"] = logp_fn  # the trainer's log-prob function (captured while tracing)
        return real_loss_and_grad(logp_fn, *args, **kwargs)

    monkeypatch.setattr(U, "make_rl_step", make_rl_step)
    monkeypatch.setattr(U, "step_loss_and_grad", step_loss_and_grad)
    run.rl_step(0)
    params, mb, m = seen["params"], seen["mb"], seen["metrics"]
    mb = {k: jnp.asarray(v) for k, v in mb.items()}
    entropy, d_entropy = jax.jit(jax.value_and_grad(_mean_entropy, argnums=1), static_argnums=0)(
        run.model_cfg, params, mb
    )

    # On-policy float32 sampler: rho = 1, ESS = 1, so P3O's KL term is 0 and
    # loss = pg_loss - beta_ent * mean(entropy), the entropy computed independently here.
    assert abs(float(entropy) - float(m["entropy_proxy"])) > 1e-2  # the proxy differs
    assert float(m["loss"]) - float(m["pg_loss"]) == pytest.approx(-BETA * float(entropy), rel=1e-5)

    # With zero advantages the step's gradient is the bonus's: -beta_ent d(mean entropy)/dparams.
    no_adv = {**mb, "advantages": jnp.zeros_like(mb["advantages"])}
    loss_grad = jax.jit(
        lambda p: U.step_loss_and_grad(seen["logp_fn"], p, no_adv, run.objective_cfg)[1]
    )
    got, want = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
        for t in (loss_grad(params), jax.tree.map(lambda g: -BETA * g, d_entropy))
    )
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())

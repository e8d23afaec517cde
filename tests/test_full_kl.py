"""objective.kl_estimator="full": P3O's KL(pi || pi_b) over the whole vocabulary, pi_b re-scored
in the train step (ess_jax/sampling/rescore.py), against a float64 numpy reference.

The reference takes each model's teacher-forced float32 logits (model.apply) to float64 and does
the rest itself: temperature, the kept support of top-k / top-p (test_sampler's independent
`_np_kept`), pi conditioned on that support, the KL, its gradient in the logits. Bugs caught:
pi_b without the temperature, or with the truncation dropped or not renormalised; pi_b from the
wrong params (the current policy instead of the lagged version, or of the start-of-batch
snapshot on the second update of a batch); external rows scored by the policy; a gradient that
flows into pi_b's params or misses pi's; the logits chunks misaligned with the tokens they score;
a config that re-scores a source it cannot re-score exactly (bf16 / fp8 sampler, greedy) instead
of refusing it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg
from test_offpolicy_exact import _start
from test_sampler import _np_kept
from test_train import tiny_config

from ess_jax import objectives as O
from ess_jax.config import schema as config_checks
from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.rl import experiment, rollout, train, update
from ess_jax.rl.full_kl import FullKL
from ess_jax.sampling import rescore

CFG = tiny_model_cfg(vocab_size=13, pad_token_id=0)
# the external model: another architecture over the same vocabulary
EXT_CFG = CFG.replace(hidden_size=24, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=12)
P, T = 3, 7  # prompt and response length; T = 7 is no multiple of the chunk 3 (padding)
_apply = jax.jit(model.apply, static_argnums=0)


def _batch(seed=0):
    """4 rows, left-padded prompts, responses that end early (rows 1, 2); rows 1, 3 external."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CFG.vocab_size, (4, P + T)).astype(np.int32)
    attn = np.ones(tokens.shape, bool)
    attn[0, 0] = False
    attn[1, P + 5 :] = False
    attn[2, P + 2 :] = False
    tokens[~attn] = 0
    return {"tokens": tokens, "attn_mask": attn, "policy_version": np.array([3, -1, 3, -1])}


def _params(cfg, seed):
    """Random params without compiling an init: norms near 1, matrices ~ N(0, 1 / fan-in)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if len(x.shape) == 1:
            return (1.0 + 0.1 * rng.normal(size=x.shape)).astype(np.float32)
        return (rng.normal(size=x.shape) / np.sqrt(x.shape[0])).astype(np.float32)

    return jax.tree.map(leaf, model.abstract_params(cfg))


def _np_response_logits(cfg, params, batch):
    """float64 logits [B, T, V] predicting each response token."""
    logits = _apply(cfg, params, batch["tokens"], batch["attn_mask"])
    return np.asarray(logits, np.float64)[:, P - 1 : -1]


def _np_log_softmax(x, keep):
    x = np.where(keep, x, -np.inf)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _np_full_kl(logits, logits_b, targets, b: rescore.Behaviour):
    """float64: per-token KL(pi(.|S) || pi_b), log pi_b(y), log pi(y), d KL / d logits."""
    scaled = logits_b / b.temperature
    keep, _ = _np_kept(scaled, b.top_k, b.top_p)
    logq = _np_log_softmax(scaled, keep)
    logp_s = _np_log_softmax(logits, keep)
    p_s = np.exp(logp_s)
    diff = np.where(keep, logp_s, 0.0) - np.where(keep, logq, 0.0)
    kl = (p_s * diff).sum(-1)
    dkl = p_s * (diff - kl[..., None])  # the KL's gradient in the logits (0 outside S)
    pick = lambda x: np.take_along_axis(x, targets[..., None], -1)[..., 0]
    return kl, pick(logq), pick(_np_log_softmax(logits, True)), dkl


def _reference(params, bparams, b, batch):
    """Float64 outputs of the pass: each row's pi_b from the model that drew it."""
    logits = _np_response_logits(CFG, params, batch)
    logits_b = _np_response_logits(CFG, bparams["policy"], batch)
    if b.external_cfg is not None:
        ext = batch["policy_version"] < 0
        logits_b[ext] = _np_response_logits(EXT_CFG, bparams["external"], batch)[ext]
    return _np_full_kl(logits, logits_b, batch["tokens"][:, P:], b)


def _pass(b, bparams, chunk, entropy=False):
    return jax.jit(rescore.logp_fn_for(CFG, P, b, bparams, entropy=entropy, chunk=chunk))


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


CASES = {
    "temperature": rescore.Behaviour(temperature=1.6),
    "cold_top_k": rescore.Behaviour(temperature=0.7, top_k=4),
    "external_top_k_top_p": rescore.Behaviour(
        temperature=1.2, top_k=8, top_p=0.8, external_cfg=EXT_CFG
    ),
}


@pytest.fixture(scope="module")
def models():
    """The policy, an older version of it (another draw of the same architecture: a lagged
    pi_b), and the external model."""
    return _params(CFG, 0), {"policy": _params(CFG, 1), "external": _params(EXT_CFG, 2)}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_full_kl_matches_float64_reference(models, by_chunk, case):
    """pi_b with the sampler's temperature / truncation / model per row, against float64: catches
    a pi_b without temperature, an unrenormalised or dropped truncation, external rows scored by
    the policy, and chunks misaligned with the tokens (the chunk 3 does not divide T)."""
    params, bparams = models
    b = CASES[case]
    if b.external_cfg is not None:  # the gradient tests' compile (chunk 3) has its outputs
        _, batch, _, out = by_chunk
        logp, extras = out[3][0]
    else:
        batch = _batch()
        logp, extras = _pass(b, bparams, chunk=3)(params, batch)
    kl, blogp, want_logp, _ = _reference(params, bparams, b, batch)
    valid = batch["attn_mask"][:, P:]
    for got, want in ((logp, want_logp), (extras["kl_full"], kl)):
        np.testing.assert_allclose(np.asarray(got), np.where(valid, want, 0.0), atol=2e-5)
    np.testing.assert_allclose(
        np.asarray(extras["rescored_behaviour_logp"]), np.where(valid, blogp, 0.0), atol=2e-5
    )
    # not vacuous: the knob of the case moves the KL measurably
    wrong = {"temperature": 1.0} if b.temperature != 1.0 else {}
    if b.top_k or b.top_p < 1:
        wrong.update(top_k=0, top_p=1.0)
    if b.external_cfg is not None:
        wrong = {"external_cfg": None}
    kl_wrong = _reference(params, bparams, rescore.Behaviour(**{**vars(b), **wrong}), batch)[0]
    assert np.abs(kl_wrong - kl)[valid].max() > 1e-2


@pytest.fixture(scope="module")
def by_chunk(models):
    """Per chunk (3: three chunks, the last padded; 0: one), the outputs of the external case
    with entropy, and the gradient of L = sum(w_lp logp + w_kl KL + w_ent entropy) in the
    policy's and in the behaviour models' params (one compile each)."""
    params, bparams = models
    b, batch = CASES["external_top_k_top_p"], _batch(1)
    w = dict(zip(("logp", "kl_full", "entropy"), np.random.default_rng(3).normal(size=(3, 4, T))))
    out = {}
    for chunk in (3, 0):

        def loss(p, bp, chunk=chunk):  # bp traced: its gradient must come out exactly 0
            logp, extras = rescore.logp_fn_for(CFG, P, b, bp, entropy=True, chunk=chunk)(p, batch)
            terms = {"logp": logp, **extras}
            return sum(jnp.sum(w[k] * terms[k]) for k in w), (logp, extras)

        grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, outputs), grads = grad_fn(params, bparams)
        out[chunk] = jax.device_get((outputs, grads))
    return b, batch, w, out


def test_gradient_flows_through_pi_only_and_matches_float64(models, by_chunk):
    """The gradient of a weighted sum of the pass's log-probs, KL and entropy equals the float64
    gradient in the logits (KL: p_S (log p_S - log q - KL) on S) pulled back through the model
    (a VJP of model.apply), and pi_b's params get exactly none. Catches a KL gradient into the
    behaviour model, a gradient without the conditioning on S, and a chunked backward
    (recomputed per chunk) that differs from the forward."""
    params, bparams = models
    b, batch, w, out = by_chunk
    _, (grad, grad_b) = out[3]
    assert not np.any(_flat(grad_b))

    logits = _np_response_logits(CFG, params, batch)
    _, _, _, dkl = _reference(params, bparams, b, batch)
    logp_all = _np_log_softmax(logits, True)
    p, ent = np.exp(logp_all), -(np.exp(logp_all) * logp_all).sum(-1)
    onehot = np.eye(CFG.vocab_size)[batch["tokens"][:, P:]]
    valid = batch["attn_mask"][:, P:, None]
    d_logits = (
        w["logp"][..., None] * (onehot - p)
        + w["kl_full"][..., None] * dkl
        - w["entropy"][..., None] * p * (logp_all + ent[..., None])
    )
    cot = np.zeros((4, P + T, CFG.vocab_size), np.float32)
    cot[:, P - 1 : -1] = np.where(valid, d_logits, 0.0)
    pull_back = jax.jit(
        lambda p, ct: jax.vjp(
            lambda q: model.apply(CFG, q, batch["tokens"], batch["attn_mask"]), p
        )[1](ct)[0]
    )
    got, want = _flat(grad), _flat(pull_back(params, jnp.asarray(cot)))
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_chunked_equals_unchunked(by_chunk):
    """logits_chunk = 3 (3 chunks over T = 7, the last padded) against one chunk: the same
    log-probs, KL, re-scored pi_b, entropy and gradient. Catches a chunk merge that shuffles
    positions or rows and a padded tail that leaks into the result."""
    (out3, (grad3, _)), (out0, (grad0, _)) = by_chunk[3][3], by_chunk[3][0]
    for got, want in zip(jax.tree.leaves(out3), jax.tree.leaves(out0)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    grad3, grad0 = _flat(grad3), _flat(grad0)
    np.testing.assert_allclose(grad3, grad0, rtol=1e-5, atol=1e-6 * np.abs(grad0).max())


@pytest.mark.parametrize("top_k", [0, 4])
def test_on_policy_kl_and_its_gradient_are_zero(models, top_k):
    """pi_b = pi at T = 1 (also with top-k: pi conditioned on the kept support is pi_b): KL = 0
    to 1e-6 and, at its minimum, zero gradient (test_gradient_* shows the same pass's KL
    gradient is O(1) elsewhere). Catches a KL that does not condition pi on pi_b's support
    (top-k: KL = -log pi(S) > 0) and one whose gradient is not a divergence's at its minimum."""
    params, _ = models
    batch = _batch(2)
    fn = rescore.logp_fn_for(CFG, P, rescore.Behaviour(top_k=top_k), {"policy": params}, chunk=3)

    def total_kl(p):
        logp, extras = fn(p, batch)
        return jnp.sum(extras["kl_full"]), (logp, extras)

    (_, (logp, extras)), grad = jax.jit(jax.value_and_grad(total_kl, has_aux=True))(params)
    assert np.abs(np.asarray(extras["kl_full"])).max() <= 1e-6
    if not top_k:  # the re-score is the policy itself
        np.testing.assert_allclose(extras["rescored_behaviour_logp"], logp, atol=1e-6)
    assert np.abs(_flat(grad)).max() <= 1e-5


# ----------------------------------------------------------------- the RL loop, instrumented


def _record_updates(monkeypatch):
    """Per update of the loop: the params before it, its batch and its metrics (numpy)."""
    real, seen = update.make_rl_step, []

    def make_rl_step(*args, **kwargs):
        step_fn = real(*args, **kwargs)

        def recorded(state, mb, *rest):
            before = jax.device_get((state.params, mb))
            new_state, metrics = step_fn(state, mb, *rest)
            seen.append((*before, jax.device_get(metrics)))
            return new_state, metrics

        return recorded

    monkeypatch.setattr(update, "make_rl_step", make_rl_step)
    return seen


def _loop_reference(cfg, params, params_b, b, mb, external=None, ext_cfg=None):
    """Float64 token-mean KL over the update's loss mask, each row's pi_b from its model."""
    resp = mb["mask"].shape[1]
    logits_of = lambda c, p: np.asarray(_apply(c, p, mb["tokens"], mb["attn_mask"]), np.float64)[
        :, -resp - 1 : -1
    ]
    logits_b = logits_of(cfg, params_b)
    if external is not None:
        ext = mb["policy_version"][:, 0] < 0
        logits_b[ext] = logits_of(ext_cfg, external)[ext]
    kl = _np_full_kl(logits_of(cfg, params), logits_b, mb["tokens"][:, -resp:], b)[0]
    mask = mb["mask"] > 0
    return kl[mask].mean()


def test_loop_rescores_the_params_the_sampler_held(tmp_path, monkeypatch):
    """A real run, T = 1.3, top-k 5, half of each group drawn by an external model:
      step 0, 1 update, lag 0: pi_b is the current params (the step is given none);
      step 1, 2 updates, lag 0: the history holds the train params' own buffers, which the
        first update donates; both updates re-score the start-of-batch params;
      step 2, 2 updates, lag 1 (the history swapped for one holding versions 1 and 2): the
        sampler holds version 1 and the step re-scores version 1.
    Every update's KL metric equals the float64 token-mean KL (pi: the params before the
    update; pi_b: the version the sampler held for the policy rows, the external model for its
    rows), the loss carries (1 - ESS) times it, and the re-score reproduces every recorded
    log pi_b(y_t). Catches pi_b re-scored with the updated or current params instead of the
    start-of-batch copy or the lagged version, external rows re-scored by the policy, and a
    crash on the donated history buffers."""
    cfg, _, _ = train.experiment.load_policy(tiny_config().model)
    external = jax.device_get(model.init_params(cfg, 123))
    weights.save_hf(cfg, external, str(tmp_path / "external"))
    config = tiny_config(
        **{
            "objective.kl_estimator": "full",
            "model.logits_chunk": 3,  # 4 response tokens: a padded second chunk
            "rollout.temperature": 1.3,
            "rollout.top_k": 5,
            "rollout.external_fraction": 0.5,
            "rollout.external_checkpoint": str(tmp_path / "external"),
            "data.prompts_per_step": 4,  # 16 rows: 8 per update with 2 updates
            "optim.lr": 1e-2,
        }
    )
    run = _start(config, tmp_path / "run")
    updates = _record_updates(monkeypatch)

    def settle(lag, n_upd):  # the update settings a run with this lag and U would build
        full = FullKL.for_run(run.objective_cfg, run.rollout_cfg, lag, n_upd, run.external)
        monkeypatch.setattr(run.trainer.learner, "updates_per_batch", n_upd)
        monkeypatch.setattr(run.trainer.learner, "full_kl", full)

    rows = [run.rl_step(0)]
    settle(0, 2)
    rows.append(run.rl_step(1))
    lagged = rollout.ParamHistory(1)
    version1 = jax.device_put(updates[1][0], run.trainer.state_sh.params)
    lagged.restore([(1, version1), (2, run.trainer.state.params)])
    monkeypatch.setattr(run.trainer, "history", lagged)
    settle(1, 2)
    rows.append(run.rl_step(2))

    assert len(updates) == 5
    b, ext_cfg = rescore.Behaviour(temperature=1.3, top_k=5), run.external.cfg
    held = [updates[0][0]] + [updates[1][0]] * 4  # the params the sampler held
    for (params, mb, m), params_b, version in zip(updates, held, (0, 1, 1, 1, 1)):
        assert sorted(np.unique(mb["policy_version"])) == [-1, version]
        want = _loop_reference(cfg, params, params_b, b, mb, external, ext_cfg)
        assert m["kl_behaviour_full"] == pytest.approx(want, rel=1e-4)
        assert m["rescore_err"] <= 2e-5
    assert m["loss"] - m["pg_loss"] == pytest.approx((1 - m["ess"]) * want, rel=1e-3)
    # not vacuous: re-scoring the params of the update itself, or the external rows with the
    # policy, moves the KL by > 1e-3 (relative)
    for params, mb, m in (updates[2], updates[4]):
        for wrong in (
            _loop_reference(cfg, params, params, b, mb, external, ext_cfg),
            _loop_reference(cfg, params, held[-1], b, mb),
        ):
            assert abs(wrong - m["kl_behaviour_full"]) > 1e-3 * m["kl_behaviour_full"]
    assert [r["policy_lag"] for r in rows] == [0, 0, 1]


# ----------------------------------------------------------------- config refusals


def _full(**overrides):
    return tiny_config(**{"objective.kl_estimator": "full", "model.logits_chunk": 4, **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rollout.precision": "bfloat16"}, r"^config\.rollout\.precision: 'bfloat16' cannot be"),
        ({"rollout.precision": "fp8"}, r"^config\.rollout\.precision: 'fp8' cannot be"),
        (
            {"rollout.external_fraction": 0.5, "rollout.external_precision": "fp8"},
            r"^config\.rollout\.external_precision: 'fp8' cannot be re-scored",
        ),
        ({"rollout.temperature": 0.0}, r"^config\.rollout\.temperature: 0 \(greedy\)"),
        ({"model.logits_chunk": 0}, r"^config\.model\.logits_chunk: .* needs it > 0"),
        ({"objective.name": "grpo"}, r"^config\.objective: .*'grpo' has no KL\(pi \|\| pi_b\)"),
        ({"objective.name": "p3o_dual"}, r"^config\.objective: .*pi_prox's whole distribution"),
        ({"objective.p3o_drop_kl": True}, r"^config\.objective: .*drops the KL term"),
    ],
)
def test_config_refuses_what_cannot_be_rescored(overrides, message):
    """Each unsupported combination fails before any work with a message naming the field,
    instead of silently re-scoring another distribution than the sampler's."""
    with pytest.raises(config_checks.ConfigError, match=message):
        experiment.validate(_full(**overrides))


def test_config_accepts_the_supported_sources_and_keeps_ref_kl_sampled():
    """Temperature, top-k / top-p, lag and a float32 external model are accepted (the checks do
    not over-refuse); the reference KL (beta_kl) has no "full"; the objective refuses a batch
    without the re-score rather than falling back to a sampled estimate."""
    supported = {"rollout.temperature": 0.7, "rollout.top_k": 5, "rollout.top_p": 0.9}
    config_checks.check(_full(**supported, **{"rollout.lag": 2}))
    external = {"rollout.external_fraction": 0.5, "rollout.external_checkpoint": "ext/hf"}
    config_checks.check(_full(**external))  # schema only: the path is validate's to find
    with pytest.raises(ValueError, match="ref_kl_estimator='full'"):
        O.ObjectiveConfig(ref_kl_estimator="full")
    batch = {k: np.zeros((1, 2), np.float32) for k in ("behaviour_logp", "advantages")}
    batch["mask"] = np.ones((1, 2), bool)
    full = O.ObjectiveConfig(kl_estimator="full")
    with pytest.raises(ValueError, match=r"needs batch\['kl_full'\]"):  # raised while tracing
        jax.eval_shape(lambda logp: O.p3o(logp, batch, full), jnp.zeros((1, 2)))

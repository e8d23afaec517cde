"""Routing replay (R3) on a mixture-of-experts policy: the sampler's recorded routing, the
trainer's replay of it (model/moe.py `route`), and the router's load-balancing loss in the RL
update (model.moe_aux_loss_coef).

The model is tests/moe_models.py's tiny random Qwen3-MoE (3 layers, layer 1 dense: sparse layers
0 and 2, 8 experts, top-2, peaked routers), float32, so the sampler's and the trainer's routing
agree and a re-score that replays the recorded routing reproduces the sampler's log-probs to
float32 noise; a routing replayed at the wrong layer or position changes them by far more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_models import np_load_balancing, tiny_moe

from ess_jax.model import decoder as model
from ess_jax.model import moe, scoring
from ess_jax.objectives import objective_config
from ess_jax.rl import steps, update
from ess_jax.sampling import engine as engine_lib
from ess_jax.sampling import sampler

PROMPTS = np.array([[5, 6, 7, 8], [0, 0, 9, 10]], np.int32)


@pytest.fixture(scope="module")
def drawn():
    """(cfg, params, engine, Generation, sampling): 2 prompts x 3 samples of 7 tokens, top-k 20
    at temperature 0.9 (pi_b != the raw softmax), stop id 3 (some rows end early)."""
    cfg, params = tiny_moe()
    sc = sampler.SamplingConfig(
        temperature=0.9, top_k=20, max_new_tokens=7, num_samples=3, stop_ids=(3,)
    )
    engine = engine_lib.JaxEngine(cfg)
    engine.update_params(0, params)
    gen = engine.generate(PROMPTS, PROMPTS > 0, sc, jax.random.key(1))
    return cfg, params, engine, gen, sc


def _gap(engine, gen, sc, routing):
    scored = engine.score(gen.sequences, gen.sequence_mask, PROMPTS.shape[1], sc, routing)
    return float(np.abs(scored - gen.behaviour_logp)[gen.response_mask].max())


def test_replayed_rescore_equals_the_samplers_logp_and_a_misplaced_routing_does_not(drawn):
    """The sampler records [B, L, Ls, X] int32 routing: the prompt's (pads unrecorded) and each
    response token's but the last (never fed back); a teacher-forced re-score replaying it gives
    the recorded behaviour log-probs (<= 1e-5), and the recorded experts are those the trainer's
    own forward picks. Catches: a layer's routing recorded or replayed at the next layer
    (planted in the decoder's replay and in the decode loop's record: gaps above 0.1), a
    response token's routing written at the next or previous column, the prompt's routing
    left out, rows or layers transposed in the record."""
    cfg, params, engine, gen, sc = drawn
    b, length = gen.sequences.shape
    routing = gen.routing
    assert routing.shape == (b, length, 2, 2) and routing.dtype == np.int32
    mask = gen.sequence_mask.astype(bool)
    recorded = routing[..., 0, 0] != moe.NOT_RECORDED
    # every real token but each row's last one went through the model
    want = mask.copy()
    for r in range(b):
        want[r, np.flatnonzero(mask[r])[-1]] = False
    np.testing.assert_array_equal(recorded, want)
    assert (routing[~recorded] == moe.NOT_RECORDED).all()
    assert not gen.response_mask.all()  # some rows stopped early

    experts = jax.jit(lambda p, t, m: scoring.scored_hidden_routed(cfg, p, t, m, 1)[2].experts)
    own = np.sort(np.asarray(experts(params, gen.sequences, mask)), -1)
    np.testing.assert_array_equal(own[recorded], np.sort(routing, -1)[recorded])

    assert _gap(engine, gen, sc, routing) <= 1e-5
    # the power of the check: the same routing one layer or one position off
    shifted_layer = np.roll(routing, 1, axis=2)
    shifted_time = np.where(recorded[..., None, None], np.roll(routing, 1, axis=1), -1)
    assert _gap(engine, gen, sc, shifted_layer) > 0.1
    assert _gap(engine, gen, sc, shifted_time) > 0.1


def _np_moe(mlp, x, experts, norm):
    """float64 MoE block on tokens x [N, D] routed to `experts` [N, X] (a top-k of its own where
    a row is -1): sum_j w_j down_j(silu(x gate_j) * (x up_j)), w the router's softmax at them."""
    p = {k: np.asarray(v, np.float64) for k, v in mlp.items()}
    x = np.asarray(x, np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    chosen = []
    for n in range(len(x)):
        ex = experts[n] if experts[n][0] >= 0 else np.argsort(-probs[n])[: len(experts[n])]
        w = probs[n, ex] / (probs[n, ex].sum() if norm else 1.0)
        for j, e in enumerate(ex):
            g, u = x[n] @ p["expert_gate"][e], x[n] @ p["expert_up"][e]
            out[n] += w[j] * ((g / (1 + np.exp(-g)) * u) @ p["expert_down"][e])
        chosen.append(ex)
    return out, np.array(chosen)


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_block_against_float64(norm):
    """One MoE block on 12 tokens, 9 with forced experts (not their own top-2) and 3 unrecorded:
    its output against a float64 numpy block, and its reported experts. Catches: the recorded
    experts ignored, the weights read at the own top-k instead of the recorded experts, the
    renormalisation skipped under replay, an unrecorded token not routed by its own top-k."""
    cfg, params = tiny_moe()
    cfg = cfg.replace(norm_topk_prob=norm)
    mlp = params["layers"][0]["mlp"]
    block = model.bind(cfg, params).layers[0].mlp
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 12, cfg.hidden_size)).astype(np.float32)
    forced = np.stack([rng.choice(8, 2, replace=False) for _ in range(12)]).astype(np.int32)
    forced[[2, 7, 11]] = moe.NOT_RECORDED
    out, (experts, _) = block(cfg, jnp.asarray(x), None, jnp.asarray(forced)[None])
    want, chosen = _np_moe(mlp, x[0], forced, norm)
    np.testing.assert_allclose(np.asarray(out[0]), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.sort(np.asarray(experts[0]), -1), np.sort(chosen, -1))
    own, _ = block(cfg, jnp.asarray(x))
    assert np.abs(np.asarray(own[0]) - want).max() > 1e-2  # forcing changes the output


def _rows(gen, cfg):
    """An RL batch of `gen`'s rows (advantages +-1) as rollout_to_batch builds it."""
    b, length = gen.sequences.shape
    t = length - PROMPTS.shape[1]
    adv = np.where(np.arange(b) % 2, 1.0, -1.0)[:, None] * gen.response_mask
    r = update.rollout_lib.Rollout(
        tokens=gen.sequences,
        attn_mask=gen.sequence_mask,
        loss_mask=gen.response_mask.astype(np.float32),
        behaviour_logp=gen.behaviour_logp,
        advantages=adv.astype(np.float32),
        rewards=np.zeros(b, np.float32),
        policy_version=np.zeros(b, np.int32),
        layout=gen.layout,
        prompt_len=PROMPTS.shape[1],
        routing=gen.routing,
    )
    assert moe.ROUTING not in update.rollout_to_batch(r)
    batch = update.rollout_to_batch(r, routing=True)
    assert batch[moe.ROUTING].shape[:2] == (b, t + PROMPTS.shape[1])
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _router_params(grads):
    return [grads["layers"][i]["mlp"]["router"] for i in (0, 2)]


def test_replay_keeps_the_router_gradient(drawn):
    """The trainer's log-prob function on a batch with the recorded routing (what the update
    differentiates under model.routing_replay "sampler"): where the recorded experts are the
    trainer's own, its value and gradient equal the free forward's (the router's included, and
    nonzero); with another routing the router still gets a gradient. Catches: replayed weights
    cut from the router (a stop_gradient, or weights taken from the record), the routing not
    reaching the trainer's forward."""
    cfg, params, _, gen, _ = drawn
    batch = _rows(gen, cfg)
    fn = steps.logp_fn_for(cfg, PROMPTS.shape[1])
    # every entry unrecorded: each token routed by its own top-k (one program for all three)
    free = {**batch, moe.ROUTING: jnp.full_like(batch[moe.ROUTING], moe.NOT_RECORDED)}

    @jax.jit
    @jax.value_and_grad
    def total(p, mb):
        return jnp.sum(fn(p, mb) * mb["mask"])

    (v_rep, g_rep), (v_free, g_free) = (total(params, mb) for mb in (batch, free))
    assert abs(float(v_rep) - float(v_free)) <= 1e-4
    for a, b in zip(_router_params(g_rep), _router_params(g_free)):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    rolled = {**batch, moe.ROUTING: jnp.roll(batch[moe.ROUTING], 1, axis=2)}
    v_rolled, g_rolled = total(params, rolled)
    assert abs(float(v_rolled) - float(v_free)) > 0.1
    assert all(float(jnp.abs(g).max()) > 1e-3 for g in _router_params(g_rolled))


def test_router_loss_joins_the_rl_gradient(drawn):
    """step_loss_and_grad with router_coef c over M = 2 micro-batches (GRPO, step scope): the
    loss is the objective's plus c times the mean over micro-batches of the load-balancing loss
    of each micro-batch's real tokens (a float64 numpy reference on the forward's router
    logits), and the gradient is the objective's plus c
    times that loss's gradient. Catches: the aux loss left out of the gradient, added once per
    micro-batch without the 1 / M, computed over pads, its metric not the loss it adds."""
    cfg, params, _, gen, _ = drawn
    rows = _rows(gen, cfg)
    rows.pop(moe.ROUTING)
    config = objective_config({"name": "grpo", "ess_scope": "step"})
    c, p, m = 0.5, PROMPTS.shape[1], 2
    fn = steps.logp_fn_for(cfg, p, router_loss=True)

    @jax.jit  # the coefficient traced: one program for c and for 0 (the objective alone)
    def step(q, coef):
        return update.step_loss_and_grad(fn, q, rows, config, m, router_coef=coef)

    (loss, grads, metrics), (loss0, grads0, _) = step(params, c), step(params, 0.0)

    def mb_router(q, mb):
        _, _, routed = scoring.scored_hidden_routed(cfg, q, mb["tokens"], mb["attn_mask"], 1)
        return routed.logits.reshape(2, -1, cfg.num_experts), mb["attn_mask"].reshape(-1)

    micro = [jax.tree.map(lambda x, i=i: x[i::m], rows) for i in range(m)]
    logits_mask = [jax.jit(mb_router)(params, mb) for mb in micro]
    ref = np.mean([np_load_balancing(lg, 2, mk) for lg, mk in logits_mask])
    assert abs(float(metrics["router_loss"]) - ref) <= 1e-5
    assert abs(float(loss) - float(loss0) - c * ref) <= 1e-5

    # the gradient is the derivative of the loss it adds: a central difference of
    # (loss_c - loss_0) / c along a random direction of the routers
    rng = np.random.default_rng(0)
    d = jax.tree.map(jnp.zeros_like, params)
    for i in (0, 2):
        r = rng.standard_normal(d["layers"][i]["mlp"]["router"].shape).astype(np.float32)
        d["layers"][i]["mlp"]["router"] = jnp.asarray(r)
    eps = 1e-3

    def aux_at(sign):
        q = jax.tree.map(lambda a, b: a + sign * eps * b, params, d)
        return (float(step(q, c)[0]) - float(step(q, 0.0)[0])) / c

    fd = (aux_at(1) - aux_at(-1)) / (2 * eps)
    g_aux = jax.tree.map(lambda a, b: (a - b) / c, grads, grads0)
    directional = sum(float(jnp.sum(a * b)) for a, b in zip(*map(jax.tree.leaves, (g_aux, d))))
    assert abs(fd) > 1e-3 and abs(directional - fd) <= 0.02 * abs(fd) + 1e-4, (directional, fd)
    # nothing after the last sparse layer's router feeds the loss: the final norm's share is 0
    assert float(jnp.abs(g_aux["final_norm"]).max()) <= 1e-6
    assert all(float(jnp.abs(g).max()) > 1e-4 for g in _router_params(g_aux))


@pytest.mark.parametrize(
    "field, value", [("routing_replay", "sampler"), ("moe_aux_loss_coef", 0.01)]
)
def test_moe_knobs_on_a_dense_model_are_one_line_errors(field, value):
    """model.routing_replay "sampler" and model.moe_aux_loss_coef > 0 on the (dense) embedded
    model are refused by experiment.validate naming the field; an unknown replay mode by the
    schema. Catches: a dense run that silently ignores the knob."""
    from ess_jax.config.defaults import base_config
    from ess_jax.config.schema import ConfigError, check
    from ess_jax.rl import experiment

    c = base_config()
    c.model[field] = value
    with pytest.raises(ConfigError, match=f"model.{field}.*dense model") as e:
        experiment.validate(c)
    assert "\n" not in str(e.value)
    c = base_config()
    c.model.routing_replay = "trainer"
    with pytest.raises(ConfigError, match="model.routing_replay"):
        check(c)

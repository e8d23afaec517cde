"""model/remat.py (model.remat_ordered): a layer rematerialised in layer order in the backward,
against jax.checkpoint's remat and the layer without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg
from moe_models import tiny_moe

from ess_jax.model import decoder as model
from ess_jax.model import remat


def _grads(cfg, params, tokens, w):
    loss = lambda p: jnp.sum(w * model.apply(cfg, p, tokens))
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_remat_gives_jax_checkpoints_values_and_gradients(kind):
    """Catches a remat whose backward differs from jax.checkpoint's (bit for bit: the same ops
    recomputed from the same inputs) or from the layer without remat (to float32 rounding: XLA
    fuses the recompute differently): cotangents returned for the wrong inputs (the
    closed-over params against the block input), a routing record or an integer input given
    a gradient, a recompute that reads other inputs than the forward's."""
    if kind == "dense":
        cfg = tiny_model_cfg()
        params = model.init_params(cfg, 0)
    else:
        cfg, params = tiny_moe()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 7)), jnp.int32)
    w = jnp.asarray(rng.normal(size=(2, 7, cfg.vocab_size)), jnp.float32)
    value, grads = _grads(cfg, params, tokens, w)
    value_r, grads_r = _grads(cfg.replace(remat=True, remat_ordered=True), params, tokens, w)
    value_c, grads_c = _grads(cfg.replace(remat=True), params, tokens, w)
    assert float(value_r) == float(value_c)
    assert jax.tree.structure(grads_r) == jax.tree.structure(grads)
    for a, b, c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), jax.tree.leaves(grads_c)):
        np.testing.assert_array_equal(b, c)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max())))
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0  # not vacuous


def _depends_on(jaxpr, source) -> set:
    """The variables of a flat `jaxpr` computed from `source` (an input variable)."""
    seen = {source}
    for eqn in jaxpr.eqns:
        if any(type(v).__name__ != "Literal" and v in seen for v in eqn.invars):
            seen.update(eqn.outvars)
    return seen


def test_the_backward_runs_layer_by_layer():
    """Catches a remat whose backward leaves the TPU compiler's latency-hiding scheduler free
    to hold every layer's activations at once (module docstring): a recompute that depends on
    the saved inputs only (plain jax.checkpoint: the scheduler runs every layer's recompute
    early), or an input cotangent passed down before the layer's weight gradient is computed
    (the scheduler defers the weight gradients, keeping each layer's recomputed activations
    to the end). In the backward's program the recompute's `sin` must be computed from the
    cotangent, and the input's and the weight's cotangents must leave through one barrier."""

    def backward(wrap):
        g = lambda x, w: wrap(lambda x: jnp.sin(x) * w)(x)
        ones = jnp.ones(3)
        return jax.make_jaxpr(lambda x, w, ct: jax.vjp(g, x, w)[1](ct))(ones, ones, ones).jaxpr

    def recompute_reads_cotangent(jaxpr):
        from_ct = _depends_on(jaxpr, jaxpr.invars[2])
        sines = [e for e in jaxpr.eqns if e.primitive.name == "sin"]
        return [any(v in from_ct for v in e.outvars) for e in sines]

    def gradients_leave_together(jaxpr):
        barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
        return any(set(jaxpr.outvars) <= set(e.outvars) for e in barriers)

    pinned, plain = backward(remat.remat), backward(jax.checkpoint)
    assert recompute_reads_cotangent(pinned) == [False, True]  # the forward, the recompute
    assert gradients_leave_together(pinned)
    assert not any(recompute_reads_cotangent(plain)) and not gradients_leave_together(plain)
    x, w = jnp.linspace(0.0, 1.0, 3), jnp.float32(1.5)
    got = jax.grad(lambda x: remat.remat(lambda x: jnp.sin(x) * w)(x).sum())(x)
    np.testing.assert_allclose(got, 1.5 * np.cos(np.asarray(x)), rtol=1e-6)

"""k3's exponent clamp at +-10 (kl.K3_EXP_CLAMP, FeynRL's) and `k3_tangent`, k3 continued
along its tangent past it, against float64 numpy references written from docs/method.md; the
shares of tokens beyond the clamp (`lr_beyond_clamp_low` / `_high`, core.finish) against numpy
on known log ratios; experiments/k3_clamp.py on a synthetic metrics.jsonl. Cheap: scalars and
one tiny batch."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.mini import common
from ess_jax import objectives as O
from ess_jax.config import schema
from ess_jax.objectives import kl as K
from ess_jax.rl import update as U
from experiments import k3_clamp

C = 10.0
H = 2.0**-6  # a step from the seam, exact in float32 around 10
# log(pi / pi_b): both sides of the clamp, the seam and its neighbours, inside (float32-exact)
X = np.array(
    [-30, -20, -12, -10.5, -10 - H, -10, -10 + H, -3, -0.25, 0.0, 0.5, 4]
    + [10 - H, 10, 10 + H, 10.5, 12, 20, 30],
    np.float32,
)
OTHER = np.float32(-2.5)  # pi_b's log-prob: logp = X + OTHER, exact in float32


def _g(x):  # k3 unclamped, x = log(pi / pi_b), float64
    return x + np.exp(-x) - 1.0


def _dg(x):
    return 1.0 - np.exp(-x)


def _tangent(x):
    """float64 k3_tangent and its derivative in log pi: g inside, g(c) + g'(c)(x - c) beyond."""
    c = np.clip(x, -C, C)
    return _g(c) + _dg(c) * (x - c), _dg(c)


def _clamped(x):
    """float64 k3 with FeynRL's clamp: x + exp(clip(-x, -10, 10)) - 1; derivative 1 beyond."""
    return x + np.exp(np.clip(-x, -C, C)) - 1.0, np.where(np.abs(x) < C, _dg(x), 1.0)


def _value_and_grad(fn, x=X):
    logp = jnp.asarray(x + OTHER, jnp.float32)
    other = jnp.full_like(logp, OTHER)
    grad = jax.vmap(jax.grad(fn))(logp, other)
    return np.asarray(fn(logp, other), np.float64), np.asarray(grad, np.float64)


def test_k3_keeps_the_clamp_whose_gradient_flips_below_minus_10():
    """Catches k3 losing FeynRL's clamp or moving it (the reproduction needs the paper code's
    estimator), and docs/method.md's numbers drifting from it: at log ratio -12 the true
    derivative is 1 - e^12 = -162753.79, the clamped one +1 (the sign flips); at +12 both are
    ~1 (0.99999386 vs 1)."""
    assert K.K3_EXP_CLAMP == C
    value, grad = _value_and_grad(K.kl_k3)
    want_v, want_g = _clamped(X.astype(np.float64))
    np.testing.assert_allclose(value, want_v, rtol=1e-6, atol=1e-6)
    seam = np.abs(X) == C  # the clip's tie: jax's gradient there is a half one
    np.testing.assert_allclose(grad[~seam], want_g[~seam], rtol=1e-5)
    assert _dg(-12.0) == pytest.approx(-162753.79, rel=1e-8) and grad[X == -12][0] == 1.0
    assert _dg(12.0) == pytest.approx(0.99999386, rel=1e-8)
    # the tangent reference tells the clamped one apart, on both sides
    tan_v, tan_g = _tangent(X.astype(np.float64))
    assert np.all(np.sign(tan_g[X < -C]) != np.sign(want_g[X < -C]))
    assert np.all(np.abs(tan_g[X > C] - want_g[X > C]) > 4e-5)
    assert np.all(np.abs(tan_v[X >= 12] - want_v[X >= 12]) > 8e-5)


def test_k3_tangent_value_and_gradient_vs_float64():
    """Catches a k3_tangent whose gradient below -10 keeps the clamp's wrong sign (planted: the
    registry entry pointing at kl_k3), a tangent taken at x instead of at the clamp (unbounded,
    overflowing), a gradient stopped beyond the clamp, and swapped arguments: value and
    derivative in log pi at every X against the float64 reference, and the true sign."""
    value, grad = _value_and_grad(K.get_kl_estimator("k3_tangent"))
    want_v, want_g = _tangent(X.astype(np.float64))
    np.testing.assert_allclose(value, want_v, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_g, rtol=2e-6, atol=1e-7)
    nonzero = X != 0
    assert np.all(np.sign(grad[nonzero]) == np.sign(X[nonzero]))  # the sign of 1 - e^-x
    far = np.float32(1e4)  # finite, slope bounded by e^10
    v, g = _value_and_grad(K.kl_k3_tangent, np.array([-far, far], np.float32))
    assert np.all(np.isfinite(v)) and g[0] == pytest.approx(_dg(-C), rel=1e-6)


def test_k3_tangent_is_continuous_at_the_seam_and_k3_inside():
    """Catches a jump at +-10 in value or slope (planted: the tangent's constant without its
    -1; the slope of k3_is's or forward's tangent), and a k3_tangent that drifts from k3 inside
    the clamp (the p3o_k3_tangent arm must match p3o to the bit on runs that never pass it)."""
    fn = K.kl_k3_tangent
    for side in (-1.0, 1.0):
        x = side * np.array([C - H, C, C + H], np.float32)
        v, g = _value_and_grad(fn, x)
        slope = _dg(side * C)
        # value: both one-sided difference quotients are g'(+-10), to O(h g'' / g')
        for q in ((v[1] - v[0]) / (side * H), (v[2] - v[1]) / (side * H)):
            assert q == pytest.approx(slope, rel=2 * H)
        # first derivative: on both sides and at the seam itself
        assert g[1] == pytest.approx(slope, rel=1e-6)
        assert g[0] == pytest.approx(slope, rel=2 * H) and g[2] == pytest.approx(slope, rel=1e-6)
    inside = np.random.default_rng(0).uniform(-C, C, 4096).astype(np.float32)
    inside = inside[np.abs(inside) < C]
    v, g = _value_and_grad(fn, inside)
    v3, g3 = _value_and_grad(K.kl_k3, inside)
    assert np.array_equal(v, v3) and np.array_equal(g, g3)


def test_k3_tangent_is_selectable_and_runs_in_p3o():
    """Catches k3_tangent missing from the config's domain or the reference KL's, the
    configs/mini arm not selecting it, and a p3o that ignores it: the loss gradient at a token
    at log ratio -12 against the float64 P3O reference (pg weight min(rho, e), KL weight 1 - e)."""
    assert O.objective_config({"kl_estimator": "k3_tangent"}).kl_estimator == "k3_tangent"
    assert O.ObjectiveConfig(ref_kl_estimator="k3_tangent").ref_kl_estimator == "k3_tangent"
    c = common.with_objective(common.testbed(), "p3o_k3_tangent")
    c.model.source = "embedded"
    schema.check(c)
    assert O.objective_config(c.objective).kl_estimator == "k3_tangent"

    lr = np.array([[-12.0, 0.5, 11.0, 0.0]], np.float32)  # the last token is a pad
    blogp = np.full_like(lr, -1.0)
    batch = {
        "behaviour_logp": blogp,
        "advantages": np.array([[1.0, -1.0, 0.5, 3.0]], np.float32),
        "mask": np.array([[True, True, True, False]]),
    }
    cfg = O.ObjectiveConfig(kl_estimator="k3_tangent")
    fn = jax.grad(lambda lp: O.p3o(lp, batch, cfg)[0])
    grad = np.asarray(fn(jnp.asarray(lr + blogp)), np.float64)
    x = lr[0, :3].astype(np.float64)
    rho = np.exp(x)
    e = rho.sum() ** 2 / (3 * (rho**2).sum())
    want = (-np.minimum(rho, e) * batch["advantages"][0, :3] + (1 - e) * _tangent(x)[1]) / 3
    np.testing.assert_allclose(grad[0, :3], want, rtol=1e-5)
    assert grad[0, 3] == 0.0 and grad[0, 0] < 0  # pulled back up toward pi_b


def _shares(x, keep):
    """float64 shares of the kept tokens below -10 and above +10, over the kept count."""
    n = keep.sum()
    return np.sum(keep & (x < -C)) / n, np.sum(keep & (x > C)) / n


def test_beyond_clamp_shares_vs_numpy_for_every_objective():
    """Catches a share taken with >= at the seam or from |log ratio| (both sides in one),
    divided by the kept tokens' count instead of N (a dropped token: planted, fails),
    normalised per micro-batch (2 strided ones in the step scope: planted, fails), or computed
    differently by one objective (every objective on one batch); pads hold log ratio -30."""
    rng = np.random.default_rng(3)
    # on a 1/64 grid, so log pi, log pi_b and their difference are exact in float32
    x = rng.choice([-14.0, -10.0, -10.5, -3.0, 0.25, 10 - H, 10.0, 10.5, 25.0], size=(4, 6))
    mask = np.arange(6)[None] < np.array([[6], [3], [5], [2]])
    x[~mask] = -30.0  # pads beyond the clamp: must not count
    blogp = rng.integers(-192, -32, (4, 6)) / 64.0
    logp = (blogp + x).astype(np.float32)
    batch = {
        "behaviour_logp": blogp.astype(np.float32),
        "prox_logp": (blogp + 0.1).astype(np.float32),
        "ref_logp": (blogp - 0.2).astype(np.float32),
        "advantages": rng.normal(size=(4, 6)).astype(np.float32),
        "mask": mask,
    }
    lr32 = logp.astype(np.float64) - batch["behaviour_logp"]
    want = _shares(lr32, mask)
    assert 0 < want[0] < 1 and 0 < want[1] < 1  # both sides populated
    for name, obj in sorted(O.OBJECTIVES.items()):
        m = jax.jit(lambda lp, b, o=obj, n=name: o.loss(lp, b, O.ObjectiveConfig(name=n))[1])(
            logp, batch
        )
        got = (float(m["lr_beyond_clamp_low"]), float(m["lr_beyond_clamp_high"]))
        assert got == pytest.approx(want, rel=1e-6), name
    # a dropped token (non-finite pi_b) leaves the numerator; N keeps it (as nonfinite_frac)
    bad = {**batch, "behaviour_logp": batch["behaviour_logp"].copy()}
    i = np.argwhere(mask & (lr32 < -C))[0]
    bad["behaviour_logp"][tuple(i)] = -np.inf
    m = O.p3o(logp, bad, O.ObjectiveConfig())[1]
    assert float(m["lr_beyond_clamp_low"]) == pytest.approx(want[0] - 1 / mask.sum(), rel=1e-6)
    # step scope, 2 strided micro-batches: the shares add up to the step's
    cfg = O.ObjectiveConfig(name="p3o")
    params = jnp.zeros((), jnp.float32)
    with_lp = {**batch, "given_logp": logp}
    _, _, m2 = U.step_loss_and_grad(lambda p, mb: mb["given_logp"] + p, params, with_lp, cfg, 2)
    assert float(m2["lr_beyond_clamp_low"]) == pytest.approx(want[0], rel=1e-6)
    assert float(m2["lr_beyond_clamp_high"]) == pytest.approx(want[1], rel=1e-6)


def _write_run(path, reward, low, high=None):
    rows = [
        {
            "step": s,
            "reward_mean": r,
            "lr_beyond_clamp_low": lo,
            "lr_beyond_clamp_high": 0.0 if high is None else high[s],
            "logratio_max": 12.0 if lo > 0 else 3.0,
        }
        for s, (r, lo) in enumerate(zip(reward, low))
    ]
    rows.insert(1, {"step": 0, "eval/pass@1": 0.5})  # an eval row is no train row
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tool_reports_shares_before_during_and_after_the_dip(tmp_path, capsys):
    """Catches experiments/k3_clamp.py using another collapse step than run_stats' dip, a
    before / during split off by one step, eval rows read as train rows, or a run without a dip
    reported as collapsing: a synthetic run whose reward drops to 0 at step 30 (dip at 35, the
    first 10-step mean below half its peak; window 26-35) and whose low share rises from 26."""
    reward = [1.0] * 30 + [0.0] * 20
    low = [0.0] * 26 + [0.01 * (s - 25) for s in range(26, 50)]
    _write_run(tmp_path / "run", reward, low)
    rep = k3_clamp.clamp_report(k3_clamp.load_run(str(tmp_path / "run"))["train"])
    assert (rep["collapse"], rep["sustained"]) == (35, 35)
    phases = ("before", "during", "after")
    steps = {p: [r["step"] for r in rep["rows"] if r["phase"] == p] for p in phases}
    assert steps == {p: list(range(a, a + 10)) for p, a in zip(phases, (16, 26, 36))}
    assert rep["before"]["lr_beyond_clamp_low"] == 0.0 and rep["before"]["steps_beyond"] == 0
    assert rep["during"]["lr_beyond_clamp_low"] == pytest.approx(np.mean(low[26:36]))
    assert rep["during"]["steps_beyond"] == 10 and rep["after"]["logratio_max"] == 12.0
    _write_run(tmp_path / "flat", [1.0] * 30, [0.0] * 30)
    assert k3_clamp.main([str(tmp_path / "run"), str(tmp_path / "flat")]) == 0
    out = capsys.readouterr().out
    assert "collapse (dip): 35; sustained: 35" in out and "collapse (dip): -; sustained: -" in out
    assert "| 25 | before | 1 | 0 | 0 | 3 |\n| 26 | during | 1 | 0.01 | 0 | 12 |" in out
    with pytest.raises(SystemExit):
        k3_clamp.main([str(tmp_path / "missing")])

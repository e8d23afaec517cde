"""model.lora with the off-policy knobs, all in one RL run (the `knob_run` fixture, 8 fake
devices, the embedded model's shapes loaded from an HF directory): adapters whose B is
non-zero, temperature 1.3, lag 1 (pi_b an older adapter version; lag alone is
tests/test_offpolicy_exact.py's), two updates per batch, an external behaviour model for half
of each group, a needs-prox objective (decoupled_ppo). Steps 0 and 1 sample in float32; step
2's draw is taken in bfloat16 and in fp8 (rollout.precision) up to the merged copy the sampler
gets, then stopped: what LoRA changes there is the copy, and a sampler compile per format
would double the run's cost. tests/test_lora_objectives.py runs every objective with LoRA.

References: float32 teacher forcing (`model.apply`) of lora.merge's weights, taken to float64
(lora.merge itself is pinned to a float64 W + (alpha / R) A B in tests/test_lora.py); for
bfloat16 / fp8, lora.merge's float32 weights prepared by the sampler's own
precision.prepare_fn (the plain model's copy, whose pi_b per format tests/test_knobs_exact.py
pins against a numpy quantizer).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_full_kl import _params
from test_lora_objectives import _logp
from test_train import coin_reward, tiny_config

from ess_jax.data.tokenizer import char_tokenizer
from ess_jax.io import weights
from ess_jax.model import lora
from ess_jax.rl import experiment, rollout, steps, train, update
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling.engine import JaxEngine

RANK, TEMP = 4, 1.3


def _nbytes(leaves) -> int:
    return sum(x.size * x.dtype.itemsize for x in leaves)


LOW_PRECISIONS = ("bfloat16", "fp8")


class _Probed(Exception):
    """Raised by the recorded draw once it has the low-precision copy."""


@pytest.fixture(scope="module")
def knob_run(tmp_path_factory):
    """The run's steps 0 (float32), 1 (bfloat16) and 2 (fp8), recorded: each rollout, each
    policy draw's copy of the weights, each update (params before it, its batch, its metrics;
    for the first, its loss with the pi_prox of the wrong params), each pi_prox score's params,
    the adapters after each step (versions[v]) and the frozen base before the first."""
    base = tmp_path_factory.mktemp("lora_knobs")
    # the embedded model's shapes, its weights drawn in numpy and loaded from HF directories
    # (the policy's base and the external model): no init program to compile
    tok = char_tokenizer()
    plain_cfg = experiment.embedded_model_config(tiny_config().model, tok)
    weights.save_hf(plain_cfg, _params(plain_cfg, 0), str(base / "base"), tokenizer=tok)
    external = _params(plain_cfg, 1)
    weights.save_hf(plain_cfg, external, str(base / "external"))
    config = tiny_config(
        **{
            "model.source": str(base / "base"),
            "model.lora.rank": RANK,
            "objective.name": "decoupled_ppo",  # needs the proximal snapshot
            "optim.lr": 2e-2,
            "rollout.temperature": TEMP,
            "rollout.lag": 1,
            "train.updates_per_batch": 2,
            "data.prompts_per_step": 4,  # 16 rows: 8 per update
            "rollout.external_fraction": 0.5,
            "rollout.external_checkpoint": str(base / "external"),
        }
    )
    run = train.Run(config, str(base / "run"))
    run.reward_fn = coin_reward
    rng = np.random.default_rng(7)  # B != 0: the merged policy is not the base
    bumped = jax.tree.map(
        lambda x: x if x.any() else np.float32(0.3 * rng.normal(size=x.shape)),
        jax.device_get(run.trainer.state.params),
    )
    run.trainer.state = run.trainer.state.replace(
        params=jax.device_put(bumped, run.trainer.state_sh.params)
    )
    rec = dict(run=run, external=external, frozen=jax.device_get(run.trainer.state.frozen))
    rec.update(rollouts=[], draws=[], updates=[], scored=[], versions=[bumped])
    real_collect, real_generate = rollout.collect, JaxEngine.generate
    real_make, real_score = update.make_rl_step, steps.score_fn

    def collect(*args, **kwargs):
        out, metrics = real_collect(*args, **kwargs)
        rec["rollouts"].append(jax.device_get(out))
        return out, metrics

    def generate(engine, *args, **kwargs):
        if engine.version >= 0:  # the policy's copy, as the sampler gets it
            copy = engine.sampler_params()
            rec["draws"].append((engine.version, copy.precision, jax.device_get(copy.params)))
            if copy.precision != "float32":
                raise _Probed  # the copy is what is checked: no sampler compile for it
        return real_generate(engine, *args, **kwargs)

    def make_rl_step(*args, **kwargs):
        step_fn = real_make(*args, **kwargs)

        def recorded(state, mb):
            before = jax.device_get((state.params, mb))
            wrong_loss = None
            if not rec["updates"]:  # pi_prox of the wrong params: the behaviour's
                wrong = {**mb, "prox_logp": mb["behaviour_logp"]}
                wrong_loss = float(step_fn(jax.tree.map(jnp.copy, state), wrong)[1]["loss"])
            new_state, metrics = step_fn(state, mb)
            rec["updates"].append((*before, jax.device_get(metrics), wrong_loss))
            return new_state, metrics

        return recorded

    def score_fn(*args):
        score = real_score(*args)

        def recorded(params, batch):
            frozen_ids = {id(x) for x in jax.tree.leaves(run.trainer.state.frozen)}
            rec["scored"].append((params, frozen_ids))
            return score(params, batch)

        return recorded

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "collect", collect)
        mp.setattr(JaxEngine, "generate", generate)
        mp.setattr(update, "make_rl_step", make_rl_step)
        mp.setattr(steps, "score_fn", score_fn)
        run.trainer.history.push(0, run.trainer.state.params)
        rec["rows"] = []
        for s in range(2):
            rec["rows"].append(run.rl_step(s))
            rec["versions"].append(jax.device_get(run.trainer.state.params))
        for precision in LOW_PRECISIONS:  # step 2's draw, in each format, then stop
            rcfg = run.rollout_cfg.copy_and_resolve_references()
            rcfg.precision = precision
            mp.setattr(run, "rollout_cfg", rcfg)
            mp.setattr(run, "engine", rollout.policy_engine(run.model_cfg, rcfg))
            with pytest.raises(_Probed):
                run.rl_step(2)
    yield rec
    run.close()


@pytest.mark.parametrize("step", [0, 1])
def test_float32_knobs_record_the_lagged_merged_adapters_pi_b(knob_run, step):
    """Catches a LoRA sampler that draws from the base alone, from the current adapters
    instead of the lagged version, or from adapters merged with the wrong scale, and external
    rows paired with the policy's pi_b: at T = 1.3 with lag 1 (both steps draw with version 0;
    at step 1 the trainer holds version 1), the recorded pi_b equals the tempered
    teacher-forced log-probs of version 0's adapters merged into the base (lora.merge) within
    1e-5 on the policy rows, of the external model on its rows; version 1 and the base alone
    are > 1e-4 off."""
    cfg = knob_run["run"].model_cfg
    plain, frozen = lora.base_config(cfg), knob_run["frozen"]
    r = knob_run["rollouts"][step]
    ext = (r.policy_version == -1)[:, None] & (r.loss_mask > 0)
    pol = (r.policy_version == 0)[:, None] & (r.loss_mask > 0)
    assert ext.any() and pol.any() and not (r.loss_mask > 0)[~(ext | pol)].any()

    def err(params, rows):
        got = _logp(plain, params, r.tokens, r.attn_mask, r.prompt_len, TEMP)
        return np.abs(got - r.behaviour_logp)[rows].max()

    merged = lambda v: lora.merge(cfg, frozen, knob_run["versions"][v])  # noqa: E731
    assert err(merged(0), pol) <= 1e-5
    assert err(knob_run["external"], ext) <= 1e-5
    assert err(merged(1), pol) > 1e-4 and err(frozen, pol) > 1e-4


@pytest.mark.parametrize("precision", LOW_PRECISIONS)
def test_low_precision_knobs_draw_from_the_merged_copy_in_that_format(knob_run, precision):
    """Catches rollout.precision dropped under LoRA (the float32 merge handed to the sampler)
    and a merged copy of the base alone or of the current instead of the lagged adapters: at
    step 2 (lag 1: version 1) the copy the policy's draw gets is prepared in that
    format and holds, in 99% of its elements exactly, precision.prepare_fn of lora.merge of
    version 1's adapters (the plain model's copy, whose pi_b per format
    tests/test_knobs_exact.py pins; tests/test_lora.py draws from the fused copy bit for bit
    as from that one). The draw stops there: the copy is what LoRA changes."""
    cfg, frozen = knob_run["run"].model_cfg, knob_run["frozen"]
    (version, prepared, got) = knob_run["draws"][2 + LOW_PRECISIONS.index(precision)]
    assert (version, prepared) == (1, precision)
    for v, agree in ((1, 0.99), (2, 0.5), (None, 0.5)):
        adapters = knob_run["versions"][v] if v is not None else None
        full = lora.merge(cfg, frozen, adapters) if adapters else frozen
        want = jax.device_get(precision_lib.prepare_fn(precision)(full))
        assert jax.tree.structure(got) == jax.tree.structure(want)
        same = []
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype and g.shape == w.shape
            same.append((np.asarray(g, np.float32) == np.asarray(w, np.float32)).ravel())
        # the fused merge sums in another order on 8 devices: a few elements may round to the
        # neighbouring value of the format; another policy's copy differs in most matrices
        frac = np.concatenate(same).mean()
        assert frac >= agree if v == 1 else frac < agree, (v, frac)


def test_prox_snapshot_holds_adapters_only_and_is_used(knob_run):
    """Catches a proximal snapshot under LoRA that copies the base (or scores the base alone,
    or the adapters without the base), one re-taken before each update, and a pi_prox the
    objective ignores: every pi_prox score gets the frozen base's own buffers (no copy) and
    adapter leaves of the adapters' bytes only; each update's pi_prox equals the teacher-forced
    log-probs (T = 1) of the adapters at the start of its batch merged into the base, within
    5e-5, the second update's > 1e-4 off its own start; and a pi_prox of the base alone
    changes the update's loss."""
    cfg = knob_run["run"].model_cfg
    adapter_bytes = _nbytes(jax.tree.leaves(knob_run["versions"][0]))
    assert len(knob_run["scored"]) == 2  # one snapshot per rollout batch
    for params, frozen_ids in knob_run["scored"]:
        leaves = jax.tree.leaves(params)
        assert frozen_ids <= {id(x) for x in leaves}
        own = [x for x in leaves if id(x) not in frozen_ids]
        assert _nbytes(own) == adapter_bytes and len(own) == 2 * len(lora.TARGETS) * cfg.num_layers
    plain = lora.base_config(cfg)
    updates = knob_run["updates"]
    assert len(updates) == 4
    for i, (params, mb, _, _) in enumerate(updates):
        r, rows = knob_run["rollouts"][i // 2], slice(8 * (i % 2), 8 * (i % 2 + 1))
        np.testing.assert_array_equal(mb["tokens"], r.tokens[rows])
        mask = mb["mask"] > 0

        def ref(p, r=r, rows=rows):  # on the whole rollout: one compile for every update
            merged = lora.merge(cfg, knob_run["frozen"], p)
            return _logp(plain, merged, r.tokens, r.attn_mask, r.prompt_len)[rows]

        # the trainer applies the adapters in the matmuls, the reference merged: 5e-5
        assert np.abs(mb["prox_logp"] - ref(updates[i - i % 2][0]))[mask].max() <= 5e-5, i
        if i % 2:
            assert np.abs(mb["prox_logp"] - ref(params))[mask].max() > 1e-4, i
    wrong_loss, loss = updates[0][3], updates[0][2]["loss"]
    assert abs(wrong_loss - loss) > 1e-4


def test_the_run_keeps_the_base_frozen_and_its_rows_finite(knob_run):
    """Catches a knob's path that trains or replaces the base under LoRA, or yields non-finite
    rows: after the two steps the frozen base is bit for bit the loaded one, the optimizer
    holds the adapters' shapes only, and every numeric value of every row is finite, with the
    off-policy knobs visible (ESS < 1, lag 1 at step 1)."""
    run, rows = knob_run["run"], knob_run["rows"]
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(run.trainer.state.frozen), knob_run["frozen"]
    )
    moments = [x.shape for x in jax.tree.leaves(run.trainer.state.opt_state) if x.ndim > 0]
    assert sorted(moments) == sorted(
        2 * [x.shape for x in jax.tree.leaves(run.trainer.state.params)]
    )
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not np.isfinite(v)}
        assert not bad, (row["step"], bad)
        assert row["ess"] < 1 - 1e-3
    assert [r["policy_lag"] for r in rows] == [0, 1]

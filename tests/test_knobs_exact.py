"""Each off-policy knob's exact pi_b: the behaviour log-probs recorded by a real RL step equal an
independent teacher-forced computation of the behaviour model with the knob's value, and the
step's ESS equals the float64 ESS of (trainer log-prob - that reference).

`tests/test_train.py` only checks that each knob lowers the ESS; a knob applied with the wrong
value passes that. Bugs caught here (each planted once, see tests/README.md): log-probs scaled
by 1/T instead of the logits (temperature); a top-k that keeps k - 1 tokens; a top-p that drops
the token crossing the threshold; a bf16 sampler computing in float32 on bf16-rounded weights;
fp8 with one scale per tensor instead of per output channel; external rows paired with the
policy rows' log-probs; the external model drawn at the policy's precision; a format of
tests/test_formats.py (float16, fp8 per tensor, e5m2, int8, int4, fp8 activations) or a KV
cache precision that the sampler drops or applies to other matrices than the reference's.

The reference: float32 teacher forcing (model.apply) for float32 samplers. For the other
formats the weights are rounded here (test_formats.ref_weights: a float64 numpy quantizer) and
each response is teacher-forced through the KV-cache decode path, one row at a time (as
each of the 8 fake devices decodes one row): bf16 activations round differently with another
op order or batch shape (a full-sequence forward is ~1e-2 off; a batch of 8 rows on one device
flips a few roundings; row by row agrees to ~4e-7). Low-precision cases still allow up to 10%
of tokens one bf16 rounding flip away (<= 0.02), so another CPU's kernels cannot make them
flaky; a wrong precision mode moves every token. Truncation uses test_sampler's float64
kept-support reference.
"""

import jax
import numpy as np
import pytest
from test_formats import ref_weights
from test_offpolicy_exact import _record_rollouts, _start
from test_sampler import _np_kept
from test_train import tiny_config

from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.model import kv_cache
from ess_jax.rl import rollout, train

_apply = jax.jit(model.apply, static_argnums=0)
_forward = jax.jit(model.forward, static_argnums=0)
GROUP = 4
# the sampler's compute per format: (dtype, fp8 activations)
_COMPUTE = {"float16": ("float16", False), "fp8_act": ("bfloat16", True)}


def _decode_logits(cfg, params, tokens, attn_mask, prompt_len, resp_len, kv="compute"):
    """Teacher-forced logits [B, T, V] through the KV cache, the prompt at the width the
    sampler drew it at (the batcher's bucket: the sampler pads no further)."""
    b = tokens.shape[0]
    prompt, pmask = tokens[:, :prompt_len], attn_mask[:, :prompt_len]
    kv_mask = np.concatenate([pmask, np.ones((b, resp_len), bool)], 1)
    pos = np.asarray(model.positions_from_mask(pmask))[:, -1] + 1
    fp8, dtype = kv == "fp8", None if kv in ("compute", "fp8") else kv
    cache = kv_cache.init_cache(cfg, b, prompt_len + resp_len, dtype, fp8=fp8)
    logits, cache = _forward(
        cfg, params, prompt, model.positions_from_mask(pmask), kv_mask, cache, 0
    )
    out = [np.asarray(logits[:, -1], np.float64)]
    for t in range(resp_len - 1):
        tok = tokens[:, prompt_len + t : prompt_len + t + 1]
        at = prompt_len + t  # the cache position of the token
        logits, cache = _forward(cfg, params, tok, (pos + t)[:, None], kv_mask, cache, at)
        out.append(np.asarray(logits[:, 0], np.float64))
    return np.stack(out, 1)


def _behaviour_logits(cfg, params, precision, r, kv="compute"):
    """Logits predicting each response token, as the behaviour model computes them (float64)."""
    t = r.behaviour_logp.shape[1]
    if precision == "float32" and kv == "compute":
        logits = np.asarray(_apply(cfg, params, r.tokens, r.attn_mask), np.float64)
        return logits[:, r.prompt_len - 1 : -1]
    if precision == "float32":
        lp, low = params, cfg
    else:
        dtype, act = _COMPUTE.get(precision, ("bfloat16", False))
        lp, low = ref_weights(params, precision), cfg.replace(dtype=dtype, activation_fp8=act)
    rows = [
        _decode_logits(low, lp, r.tokens[i : i + 1], r.attn_mask[i : i + 1], r.prompt_len, t, kv)
        for i in range(r.tokens.shape[0])
    ]
    return np.concatenate(rows)


def _np_ess(log_ratio, mask):
    rho = np.exp(log_ratio[mask])
    return rho.sum() ** 2 / (rho.size * (rho**2).sum())


@pytest.fixture(scope="module")
def knob_run(tmp_path_factory):
    """One RL run (so one trainer compile) whose rollout knobs each test sets before a step; an
    external model (another random init, saved as an HF checkpoint) is loaded for the external
    cases. Each test records the policy params right before its own step."""
    base = tmp_path_factory.mktemp("knobs")
    config = tiny_config()
    cfg, _, _ = train.experiment.load_policy(config.model)
    external = jax.device_get(model.init_params(cfg, 123))
    weights.save_hf(cfg, external, str(base / "external"))
    config = tiny_config(
        **{
            "rollout.external_fraction": 0.5,
            "rollout.external_checkpoint": str(base / "external"),
            "rollout.group_size": GROUP,
        }
    )
    return {"run": _start(config, base / "run"), "external": external, "step": 0}


def _step_with_knobs(knob_run, monkeypatch, **knobs):
    """One rl_step with the given rollout knobs (others at their defaults, no external rows
    unless asked): (row, rollout, params the step sampled and trained from)."""
    run = knob_run["run"]
    rcfg = run.rollout_cfg.copy_and_resolve_references()
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, precision="float32")
    defaults.update(kv_cache_precision="compute")
    defaults.update(external_fraction=0.0, external_precision="float32")
    for key, value in {**defaults, **knobs}.items():
        rcfg[key] = value
    monkeypatch.setattr(run, "rollout_cfg", rcfg)
    # the engines' formats (precision, KV cache) are fixed when they are built: build them anew
    monkeypatch.setattr(run, "engine", rollout.policy_engine(run.model_cfg, rcfg))
    ext = rollout.external_engine(run.external.cfg, run.external.params, rcfg)
    monkeypatch.setattr(run, "external", ext)
    rollouts = _record_rollouts(monkeypatch)
    params = jax.device_get(run.trainer.state.params)
    step = knob_run["step"]
    knob_run["step"] += 1
    row = run.rl_step(step)
    return row, rollouts[0], params, step


CASES = {
    "temperature": dict(temperature=1.5),
    "cold": dict(temperature=0.6),
    "top_k": dict(top_k=4),
    "top_p": dict(top_p=0.7),
    "temp_top_k_top_p": dict(temperature=0.8, top_k=6, top_p=0.8),
    "bfloat16": dict(precision="bfloat16"),
    "fp8": dict(precision="fp8"),
    "external": dict(external_fraction=0.5),
    "external_fp8_policy_f32": dict(
        external_fraction=0.5, precision="float32", external_precision="fp8"
    ),
    **{f: dict(precision=f) for f in ("fp8_e4m3_tensor", "fp8_e5m2", "int4", "fp8_act")},
    # a KV cache precision rides along with a format: one sampler compile for both
    "float16_kv_bfloat16": dict(precision="float16", kv_cache_precision="bfloat16"),
    "int8_kv_fp8": dict(precision="int8", kv_cache_precision="fp8"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_recorded_log_ratio_equals_teacher_forced_behaviour(knob_run, monkeypatch, case):
    knobs = CASES[case]
    row, r, params, step = _step_with_knobs(knob_run, monkeypatch, **knobs)
    run = knob_run["run"]
    mask = r.loss_mask > 0
    resp_tokens = r.tokens[:, r.prompt_len :]
    n_ext = round(knobs.get("external_fraction", 0.0) * GROUP)
    # layout: the external samples come first in each group, then the policy's
    versions = r.policy_version.reshape(-1, GROUP)
    assert (versions[:, :n_ext] == -1).all() and (versions[:, n_ext:] == step).all()
    ext_rows = r.policy_version == -1

    scaled = np.zeros(resp_tokens.shape + (run.model_cfg.vocab_size,))
    for rows, params_b, precision in (
        (~ext_rows, params, knobs.get("precision", "float32")),
        (ext_rows, knob_run["external"], knobs.get("external_precision", "float32")),
    ):
        if rows.any():
            kv = knobs.get("kv_cache_precision", "compute")
            logits = _behaviour_logits(run.model_cfg, params_b, precision, r, kv)
            scaled[rows] = logits[rows] / knobs.get("temperature", 1.0)
    keep, margin = _np_kept(scaled, knobs.get("top_k", 0), knobs.get("top_p", 1.0))
    top = scaled.max(-1, keepdims=True)
    kept_lse = np.log(np.where(keep, np.exp(scaled - top), 0.0).sum(-1)) + top[..., 0]
    want = np.take_along_axis(scaled, resp_tokens[..., None], -1)[..., 0] - kept_lse
    ok = mask & (margin > 1e-4)  # a float32 tie at a truncation boundary is ambiguous
    assert ok.sum() >= 0.9 * mask.sum() > 0

    # the log-ratio the objective sees, exp(logp - blogp): trainer float32 at T=1, policy params
    logits = _behaviour_logits(run.model_cfg, params, "float32", r)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    logp = np.take_along_axis(logits, resp_tokens[..., None], -1)[..., 0] - log_z
    recorded, expected = logp - r.behaviour_logp, logp - want
    err = np.where(ok, np.abs(recorded - expected), 0.0)
    agree = ok & (err <= 2e-5)
    low_precision = {knobs.get("precision"), knobs.get("external_precision")} - {None, "float32"}
    low_precision |= {knobs.get("kv_cache_precision")} - {None, "compute"}
    if low_precision:  # see the module docstring: a rare bf16 rounding flip is allowed
        assert agree.sum() >= 0.9 * ok.sum() and err.max() <= 0.02, (case, err[ok])
    else:
        assert agree.sum() == ok.sum(), (case, err.max())
    # not vacuous: the knob really moved pi_b away from the trainer's policy
    assert np.abs(expected[ok]).max() > 1e-3
    # the loop's ESS is the float64 ESS of those log-ratios
    assert row["ess"] == pytest.approx(_np_ess(np.where(agree, expected, recorded), mask), rel=1e-5)

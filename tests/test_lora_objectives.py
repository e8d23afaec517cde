"""model.lora with every objective of the registry: the real LoRA train step
(`update.make_rl_step` with a frozen base) of one objective per kind, on one device, every
kind in one program (the `lora_steps` fixture, compiled once).

An objective reaches the LoRA path only through the facts of its record (`needs_prox`:
pi_prox is scored with the base joined to the adapters; `batch_pass`: vcpo's pass gets the
adapters and the base-joined log-prob function); its loss sees log-prob arrays only. So the
kinds are the distinct values of those facts over the registry (NOT_A_KIND lists the fields
that are not such facts), each run by its first objective: a new objective is checked by its
kind's step, a new kind or a new record field gets a step of its own. The kind that accepts
objective.kl_estimator "full" runs it, re-scoring pi_b with lagged adapters
(`FullKL.inputs` at lag 1). The program is compiled at XLA's optimization level 0 (the
checks are of values and tree contents, not speed): the compile is this file's cost, about
2.5-4.5 s of CPU per kind here, where one objective's step at the default level costs about
4.7 s. tests/test_lora_knobs.py runs the off-policy knobs with LoRA.

References: float32 teacher forcing (`model.apply`) of lora.merge's weights, taken to float64
(lora.merge itself is pinned to a float64 W + (alpha / R) A B in tests/test_lora.py); the
float64 full KL of tests/test_full_kl.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg
from test_full_kl import _np_full_kl, _params
from test_train import tiny_config

from ess_jax import objectives as O
from ess_jax.model import decoder as model
from ess_jax.model import lora
from ess_jax.objectives.registry import Objective
from ess_jax.parallel import sharding
from ess_jax.rl import steps, update
from ess_jax.rl.full_kl import FullKL
from ess_jax.rl.optim import make_optimizer
from ess_jax.sampling import rescore

RANK, ALPHA, TEMP = 4, 8.0, 1.3
_apply = jax.jit(model.apply, static_argnums=0)
# Objective fields that only parameterize its loss (what the loss computes from log-prob
# arrays), and ess_in_loss, which acts only with several micro-batches (the statistics pass;
# these steps take one); every other field is a fact the loop or the step acts on, and
# defines a kind.
NOT_A_KIND = ("name", "loss", "fields", "paper_clips", "no_full_kl", "ess_in_loss")


def _kind(record: Objective) -> tuple:
    return tuple(
        (f.name, bool(getattr(record, f.name)))
        for f in dataclasses.fields(record)
        if f.name not in NOT_A_KIND
    )


KINDS: dict[tuple, str] = {}  # kind -> its first objective in the registry
for _name, _record in O.OBJECTIVES.items():
    KINDS.setdefault(_kind(_record), _name)


def _logp(cfg, params, tokens, attn_mask, prompt_len, temperature=1.0):
    """float64 log softmax(logits / T)[y] of each response token, teacher-forced in float32."""
    logits = np.asarray(_apply(cfg, params, tokens, attn_mask), np.float64)
    logits = logits[:, prompt_len - 1 : -1] / temperature
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    resp = np.asarray(tokens)[:, prompt_len:]
    return np.take_along_axis(logits, resp[..., None], -1)[..., 0] - log_z


B, G, P, T = 8, 4, 4, 4  # rows, group, prompt and response length


@pytest.fixture(scope="module")
def lora_steps():
    """Each kind's real LoRA step on one batch, twice: with pi_prox scored from the adapters
    the step starts from (as Trainer.learn does) and with a pi_prox of the wrong params (the
    lagged adapters). Returns (cfg, frozen, adapters, lagged, batch, {name: (right, wrong)}),
    each result (state, metrics) as numpy."""
    cfg = lora.with_lora(tiny_model_cfg(), RANK, ALPHA, lora.TARGETS)
    frozen, adapters = lora.split(_params(cfg, 0))  # B random: as after training
    lagged = lora.split(_params(cfg, 1))[1]
    plain = lora.base_config(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (B, P + T)).astype(np.int32)
    attn = np.ones(tokens.shape, bool)
    attn[0, :2] = False  # a left-padded prompt
    attn[1, P + 2 :] = attn[5, P + 3 :] = False  # responses that end early
    tokens[~attn] = 0
    batch = {
        "tokens": tokens,
        "attn_mask": attn,
        "mask": attn[:, P:].astype(np.float32),
        "advantages": np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32),
        # pi_b: the lagged adapters at T = 1.3 (the full-KL kind re-scores exactly this)
        "behaviour_logp": np.float32(
            np.where(
                attn[:, P:], _logp(plain, lora.merge(cfg, frozen, lagged), tokens, attn, P, TEMP), 0
            )
        ),
    }
    prox = {
        "right": _logp(plain, lora.merge(cfg, frozen, adapters), tokens, attn, P),
        "wrong": _logp(plain, lora.merge(cfg, frozen, lagged), tokens, attn, P),
    }

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    tx = make_optimizer({**tiny_config().optim.to_dict(), "lr": 1e-2, "total_steps": 2})
    on_mesh = lambda tree: jax.device_put(tree, sharding.replicated(mesh))  # noqa: E731
    state, state_sh = steps.init_state(on_mesh(adapters), tx, mesh, on_mesh(frozen))
    rcfg = tiny_config(**{"rollout.temperature": TEMP}).rollout
    fns, behaviour = {}, None
    for name in KINDS.values():
        record = O.OBJECTIVES[name]
        kl = {"kl_estimator": "full"} if record.no_full_kl == "" else {}
        ocfg = O.objective_config({"name": name, **kl})
        key = update.StepKey(P)
        if kl:
            key = update.StepKey(P, FullKL.for_run(ocfg, rcfg, 1, 1))
            behaviour = key.full_kl.inputs(on_mesh(lagged), state_sh.params)
        fns[name] = update.make_rl_step(
            update.UpdateConfig(cfg, ocfg, tx, group_size=G), key, state_sh,
            sharding.batch_sharding(mesh), behaviour.shardings if kl else None,
        )  # fmt: skip

    def all_kinds(state, batch, prox, bparams):
        out = {}
        for name, fn in fns.items():
            mb = dict(batch)
            if O.OBJECTIVES[name].needs_prox:
                mb["prox_logp"] = prox
            if O.OBJECTIVES[name].no_full_kl == "":
                mb["policy_version"] = jnp.ones((B, 1), jnp.int32)
                out[name] = fn(state, mb, bparams)
            else:
                out[name] = fn(state, mb)
        return out

    bparams = behaviour.params if behaviour else {}
    program = jax.jit(all_kinds).lower(state, batch, prox["right"], bparams)
    program = program.compile({"xla_backend_optimization_level": 0})
    runs = {
        k: jax.device_get(program(state, batch, np.float32(p), bparams)) for k, p in prox.items()
    }
    results = {name: (runs["right"][name], runs["wrong"][name]) for name in fns}
    return cfg, frozen, adapters, lagged, batch, results


@pytest.mark.parametrize("name", list(O.OBJECTIVES))
def test_every_objective_kind_trains_the_adapters_only(lora_steps, name):
    """Catches a LoRA step that breaks with some objective's facts (pi_prox scored without the
    base, vcpo's per-sequence pass given the base as trainable params, a full-KL re-score
    that drops the base): the step of the objective's kind has a finite loss
    and gradient, changes every adapter, returns the frozen base bit for bit, and its
    optimizer state holds the adapters' shapes only (Adam's two moments), no base matrix."""
    cfg, frozen, adapters, _, _, results = lora_steps
    (state, metrics), _ = results[KINDS[_kind(O.OBJECTIVES[name])]]
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert metrics["grad_norm"] > 0
    assert metrics["skipped"] == 0
    moved = jax.tree.map(lambda new, old: np.abs(new - old).max(), state.params, adapters)
    assert min(jax.tree.leaves(moved)) > 0, moved
    jax.tree.map(np.testing.assert_array_equal, state.frozen, frozen)
    n = sum(x.size for x in jax.tree.leaves(adapters))
    assert n == lora.num_adapter_params(cfg)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sorted(x.shape for x in moments) == sorted(
        2 * [x.shape for x in jax.tree.leaves(adapters)]
    )


def test_prox_objectives_read_their_snapshot(lora_steps):
    """Catches a pi_prox that the step ignores under LoRA: with the snapshot of the wrong params
    (the lagged adapters instead of the adapters the step starts from) the loss of every kind
    with needs_prox changes, and that of every other kind is bit for bit the same."""
    *_, results = lora_steps
    for name, ((_, right), (_, wrong)) in results.items():
        if O.OBJECTIVES[name].needs_prox:
            assert abs(right["loss"] - wrong["loss"]) > 1e-4, name
        else:
            assert right["loss"] == wrong["loss"], name
    assert any(O.OBJECTIVES[n].needs_prox for n in results)


def test_full_kl_rescores_the_lagged_adapters_over_the_frozen_base(lora_steps):
    """Catches a full-KL re-score under LoRA that uses the current adapters, the base alone or
    adapters without the base: the step's re-score of pi_b reproduces the recorded log-probs
    (drawn by the lagged adapters, T = 1.3) within 2e-5, and its KL equals the float64
    KL(pi || pi_b) with pi the adapters the step starts from and pi_b the lagged ones, not the
    KL against the current adapters."""
    cfg, frozen, adapters, lagged, batch, results = lora_steps
    (name,) = [n for n in results if O.OBJECTIVES[n].no_full_kl == ""]
    (_, m), _ = results[name]
    assert m["rescore_err"] <= 2e-5
    plain, b = lora.base_config(cfg), rescore.Behaviour(temperature=TEMP)

    def logits(adapters_):
        out = _apply(plain, lora.merge(cfg, frozen, adapters_), batch["tokens"], batch["attn_mask"])
        return np.asarray(out, np.float64)[:, P - 1 : -1]

    mask = batch["mask"] > 0
    want = _np_full_kl(logits(adapters), logits(lagged), batch["tokens"][:, P:], b)[0][mask].mean()
    assert m["kl_behaviour_full"] == pytest.approx(want, rel=1e-4)
    wrong = _np_full_kl(logits(adapters), logits(adapters), batch["tokens"][:, P:], b)[0][mask]
    assert abs(wrong.mean() - want) > 1e-3 * want

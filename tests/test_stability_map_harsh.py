"""configs/mini/stability_map_harsh.py's grid and experiments/harsh_headline.py's declared
comparisons. Cheap: configs built without a run, synthetic runs in memory."""

import math

import pytest
from scipy import stats

from configs.mini import common
from configs.mini import stability_map as committed
from configs.mini import stability_map_harsh as harsh
from ess_jax.config.defaults import base_config
from experiments import harsh_headline, reproduce

# The objectives common.OBJECTIVES gained after the committed map, in the harsh map's order.
NEW = "p3o_k3_tangent dppo icepop seq_mis geo_rs vcpo_authors m2po_areal m2po_authors".split()
# What each condition's name says, written out here rather than parsed from it:
# (temperature, lag, updates per batch, external fraction, precision, KV cache precision)
SAYS = {
    "calib+lag8": (1.0, 8, 1, 0.0, "int4", "fp8"),
    "t1.5+lag8": (1.5, 8, 1, 0.0, "float32", "compute"),
    "upd8": (1.2, 0, 8, 0.0, "float32", "compute"),
    "ext75": (1.0, 0, 1, 0.75, "float32", "compute"),
    "lag16": (1.0, 16, 1, 0.0, "float32", "compute"),
    "lag32": (1.0, 32, 1, 0.0, "float32", "compute"),
}
CONDITION_FIELDS = (
    ("rollout", "temperature"),
    ("rollout", "lag"),
    ("train", "updates_per_batch"),
    ("rollout", "external_fraction"),
    ("rollout", "precision"),
    ("rollout", "kv_cache_precision"),
)


def _says(c) -> tuple:
    return tuple(c[section][key] for section, key in CONDITION_FIELDS)


def _unconditioned(c) -> dict:
    """The config as a dict without the fields a condition sets (external_checkpoint too)."""
    d = c.to_dict()
    for section, key in (*CONDITION_FIELDS, ("rollout", "external_checkpoint")):
        del d[section][key]
    return d


def test_arms_are_the_conditions_times_the_objectives_less_the_refused_exact_kl():
    """Catches an arm missing from or added to the grid, an objective of the committed map or a
    new one left out, a condition name whose underscore makes split() cut it in the wrong place,
    and ext75 arms that reproduce.py would start without the external checkpoint."""
    assert harsh.OBJECTIVES == committed.FIRST + tuple(NEW)
    assert set(harsh.OBJECTIVES) <= set(common.OBJECTIVES)
    assert harsh.CONDITIONS == tuple(SAYS)
    grid = {f"{c}_{o}" for c in harsh.CONDITIONS for o in harsh.OBJECTIVES}
    assert len(harsh.ARMS) == len(set(harsh.ARMS)) == 101
    assert set(harsh.ARMS) == grid - {"calib+lag8_p3o_full"}
    assert {harsh.split(a) for a in harsh.ARMS} == {
        (c, o) for c in harsh.CONDITIONS for o in harsh.OBJECTIVES
    } - {("calib+lag8", "p3o_full")}
    assert reproduce.arms_of("stability_map_harsh") == harsh.ARMS
    needs = {
        a
        for a in harsh.ARMS
        if reproduce.needs_external(reproduce.Job("stability_map_harsh", a, 0))
    }
    assert needs == {f"ext75_{o}" for o in harsh.OBJECTIVES}


def test_each_condition_sets_what_its_name_says_and_nothing_else_differs():
    """Catches a condition that sets the wrong knob or value (lag 8 left out of a compound, upd8
    at T 1 or with 4 updates, ext75 at 50%), and an arm tuned apart from the committed map: with
    the condition's fields taken out, one of the committed map's nine (stability_map.FIRST) has
    the config of its t1.0 arm there, and a new objective the config of GRPO's t1.0 arm
    outside `objective`, whose fields are the defaults but for those common.OBJECTIVES names."""
    defaults = base_config().objective.to_dict()
    reference = _unconditioned(committed.get_config("t1.0_grpo_eps0.2"))
    for arm in harsh.ARMS:
        cond, obj = harsh.split(arm)
        c = harsh.get_config(arm)
        assert _says(c) == SAYS[cond], arm
        got = _unconditioned(c)
        if obj in committed.FIRST:
            assert got == _unconditioned(committed.get_config(f"t1.0_{obj}")), arm
            continue
        assert {k: v for k, v in got.items() if k != "objective"} == {
            k: v for k, v in reference.items() if k != "objective"
        }, arm
        assert got["objective"] == {**defaults, **common.OBJECTIVES[obj]}, arm


def _run(stable: bool, pass1: float) -> dict:
    """A run as run_stats.load_run gives it: 40 steps, flat reward (stable) or one that falls
    to 0 and stays (a sustained collapse), held-out pass@1 0.3 at step 0 and `pass1` at the end."""
    reward = [0.5] * 40 if stable else [0.5] * 15 + [0.0] * 25
    train = [{"step": i, "reward_mean": r, "ess": 0.9} for i, r in enumerate(reward)]
    evals = [{"step": 0, "eval/pass@1": 0.3}, {"step": 40, "eval/pass@1": pass1}]
    return {"train": train, "eval": evals}


def _grid(objective: str, seeds, stable=lambda cond, seed: True, pass1=0.5) -> dict:
    return {
        f"{cond}_{objective}": {s: _run(stable(cond, s), pass1) for s in seeds}
        for cond in harsh.CONDITIONS
    }


def test_c_baseline_is_chosen_by_stable_runs_then_pass1_on_the_selection_seeds_only():
    """Catches a choice that reads the confirmation seeds (geo_rs is best on seeds 5-9 only),
    that ranks by pass@1 before stability (dppo has the best pass@1 and one unstable run), that
    breaks a tie by order instead of pass@1 (seq_mis over icepop), or that chooses before every
    candidate's selection runs are in."""
    sel, conf = harsh.SELECTION_SEEDS, harsh.CONFIRMATION_SEEDS
    arms = {}
    for obj in harsh.CANDIDATES:
        arms.update(_grid(obj, sel, pass1=0.4))
    arms.update(_grid("dppo", sel, stable=lambda c, s: (c, s) != ("lag32", 3), pass1=0.9))
    arms.update(_grid("icepop", sel, pass1=0.5))
    arms.update(_grid("seq_mis", sel, pass1=0.6))
    for cond in harsh.CONDITIONS:  # geo_rs: 0.4 on seeds 0-4, 0.99 on 5-14
        arms[f"{cond}_geo_rs"].update({s: _run(True, 0.99) for s in conf})
    assert harsh_headline.choose_baseline(arms) == "seq_mis"
    del arms["upd8_m2po_areal"][4]
    assert harsh_headline.choose_baseline(arms) is None


def test_declared_family_is_the_five_and_a_comparison_concludes_only_with_its_ten_seeds():
    """Catches a Holm family that shrinks to the comparisons computed so far (A1 alone would
    pass at p 0.015), one that counts more than the five, a count of stable conditions that is
    off, and a comparison concluded before all ten of its seeds are in."""
    seeds = harsh.SEEDS
    arms = _grid("vcpo", seeds)  # stable in all 6 conditions, every seed
    # GRPO + TIS unstable at lag32 in seeds 0, 2, 4, 6, 8: differences 1, 0, 1, 0, ...
    arms.update(_grid("grpo_tis", seeds, stable=lambda c, s: not (c == "lag32" and s % 2 == 0)))
    assert harsh_headline.stable_counts(arms, "grpo_tis", seeds) == {
        s: 5 if s % 2 == 0 else 6 for s in seeds
    }
    chosen, rows = harsh_headline.declared(arms, {})
    assert chosen is None and len(rows) == 5
    a1 = rows[0]
    t = 0.5 / (math.sqrt(10 / 36) / math.sqrt(10))  # mean 0.5, sd sqrt(10/36): t = 3.0
    p = 2 * stats.t.sf(t, 9)
    assert (a1["n"], a1["t"][0], a1["t"][3]) == (10, pytest.approx(0.5), pytest.approx(p))
    assert a1["holm"] == pytest.approx(5 * p) and not a1["concluded"]  # 0.075
    assert all(r["holm"] == 1.0 and r["n"] == 0 for r in rows[1:])
    # every seed +1: p = 0, concluded with 10 seeds, not with 9
    arms.update(_grid("grpo_tis", seeds, stable=lambda c, s: c != "lag32"))
    assert harsh_headline.declared(arms, {})[1][0]["concluded"]
    del arms["lag16_grpo_tis"][9]
    a1 = harsh_headline.declared(arms, {})[1][0]
    assert a1["n"] == 9 and a1["holm"] == 0.0 and not a1["concluded"]

"""Beyond the paper, at CPU scale: does P3O's collapse come from k3's clamp or from its trust
region? The stability map's three conditions where P3O as the paper has it collapses, each with
P3O's k3 (FeynRL's exponent clamped at +-10) and with `k3_tangent` (k3 continued along its
tangent past the clamp: the same estimator wherever |log(pi / pi_b)| < 10, the sign of its
gradient right beyond), on the map's testbed and hyper-parameters (configs/mini/common.testbed,
nothing tuned).

Arms: <condition>_<objective> for the conditions t1.5, t2.0, calib (configs/mini/
stability_map.condition) and the objectives p3o, p3o_k3_tangent; seeds 0-4, the map's.

    .venv/bin/python experiments/reproduce.py --experiments k3_clamp --seeds 0 1 2 3 4 --jobs 2
    .venv/bin/python experiments/k3_clamp.py runs/mini/k3_clamp/t2.0_p3o/0  # clamp shares

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/k3_clamp.py:t2.0_p3o_k3_tangent \\
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \\
        --workdir=runs/mini/k3_clamp/t2.0_p3o_k3_tangent/0

Declared before any run of this file. The p3o arms rerun the map's committed cells
(results/stability_map/) with the clamp's shares in every metrics row (`lr_beyond_clamp_low`,
`lr_beyond_clamp_high`), which the rows in results/stability_map/ lack. Reading, per
condition, over the 5 seeds (exploratory: no Holm family is declared here):
  the clamp's sign   if p3o_k3_tangent has fewer sustained collapses than p3o in a condition
                     and the p3o runs' share beyond -10 is above 0 in the 10 steps before
                     their dip (experiments/k3_clamp.py's `before` phase);
  not the clamp      if p3o_k3_tangent collapses in as many seeds as p3o, or no p3o run has a
                     token beyond the clamp before its dip: then the collapse is the trust
                     region's (k3's bias, or the (1 - ESS) KL term itself: the map's p3o_full,
                     the exact KL with neither bias nor clamp, also collapses at T 2.0);
  both               anything between, reported with its numbers.
"""

from configs.mini import common, stability_map

CONDITIONS = ("t1.5", "t2.0", "calib")
OBJECTIVES = ("p3o", "p3o_k3_tangent")
ARMS = stability_map.arms(CONDITIONS, OBJECTIVES)


def get_config(arg: str | None = None):
    cond, objective = stability_map.split(common.pick(ARMS, arg))
    return common.with_objective(stability_map.condition(common.testbed(), cond), objective)

"""Beyond the paper, at CPU scale: P3O's trust-region term with each KL estimator, at the two
temperatures where the term matters most on this testbed (T 1.5: P3O with k3 collapses in 3 of
3 seeds while cap-only holds; T 0.6: P3O with k3 ends with the lowest entropy of all arms).
Arms: P3O with the reference code's k3 (its mean on pi_b's tokens is chi^2(pi_b || pi) -
KL(pi_b || pi)), with k3_is (unbiased for KL(pi || pi_b) in value and gradient), with forward
(unbiased for KL(pi_b || pi)), and cap-only (no term). Every arm runs at one commit, so the
comparisons are paired by seed within this experiment; same testbed and hyper-parameters as
every other configs/mini experiment.

    .venv/bin/python experiments/reproduce.py --experiments kl_estimators --seeds 0 1 2 --jobs 2

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/kl_estimators.py:t1.5_p3o_k3_is \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/kl_estimators/t1.5_p3o_k3_is/0
"""

from configs.mini import common

ARMS = tuple(
    f"t{t}_{arm}"
    for t in ("1.5", "0.6")
    for arm in ("p3o", "p3o_k3_is", "p3o_forward", "p3o_cap_only")
)


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    temperature, objective = arm.split("_", 1)
    c.rollout.temperature = float(temperature[1:])
    return common.with_objective(c, objective)

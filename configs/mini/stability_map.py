"""Beyond the paper, at CPU scale: the stability map. Every objective under every source of
off-policyness the loop has, one condition at a time, on the configs/mini testbed with the same
hyper-parameters for every arm (nothing tuned per arm or per condition).

Conditions (arm prefix):
  t0.6 t1.0 t1.2 t1.5 t2.0   rollout temperature (pi_b is the tempered sampler);
  fp8                        fp8 sampler (float8_e4m3fn weights, per-channel scales), T 1;
  calib                      the calibrated mismatch (common.CALIBRATED_*: int4 weights, fp8 KV
                             cache, closest to SmolLM2-135M's fp8 statistics), T 1;
  lag8                       rollouts from the policy 8 updates old, T 1;
  ext50                      half of each group from the external model of warm_start.py, T 1;
  upd4                       4 optimizer steps per rollout batch at T 1.2.
Objectives (arm suffix, common.OBJECTIVES): GRPO clip 0.2, GRPO + truncated IS, P3O as the paper
has it (k3), P3O cap-only, P3O with each other trust-region estimator (k3_is, forward, full),
M2PO, VCPO; then VCPO with its authors' baseline, M2PO as AReaL runs it and as its authors'
code does (REFERENCE_FORMS, 10 x 12 = 120 cells less p3o_full's fp8 and calib: 118 arms).

    .venv/bin/python experiments/reproduce.py --experiments stability_map --seeds 0 1 2 3 4 --jobs 2
    .venv/bin/python experiments/analyze.py results  # tables; the heat-map is written beside them

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/stability_map.py:t1.5_p3o_k3_is \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/stability_map/t1.5_p3o_k3_is/0

(ext50 arms also take --config.rollout.external_checkpoint=runs/mini/warm/external/seed0/hf.)
"""

from configs.mini import common

CONDITIONS = ("t0.6", "t1.0", "t1.2", "t1.5", "t2.0", "fp8", "calib", "lag8", "ext50", "upd4")
# The map's nine objectives, each as ess_jax's paper-following form has it.
FIRST = (
    "grpo_eps0.2",
    "grpo_tis",
    "p3o",
    "p3o_cap_only",
    "p3o_k3_is",
    "p3o_forward",
    "p3o_full",
    "m2po",
    "vcpo",
)
# VCPO and M2PO as their authors' code runs them (common.OBJECTIVES: vcpo_authors weighs the
# off-policy baseline as mit-han-lab/vcpo; m2po_areal normalises as AReaL; m2po_authors is
# Infini-AI-Lab/M2PO's adaptive clip), beside the forms above in every condition, so each VCPO
# or M2PO cell of the map can be read with the reference form it stands for.
REFERENCE_FORMS = ("vcpo_authors", "m2po_areal", "m2po_authors")
OBJECTIVES = FIRST + REFERENCE_FORMS
# P3O with the exact KL has no fp8 or calib arm: a low-precision decode cannot be re-scored
# exactly (config/schema.py:check_full_kl refuses it), so those cells of the map stay empty.
LOW_PRECISION = ("fp8", "calib")


def split(arm: str) -> tuple[str, str]:
    """(condition, objective arm) of a map arm: no condition name holds an underscore."""
    condition, objective = arm.split("_", 1)
    return condition, objective


def refused(condition: str, objective: str) -> bool:
    """Whether the grid leaves the cell out: the exact KL under a low-precision sampler."""
    return objective == "p3o_full" and any(p in LOW_PRECISION for p in condition.split("+"))


def arms(conditions, objectives) -> tuple[str, ...]:
    """`<condition>_<objective>` for every cell not refused, condition by condition."""
    return tuple(
        f"{cond}_{obj}" for cond in conditions for obj in objectives if not refused(cond, obj)
    )


def external_arms(names: tuple[str, ...]) -> tuple[str, ...]:
    """The arms whose groups are partly drawn by the external model (experiments/reproduce.py
    passes its checkpoint)."""
    return tuple(a for a in names if any(p.startswith("ext") for p in split(a)[0].split("+")))


ARMS = arms(CONDITIONS, OBJECTIVES)
EXTERNAL_ARMS = external_arms(ARMS)


def condition(c, name: str):
    """c under the condition `name`: t<T> rollout temperature T; fp8 the fp8 sampler; calib the
    calibrated mismatch; lag<N> rollouts from the policy N updates old; ext<P> P% of each group
    from the external model; upd<N> N optimizer steps per rollout batch at T 1.2. Names joined
    by '+' apply in turn (configs/mini/stability_map_harsh.py: calib+lag8)."""
    for part in name.split("+"):
        if part.startswith("t"):
            c.rollout.temperature = float(part[1:])
        elif part == "fp8":
            c.rollout.precision = "fp8"
        elif part == "calib":
            common.calibrated(c)
        elif part.startswith("lag"):
            c.rollout.lag = int(part[3:])
        elif part.startswith("ext"):
            c.rollout.external_fraction = int(part[3:]) / 100
            c.rollout.external_checkpoint = common.placeholder(str)
        elif part.startswith("upd"):
            c.rollout.temperature = 1.2
            c.train.updates_per_batch = int(part[3:])
        else:
            raise ValueError(f"unknown condition {part!r} in {name!r}")
    return c


def build(arms: tuple[str, ...], arg: str | None):
    """The config of the arm `arg` of a map whose arms are `arms`."""
    cond, objective = split(common.pick(arms, arg))
    return common.with_objective(condition(common.testbed(), cond), objective)


def get_config(arg: str | None = None):
    return build(ARMS, arg)

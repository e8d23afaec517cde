"""Beyond the paper on a real pretrained model: SmolLM2-135M-Instruct under its own fp8 sampler,
P3O against its cap-only ablation and VCPO (issue: a harsher stability map, item 5).

The question: does P3O collapse on a real model as it does on the mini testbed under the
calibrated mismatch (results/stability_map.md)? The mini testbed's calibrated sampler (int4
weights, fp8 KV cache) was fitted to the token statistics of exactly this sampler: SmolLM2's
fp8 weights (per-channel scales), whose exact KL(pi_b || pi) is 2.2e-2 per token with 22% of
the ratios outside [0.8, 1.2] (docs/mismatch.md). So here the mismatch is the real one, not
the calibrated stand-in.

Everything but the sampler format and the objective is configs/smollm2_arith.py (1-digit word
problems, chat template, reward the answer's final number, 8 prompts x 4 samples, 48 new
tokens, lr 1e-6), with a budget of 40 RL steps (eval at 0, 20 and 40 on all 10 held-out
problems x 4 samples): at ~1 step a minute on two cores, the longest run this CPU allows
three seeds of three arms. Arms (configs/mini/common.OBJECTIVES, nothing tuned per arm):

  p3o            P3O as the paper has it (k3 trust region, FeynRL's clamp);
  p3o_cap_only   P3O without its (1 - ESS) KL term;
  vcpo           VCPO as ess_jax implements it (its off-policy baseline weighs a row by
                 w^2 ||g||^2; see docs/method.md).

    python -m ess_jax.main --config=configs/smollm2_mismatch.py:p3o --config.seed=0 \\
        --workdir=runs/smollm2_mismatch/p3o/0

`:tiny_<arm>` runs 2 steps of that arm (a smoke test).

Budget `lr1e-5` (`:<arm>,lr1e-5`, results in results/smollm2_mismatch_lr1e-5/): the same three
arms with every arm's learning rate 1e-5 (10x), nothing else changed. Declared before its runs,
because at lr 1e-6 x 40 steps no arm learned (train reward 0.13 -> 0.16, held-out pass@1 at most
3 of 40; results/smollm2_mismatch.md), so that budget could not show a collapse. The question
and its reading are fixed now: an arm "collapses" if its train reward over steps 30-39 falls
below half of its steps 0-9 mean, or its loss or gradient goes non-finite; it "learns" if its
held-out pass@1 at step 40 exceeds step 0's by 0.1 (4 of 40 samples). Three seeds per arm,
exploratory (no Holm family is declared over them).

    python -m ess_jax.main --config=configs/smollm2_mismatch.py:p3o,lr1e-5 --config.seed=0 \\
        --workdir=runs/smollm2_mismatch_lr1e-5/p3o/0
"""

from configs.mini.common import with_objective
from configs.smollm2_arith import get_config as arith_config

ARMS = ("p3o", "p3o_cap_only", "vcpo")
STEPS = 40
BUDGETS = {"": 1e-6, "lr1e-5": 1e-5}  # budget name -> every arm's learning rate


def get_config(arg: str | None = None):
    arg, _, budget = (arg or "").partition(",")
    if budget not in BUDGETS:
        raise ValueError(
            f"unknown budget {budget!r}; this file's budgets: {', '.join(b for b in BUDGETS if b)}"
            " (or none: lr 1e-6)"
        )
    tiny = arg.startswith("tiny_")
    arm = arg[len("tiny_") :] if tiny else arg
    if arm not in ARMS:
        raise ValueError(
            f"unknown arm {arg!r}; this file's arms: {', '.join(ARMS)} (or tiny_<arm>)"
        )
    c = arith_config("tiny" if tiny else None)
    c.rollout.precision = "fp8"
    if not tiny:
        c.train.steps = STEPS
        c.eval.every = STEPS // 2
    c.optim.lr = BUDGETS[budget]
    return with_objective(c, arm)

"""Beyond the paper, at CPU scale: a harsher stability map, where VCPO (stable in all ten
conditions of configs/mini/stability_map.py) may fail. Same protocol and hyper-parameters as
that map (configs/mini/common.testbed, nothing tuned per arm or per condition: the conditions
below are its condition helper's names, joined by '+' where two apply at once).

Conditions (arm prefix; no name holds an underscore, so stability_map.split stays exact):
  calib+lag8   the calibrated mismatch (int4 weights, fp8 KV cache) and rollouts 8 updates old;
  t1.5+lag8    rollout temperature 1.5 and rollouts 8 updates old;
  upd8         8 optimizer steps per rollout batch at T 1.2 (the map's upd4, twice the updates);
  ext75        75% of each group (6 of 8) from the external model of warm_start.py, T 1;
  lag16 lag32  rollouts 16 / 32 updates old, T 1 (steps 0-16 / 0-32 sample the warm start:
               the history holds no older version yet).
Objectives (arm suffix, common.OBJECTIVES): the map's nine, then the ones added since: P3O with
k3 continued along its tangent, DPPO, IcePop, Seq-MIS, Geo-RS, VCPO with its authors' baseline,
M2PO as AReaL runs it and as its authors' code does. 6 x 17 = 102 cells less calib+lag8 x
p3o_full (a low-precision decode cannot be re-scored exactly: check_full_kl refuses it): 101
arms. Lag 32 holds 33 policy versions of 102,208 float32 params (13 MB) in memory and in each
of the 2 kept checkpoints; rollout.lag has no upper bound in config/fields.py.

Declared comparisons, written before any run of this file. The Holm family is these five and
nothing else; every other number of the report is exploratory.
  stable conditions of a seed  for objective o and seed s, the count of this map's 6 conditions
                               where o's run of seed s is stable (experiments/stability_map.py:
                               no sustained collapse, held-out pass@1 at the last eval not below
                               step 0's); a seed counts only with all 6 of o's runs;
  widest, runners-up           by the committed map's stable region (results/stability_map.md,
                               seeds 0-4): VCPO the widest (10 of 10 conditions); GRPO + TIS,
                               P3O cap-only and M2PO the runners-up (9 of 10, the next count);
  A1  VCPO - GRPO + TIS      stable conditions of a seed, paired by seed, seeds 0-9;
  A2  VCPO - P3O cap-only    stable conditions of a seed, paired by seed, seeds 0-9;
  A3  VCPO - M2PO            stable conditions of a seed, paired by seed, seeds 0-9;
  B   P3O - P3O cap-only under calib (configs/mini/stability_map.py's calib arms: seeds 0-4
      committed, 5-9 new), final held-out pass@1, paired by seed, seeds 0-9;
  C   VCPO - the best new baseline, stable conditions of a seed, paired by seed, seeds 5-14.
  best new baseline            of CANDIDATES (dppo, icepop, seq_mis, geo_rs, m2po_areal,
                               m2po_authors: the new objectives that are neither VCPO nor P3O in
                               another form), the one with the most stable runs over the 6
                               conditions x seeds 0-4 (of 30); ties: the higher mean final
                               held-out pass@1 over those 30 runs, then CANDIDATES' order. C is
                               tested on seeds 5-14, which the choice never sees; seeds 10-14 run
                               for VCPO and the chosen baseline only;
  test                         two-sided paired t-test (run_stats.paired_t, as the map's report:
                               Student's t with n - 1 = 9 degrees of freedom on the per-seed
                               differences; p = 1 when every difference is 0, p = 0 when they are
                               equal and not 0), 95% t-interval; Holm step-down (run_stats.holm)
                               over the five; a comparison not yet computable counts as p = 1.
                               Concluded: all 10 of its seeds and Holm p < 0.05, in the direction
                               of the mean difference. Should another objective turn out wider on
                               this map, that reading is exploratory: the five stay as declared.
  power                        10 seeds give 80% power for an effect of 1.34 standard deviations
                               of the per-seed differences at Holm's strictest level (0.05 / 5),
                               1.0 at 0.05. B's committed effect is 2.9 (-0.539, sd 0.184); A1's
                               on the committed conditions 0.45 (+0.2, sd 0.45): the harsher
                               conditions must widen it for A to conclude.
experiments/harsh_headline.py computes the five and C's choice.

A new objective only where the map shows a gap (the issue's item 7), written after seeds 0 and
1 of every arm had landed and before seeds 2-4 had: a gap is a condition where no objective's
cell is stable over seeds 0-4 (the report's "Stable objectives per condition" line). Seeds 0-1
show none. Should seeds 0-4 show one, a new objective is declared here for that condition, its
rationale with it, before any of its runs; with none, no new objective is run, and the report
says so.

Compute budget: 101 arms x seeds 0-9 = 1010 runs; B's seeds 5-9 of calib_p3o and
calib_p3o_cap_only = 10; C's seeds 10-14 of VCPO and the chosen baseline, 6 conditions each =
60: 1080 RL runs, and the policy and external warm starts of seeds 0-14 (30, each shared by
every arm of its seed). At about 1 minute of wall time per run with --jobs 2 on 2 cores (two
runs at a time, about 2 minutes each), that is about 18 hours of both cores, seeds 0-4 about
8.5 of them. The minute is the committed map's: its 440 runs landed within 453 minutes, from
its config's commit at 07:35 to its last results at 15:08; their step_s fields sum to a median
24 s, mean 35 s, 90th percentile 60 s of training steps per run, two runs sharing the cores
(the rest is process start, compilation and 4 evals), and its lag8, upd4 and ext50 runs to 24,
22 and 26 s on average: the harsher conditions cost about what the map's did. Disk under runs/:
each lag32 run keeps about 28 MB of checkpoints, each lag16 run 15 MB (7.4 GB for both lags'
340 runs).

    .venv/bin/python experiments/reproduce.py --experiments stability_map_harsh \
        --seeds 0 1 2 3 4 --jobs 2
    .venv/bin/python experiments/harsh_headline.py results   # C's baseline and its 10-14 command
    .venv/bin/python experiments/reproduce.py --experiments stability_map_harsh \
        --seeds 5 6 7 8 9 --jobs 2
    .venv/bin/python experiments/reproduce.py --check results/stability_map/calib_p3o/0
    .venv/bin/python experiments/reproduce.py --experiments stability_map \
        --arms calib_p3o calib_p3o_cap_only --seeds 5 6 7 8 9 --jobs 2
    .venv/bin/python experiments/harsh_headline.py results   # the five, Holm over them

(the --check first: B pairs the committed seeds 0-4 with new ones, so today's code must give the
committed run; if it does not, B's ten seeds are rerun together, in another --results.) One arm
by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/stability_map_harsh.py:lag32_vcpo \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/stability_map_harsh/lag32_vcpo/0

(ext75 arms also take --config.rollout.external_checkpoint=runs/mini/warm/external/seed0/hf.)
"""

from configs.mini import stability_map as committed

CONDITIONS = ("calib+lag8", "t1.5+lag8", "upd8", "ext75", "lag16", "lag32")
NEW_OBJECTIVES = (
    "p3o_k3_tangent",
    "dppo",
    "icepop",
    "seq_mis",
    "geo_rs",
    "vcpo_authors",
    "m2po_areal",
    "m2po_authors",
)
OBJECTIVES = committed.FIRST + NEW_OBJECTIVES
ARMS = committed.arms(CONDITIONS, OBJECTIVES)
EXTERNAL_ARMS = committed.external_arms(ARMS)
split = committed.split

# The declared comparisons (the docstring's A, B, C), read by experiments/harsh_headline.py.
SEEDS = tuple(range(10))
WIDEST, RUNNERS_UP = "vcpo", ("grpo_tis", "p3o_cap_only", "m2po")
CALIB = ("calib", "p3o", "p3o_cap_only")  # B: configs/mini/stability_map.py's condition, a - b
CANDIDATES = ("dppo", "icepop", "seq_mis", "geo_rs", "m2po_areal", "m2po_authors")
SELECTION_SEEDS, CONFIRMATION_SEEDS = tuple(range(5)), tuple(range(5, 15))


def get_config(arg: str | None = None):
    return committed.build(ARMS, arg)

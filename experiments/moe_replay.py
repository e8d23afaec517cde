"""The MoE testbed's report: routing replay against none under the calibrated mismatch
(configs/mini/moe_replay.py), from the committed runs only.

    .venv/bin/python experiments/moe_replay.py results

Reads <results>/moe_replay/<condition>_<objective>/<seed>/metrics.jsonl and writes, byte for
byte the same each time:
  <results>/moe_replay.md    per arm (condition x objective): runs, sustained collapses (step
                             per seed), stable runs, held-out pass@1 at step 0 and at the last
                             eval per seed, final train reward (mean of the last 10 steps),
                             mean token ESS, mean KL(pi || pi_b) (k3) and mean `routing_flip`
                             (the share of response tokens x sparse layers whose sampler top-k
                             is not the trainer's own); then per objective, replay minus none
                             paired by seed (the seeds share a warm start) with the 95%
                             t-interval, and the declared reading of each;
  <results>/moe_replay.png   per objective, train reward, token ESS and routing_flip against
                             step (10-step means) and held-out pass@1 at each eval, mean over
                             seeds, replay solid and none dashed.
Criteria (the map's, experiments/run_stats.py): sustained collapse, stable run (no sustained
collapse, last held-out pass@1 not below step 0's). Reading, as the config declares it: a
difference whose 95% interval excludes 0 is "seen in these seeds", anything else "no
difference seen"; exploratory (3 seeds, no test, no Holm family).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.run_stats import (  # noqa: E402
    WINDOW,
    fail,
    fmt,
    fmt_interval,
    load_experiment,
    moving_mean,
    paired_interval,
    run_summary,
)

EXPERIMENT = "moe_replay"
CONDITIONS = ("calib", "calib+replay")  # configs/mini/moe_replay.py (this tool imports no jax)
OBJECTIVES = ("p3o", "p3o_cap_only", "grpo_tis", "vcpo")
NONE, REPLAY = CONDITIONS


def _col(run: dict, key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) for r in run["train"]], np.float64)


def summary(run: dict) -> dict:
    """run_summary and the step-0 pass@1, mean routing_flip and mean k3 KL of a run."""
    s = run_summary(run)
    first = [r["eval/pass@1"] for r in run["eval"] if r["step"] == 0]
    s["pass1_0"] = first[0] if first else float("nan")
    s["flip"] = float(np.nanmean(_col(run, "routing_flip")))
    s["kl"] = float(np.nanmean(_col(run, "kl_behaviour")))
    s["stable"] = s["sustained"] is None and not s["below_step0"]
    return s


def _steps(values) -> str:
    return ", ".join("none" if v is None else str(v) for v in values)


def arm_rows(arms: dict[str, dict[int, dict]]) -> list[str]:
    lines = [
        "| objective | replay | runs | sustained collapses (step per seed) | stable runs "
        "| held-out pass@1 step 0 -> last (per seed) | final reward | mean ESS | mean k3 KL "
        "| routing_flip |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for obj in OBJECTIVES:
        for cond in CONDITIONS:
            runs = arms.get(f"{cond}_{obj}", {})
            if not runs:
                replay = "yes" if cond == REPLAY else "no"
                lines.append(f"| {obj} | {replay} | 0 | - | - | - | - | - | - | - |")
                continue
            s = [summary(runs[k]) for k in sorted(runs)]
            collapses = sum(x["sustained"] is not None for x in s)
            pass1 = " / ".join(f"{x['pass1_0']:.3f} -> {x['pass1']:.3f}" for x in s)
            seeds = ", ".join(map(str, sorted(runs)))
            lines.append(
                f"| {obj} | {'yes' if cond == REPLAY else 'no'} | {len(s)} (seeds {seeds}) "
                f"| {collapses} ({_steps(x['sustained'] for x in s)}) "
                f"| {sum(x['stable'] for x in s)} | {pass1} | {fmt([x['final'] for x in s])} "
                f"| {fmt([x['ess'] for x in s], 4)} | {fmt([x['kl'] for x in s], 4)} "
                f"| {fmt([x['flip'] for x in s], 4)} |"
            )
    return lines


def comparison_rows(arms: dict[str, dict[int, dict]]) -> list[str]:
    lines = [
        "| objective | seeds | final held-out pass@1 | final reward | mean ESS | reading |",
        "|---|---|---|---|---|---|",
    ]
    for obj in OBJECTIVES:
        a, b = arms.get(f"{REPLAY}_{obj}", {}), arms.get(f"{NONE}_{obj}", {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            lines.append(f"| {obj} | 0 | - | - | - | no paired seeds yet |")
            continue
        sa = [summary(a[k]) for k in seeds]
        sb = [summary(b[k]) for k in seeds]
        cells, seen = [], []
        for key in ("pass1", "final", "ess"):
            m = paired_interval([x[key] for x in sa], [x[key] for x in sb])
            cells.append(fmt_interval(m))
            if not np.isnan(m[1]) and (m[1] > 0 or m[2] < 0):
                seen.append(key)
        reading = (
            "seen in these seeds: " + ", ".join(seen)
            if seen
            else ("no difference seen" if len(seeds) > 1 else "one seed: no interval")
        )
        lines.append(f"| {obj} | {len(seeds)} | {' | '.join(cells)} | {reading} |")
    return lines


DEAD_START = 0.05  # step-0 held-out pass@1 below which a seed's warm start is flagged


def dead_starts(arms: dict[str, dict[int, dict]]) -> list[str]:
    """A note per seed whose warm start has step-0 held-out pass@1 below DEAD_START in every
    arm (a flag added after the runs, no part of the declared reading): such a policy has
    almost no reward to learn from or to lose, so its runs say little about stability."""
    seeds = sorted({k for runs in arms.values() for k in runs})
    out = []
    for k in seeds:
        first = [summary(runs[k])["pass1_0"] for runs in arms.values() if k in runs]
        if first and max(first) < DEAD_START:
            out.append(
                f"- Seed {k}: its warm start's held-out pass@1 at step 0 is {max(first):.3f} "
                f"(below {DEAD_START}): the SFT did not learn the task, so its runs have almost "
                "no reward to learn from or to lose; its collapse and stability counts are noise "
                "(flagged after the runs, not part of the declared reading)."
            )
    return out


def markdown(arms: dict[str, dict[int, dict]]) -> str:
    notes = dead_starts(arms)
    lines = [
        "# Routing replay under the calibrated mismatch on an MoE policy "
        "(configs/mini/moe_replay.py)",
        "",
        "The MoE testbed (the embedded decoder with every MLP a Qwen3-MoE block of 4 experts, "
        "top 2; 1000 noisy-teacher SFT steps per seed; 60 RL steps of the map's protocol) under "
        "the calibrated mismatch (int4 sampler weights, fp8 KV cache), the trainer routing "
        "every token itself (replay no) or replaying the sampler's recorded experts (replay "
        "yes). Written by experiments/moe_replay.py from results/moe_replay/; the question "
        "and the reading were declared in the config before any run. Exploratory: 3 seeds, "
        "no test, no Holm family.",
        "",
        "Per seed values are in seed order. final reward: mean train reward of the last "
        f"{WINDOW} steps; mean ESS: token ESS over all steps; mean k3 KL: the k3 estimate of "
        "KL(pi || pi_b) over all steps; routing_flip: the share of (response token, sparse "
        "layer) pairs whose sampler top-2 is not the trainer's own, with the params that "
        "sampled, mean over steps (measured with and without replay: replay changes what the "
        "trainer computes, not what it would route). Stable: no sustained collapse and the last "
        "held-out pass@1 not below step 0's.",
        "",
        *arm_rows(arms),
        "",
        "## Replay minus none, paired by seed (mean [95% t-interval])",
        "",
        *comparison_rows(arms),
        "",
        *(["## Notes", "", *notes, ""] if notes else []),
    ]
    return "\n".join(lines)


def figure(arms: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("reward_mean", "train reward"),
        ("ess", "token ESS"),
        ("routing_flip", "routing_flip (top-k differs)"),
        ("eval/pass@1", "held-out pass@1 (T=1)"),
    )
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    cmap = plt.get_cmap("tab10")
    for ax, (key, title) in zip(axes, panels):
        for i, obj in enumerate(OBJECTIVES):
            for cond, style in ((NONE, "--"), (REPLAY, "-")):
                runs = arms.get(f"{cond}_{obj}", {})
                if not runs:
                    continue
                label = f"{obj}{', replay' if cond == REPLAY else ''} ({len(runs)})"
                if key == "eval/pass@1":
                    evals = [runs[k]["eval"] for k in sorted(runs)]
                    n = min(len(e) for e in evals)
                    y = np.array([[r[key] for r in e[:n]] for e in evals])
                    x = [r["step"] for r in evals[0][:n]]
                    ax.plot(x, y.mean(0), style, marker="o", color=cmap(i), ms=3, label=label)
                    continue
                curves = [moving_mean(_col(runs[k], key)) for k in sorted(runs)]
                n = min(len(c) for c in curves)
                y = np.stack([c[:n] for c in curves])
                ax.plot(np.arange(n) + WINDOW - 1, y.mean(0), style, color=cmap(i), label=label)
        ax.set_title(title if key == "eval/pass@1" else f"{title}, {WINDOW}-step mean")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("moe_replay: calibrated mismatch on the MoE testbed, mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


def write(results: str) -> list[str]:
    """Writes <results>/moe_replay.md and .png; their paths."""
    exp_dir = os.path.join(results, EXPERIMENT)
    arms = load_experiment(exp_dir) if os.path.isdir(exp_dir) else {}
    if not arms:
        fail(f"{exp_dir}: no <arm>/<seed>/metrics.jsonl under it")
    md, png = (os.path.join(results, f"{EXPERIMENT}.{ext}") for ext in ("md", "png"))
    with open(md, "w") as f:
        f.write(markdown(arms))
    figure(arms, png)
    return [md, png]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    for path in write(ap.parse_args(argv).results):
        print("wrote", path)


if __name__ == "__main__":
    main()

"""Tables and figures of the CPU-scale ablations, from the committed results only.

    .venv/bin/python experiments/analyze.py results

Reads <results>/<experiment>/<arm>/<seed>/metrics.jsonl (written by experiments/reproduce.py)
and writes, without rerunning anything and byte for byte the same each time:
  <results>/<experiment>/table.md     per arm, mean +- std over seeds: final reward (mean of the
                                      last 10 steps), held-out pass@1 (last eval), peak (max
                                      10-step mean), both collapse steps per seed, held-out
                                      pass@1 below step 0, ESS (mean, min), capped share,
                                      entropy proxy first -> last 10 steps;
                                      then P3O minus each other arm (paired by seed: the seeds
                                      share their warm start) with a 95% t-interval;
  <results>/<experiment>/figure.png   reward, KL(pi || pi_b) (k3), ESS, capped fraction and
                                      entropy proxy against step (10-step means) and held-out
                                      pass@1 at each eval; line: mean over seeds, band: min-max;
  <results>/async_actor_learner/lag.md  per arm, the lag distribution and throughput
                                      (experiments/async_report.py);
  <results>/summary.md                every P3O-minus-baseline comparison in one table, and the
                                      collapse counts per arm;
  <results>/stability_map.md (+ PNGs) the stability map's report (experiments/stability_map.py);
  <results>/stability_map_harsh.md (+ PNGs)  the harsh map's, opening with its declared
                                      comparisons (experiments/harsh_headline.py).
Collapse (dip): the first step whose 10-step mean reward falls below half of its running peak.
Collapse (sustained): the first step from which the 10-step mean reward stays below half of its
running peak for at least 20 consecutive steps, or to the end of the run if fewer remain.
Both are "none" if there is no such step. Held-out below step 0: held-out pass@1 of the last
eval below that of the eval at step 0.
Shared runs: a run whose metrics equal, row for row (timing fields aside), a run of an
experiment earlier in sorted order is listed under that earlier experiment in summary.md and
marked "Shared:" in its own table; summary.md counts it once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # experiments.*; configs.mini, for the experiments' arm order

from experiments import stability_map  # noqa: E402
from experiments.run_stats import (  # noqa: E402
    COLLAPSE_NOTES,
    WINDOW,
    fail,
    fingerprint,
    fmt,
    fmt_interval,
    load_experiment,
    moving_mean,
    paired_interval,
    run_summary,
)

REFERENCE = "p3o"


def arm_order(experiment: str, arms: list[str]) -> list[str]:
    """The experiment file's ARMS order when it is importable, else sorted."""
    try:
        declared = list(importlib.import_module(f"configs.mini.{experiment}").ARMS)
    except (ImportError, AttributeError):
        declared = []
    return [a for a in declared if a in arms] + sorted(a for a in arms if a not in declared)


def split_arm(arm: str) -> tuple[str, str]:
    """('lag4_', 'p3o') for 'lag4_p3o', ('t1.2_', 'p3o_dual_mixture'), ('', 'grpo_eps0.2')."""
    head, _, rest = arm.partition("_")
    if rest and (head.startswith("lag") or head.startswith("t")) and head[-1].isdigit():
        return head + "_", rest
    return "", arm


def comparisons(arms: dict[str, dict[int, dict]], order: list[str]) -> list[dict]:
    """P3O minus every other arm of the same setting (prefix), over the seeds both have."""
    out = []
    for arm in order:
        prefix, objective = split_arm(arm)
        ref = prefix + REFERENCE
        if objective == REFERENCE or ref not in arms:
            continue
        seeds = sorted(set(arms[ref]) & set(arms[arm]))
        if not seeds:
            continue
        s_ref = [run_summary(arms[ref][s]) for s in seeds]
        s_arm = [run_summary(arms[arm][s]) for s in seeds]
        row = {"ref": ref, "arm": arm, "n": len(seeds)}
        for key in ("final", "pass1"):
            row[key] = paired_interval([x[key] for x in s_ref], [x[key] for x in s_arm])
        out.append(row)
    return out


def table(
    experiment: str,
    arms: dict[str, dict[int, dict]],
    shared: dict[str, dict[int, str]] | None = None,
) -> str:
    """The experiment's table.md; shared: {arm: {seed: experiment it is listed under}}."""
    shared = shared or {}
    order = arm_order(experiment, list(arms))
    lines = [
        f"# {experiment}",
        "",
        "| arm | seeds | final reward | held-out pass@1 | peak | collapse (dip) "
        "| collapse (sustained) | held-out below step 0 | mean ESS | min ESS | capped frac "
        "| entropy first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in order:
        runs = [run_summary(arms[arm][s]) for s in sorted(arms[arm])]
        dip, sustained = (
            ", ".join("none" if r[key] is None else str(r[key]) for r in runs)
            for key in ("collapse", "sustained")
        )
        below = sum(r["below_step0"] for r in runs)
        entropy = (
            f"{fmt([r['ent_first'] for r in runs], 2)} -> {fmt([r['ent_last'] for r in runs], 2)}"
        )
        lines.append(
            f"| {arm} | {len(runs)} | {fmt([r['final'] for r in runs])} "
            f"| {fmt([r['pass1'] for r in runs])} | {fmt([r['peak'] for r in runs])} "
            f"| {dip} | {sustained} | {below} of {len(runs)} "
            f"| {fmt([r['ess'] for r in runs], 4)} "
            f"| {min(r['ess_min'] for r in runs):.4f} | {fmt([r['capped'] for r in runs])} "
            f"| {entropy} |"
        )
    comps = comparisons(arms, order)
    if comps:
        lines += [
            "",
            "P3O minus each arm (paired by seed), mean [95% t-interval]:",
            "",
            "| P3O arm | minus arm | seeds | final reward | held-out pass@1 |",
            "|---|---|---|---|---|",
        ]
        for c in comps:
            lines.append(
                f"| {c['ref']} | {c['arm']} | {c['n']} | {fmt_interval(c['final'])} "
                f"| {fmt_interval(c['pass1'])} |"
            )
    lines += ["", *COLLAPSE_NOTES]
    for arm in order:
        for source in sorted(set(shared.get(arm, {}).values())):
            seeds = sorted(s for s, e in shared[arm].items() if e == source)
            lines.append(
                f"Shared: `{arm}` seeds {', '.join(map(str, seeds))} are row for row (timing "
                f"fields aside) runs of `{source}`; summary.md counts them under `{source}`."
            )
    return "\n".join(lines) + "\n"


def figure(experiment: str, arms: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("reward_mean", "train reward"),
        ("eval/pass@1", "held-out pass@1"),
        ("kl_behaviour", "KL(pi || pi_b), k3"),
        ("ess", "ESS"),
        ("capped_frac", "capped fraction"),
        ("entropy_proxy", "entropy proxy (-mean logp)"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    order = arm_order(experiment, list(arms))
    cmap = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
    colors = [cmap(i) for i in range(len(order))]
    for ax, (key, title) in zip(axes.flat, panels):
        if key == "eval/pass@1":
            for arm, color in zip(order, colors):
                evals = [arms[arm][s]["eval"] for s in sorted(arms[arm])]
                n = min(len(e) for e in evals)
                if n == 0:
                    continue
                y = np.array([[r[key] for r in e[:n]] for e in evals])
                x = [r["step"] for r in evals[0][:n]]
                ax.plot(x, y.mean(0), "o-", color=color, lw=1.2, ms=3)
                ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.15, lw=0)
            ax.set_title("held-out pass@1 (T=1)")
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
            continue
        for arm, color in zip(order, colors):
            curves = []
            for seed in sorted(arms[arm]):
                tr = arms[arm][seed]["train"]
                curves.append(moving_mean(np.array([r.get(key, np.nan) for r in tr], float)))
            n = min(len(c) for c in curves)
            if n == 0:
                continue
            y = np.stack([c[:n] for c in curves])
            x = np.arange(n) + WINDOW - 1
            ax.plot(x, y.mean(0), color=color, label=f"{arm} ({len(curves)})", lw=1.2)
            ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.15, lw=0)
        ax.set_title(f"{title}, {WINDOW}-step mean")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{experiment}: mean over seeds (band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


# Experiments with a report of their own (experiments/stability_map.py) instead of table.md,
# figure.png and summary rows (the maps' 80 and 101 arms would make an unreadable table and
# legend; split_arm reads no harsh condition, calib+lag8_p3o among them): still read for shared
# runs.
OWN_REPORT = tuple(stability_map.SETTINGS)


def shared_runs(experiments: dict[str, dict[str, dict[int, dict]]]) -> dict[str, dict]:
    """{experiment: {arm: {seed: earlier experiment}}} for every run whose metrics equal, row for
    row (timing fields aside), a run of an experiment earlier in sorted order."""
    first: dict[str, str] = {}
    out: dict[str, dict] = {}
    for experiment in sorted(experiments):
        for arm, seeds in sorted(experiments[experiment].items()):
            for seed, run in sorted(seeds.items()):
                source = first.setdefault(fingerprint(run), experiment)
                if source != experiment:
                    out.setdefault(experiment, {}).setdefault(arm, {})[seed] = source
    return out


def analyze(results: str) -> list[str]:
    """Writes every table, figure and the summary; returns the paths written."""
    if not os.path.isdir(results):
        fail(f"{results}: not a directory (give the one experiments/reproduce.py writes)")
    experiments = {}
    for experiment in sorted(os.listdir(results)):
        exp_dir = os.path.join(results, experiment)
        if os.path.isdir(exp_dir):
            arms = load_experiment(exp_dir)
            if arms:
                experiments[experiment] = arms
    if not experiments:
        fail(f"{results}: no <experiment>/<arm>/<seed>/metrics.jsonl under it")
    shared = shared_runs(experiments)
    written, summary, notes, counts = [], [], [], []
    totals = [0, 0, 0, 0]
    for experiment, arms in experiments.items():
        if experiment in OWN_REPORT:
            continue
        exp_dir = os.path.join(results, experiment)
        exp_shared = shared.get(experiment, {})
        with open(os.path.join(exp_dir, "table.md"), "w") as f:
            f.write(table(experiment, arms, exp_shared))
        figure(experiment, arms, os.path.join(exp_dir, "figure.png"))
        written += [os.path.join(exp_dir, "table.md"), os.path.join(exp_dir, "figure.png")]
        order = arm_order(experiment, list(arms))
        if experiment == "async_actor_learner":  # and its lag.md: experiments/async_report.py
            from experiments import async_report

            written.append(async_report.write(exp_dir, arms, order))
        for c in comparisons(arms, order):
            seeds = [s for s in arms[c["ref"]] if s in arms[c["arm"]]]
            sources = {exp_shared.get(a, {}).get(s) for a in (c["ref"], c["arm"]) for s in seeds}
            if len(sources) == 1 and None not in sources:
                notes.append(
                    f"- {experiment} {c['ref']} - {c['arm']}: the same runs as "
                    f"{sources.pop()}'s, listed there."
                )
                continue
            summary.append(
                f"| {experiment} | {c['ref']} - {c['arm']} | {c['n']} "
                f"| {fmt_interval(c['final'])} | {fmt_interval(c['pass1'])} |"
            )
        for arm in order:
            own = [s for s in sorted(arms[arm]) if s not in exp_shared.get(arm, {})]
            runs = [run_summary(arms[arm][s]) for s in own]
            n = [len(runs), sum(r["collapse"] is not None for r in runs)]
            n += [
                sum(r["sustained"] is not None for r in runs),
                sum(r["below_step0"] for r in runs),
            ]
            totals = [t + k for t, k in zip(totals, n)]
            where = sorted(set(exp_shared.get(arm, {}).values()))
            mark = f" ({len(arms[arm]) - len(own)} shared, counted under {', '.join(where)})"
            counts.append(
                f"| {experiment} | {arm} | {n[0]}{mark if where else ''} | {n[1]} | {n[2]} "
                f"| {n[3]} |"
            )
    head = [
        "# P3O minus baseline, every experiment (paired by seed, mean [95% t-interval])",
        "",
        "| experiment | comparison | seeds | final reward | held-out pass@1 |",
        "|---|---|---|---|---|",
    ]
    if notes:
        summary += ["", "Listed once (shared runs, see the experiments' table.md):", "", *notes]
    counts_head = [
        "",
        "# Collapse counts per arm (each distinct run counted once)",
        "",
        *COLLAPSE_NOTES,
        "",
        "| experiment | arm | runs | collapse (dip) | collapse (sustained) "
        "| held-out below step 0 |",
        "|---|---|---|---|---|---|",
    ]
    counts.append(f"| all | all | {totals[0]} | {totals[1]} | {totals[2]} | {totals[3]} |")
    path = os.path.join(results, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(head + summary + counts_head + counts) + "\n")
    committed = experiments.get(stability_map.EXPERIMENT, {})
    for experiment in OWN_REPORT:
        if experiment in experiments:
            written += stability_map.write(results, experiments[experiment], experiment, committed)
    return [*written, path]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    args = ap.parse_args(argv)
    for path in analyze(args.results):
        print("wrote", path)


if __name__ == "__main__":
    main()

"""Tables and figures of the CPU-scale ablations, from the committed results only.

    python experiments/analyze.py results

Reads <results>/<experiment>/<arm>/<seed>/metrics.jsonl (written by experiments/reproduce.py)
and writes, without rerunning anything and byte for byte the same each time:
  <results>/<experiment>/table.md     per arm, mean +- std over seeds: final reward (mean of the
                                      last 10 steps), held-out pass@1 (last eval), peak (max
                                      10-step mean), both collapse steps per seed, held-out
                                      pass@1 below step 0, ESS, capped share, entropy proxy
                                      first -> last 10 steps;
                                      then P3O minus each other arm (paired by seed: the seeds
                                      share their warm start) with a 95% t-interval;
  <results>/<experiment>/figure.png   reward, ESS, capped fraction and entropy proxy against
                                      step (10-step means; line: mean over seeds, band: min-max);
  <results>/async_actor_learner/lag.md  per arm, the lag distribution and throughput
                                      (experiments/async_report.py);
  <results>/summary.md                every P3O-minus-baseline comparison in one table, and the
                                      collapse counts per arm;
  <results>/stability_map.md (+ PNGs) the stability map's report (experiments/stability_map.py).
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
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # configs.mini, for the experiments' declared arm order
WINDOW = 10
SUSTAIN = 20  # consecutive steps below half the running peak for a sustained collapse
# Per-step fields that measure time, not the run: they differ between two identical runs.
TIMING_KEYS = ("tokens_per_s", "sample_s", "step_s")
# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
REFERENCE = "p3o"
COLLAPSE_NOTES = [
    "collapse (dip): the first step whose 10-step mean reward is below half its running peak.",
    f"collapse (sustained): the first step from which it stays there for {SUSTAIN} consecutive "
    'steps, or to the end of the run if fewer remain. Both per seed, "none" if never.',
    "held-out below step 0: runs whose held-out pass@1 at the last eval is below step 0's.",
]


def read_rows(path: str) -> list[dict]:
    """A metrics.jsonl's rows (ess_jax.rl.metrics.read_metrics, which imports no jax): a cut last
    line is left out with a warning; a bad line before it stops with the file and line."""
    from ess_jax.rl.metrics import MetricsError, read_metrics

    try:
        return read_metrics(path)
    except MetricsError as e:
        raise SystemExit(str(e)) from e


def load_run(path: str) -> dict:
    """{'train': [rows with reward_mean], 'eval': [rows with eval/pass@1]} of a metrics.jsonl."""
    rows = read_rows(path)
    train = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])
    return {"train": train, "eval": evals}


def moving_mean(x: np.ndarray, w: int = WINDOW) -> np.ndarray:
    """Means of the full windows x[i - w + 1 : i + 1], for i = w - 1 ... len(x) - 1."""
    if len(x) < w:
        return np.array([])
    c = np.cumsum(np.concatenate([[0.0], x]))
    return (c[w:] - c[:-w]) / w


def below_half_peak(reward: np.ndarray) -> np.ndarray:
    """Per full window: is the 10-step mean reward below half its running peak."""
    mm = moving_mean(reward)
    peak = np.maximum.accumulate(mm) if len(mm) else mm
    return mm < 0.5 * peak


def collapse_step(steps: np.ndarray, reward: np.ndarray) -> int | None:
    """Collapse (dip): first step whose 10-step mean reward is below half its running peak, or
    None."""
    below = np.nonzero(below_half_peak(reward))[0]
    return int(steps[below[0] + WINDOW - 1]) if len(below) else None


def sustained_collapse_step(
    steps: np.ndarray, reward: np.ndarray, sustain: int = SUSTAIN
) -> int | None:
    """Collapse (sustained): first step from which the 10-step mean reward stays below half its
    running peak for `sustain` consecutive steps, or to the end of the run if fewer remain; or
    None."""
    below = below_half_peak(reward)
    for i in np.nonzero(below)[0]:
        if np.all(below[i : i + sustain]):
            return int(steps[i + WINDOW - 1])
    return None


def run_summary(run: dict) -> dict:
    tr = run["train"]
    steps = np.array([r["step"] for r in tr])
    col = lambda k: np.array([r.get(k, np.nan) for r in tr], np.float64)
    reward = col("reward_mean")
    ent = col("entropy_proxy")
    return {
        "steps": int(len(tr)),
        "final": float(np.mean(reward[-WINDOW:])),
        "peak": float(np.max(moving_mean(reward))) if len(tr) >= WINDOW else float("nan"),
        "collapse": collapse_step(steps, reward),
        "sustained": sustained_collapse_step(steps, reward),
        "pass1": float(run["eval"][-1]["eval/pass@1"]) if run["eval"] else float("nan"),
        "below_step0": heldout_below_step0(run["eval"]),
        "ess": float(np.mean(col("ess"))),
        "ess_min": float(np.min(col("ess_min") if "ess_min" in tr[0] else col("ess"))),
        "capped": float(np.mean(col("capped_frac"))),
        "ent_first": float(np.mean(ent[:WINDOW])),
        "ent_last": float(np.mean(ent[-WINDOW:])),
    }


def heldout_below_step0(evals: list[dict]) -> bool:
    """Held-out pass@1 of the last eval below that of the eval at step 0 (False without both)."""
    first = [r["eval/pass@1"] for r in evals if r["step"] == 0]
    if not first or evals[-1]["step"] == 0:
        return False
    return bool(evals[-1]["eval/pass@1"] < first[0])


def fingerprint(run: dict) -> str:
    """The run's metrics rows, timing fields aside, as one string: equal for identical runs."""
    rows = [
        {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in run["train"] + run["eval"]
    ]
    return json.dumps(rows, sort_keys=True)


def arm_order(experiment: str, arms: list[str]) -> list[str]:
    """The experiment file's ARMS order when it is importable, else sorted."""
    try:
        declared = list(importlib.import_module(f"configs.mini.{experiment}").ARMS)
    except (ImportError, AttributeError):
        declared = []
    return [a for a in declared if a in arms] + sorted(a for a in arms if a not in declared)


def load_experiment(path: str) -> dict[str, dict[int, dict]]:
    """{arm: {seed: run}} of an experiment directory."""
    out: dict[str, dict[int, dict]] = {}
    for arm in sorted(os.listdir(path)):
        arm_dir = os.path.join(path, arm)
        if not os.path.isdir(arm_dir):
            continue
        for seed in sorted(os.listdir(arm_dir)):
            f = os.path.join(arm_dir, seed, "metrics.jsonl")
            if seed.isdigit() and os.path.exists(f):
                out.setdefault(arm, {})[int(seed)] = load_run(f)
    return out


def fmt(values, digits: int = 3) -> str:
    v = np.asarray(values, np.float64)
    if len(v) == 0 or np.all(np.isnan(v)):
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f}"


def paired_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of a - b and its 95% t-interval half-width (paired by seed)."""
    d = np.asarray(a) - np.asarray(b)
    if len(d) < 2:
        return float(np.mean(d)), float("nan"), float("nan")
    half = T975.get(len(d) - 1, 1.96) * np.std(d, ddof=1) / math.sqrt(len(d))
    return float(np.mean(d)), float(np.mean(d) - half), float(np.mean(d) + half)


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


def fmt_interval(m: tuple[float, float, float]) -> str:
    if math.isnan(m[1]):
        return f"{m[0]:+.3f}"
    return f"{m[0]:+.3f} [{m[1]:+.3f}, {m[2]:+.3f}]"


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


# Experiments with a report of their own instead of table.md, figure.png and summary rows (the
# stability map's 80 arms would make an unreadable table and legend): still read for shared runs.
OWN_REPORT = ("stability_map",)


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
    experiments = {}
    for experiment in sorted(os.listdir(results)):
        exp_dir = os.path.join(results, experiment)
        if os.path.isdir(exp_dir):
            arms = load_experiment(exp_dir)
            if arms:
                experiments[experiment] = arms
    if not experiments:
        raise SystemExit(f"no <experiment>/<arm>/<seed>/metrics.jsonl under {results!r}")
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
    if "stability_map" in experiments:  # imported here: stability_map imports this module
        from experiments import stability_map

        written += stability_map.write(results, experiments["stability_map"])
    return [*written, path]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    args = ap.parse_args()
    for path in analyze(args.results):
        print("wrote", path)


if __name__ == "__main__":
    main()

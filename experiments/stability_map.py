"""The stability map's report: which objective holds under which source of off-policyness.

    .venv/bin/python experiments/stability_map.py results     # this report only
    .venv/bin/python experiments/analyze.py results           # every table, this report among them

Reads <results>/stability_map/<condition>_<objective>/<seed>/metrics.jsonl (the arms of
configs/mini/stability_map.py) and writes, byte for byte the same each time:
  <results>/stability_map.md            the stable region per objective, one table per condition,
                                        the paired comparisons, the two figures;
  <results>/stability_map_heatmap.png   objective x condition -> final held-out pass@1 (mean over
                                        seeds); unstable cells framed in red, with how many seeds
                                        collapse (sustained) and end below step 0; cells without
                                        runs grey ("refused": not in the config's ARMS, e.g. fp8 x
                                        p3o_full; "not run": no finished run yet);
  <results>/stability_map_entropy.png   entropy_proxy at T 0.6 and T 1.5 for each estimator
                                        of P3O's trust-region term, mean over seeds: per step
                                        (faint) and its 10-step mean.

Definitions (per-run quantities are experiments/run_stats.py's run_summary):
  final held-out pass@1   pass@1 of the run's last eval (step 150 on the testbed);
  collapse (dip), collapse (sustained), held-out below step 0   as in run_stats.COLLAPSE_NOTES;
  final entropy           mean entropy_proxy of the last 10 steps; mean ESS: over all steps;
  stable run              no sustained collapse and held-out pass@1 at the last eval not below
                          its value at step 0;
  stable cell             (objective, condition) with at least one run, every run of it stable;
                          a cell without runs (refused or not run) is not stable;
  stable region           an objective's stable cells, counted over the conditions; widest:
                          the largest count (every objective with it is marked). Per seed, an
                          objective's count is its stable runs of that seed; its difference to
                          the first widest objective in the config's OBJECTIVES is paired by seed
                          over the seeds where both have every arm of the grid, with a 95%
                          t-interval and no test (outside the Holm family);
  comparisons             per condition, each objective minus P3O cap-only and minus GRPO eps 0.2
                          (cap-only minus GRPO once), final held-out pass@1 paired by seed (the
                          seeds share a warm start): mean, 95% t-interval
                          (run_stats.paired_interval) and the two-sided p-value of the paired
                          t-test (run_stats.paired_t: Student's t with n - 1 degrees of freedom on
                          the per-seed differences; p = 1 when every difference is 0, p = 0 when
                          they are equal and not 0);
  Holm correction         step-down over every comparison with at least 2 paired seeds (those
                          with one get no test and are no member of the family): the i-th smallest
                          of m p-values becomes max over j <= i of min(1, (m - j + 1) p_(j));
  status                  "corrected" for a comparison with at least HEADLINE_SEEDS (5) paired
                          seeds, the seeds issue 26 gives every arm that enters a headline verdict;
                          "exploratory" for the rest (fewer seeds, or no test). Every row's Holm
                          p-value counts the whole family, exploratory rows included.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # experiments.run_stats; configs.mini, for the grid

from experiments.run_stats import (  # noqa: E402
    COLLAPSE_NOTES,
    WINDOW,
    fail,
    fingerprint,
    fmt,
    fmt_interval,
    holm,
    load_experiment,
    moving_mean,
    paired_interval,
    paired_t,
    run_summary,
)

EXPERIMENT = "stability_map"
CAP_ONLY, GRPO = "p3o_cap_only", "grpo_eps0.2"
HEADLINE_SEEDS = 5
# P3O's trust-region estimators (arm, label) and the temperatures of the entropy traces.
ESTIMATORS = (
    ("p3o", "k3 (paper)"),
    ("p3o_k3_is", "k3 IS"),
    ("p3o_forward", "forward"),
    ("p3o_full", "full"),
    ("p3o_cap_only", "cap-only (none)"),
)
ENTROPY_CONDITIONS = ("t0.6", "t1.5")
FILES = ("stability_map.md", "stability_map_heatmap.png", "stability_map_entropy.png")


@dataclasses.dataclass(frozen=True)
class Map:
    """The map's runs, their summaries per cell, and the grid's order."""

    arms: dict[str, dict[int, dict]]  # {arm: {seed: run}} (run_stats.load_experiment)
    cells: dict[tuple[str, str], dict[int, dict]]  # {(condition, objective): {seed: summary}}
    conds: list[str]  # configs/mini/stability_map.py's order, then others found, sorted
    objs: list[str]
    declared: set[str]  # the config's ARMS

    @classmethod
    def of(cls, arms: dict[str, dict[int, dict]]) -> Map:
        mod = importlib.import_module(f"configs.mini.{EXPERIMENT}")
        conds, objs = list(mod.CONDITIONS), list(mod.OBJECTIVES)
        for arm in sorted(arms):
            cond, obj = arm.split("_", 1)
            conds += [cond] if cond not in conds else []
            objs += [obj] if obj not in objs else []
        cells = {
            tuple(arm.split("_", 1)): {s: run_summary(run) for s, run in sorted(seeds.items())}
            for arm, seeds in arms.items()
        }
        return cls(arms, cells, conds, objs, set(mod.ARMS))

    def no_runs(self, cond: str, obj: str) -> str:
        """Why a cell has no runs: "refused" when the grid leaves it out, else "not run" (yet)."""
        return "not run" if f"{cond}_{obj}" in self.declared else "refused"


def stable_run(s: dict) -> bool:
    """No sustained collapse and held-out pass@1 not below step 0's (s: a run_summary)."""
    return s["sustained"] is None and not s["below_step0"]


def stable_cell(summaries: list[dict]) -> bool:
    """A cell is stable when it has a run and every run is stable."""
    return bool(summaries) and all(stable_run(s) for s in summaries)


def comparisons(m: Map) -> list[dict]:
    """Each objective minus cap-only and minus GRPO 0.2 per condition, Holm over the family."""
    rows = []
    for cond in m.conds:
        for ref in (CAP_ONLY, GRPO):
            for obj in m.objs:
                if obj == ref or (ref == GRPO and obj == CAP_ONLY):
                    continue
                a, b = m.cells.get((cond, obj), {}), m.cells.get((cond, ref), {})
                seeds = sorted(set(a) & set(b))
                if not seeds:
                    continue
                stat = paired_t([a[s]["pass1"] for s in seeds], [b[s]["pass1"] for s in seeds])
                rows.append({"cond": cond, "obj": obj, "ref": ref, "n": len(seeds), "t": stat})
    for row, p in zip(rows, holm([r["t"][3] for r in rows])):
        row["holm"] = p
        row["status"] = "corrected" if row["n"] >= HEADLINE_SEEDS else "exploratory"
    return rows


def region(m: Map) -> list[dict]:
    """Per objective: stable cells, the conditions that are not, and the per-seed difference of
    stable conditions to the widest objective."""
    rows = []
    for obj in m.objs:
        expected = [c for c in m.conds if f"{c}_{obj}" in m.declared]
        present = [c for c in m.conds if (c, obj) in m.cells]
        stable = [c for c in present if stable_cell(list(m.cells[(c, obj)].values()))]
        seeds = set().union(*(m.cells[(c, obj)] for c in present))
        complete = {s for s in seeds if all(s in m.cells.get((c, obj), {}) for c in expected)}
        per_seed = {
            s: sum(stable_run(m.cells[(c, obj)][s]) for c in expected) for s in sorted(complete)
        }
        rows.append({"obj": obj, "stable": stable, "present": present, "per_seed": per_seed})
    widest = max(rows, key=lambda r: len(r["stable"])) if rows else None
    for r in rows:
        seeds = sorted(set(r["per_seed"]) & set(widest["per_seed"]))
        r["widest"] = len(r["stable"]) == len(widest["stable"])
        r["diff"] = None
        if seeds and not r["widest"]:
            r["diff"] = paired_interval(
                [r["per_seed"][s] for s in seeds], [widest["per_seed"][s] for s in seeds]
            )
    return rows


def identical(m: Map) -> dict[str, list[str]]:
    """{condition: ["b = a (seeds 0, 1)"]}: objective b's run of a seed equals, row for row
    (timing fields aside: run_stats.fingerprint), the run of an earlier objective a."""
    first: dict[tuple, str] = {}
    pairs: dict[str, dict[tuple[str, str], list[int]]] = {}
    for cond in m.conds:
        for obj in m.objs:
            for seed, run in sorted(m.arms.get(f"{cond}_{obj}", {}).items()):
                source = first.setdefault((cond, seed, fingerprint(run)), obj)
                if source != obj:
                    pairs.setdefault(cond, {}).setdefault((obj, source), []).append(seed)
    return {
        cond: [f"{b} = {a} (seeds {', '.join(map(str, seeds))})" for (b, a), seeds in p.items()]
        for cond, p in pairs.items()
    }


def fmt_p(p: float) -> str:
    return "-" if math.isnan(p) else f"{p:.3f}"


def condition_table(m: Map, cond: str, same: list[str]) -> list[str]:
    lines = [
        f"### {cond}",
        "",
        "| objective | seeds | held-out pass@1 | per seed | collapse (dip) "
        "| collapse (sustained) | held-out below step 0 | final entropy | mean ESS | stable |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for obj in m.objs:
        runs = m.cells.get((cond, obj))
        if not runs:
            lines.append(f"| {obj} | 0 | {m.no_runs(cond, obj)} | | | | | | | |")
            continue
        s = [runs[k] for k in sorted(runs)]
        per_seed = ", ".join(f"{k}: {runs[k]['pass1']:.3f}" for k in sorted(runs))
        n = len(s)
        dip, sus = (sum(r[key] is not None for r in s) for key in ("collapse", "sustained"))
        lines.append(
            f"| {obj} | {n} | {fmt([r['pass1'] for r in s])} | {per_seed} | {dip} of {n} "
            f"| {sus} of {n} | {sum(r['below_step0'] for r in s)} of {n} "
            f"| {fmt([r['ent_last'] for r in s], 2)} | {fmt([r['ess'] for r in s], 4)} "
            f"| {'yes' if stable_cell(s) else 'no'} |"
        )
    if same:
        lines += ["", f"Row for row the same runs (timing fields aside): {'; '.join(same)}."]
    return lines + [""]


def report(m: Map) -> str:
    """The text of stability_map.md."""
    same = identical(m)
    n_runs = sum(len(v) for v in m.cells.values())
    lines = [
        "# Stability map: objective x condition (configs/mini/stability_map.py)",
        "",
        f"{n_runs} runs in {len(m.cells)} cells of {len(m.conds)} conditions x {len(m.objs)} "
        f"objectives ({len(m.declared)} cells in the grid). Definitions: "
        "experiments/stability_map.py's docstring. Stable cell: every run has no sustained "
        "collapse and held-out pass@1 at the last eval not below step 0's.",
        "",
        "## Stable region per objective",
        "",
        "| objective | stable conditions | of | not stable | no runs | stable per seed "
        "| minus widest, per seed [95% t-interval] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in region(m):
        unstable = [c for c in r["present"] if c not in r["stable"]]
        absent = [
            c if m.no_runs(c, r["obj"]) == "not run" else f"{c} (refused)"
            for c in m.conds
            if c not in r["present"]
        ]
        per_seed = ", ".join(f"{s}: {k}" for s, k in r["per_seed"].items()) or "-"
        diff = "widest" if r["widest"] else fmt_interval(r["diff"]) if r["diff"] else "-"
        lines.append(
            f"| {r['obj']} | {len(r['stable'])} | {len(m.conds)} | {', '.join(unstable) or '-'} "
            f"| {', '.join(absent) or '-'} | {per_seed} | {diff} |"
        )
    lines += ["", "## Final held-out pass@1", "", f"![objective x condition]({FILES[1]})"]
    lines += ["", "## Per condition", ""]
    for cond in m.conds:
        lines += condition_table(m, cond, same.get(cond, []))
    lines += [*COLLAPSE_NOTES, "", *comparison_lines(m)]
    lines += ["", "## Entropy of the trust-region estimators", "", f"![entropy]({FILES[2]})"]
    return "\n".join(lines) + "\n"


def comparison_lines(m: Map) -> list[str]:
    rows = comparisons(m)
    family = sum(not math.isnan(r["holm"]) for r in rows)
    lines = [
        "## Paired comparisons: final held-out pass@1, objective minus reference",
        "",
        f"Paired by seed; 95% t-interval; p: two-sided paired t-test; Holm over the {family} "
        f"comparisons with 2 or more seeds; corrected: {HEADLINE_SEEDS} or more seeds.",
        "",
        "| condition | objective | minus | seeds | difference [95% t-interval] | p | p (Holm) "
        "| status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cond']} | {r['obj']} | {r['ref']} | {r['n']} | {fmt_interval(r['t'][:3])} "
            f"| {fmt_p(r['t'][3])} | {fmt_p(r['holm'])} | {r['status']} |"
        )
    return lines


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, path: str) -> None:
    """PNG without the matplotlib version in its metadata, so the bytes depend on the data."""
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


def heatmap(m: Map, path: str) -> None:
    plt = pyplot()
    text = {"ha": "center", "va": "center", "fontsize": 7}
    value = np.full((len(m.objs), len(m.conds)), np.nan)
    fig, ax = plt.subplots(figsize=(1.1 * len(m.conds) + 3, 0.55 * len(m.objs) + 1.5))
    for i, obj in enumerate(m.objs):
        for j, cond in enumerate(m.conds):
            runs = list(m.cells.get((cond, obj), {}).values())
            if not runs:
                ax.text(j, i, m.no_runs(cond, obj), color="dimgrey", **text)
                continue
            value[i, j] = np.mean([r["pass1"] for r in runs])
            sus = sum(r["sustained"] is not None for r in runs)
            below = sum(r["below_step0"] for r in runs)
            note = f"{sus}/{len(runs)} coll" if sus else f"n={len(runs)}"
            note += f"\n{below}/{len(runs)} < step 0" if below else ""
            color = "white" if value[i, j] < 0.5 else "black"
            ax.text(j, i, f"{value[i, j]:.2f}\n{note}", color=color, **text)
            if not stable_cell(runs):
                frame = plt.Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, lw=2)
                ax.add_patch(frame).set_edgecolor("red")
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(value), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(m.conds)), m.conds)
    ax.set_yticks(range(len(m.objs)), m.objs)
    fig.colorbar(im, ax=ax, label="final held-out pass@1 (mean over seeds)")
    ax.set_title(
        "red frame: not stable (k/n coll: sustained collapses; < step 0: held-out pass@1 at "
        "the last eval below step 0's)",
        fontsize=9,
    )
    save(plt, fig, path)


def entropy_figure(m: Map, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ENTROPY_CONDITIONS), figsize=(12, 4.5))
    cmap = plt.get_cmap("tab10")
    for ax, cond in zip(np.atleast_1d(axes), ENTROPY_CONDITIONS):
        for k, (obj, label) in enumerate(ESTIMATORS):
            seeds = m.arms.get(f"{cond}_{obj}", {})
            curves = [
                [(r["step"], r.get("entropy_proxy", np.nan)) for r in seeds[s]["train"]]
                for s in sorted(seeds)
            ]
            n = min((len(c) for c in curves), default=0)
            if n < WINDOW:
                continue
            y = np.array([[v for _, v in c[:n]] for c in curves], np.float64).mean(0)
            x = np.array([st for st, _ in curves[0][:n]])
            ax.plot(x, y, color=cmap(k), lw=0.6, alpha=0.35)
            label = f"{label} ({len(curves)})"
            ax.plot(x[WINDOW - 1 :], moving_mean(y), color=cmap(k), lw=1.6, label=label)
        ax.set_title(f"{cond}: entropy proxy (-mean logp)")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best", title="estimator (seeds)")
    fig.suptitle(
        f"P3O's trust-region estimators, mean over seeds: per step (faint), {WINDOW}-step mean"
    )
    save(plt, fig, path)


def write(results: str, arms: dict[str, dict[int, dict]] | None = None) -> list[str]:
    """Writes the report and its two figures next to it; returns the paths written."""
    if arms is None:
        exp_dir = os.path.join(results, EXPERIMENT)
        arms = load_experiment(exp_dir) if os.path.isdir(exp_dir) else {}
    if not arms:
        fail(f"{results}: no {EXPERIMENT}/<arm>/<seed>/metrics.jsonl under it")
    md, hm, ent = (os.path.join(results, f) for f in FILES)
    m = Map.of(arms)
    with open(md, "w") as f:
        f.write(report(m))
    heatmap(m, hm)
    entropy_figure(m, ent)
    return [md, hm, ent]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    for path in write(ap.parse_args(argv).results):
        print("wrote", path)


if __name__ == "__main__":
    main()

"""The stability maps' report: which objective holds under which source of off-policyness.

    .venv/bin/python experiments/stability_map.py results     # the committed map's report only
    .venv/bin/python experiments/stability_map.py results --experiment stability_map_harsh
    .venv/bin/python experiments/analyze.py results           # every table, these reports too

Reads <results>/<experiment>/<condition>_<objective>/<seed>/metrics.jsonl (the arms of
configs/mini/<experiment>.py; experiment: stability_map, the default, or stability_map_harsh)
and writes, byte for byte the same each time:
  <results>/<experiment>.md             the stable region per objective, one table per condition,
                                        the paired comparisons, the two figures; the harsh map's
                                        opens with its declared comparisons
                                        (experiments/harsh_headline.py);
  <results>/<experiment>_heatmap.png    objective x condition -> final held-out pass@1 (mean over
                                        seeds); unstable cells framed in red, with how many seeds
                                        collapse (sustained) and end below step 0; cells without
                                        runs grey ("refused": not in the config's ARMS, e.g. fp8 x
                                        p3o_full; "not run": no finished run yet);
  <results>/<experiment>_entropy.png    entropy_proxy for each estimator of P3O's trust-region
                                        term, mean over seeds: per step (faint) and its 10-step
                                        mean; at T 0.6 and T 1.5 on the committed map, at
                                        t1.5+lag8 and lag32 on the harsh map (it has neither
                                        t0.6 nor t1.5; its P3O with k3 along its tangent too).

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
                          On the harsh map every row is "exploratory": its confirmatory family is
                          the five comparisons configs/mini/stability_map_harsh.py declares (A1-A3,
                          B, C; experiments/harsh_headline.py), Holm over those five only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # experiments.run_stats; configs.mini, for the grid

from experiments.run_stats import (  # noqa: E402
    COLLAPSE_NOTES,
    fail,
    fingerprint,
    fmt,
    fmt_interval,
    holm,
    load_experiment,
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


@dataclasses.dataclass(frozen=True)
class Setting:
    """What the two maps' reports differ in."""

    experiment: str  # results/<experiment>/, configs/mini/<experiment>.py, <experiment>.md
    title: str
    entropy_conditions: tuple[str, ...]
    estimators: tuple[tuple[str, str], ...] = ESTIMATORS
    # The config declares its own confirmatory family (experiments/harsh_headline.py): the report
    # opens with it and labels no per-condition comparison "corrected".
    declared: bool = False

    @property
    def files(self) -> tuple[str, str, str]:
        return tuple(self.experiment + end for end in (".md", "_heatmap.png", "_entropy.png"))


SETTINGS = {
    s.experiment: s
    for s in (
        Setting(EXPERIMENT, "Stability map", ENTROPY_CONDITIONS),
        Setting(
            "stability_map_harsh",
            "Harsh stability map",
            ("t1.5+lag8", "lag32"),
            (*ESTIMATORS, ("p3o_k3_tangent", "k3 tangent")),
            declared=True,
        ),
    )
}
FILES = SETTINGS[EXPERIMENT].files


@dataclasses.dataclass(frozen=True)
class Map:
    """The map's runs, their summaries per cell, and the grid's order."""

    arms: dict[str, dict[int, dict]]  # {arm: {seed: run}} (run_stats.load_experiment)
    cells: dict[tuple[str, str], dict[int, dict]]  # {(condition, objective): {seed: summary}}
    conds: list[str]  # configs/mini/<experiment>.py's order, then others found, sorted
    objs: list[str]
    declared: set[str]  # the config's ARMS
    setting: Setting

    @classmethod
    def of(cls, arms: dict[str, dict[int, dict]], experiment: str = EXPERIMENT) -> Map:
        mod = importlib.import_module(f"configs.mini.{experiment}")
        conds, objs = list(mod.CONDITIONS), list(mod.OBJECTIVES)
        for arm in sorted(arms):
            cond, obj = arm.split("_", 1)
            conds += [cond] if cond not in conds else []
            objs += [obj] if obj not in objs else []
        cells = {
            tuple(arm.split("_", 1)): {s: run_summary(run) for s, run in sorted(seeds.items())}
            for arm, seeds in arms.items()
        }
        return cls(arms, cells, conds, objs, set(mod.ARMS), SETTINGS[experiment])

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
    """Each objective minus cap-only and minus GRPO 0.2 per condition, Holm over the family;
    none "corrected" on a map that declares its own family."""
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
        headline = row["n"] >= HEADLINE_SEEDS and not m.setting.declared
        row["status"] = "corrected" if headline else "exploratory"
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


def report(m: Map, declared: list[str] = ()) -> str:
    """The text of <experiment>.md; declared: the declared comparisons' lines, after the intro."""
    same = identical(m)
    n_runs = sum(len(v) for v in m.cells.values())
    files = m.setting.files
    lines = [
        f"# {m.setting.title}: objective x condition (configs/mini/{m.setting.experiment}.py)",
        "",
        f"{n_runs} runs in {len(m.cells)} cells of {len(m.conds)} conditions x {len(m.objs)} "
        f"objectives ({len(m.declared)} cells in the grid). Definitions: "
        "experiments/stability_map.py's docstring. Stable cell: every run has no sustained "
        "collapse and held-out pass@1 at the last eval not below step 0's.",
        "",
        *declared,
        *([""] if declared else []),
        "## Stable region per objective",
        "",
        "| objective | stable conditions | of | not stable | no runs | stable per seed "
        "| minus widest, per seed [95% t-interval] |",
        "|---|---|---|---|---|---|---|",
    ]
    regions = region(m)
    for r in regions:
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
    per_cond = {c: sum(c in r["stable"] for r in regions) for c in m.conds}
    # of the condition's cells: a refused cell (p3o_full under a low-precision decode) is none
    in_grid = {
        c: sum(m.no_runs(c, o) == "not run" or (c, o) in m.cells for o in m.objs) for c in m.conds
    }
    lines += [
        "",
        "Stable objectives per condition (a condition with none is a gap in the map): "
        + ", ".join(f"{c} {n} of {in_grid[c]}" for c, n in per_cond.items())
        + ".",
    ]
    lines += ["", "## Final held-out pass@1", "", f"![objective x condition]({files[1]})"]
    lines += ["", "## Per condition", ""]
    for cond in m.conds:
        lines += condition_table(m, cond, same.get(cond, []))
    lines += [*COLLAPSE_NOTES, "", *comparison_lines(m)]
    lines += ["", "## Entropy of the trust-region estimators", "", f"![entropy]({files[2]})"]
    return "\n".join(lines) + "\n"


def comparison_lines(m: Map) -> list[str]:
    rows = comparisons(m)
    family = sum(not math.isnan(r["holm"]) for r in rows)
    status = (
        "every row exploratory: the confirmatory family is the declared comparisons above"
        if m.setting.declared
        else f"corrected: {HEADLINE_SEEDS} or more seeds"
    )
    lines = [
        "## Paired comparisons: final held-out pass@1, objective minus reference",
        "",
        f"Paired by seed; 95% t-interval; p: two-sided paired t-test; Holm over the {family} "
        f"comparisons with 2 or more seeds; {status}.",
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


def load(results: str, experiment: str) -> dict[str, dict[int, dict]]:
    """{arm: {seed: run}} of <results>/<experiment>/, {} without that directory."""
    exp_dir = os.path.join(results, experiment)
    return load_experiment(exp_dir) if os.path.isdir(exp_dir) else {}


def write(
    results: str,
    arms: dict[str, dict[int, dict]] | None = None,
    experiment: str = EXPERIMENT,
    committed: dict[str, dict[int, dict]] | None = None,
) -> list[str]:
    """Writes the experiment's report and its two figures next to it; returns the paths written.
    committed: the committed map's arms, which the harsh map's comparison B reads (from
    <results>/stability_map/ when not given)."""
    from experiments import stability_map_figures as figures

    arms = load(results, experiment) if arms is None else arms
    if not arms:
        fail(f"{results}: no {experiment}/<arm>/<seed>/metrics.jsonl under it")
    md, hm, ent = (os.path.join(results, f) for f in SETTINGS[experiment].files)
    m = Map.of(arms, experiment)
    declared = []
    if m.setting.declared:
        from experiments import harsh_headline

        committed = load(results, EXPERIMENT) if committed is None else committed
        declared = harsh_headline.table(arms, committed)
    with open(md, "w") as f:
        f.write(report(m, declared))
    figures.heatmap(m, hm)
    figures.entropy_figure(m, ent)
    return [md, hm, ent]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    ap.add_argument("--experiment", choices=sorted(SETTINGS), default=EXPERIMENT)
    args = ap.parse_args(argv)
    for path in write(args.results, experiment=args.experiment):
        print("wrote", path)


if __name__ == "__main__":
    main()

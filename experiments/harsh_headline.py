"""The declared comparisons of the harsh stability map: A1-A3, B and C as
configs/mini/stability_map_harsh.py's docstring states them, Holm over those five only.

    .venv/bin/python experiments/harsh_headline.py results

Reads <results>/stability_map_harsh/ and (for B) <results>/stability_map/, prints C's baseline
once seeds 0-4 of every candidate are in, the command for its seeds 10-14, and the five rows:
seeds, mean difference [95% t-interval], p, Holm p, concluded or not.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # configs.mini; experiments.*

from configs.mini import stability_map_harsh as harsh  # noqa: E402
from experiments.run_stats import (  # noqa: E402
    fmt_interval,
    holm,
    load_experiment,
    paired_t,
    run_summary,
)
from experiments.stability_map import stable_run  # noqa: E402

Arms = dict[str, dict[int, dict]]  # {arm: {seed: run}} (run_stats.load_experiment)


def runs_of(arms: Arms, objective: str, seed: int) -> list[dict] | None:
    """The run summaries of `objective`'s seed in every condition of the map; None if one lacks."""
    runs = [arms.get(f"{cond}_{objective}", {}).get(seed) for cond in harsh.CONDITIONS]
    return None if any(r is None for r in runs) else [run_summary(r) for r in runs]


def stable_counts(arms: Arms, objective: str, seeds) -> dict[int, int]:
    """{seed: stable conditions of the seed} over the seeds with all of the objective's runs."""
    out = {}
    for seed in seeds:
        if (runs := runs_of(arms, objective, seed)) is not None:
            out[seed] = sum(map(stable_run, runs))
    return out


def choose_baseline(arms: Arms) -> str | None:
    """C's baseline by the declared rule: most stable runs over the conditions x the selection
    seeds, then the higher mean final held-out pass@1, then CANDIDATES' order. None until every
    candidate has every selection run."""
    scores = []
    for rank, objective in enumerate(harsh.CANDIDATES):
        per_seed = [runs_of(arms, objective, s) for s in harsh.SELECTION_SEEDS]
        if any(r is None for r in per_seed):
            return None
        runs = [r for seed_runs in per_seed for r in seed_runs]
        pass1 = float(np.nanmean([r["pass1"] for r in runs]))  # a run without evals: NaN
        pass1 = pass1 if pass1 == pass1 else -math.inf  # never ranks by accident
        scores.append((sum(map(stable_run, runs)), pass1, -rank, objective))
    return max(scores)[3]


def compare(name: str, a: dict[int, float], b: dict[int, float], seeds) -> dict:
    """a - b paired over the declared seeds both have; p nan below 2 seeds, all nan with none."""
    both = [s for s in seeds if s in a and s in b]
    stat = paired_t([a[s] for s in both], [b[s] for s in both]) if both else (math.nan,) * 4
    return {"name": name, "n": len(both), "of": len(seeds), "t": stat}


def declared(harsh_arms: Arms, map_arms: Arms) -> tuple[str | None, list[dict]]:
    """(C's baseline, the five rows with their Holm p-values over the five)."""
    widest = stable_counts(harsh_arms, harsh.WIDEST, harsh.SEEDS)
    rows = [
        compare(
            f"A{i} {harsh.WIDEST} - {ref}: stable conditions",
            widest,
            stable_counts(harsh_arms, ref, harsh.SEEDS),
            harsh.SEEDS,
        )
        for i, ref in enumerate(harsh.RUNNERS_UP, 1)
    ]
    cond, a, b = harsh.CALIB
    pass1 = {
        obj: {s: run_summary(run)["pass1"] for s, run in map_arms.get(f"{cond}_{obj}", {}).items()}
        for obj in (a, b)
    }
    rows.append(compare(f"B {a} - {b} at {cond}: held-out pass@1", *pass1.values(), harsh.SEEDS))
    chosen = choose_baseline(harsh_arms)
    seeds = harsh.CONFIRMATION_SEEDS
    c_rows = {obj: stable_counts(harsh_arms, obj, seeds) for obj in (harsh.WIDEST, chosen) if obj}
    rows.append(
        compare(
            f"C {harsh.WIDEST} - {chosen or '(not chosen yet)'}: stable conditions",
            c_rows[harsh.WIDEST],
            c_rows.get(chosen, {}),
            seeds,
        )
    )
    ps = [1.0 if math.isnan(r["t"][3]) else r["t"][3] for r in rows]  # not computable: p = 1
    for row, p in zip(rows, holm(ps)):
        row["holm"] = p
        row["concluded"] = row["n"] == row["of"] and p < 0.05
    return chosen, rows


def lines(results: str) -> list[str]:
    load = lambda name: (
        load_experiment(path) if os.path.isdir(path := os.path.join(results, name)) else {}
    )
    return table(load("stability_map_harsh"), load("stability_map"))


def table(harsh_arms: Arms, map_arms: Arms) -> list[str]:
    """C's baseline, the five rows and C's command (once chosen): what main prints and what
    experiments/stability_map.py writes into the harsh map's report."""
    chosen, rows = declared(harsh_arms, map_arms)
    out = [
        "## Declared comparisons (configs/mini/stability_map_harsh.py), Holm over these five",
        "",
        f"C's baseline (seeds {harsh.SELECTION_SEEDS[0]}-{harsh.SELECTION_SEEDS[-1]}): "
        + (chosen or "not chosen yet (a candidate lacks a selection run)"),
        "",
        "| comparison | seeds | difference [95% t-interval] | p | p (Holm) | concluded |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = "-" if math.isnan(r["t"][3]) else f"{r['t'][3]:.4f}"
        diff = fmt_interval(r["t"][:3]) if r["n"] else "-"
        out.append(
            f"| {r['name']} | {r['n']} of {r['of']} | {diff} | {p} | {r['holm']:.4f} "
            f"| {'yes' if r['concluded'] else 'no'} |"
        )
    if chosen:
        arms = " ".join(f"{c}_{o}" for o in (harsh.WIDEST, chosen) for c in harsh.CONDITIONS)
        seeds = " ".join(str(s) for s in harsh.CONFIRMATION_SEEDS if s not in harsh.SEEDS)
        out += [
            "",
            "C's seeds beyond the map's: .venv/bin/python experiments/reproduce.py "
            f"--experiments stability_map_harsh --arms {arms} --seeds {seeds} --jobs 2",
        ]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="directory written by experiments/reproduce.py")
    print("\n".join(lines(ap.parse_args(argv).results)))


if __name__ == "__main__":
    main()

"""The stability maps' two figures (experiments/stability_map.py's docstring says what they show):
the heat-map of final held-out pass@1 and the entropy traces of P3O's trust-region estimators."""

from __future__ import annotations

import numpy as np

from experiments.run_stats import WINDOW, moving_mean
from experiments.stability_map import Map, stable_cell


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
    """One panel per condition of the map's Setting.entropy_conditions."""
    plt = pyplot()
    conditions = m.setting.entropy_conditions
    fig, axes = plt.subplots(1, len(conditions), figsize=(12, 4.5))
    cmap = plt.get_cmap("tab10")
    for ax, cond in zip(np.atleast_1d(axes), conditions):
        for k, (obj, label) in enumerate(m.setting.estimators):
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

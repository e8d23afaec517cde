"""The mismatch command's three files: mismatch.json (everything), mismatch.md (tables) and
mismatch.png (the figure), from the list of per-setting results `cli.run` builds.

Each result: {"setting": Setting.to_dict(), "stats": stats.summarize(...), "replay_err",
"mean_length", "seconds"}; the JSON also carries the run's arguments ("run").
"""

from __future__ import annotations

import json
import os

COLUMNS = (  # (stats key, header, format)
    ("ess_token", "ESS token", "{:.5f}"),
    ("ess_seq", "ESS seq", "{:.4f}"),
    ("abs_lr_mean", "mean abs lr", "{:.2e}"),
    ("abs_lr_p50", "p50", "{:.2e}"),
    ("abs_lr_p95", "p95", "{:.2e}"),
    ("abs_lr_max", "max", "{:.2e}"),
    ("lr_rms", "rms", "{:.2e}"),
    ("chi2", "chi^2", "{:.2e}"),
    ("lr_mean", "k1", "{:.2e}"),
    ("k3", "k3", "{:.2e}"),
    ("kl_exact", "KL(pi_b, pi)", "{:.2e}"),
    ("kl_exact_rev", "KL(pi, pi_b)", "{:.2e}"),
    ("frac_outside", "outside [0.8, 1.2]", "{:.2%}"),
    ("frac_outside_0.1", "outside [0.9, 1.1]", "{:.2%}"),
)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _row(name: str, s: dict, extra: tuple = ()) -> str:
    cells = [name, *extra, *(_cell(s.get(k), f) for k, _, f in COLUMNS), str(s["tokens"])]
    return "| " + " | ".join(cells) + " |"


def _header(first: tuple) -> list[str]:
    heads = [*first, *(h for _, h, _ in COLUMNS), "tokens"]
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]


def markdown(results: list[dict], run: dict) -> str:
    lines = [
        f"# Sampler-trainer mismatch: {run['model']}",
        "",
        f"Task `{run['task']}`, {run['prompts']} prompts x {run['samples']} samples, "
        f"responses <= {run['max_new_tokens']} tokens, seed {run['seed']}. lr = log pi_theta - "
        "log pi_b per sampled token (pi_b: the sampler's recorded log-prob, pi_theta: the "
        "trainer's re-score); definitions: ess_jax/mismatch/stats.py. `replay` is the largest "
        "gap between the recorded log pi_b and the decode replay that gives the exact KLs.",
        "",
        *_header(("setting", "mean length", "replay")),
    ]
    for r in results:
        extra = (f"{r['mean_length']:.1f}", f"{r['replay_err']:.1e}")
        lines.append(_row(r["setting"]["label"], r["stats"]["all"], extra))
    lines += moe_markdown(results)
    for part, title in (("by_length", "response length"), ("by_pb", "pi_b(y) of the token")):
        lines += ["", f"## By {title}", "", *_header(("setting", "bucket"))]
        for r in results:
            for b in r["stats"][part]:
                lines.append(_row(r["setting"]["label"], b, (b["bucket"],)))
    return "\n".join(lines) + "\n"


MOE_COLUMNS = (  # (stats key, header, format): each without and with routing replay
    ("ess_token", "ESS token", "{:.5f}"),
    ("kl_exact", "KL(pi_b, pi)", "{:.2e}"),
    ("frac_outside", "outside [0.8, 1.2]", "{:.2%}"),
)


def moe_markdown(results: list[dict]) -> list[str]:
    """The mixture-of-experts rows (results with "moe"; none for a dense model): per setting
    the share of routed response tokens whose recorded top-k is not the trainer's own, per
    sparse layer and over all, and the statistics without / with routing replay."""
    moe_rows = [r for r in results if "moe" in r]
    if not moe_rows:
        return []
    layers = len(moe_rows[0]["moe"]["flip_by_layer"])
    heads = ["setting", *(f"top-k differs, layer {i}" for i in range(layers)), "all layers"]
    for _, h, _ in MOE_COLUMNS:
        heads += [f"{h}", f"{h}, replay"]
    lines = [
        "",
        "## Mixture of experts: routing",
        "",
        "Top-k differs: the share of the response tokens the sampler routed (all but each "
        "response's last) whose recorded experts in a sparse layer are not the set the "
        "trainer's own router picks. The statistics are the trainer's re-score without "
        "routing replay (as above) and with it (the sampler's recorded experts, "
        "model.routing_replay sampler).",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "---|" * len(heads),
    ]
    for r in moe_rows:
        m, a = r["moe"], r["stats"]["all"]
        cells = [r["setting"]["label"], *(f"{x:.2%}" for x in m["flip_by_layer"])]
        cells.append(f"{m['flip']:.2%}")
        for key, _, fmt in MOE_COLUMNS:
            cells += [_cell(a.get(key), fmt), _cell(m["replay"].get(key), fmt)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def figure(results: list[dict], run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["setting"]["label"] for r in results]
    alls = [r["stats"]["all"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.5 * len(labels) + 2.5))
    y = range(len(labels))
    for ax, key, title, log in (
        (axes[0], "kl_exact", "exact KL(pi_b || pi_theta) per token (floor 1e-12)", True),
        (axes[1], "frac_outside", "share of tokens with ratio outside [0.8, 1.2]", False),
    ):
        vals = [max(a.get(key) or 0.0, 1e-12 if log else 0.0) for a in alls]
        ax.barh(y, vals, color="tab:blue")
        ax.set_xscale("log" if log else "linear")
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    ax = axes[2]
    for r in results:
        b = r["stats"]["by_pb"]
        ax.plot(range(len(b)), [max(x["abs_lr_mean"], 1e-9) for x in b], marker="o", ms=3)
        ax.set_xticks(range(len(b)), [x["bucket"] for x in b], fontsize=7, rotation=20)
    ax.set_yscale("log")
    ax.set_title("mean |log-ratio| by pi_b(y) bucket", fontsize=9)
    ax.legend(labels, fontsize=6)
    fig.suptitle(
        f"{run['model']}: {run['task']}, {run['prompts']} prompts x {run['samples']}, "
        f"<= {run['max_new_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: str, results: list[dict], run: dict) -> dict[str, str]:
    """mismatch.json / .md / .png in `out_dir` (created); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"mismatch.{ext}") for ext in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump({"run": run, "results": results}, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown(results, run))
    figure(results, run, paths["png"])
    return paths

"""The lag report of the asynchronous actor-learner experiment
(configs/mini/async_actor_learner.py): <results>/async_actor_learner/lag.md, beside its
table.md, written by experiments/analyze.py from the runs' metrics rows, byte for byte the same
each time.

Per arm, the batches of all its seeds pooled:
  lag k      the share of trained batches whose lag (a row's lag_max: the step minus the policy
             version that drew its batch) is k, for k = 0 .. the largest lag budget or lag of
             any row of the experiment (rollout.max_lag when some row reached it)
  mean lag   the mean of the rows' lag_mean
  budget     the mean lag budget after a step (rollout.max_lag, lower under ESS pacing)
  queue      the mean queue depth (batches ready when the trainer took its batch)
and per seed, then mean ± std over seeds (one seed: its value):
  steps/s    steps over their seconds, each step's step_s + push_s (the trainer's wait for its
             batch, its updates, and the params push at its start)
  tokens/s   trained tokens (a row's tokens_per_s x step_s) over the same seconds
The throughput leaves out each run's first WARMUP steps (they compile the sampler and the
trainer). Rows without the async fields (a sync run) are refused with the run named.
"""

from __future__ import annotations

import os

import numpy as np

from experiments.run_stats import fail

EXPERIMENT = "async_actor_learner"
FILE = "lag.md"
WARMUP = 5
FIELDS = ("lag_mean", "lag_max", "lag_budget", "queue_depth", "step_s", "push_s", "tokens_per_s")


def check_rows(arm: str, seed: int, rows: list[dict]) -> None:
    """`fail` (one `error:` line, exit 2) naming the run and field if a row lacks an async
    field."""
    for r in rows:
        missing = [k for k in FIELDS if k not in r]
        if missing:
            fail(
                f"{EXPERIMENT}/{arm}/{seed}: step {r.get('step')} has no {', '.join(missing)} "
                "(not a train.mode 'async' run?)"
            )


def throughput(rows: list[dict]) -> tuple[float, float]:
    """(steps/s, trained tokens/s) of a run's rows after the first WARMUP steps (nan if none)."""
    rows = [r for r in rows if r["step"] >= WARMUP]
    seconds = sum(r["step_s"] + r["push_s"] for r in rows)
    if not rows or seconds <= 0:
        return float("nan"), float("nan")
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rows)
    return len(rows) / seconds, tokens / seconds


def arm_summary(seeds: dict[int, list[dict]], max_lag: int) -> dict:
    """The row of one arm: {seed: train rows} -> shares, means and per-seed throughputs."""
    rows = [r for s in sorted(seeds) for r in seeds[s]]
    lags = np.array([r["lag_max"] for r in rows], np.int64)
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    speeds = [throughput(seeds[s]) for s in sorted(seeds)]
    return {
        "seeds": len(seeds),
        "batches": len(rows),
        "shares": [float(np.mean(lags == k)) for k in range(max_lag + 1)],
        "lag_mean": mean("lag_mean"),
        "budget": mean("lag_budget"),
        "queue": mean("queue_depth"),
        "steps_per_s": [s for s, _ in speeds],
        "tokens_per_s": [t for _, t in speeds],
    }


def _mean_std(values: list[float], digits: int) -> str:
    v = np.asarray(values, np.float64)
    v = v[~np.isnan(v)]
    if len(v) == 0:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f}"


def lag_table(arms: dict[str, dict[int, list[dict]]], order: list[str]) -> str:
    """The text of lag.md: {arm: {seed: train rows}} in the arms' `order`."""
    for arm in order:
        for seed, rows in sorted(arms[arm].items()):
            check_rows(arm, seed, rows)
    every = [r for arm in order for rows in arms[arm].values() for r in rows]
    max_lag = int(max((max(r["lag_max"], r["lag_budget"]) for r in every), default=0))
    head = ["arm", "seeds", "batches", *(f"lag {k}" for k in range(max_lag + 1))]
    head += ["mean lag", "budget", "queue", "steps/s", "tokens/s"]
    lines = [
        f"# {EXPERIMENT}: lag distribution and throughput",
        "",
        "Share of trained batches at each lag (step minus the version that drew the batch), all "
        "seeds pooled; mean lag, lag budget and queue depth per step; steps/s and trained "
        f"tokens/s per seed after the first {WARMUP} steps, mean ± std over seeds. Definitions: "
        "experiments/async_report.py.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for arm in order:
        s = arm_summary(arms[arm], max_lag)
        cells = [arm, str(s["seeds"]), str(s["batches"])]
        cells += [f"{x:.3f}" for x in s["shares"]]
        cells += [f"{s[k]:.3f}" for k in ("lag_mean", "budget", "queue")]
        cells += [_mean_std(s["steps_per_s"], 3), _mean_std(s["tokens_per_s"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(exp_dir: str, arms: dict[str, dict[int, dict]], order: list[str]) -> str:
    """Writes <exp_dir>/lag.md from run_stats.load_experiment's {arm: {seed: run}}; its path."""
    train = {arm: {s: run["train"] for s, run in seeds.items()} for arm, seeds in arms.items()}
    path = os.path.join(exp_dir, FILE)
    with open(path, "w") as f:
        f.write(lag_table(train, order))
    return path

"""The per-arm table of a SmolLM2 experiment (configs/smollm2_mismatch.py's budgets), from its
runs' metrics.jsonl, written between markers in its results page.

    .venv/bin/python experiments/smollm2_table.py results/smollm2_mismatch_lr1e-5 \
        --write results/smollm2_mismatch_lr1e-5.md

One row per arm and seed (<dir>/<arm>/<seed>/metrics.jsonl): train reward over the first and
the last 10 steps, held-out pass@1 at every eval, the ESS's mean and minimum over the steps,
k3 of log(pi / pi_b) per token (`kl_behaviour`), the mean response length, and the two
readings that configs/smollm2_mismatch.py declares for its lr1e-5 budget: collapse (the last
10 steps' train reward below half the first 10 steps', or a non-finite loss or gradient) and
learning (held-out pass@1 at the last eval above step 0's by more than 0.1).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.run_stats import fail, load_run  # noqa: E402

BEGIN = "<!-- experiments/smollm2_table.py: begin -->"
END = "<!-- experiments/smollm2_table.py: end -->"
WINDOW = 10
LEARNED = 0.1  # held-out pass@1 gain that counts as learning (configs/smollm2_mismatch.py)


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def row(arm: str, seed: int, run: dict) -> str:
    train, evals = run["train"], run["eval"]
    if not train:
        fail(f"{arm}/{seed}: no train rows")
    reward = [r["reward_mean"] for r in train]
    first, last = _mean(reward[:WINDOW]), _mean(reward[-WINDOW:])
    ess = [r["ess"] for r in train]
    nonfinite = any(
        not math.isfinite(r.get(k, 0.0)) for r in train for k in ("loss", "grad_norm")
    ) or any(r.get("nonfinite_frac", 0) > 0 for r in train)
    pass1 = {r["step"]: r["eval/pass@1"] for r in evals}
    steps = sorted(pass1)
    collapsed = nonfinite or last < first / 2
    learned = bool(steps) and pass1[steps[-1]] - pass1[steps[0]] > LEARNED
    length = _mean([r["response_len"] for r in train])
    return (
        f"| {arm} | {seed} | {first:.3f} | {last:.3f} | "
        + " / ".join(f"{pass1[s]:.3f}" for s in steps)
        + f" (steps {', '.join(str(s) for s in steps)}) | {_mean(ess):.3f} ({min(ess):.3f}) | "
        f"{_mean([r['kl_behaviour'] for r in train]):.3f} | "
        f"{length:.1f} | "
        f"{'yes' if collapsed else 'no'} | {'yes' if learned else 'no'} |"
    )


def table(folder: str) -> str:
    lines = [
        "| arm | seed | train reward, first 10 steps | last 10 steps | held-out pass@1 | "
        "ESS mean (min) | `kl_behaviour` | response length | collapse | learned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    arms = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    for arm in arms:
        for seed in sorted(int(s) for s in os.listdir(os.path.join(folder, arm)) if s.isdigit()):
            path = os.path.join(folder, arm, str(seed))
            lines.append(row(arm, seed, load_run(path)))
    if len(lines) == 2:
        fail(f"{folder}: no runs (<arm>/<seed>/metrics.jsonl)")
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> None:
    with open(path) as f:
        page = f.read()
    if BEGIN not in page or END not in page:
        fail(f"{path}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}{END}{tail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="results/<experiment>: <arm>/<seed>/metrics.jsonl")
    ap.add_argument("--write", help="the results page to write the table into (its markers)")
    args = ap.parse_args(argv)
    text = table(args.folder)
    if args.write:
        write(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one config several times with different overrides, then compare the runs.

    python experiments/sweep.py --config=configs/quickstart.py --root=runs/clip_sweep \
        --variant p3o objective.name=p3o \
        --variant grpo_eps0.2 objective.name=grpo objective.clip_eps_low=0.2 \
            objective.clip_eps_high=0.2

Each variant runs `python -m ess_jax.main` in its own process and workdir (so a crash in one
does not take down the others and each run can be resumed), then experiments/compare.py
writes <root>/compare.md and <root>/compare.png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_variants(argv: list[str]) -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {}
    current = None
    for tok in argv:
        if tok == "--variant":
            current = None
            continue
        if current is None:
            current = tok
            if current in variants:
                raise ValueError(f"variant {current!r} given twice")
            variants[current] = []
        else:
            if "=" not in tok:
                raise ValueError(f"override {tok!r} of variant {current!r} is not key=value")
            variants[current].append(f"--config.{tok}")
    if not variants:
        raise ValueError("no --variant given")
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--root", required=True)
    args, rest = ap.parse_known_args()
    variants = parse_variants(rest)
    workdirs = []
    for name, overrides in variants.items():
        wd = os.path.join(args.root, name)
        workdirs.append(wd)
        cmd = [
            sys.executable,
            "-m",
            "ess_jax.main",
            f"--config={args.config}",
            f"--workdir={wd}",
            *overrides,
        ]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=os.path.join(HERE, ".."))
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "compare.py"),
            *workdirs,
            "--out",
            os.path.join(args.root, "compare"),
        ],
        check=True,
    )


if __name__ == "__main__":
    main()

"""Run one config several times with different overrides, then compare the runs.

    .venv/bin/python experiments/sweep.py --config=configs/quickstart.py --root=runs/clip_sweep \
        --variant p3o objective.name=p3o \
        --variant grpo_eps0.2 objective.name=grpo objective.clip_eps_low=0.2 \
            objective.clip_eps_high=0.2

Each variant runs `python -m ess_jax.main` in its own process and workdir <root>/<variant> (so
a crash in one does not take down the others and each run can be resumed), its output on the
console and in <root>/logs/<variant>.log; then experiments/compare.py writes <root>/compare.md
and <root>/compare.png. A variant that fails does not stop the others: compare.md lists it (its
exit code and log) under the table of the runs that finished, and the sweep exits with 1.
"""

from __future__ import annotations

import argparse
import codecs
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments import compare  # noqa: E402
from experiments.run_stats import fail  # noqa: E402

MAIN = (sys.executable, "-m", "ess_jax.main")  # what each variant runs, before its flags


def parse_variants(argv: list[str]) -> dict[str, list[str]]:
    """{variant: its --config.KEY=VALUE flags} of `--variant NAME KEY=VALUE ...` groups; a
    mistake in them (no variant, a name given twice, a name that is a flag or an override or
    holds a "/", an override without "=") is a `fail`: one `error:` line, exit code 2."""
    variants: dict[str, list[str]] = {}
    current = None
    for tok in argv:
        if tok == "--variant":
            current = None
            continue
        if current is None:
            current = tok
            if tok.startswith("-") or "=" in tok or "/" in tok:
                fail(
                    f"--variant {tok}: not a variant name (a workdir under --root); "
                    "give --variant NAME KEY=VALUE ..."
                )
            if current in variants:
                fail(f"--variant {current}: given twice")
            variants[current] = []
        else:
            if "=" not in tok:
                fail(f"--variant {current}: override {tok!r} is not KEY=VALUE")
            variants[current].append(f"--config.{tok}")
    if not variants:
        fail("no --variant given: --variant NAME KEY=VALUE ... (one or more)")
    return variants


def run_logged(cmd: list[str], log_path: str) -> int:
    """Runs `cmd` from the repository root, its stdout and stderr both on the console and
    appended to `log_path` (after a `+ cmd` line); returns its exit code."""
    line = "+ " + " ".join(cmd) + "\n"
    print(line, end="", flush=True)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(log_path, "ab") as log:
        log.write(line.encode())
        log.flush()
        with subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as proc:
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
                log.write(chunk)
                log.flush()
                sys.stdout.write(text.decode(chunk))
                sys.stdout.flush()
    return proc.returncode


def failure_table(failed: dict[str, tuple[int, str]]) -> str:
    """The markdown of {variant: (exit code, log path)}."""
    lines = ["| failed variant | exit code | log |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {n} | {rc} | {log} |" for n, (rc, log) in failed.items())])


def main(argv: list[str] | None = None) -> int:
    """Runs every variant, then the comparison; 1 if a variant failed, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--root", required=True)
    args, rest = ap.parse_known_args(argv)
    variants = parse_variants(rest)
    # the variants run from the repository root: paths typed from elsewhere made absolute
    args.root = os.path.abspath(args.root)
    path, sep, arm = args.config.partition(":")
    args.config = os.path.abspath(path) + sep + arm
    log_dir = os.path.join(args.root, "logs")
    os.makedirs(log_dir, exist_ok=True)
    finished, failed = [], {}
    for name, overrides in variants.items():
        wd = os.path.join(args.root, name)
        log = os.path.join(log_dir, name + ".log")
        cmd = [*MAIN, f"--config={args.config}", f"--workdir={wd}", *overrides]
        rc = run_logged(cmd, log)
        if rc == 0:
            finished.append(wd)
        else:
            failed[name] = (rc, log)
            print(f"variant {name} failed (exit code {rc}); its log: {log}", flush=True)
    out = os.path.join(args.root, "compare")
    print(compare.write(finished, out, failure_table(failed) if failed else ""))
    print(f"wrote {out}.md" + (f" and {out}.png" if finished else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

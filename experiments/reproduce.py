"""Runs the CPU-scale ablations (configs/mini/): experiments x arms x seeds, resumable.

    .venv/bin/python experiments/reproduce.py --seeds 0 1 2 --jobs 2            # every experiment
    .venv/bin/python experiments/reproduce.py --experiments e1_clip_sweep --arms p3o --seeds 0
    .venv/bin/python experiments/reproduce.py --list                            # what would run

Each seed's SFT warm start (the arm of configs/mini/warm_start.py that the experiment's WARM
names, `policy` when it names none, and the external model for E7) runs once and is shared by
every arm of that seed. Every run is its own `python -m ess_jax.main`
process with a log in <runs>/logs/; a killed sweep resumes where it was: runs whose results
are in <results> are skipped, unfinished ones resume from their own checkpoints. When a run
finishes, its metrics.jsonl and a command.txt (the exact commands that reproduce it from a
fresh clone, `{workdir}` standing for any empty directory) go to
<results>/<experiment>/<arm>/<seed>/. `experiments/analyze.py <results>` makes the tables.

Runs are deterministic on the CPU for a given CPU count: a rerun of the command gives the same
metrics (timing fields aside: run_stats.TIMING_KEYS; `check` reruns a committed run and
compares). XLA:CPU's numbers depend on how many CPUs the process may use (`cpus`), so
command.txt pins its commands to as many and the compilation cache is kept per count. XLA_FLAGS
below asks for one XLA thread per process, which jax 0.10.2's XLA:CPU no longer honours (a
1024^3 matmul chain with the flag runs 2.2x faster on two cores than pinned to one:
tools/async_cost.py's docstring), so jobs run side by side share the cores: their timing
fields show it, their metrics do not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # configs.mini; experiments.run_stats

from experiments.run_stats import TIMING_KEYS, read_rows  # noqa: E402

# --xla_cpu_multi_thread_eigen=false asks for one XLA thread (no longer honoured, see the
# module docstring). The bare intra_op_parallelism_threads=1 token is no XLA flag: XLA stops
# reading at it, so any flag must come before it (xla_flags). Both stay because every
# committed command.txt carries this exact string.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# Experiments in the order they run (each completes all its seeds before the next starts).
EXPERIMENTS = (
    "e1_clip_sweep",
    "e3_temperature_1p2",
    "e5_fp8",
    "e4_temperature_0p6",
    "e3b_temperature_1p5",
    "e7_external",
    "e8_dual_anchor",
    "async_lag",
    "e1b_clip_sweep_fp8",
    "kl_estimators",
    "stability_map",
    "async_actor_learner",
    "e3_lora",
    "e1b_clip_sweep_calibrated",
    "e5_calibrated",
    "stability_map_harsh",
    "k3_clamp",
    "moe_replay",
)
# CPU devices per run where an experiment needs more than one: the async actor-learner's
# sampler and trainer each get one (their runs are not bit-reproducible: the lag is measured)
DEVICES = {"async_actor_learner": 2}
NEEDS_EXTERNAL = ("e7_external",)  # every arm; other experiments name theirs in EXTERNAL_ARMS


@dataclasses.dataclass(frozen=True)
class Job:
    experiment: str  # configs/mini/<experiment>.py, or "warm" for a warm start
    arm: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.experiment}__{self.arm}__{self.seed}"


def arms_of(experiment: str) -> tuple[str, ...]:
    if experiment not in EXPERIMENTS:
        raise SystemExit(f"unknown experiment {experiment!r}; valid: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"configs.mini.{experiment}").ARMS


def main_args(job: Job, workdir: str, warm_root: str, sets: tuple[str, ...] = ()) -> list[str]:
    """Arguments of `python -m ess_jax.main` for a job (paths as given). `sets` are extra config
    overrides: KEY=VALUE for the RL runs, warm:KEY=VALUE for the warm starts."""
    is_warm = job.experiment == "warm"
    extra = [
        f"--config.{kv.removeprefix('warm:')}" for kv in sets if kv.startswith("warm:") == is_warm
    ]
    if job.experiment == "warm":
        cfg = f"configs/mini/warm_start.py:{job.arm}"
        return [f"--config={cfg}", f"--config.seed={job.seed}", *extra, f"--workdir={workdir}"]
    args = [
        f"--config=configs/mini/{job.experiment}.py:{job.arm}",
        f"--config.seed={job.seed}",
        f"--config.model.source={warm_dir(warm_root, warm_kind(job), job.seed)}/hf",
    ]
    if needs_external(job):
        ext = warm_dir(warm_root, "external", job.seed)
        args.append(f"--config.rollout.external_checkpoint={ext}/hf")
    return [*args, *extra, f"--workdir={workdir}"]


def warm_kind(job: Job) -> str:
    """The warm start (configs/mini/warm_start.py's arm) a job's run starts from: the
    experiment's WARM, "policy" when it names none."""
    module = importlib.import_module(f"configs.mini.{job.experiment}")
    return getattr(module, "WARM", "policy")


def needs_external(job: Job) -> bool:
    """Whether a job's run samples part of its groups from the external model."""
    if job.experiment == "warm":
        return False
    if job.experiment in NEEDS_EXTERNAL:
        return True
    module = importlib.import_module(f"configs.mini.{job.experiment}")
    return job.arm in getattr(module, "EXTERNAL_ARMS", ())


def warm_dir(warm_root: str, kind: str, seed: int) -> str:
    return os.path.join(warm_root, kind, f"seed{seed}")


def warm_jobs(job: Job) -> list[Job]:
    kinds = [warm_kind(job)] + (["external"] if needs_external(job) else [])
    return [Job("warm", kind, job.seed) for kind in kinds]


def code_version() -> str:
    """The commit the sweep runs at, "+dirty" when ess_jax/ or configs/ have uncommitted changes
    (then the numbers may not be reproducible from any commit)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    commit = git("rev-parse", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "ess_jax", "configs").strip()
    return commit + ("+dirty" if dirty else "")


def cpus() -> int:
    """The CPUs this process may run on (its affinity), which its runs inherit. XLA:CPU sizes
    its thread pool by them, and the numbers depend on it: the calib_p3o warm start of seed 0
    evaluates to pass@1 0.241 pinned to one core and 0.266 on two, same code, same flags."""
    return len(os.sched_getaffinity(0))


def command_txt(job: Job, sets: tuple[str, ...] = ()) -> str:
    """The commands that reproduce `job`'s metrics from a fresh clone (README install first),
    each under `taskset` to as many CPUs as the run had (`cpus`)."""
    n = cpus()
    py = f"taskset -c {'0' if n == 1 else f'0-{n - 1}'} .venv/bin/python -m ess_jax.main"
    lines = [
        f"# Code: {code_version()} (check this commit out first: other code may differ).",
        "# From the root of a fresh clone after `bash tools/install.sh`; {workdir}: an empty dir.",
        "# The metrics land in {workdir}/run/metrics.jsonl (timing fields differ run to run).",
        f"# CPUs: {n} (XLA:CPU's numbers depend on the CPUs a process may use: taskset below).",
        f'export XLA_FLAGS="{xla_flags(job.experiment)}"',
    ]
    for w in warm_jobs(job):
        wd = warm_dir("{workdir}/warm", w.arm, w.seed)
        lines.append(" ".join([py, *main_args(w, wd, "", sets)]))
    lines.append(" ".join([py, *main_args(job, "{workdir}/run", "{workdir}/warm", sets)]))
    return "\n".join(lines) + "\n"


def xla_flags(experiment: str) -> str:
    """XLA_FLAGS of a run: XLA_FLAGS, and the experiment's DEVICES CPU devices. The device
    count goes first: XLA stops reading flags at the bare `intra_op_parallelism_threads=1`
    token of XLA_FLAGS, so a flag after it is ignored (the async runs then saw one device)."""
    n = DEVICES.get(experiment, 1)
    return (f"--xla_force_host_platform_device_count={n} " if n > 1 else "") + XLA_FLAGS


def result_dir(results: str, job: Job) -> str:
    return os.path.join(results, job.experiment, job.arm, str(job.seed))


def compile_cache_env(runs: str) -> dict[str, str]:
    """A persistent XLA compilation cache shared by the sweep's runs: most of a short run is
    compiling the same sampler and step programs; a cached executable computes the same numbers
    (tests/test_reproduce.py checks a cached run against command.txt run without the cache).
    The size cap turns on jax's file lock, so two jobs never read a half-written entry."""
    return {  # one cache per CPU count: an executable compiled under another count differs
        "JAX_COMPILATION_CACHE_DIR": os.path.join(runs, f"jax_cache_{cpus()}cpu"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 * 2**30),
    }


def run_job(job: Job, runs: str, log_dir: str, sets=()) -> tuple[Job, int, float]:
    """Runs (or resumes) one job in its own process; returns (job, exit code, seconds)."""
    if job.experiment == "warm":
        workdir = warm_dir(os.path.join(runs, "warm"), job.arm, job.seed)
    else:
        workdir = os.path.join(runs, job.experiment, job.arm, str(job.seed))
    args = main_args(job, workdir, f"{runs}/warm", sets)
    cmd = [sys.executable, "-m", "ess_jax.main", *args]
    env = {**os.environ, "XLA_FLAGS": xla_flags(job.experiment), **compile_cache_env(runs)}
    t0 = time.time()
    with open(os.path.join(log_dir, job.name + ".log"), "a") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return job, rc, time.time() - t0


def collect(job: Job, runs: str, results: str, sets=()) -> None:
    """Copies a finished run's small files to <results>/<experiment>/<arm>/<seed>/."""
    src = os.path.join(runs, job.experiment, job.arm, str(job.seed), "metrics.jsonl")
    dst = result_dir(results, job)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "command.txt"), "w") as f:
        f.write(command_txt(job, sets))
    shutil.copyfile(src, os.path.join(dst, "metrics.jsonl.tmp"))
    os.replace(os.path.join(dst, "metrics.jsonl.tmp"), os.path.join(dst, "metrics.jsonl"))


def warm_done(runs: str, job: Job) -> bool:
    hf = warm_dir(os.path.join(runs, "warm"), job.arm, job.seed)
    return os.path.exists(os.path.join(hf, "hf", "config.json"))


def plan(experiments, arms, seeds, results) -> list[Job]:
    jobs = []
    for exp in experiments:
        exp_arms = arms_of(exp)
        unknown = sorted(set(arms or ()) - set(exp_arms)) if arms and len(experiments) == 1 else []
        if unknown:
            raise SystemExit(f"{exp}: unknown arms {unknown}; valid: {', '.join(exp_arms)}")
        for seed in seeds:
            for arm in exp_arms:
                if arms and arm not in arms:
                    continue
                job = Job(exp, arm, seed)
                if not os.path.exists(os.path.join(result_dir(results, job), "metrics.jsonl")):
                    jobs.append(job)
    return jobs


def deterministic_rows(path: str) -> list[dict]:
    """A metrics.jsonl's rows without the timing fields (they differ between identical runs)."""
    rows = read_rows(path)
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def check(result: str) -> int:
    """Reruns <result>/command.txt in a fresh temporary workdir; 0 if the metrics match."""
    template = open(os.path.join(result, "command.txt")).read()
    with tempfile.TemporaryDirectory(prefix="ess_check_") as tmp:
        script = template.replace("{workdir}", tmp).replace(".venv/bin/python", sys.executable)
        print(f"rerunning {result} in {tmp}", flush=True)
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, check=True)
        new = deterministic_rows(os.path.join(tmp, "run", "metrics.jsonl"))
    old = deterministic_rows(os.path.join(result, "metrics.jsonl"))
    if new == old:
        print(f"same metrics: {len(old)} rows equal (timing fields aside)")
        return 0
    for kind, test in (("train", "reward_mean"), ("eval", "eval/pass@1")):
        a, b = [r for r in old if test in r], [r for r in new if test in r]
        same = sum(x == y for x, y in zip(a, b))
        print(f"{kind} rows: {same} of {len(a)} committed rows equal ({len(b)} rerun)")
    diff = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    print(
        f"DIFFERENT: first difference at row {diff}:\n"
        f"  committed {old[diff] if diff < len(old) else None}\n"
        f"  rerun     {new[diff] if diff < len(new) else None}"
    )
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS))
    ap.add_argument("--arms", nargs="+", default=None, help="only these arms")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    ap.add_argument("--runs", default="runs/mini", help="workdirs and logs")
    ap.add_argument("--results", default="results", help="where finished runs' files go")
    ap.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        dest="sets",
        help="config overrides of the RL runs (e.g. train.steps=20) and, prefixed warm:, of the "
        "warm starts (warm:sft.steps=100); recorded in command.txt",
    )
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--check",
        metavar="RESULT_DIR",
        help="rerun one committed run from its command.txt in a temporary "
        "directory and compare its metrics with the committed ones",
    )
    args = ap.parse_args()
    if args.check:
        raise SystemExit(check(args.check))
    sets = tuple(args.sets)
    for kv in sets:
        if "=" not in kv:
            raise SystemExit(f"--set {kv!r}: expected KEY=VALUE")
    runs, results = os.path.abspath(args.runs), os.path.abspath(args.results)
    experiments = [e.strip() for x in args.experiments for e in x.split(",") if e.strip()]
    jobs = plan(experiments, args.arms, args.seeds, results)
    warm = sorted({w for j in jobs for w in warm_jobs(j)}, key=lambda w: (w.seed, w.arm))
    warm = [w for w in warm if not warm_done(runs, w)]
    print(f"{len(warm)} warm starts and {len(jobs)} runs to go ({args.jobs} at a time)")
    if args.list:
        for j in warm + jobs:
            print(" ", j.name)
        return
    log_dir = os.path.join(runs, "logs")
    os.makedirs(log_dir, exist_ok=True)
    failed = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for batch in (warm, jobs):
            futures = [pool.submit(run_job, j, runs, log_dir, sets) for j in batch]
            for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                job, rc, secs = fut.result()
                status = "ok" if rc == 0 else f"FAILED (exit {rc})"
                print(f"[{n}/{len(batch)}] {job.name}: {status} in {secs:.0f}s", flush=True)
                if rc:
                    failed.append(job)
                elif job.experiment != "warm":
                    collect(job, runs, results, sets)
            if failed:
                break  # an RL run without its warm start would fail the same way
    if failed:
        names = ", ".join(j.name for j in failed)
        raise SystemExit(f"{len(failed)} runs failed: {names}; logs in {log_dir}")
    print(f"done; tables: .venv/bin/python experiments/analyze.py {os.path.relpath(results, ROOT)}")


if __name__ == "__main__":
    main()

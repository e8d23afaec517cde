"""The async actor-learner's cost model against a measurement (ess_jax/rl/async_cost.py).

    .venv/bin/python tools/async_cost.py                          # 8 fake CPU devices, 4 + 4
    .venv/bin/python tools/async_cost.py --devices=16 --rollout_devices=8 --max_lag=2 --steps=16
    .venv/bin/python tools/async_cost.py --config=configs/quickstart.py \
        --set data.prompts_per_step=64
    taskset -c 0 .venv/bin/python tools/async_cost.py             # the whole process on one core

Three runs of the same config, each in a temporary workdir, timed per step after --warmup
steps (compiles):
  1. sync on every device: the sync loop's sample_s and train_s per step;
  2. async with rollout.max_lag=0: the two sides take turns, so its rows give each term
     alone on its mesh: draw_s (sampler, rollout mesh), step_s - sample_s (trainer, train
     mesh), push_s (params to the rollout mesh);
  3. async with --max_lag and --sync_every: the measured seconds per step, queue depth, lag.
Prints the terms, then the model's prediction for runs 2 and 3 (async_cost.simulate) next to
what was measured, and the speed-up over run 1 predicted and measured.

Seconds per step are the median of the gaps between consecutive trainer steps (the time from
one `Trainer.learn` start to the next), which includes the waits. On CPU devices the two sides
share the host's cores: the measured speed-up there tests the model's contention-free
assumption as much as the schedule. XLA:CPU gives no way to run each side on a core of its
own: both meshes' programs run on the process's one thread pool, which uses every core the
process may use, and `--xla_cpu_multi_thread_eigen=false` no longer limits it (a 1024^3 matmul
chain on the 2-core host: 0.0447 s a call on both cores, 0.0965 s pinned to one with
`taskset -c 0`, the same with the flag). `taskset` pins the whole process, both sides at once.
Do not time it next to other work on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart.py:tiny")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU only)")
    p.add_argument("--rollout_devices", type=int, default=0, help="0: half")
    p.add_argument("--max_lag", type=int, default=2)
    p.add_argument("--sync_every", type=int, default=1)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--json", default="", help="also write the numbers here")
    return p.parse_args(argv)


def _config(args, **fields):
    """--config=FILE[:ARG] with --set, no SFT or eval, `fields` ("section.leaf": value)."""
    from ess_jax.config import names

    path, _, arm = args.config.partition(":")
    spec = importlib.util.spec_from_file_location("timed_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(arm or None)
    c.sft.steps, c.eval.every = 0, 0
    c.train.steps, c.train.checkpoint_every = args.steps, args.steps
    sets = {key: names.literal(value) for key, _, value in (s.partition("=") for s in args.set)}
    for key, value in {**sets, **fields}.items():  # the run's own mode fields win
        names.assign(c, key, value)
    return c


def _timed(config):
    """(metrics rows, seconds per step) of one run after the warm-up steps."""
    from ess_jax.rl import train
    from ess_jax.rl.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="async_cost_") as wd:
        run = train.Run(config, wd)
        starts, real = [], run.trainer.learn

        def learn(step, *a):
            starts.append(time.perf_counter())
            return real(step, *a)

        run.trainer.learn = learn
        run.run()
        rows = [r for r in read_metrics(wd) if "reward_mean" in r]
    return rows, starts


def _median(rows, key, skip, fn=None):
    vals = [fn(r) if fn else r[key] for r in rows[skip:]]
    return statistics.median(vals)


def main(argv=None) -> None:
    args = _args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ["JAX_PLATFORMS"] == "cpu":
        # the device count first: XLA stops reading XLA_FLAGS at a bare `name=value` token
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = f"{flag} {os.environ.get('XLA_FLAGS', '')}".strip()
    from ess_jax.rl import async_cost

    w = args.warmup
    gap = lambda starts: statistics.median(b - a for a, b in zip(starts[w:], starts[w + 1 :]))  # noqa: E731
    split = {"train.async_rollout_devices": args.rollout_devices}

    sync_rows, sync_starts = _timed(_config(args))
    s_sample = _median(sync_rows, "sample_s", w)
    s_train = _median(sync_rows, None, w, lambda r: r["step_s"] - r["sample_s"])
    turns_rows, turns_starts = _timed(
        _config(args, **{"train.mode": "async", "rollout.max_lag": 0, **split})
    )
    terms = async_cost.Terms(
        sample_s=_median(turns_rows, "draw_s", w),
        train_s=_median(turns_rows, None, w, lambda r: r["step_s"] - r["sample_s"]),
        push_s=_median(turns_rows, "push_s", w),
        sync_every=args.sync_every,
        max_lag=args.max_lag,
    )
    fields = {
        "train.mode": "async",
        "rollout.max_lag": args.max_lag,
        "train.sync_every": args.sync_every,
        **split,
    }
    async_rows, async_starts = _timed(_config(args, **fields))
    sync_step = gap(sync_starts)
    out = {
        "argv": sys.argv[1:] if argv is None else list(argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cores": sorted(os.sched_getaffinity(0)),
        "sync": {"sample_s": s_sample, "train_s": s_train, "step_s": sync_step},
        "terms": terms.__dict__,
        "turns": {
            "predicted_step_s": async_cost.simulate(
                async_cost.Terms(terms.sample_s, terms.train_s, terms.push_s, 1, 0)
            ).step_s,
            "measured_step_s": gap(turns_starts),
        },
    }
    pred = async_cost.simulate(terms)
    out["async"] = {
        "predicted_step_s": pred.step_s,
        "measured_step_s": gap(async_starts),
        "predicted_queue_depth": pred.queue_depth,
        "measured_queue_depth": statistics.mean(r["queue_depth"] for r in async_rows[w:]),
        "predicted_lag_mean": pred.lag_mean,
        "measured_lag_mean": statistics.mean(r["lag_mean"] for r in async_rows[w:]),
        "predicted_speedup": (s_sample + s_train) / pred.step_s,
        "measured_speedup": sync_step / gap(async_starts),
    }
    print(f"sync loop, all devices: sample {s_sample:.4f} s + train {s_train:.4f} s per step,")
    print(f"  measured {sync_step:.4f} s per step")
    print(
        f"terms on the split: sample {terms.sample_s:.4f} s, train {terms.train_s:.4f} s, "
        f"push {terms.push_s:.4f} s"
    )
    print(f"{'':34s} {'predicted':>10s} {'measured':>10s}")
    t, a = out["turns"], out["async"]
    print(f"{'s/step, max_lag 0':34s} {t['predicted_step_s']:10.4f} {t['measured_step_s']:10.4f}")
    label = f"max_lag {args.max_lag}, sync_every {args.sync_every}"
    for key, name in (
        ("step_s", f"s/step, {label}"),
        ("queue_depth", "queue depth"),
        ("lag_mean", "lag (mean)"),
        ("speedup", "speed-up over sync"),
    ):
        print(f"{name:34s} {a['predicted_' + key]:10.4f} {a['measured_' + key]:10.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

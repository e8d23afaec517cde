"""The two-program async run (`--role=trainer|sampler`) on two TPU slices, predicted from
compiled records: every time below is the TPU compiler's estimate (`optimal_seconds` of
tools/compile_tpu.py's records), never a measurement.

    .venv/bin/python tools/async_tpu.py results/tpu/e3_temperature_1p2__p3o__v5p-8.json
    .venv/bin/python tools/async_tpu.py RECORD --max_lag=2 --link_gbs=25 --json=OUT

The record is one slice's compile of a config (both groups run on a slice of that kind). From
it, per RL step of the config:

  sample_s  the sampler's batch: rollout.sample_microbatches calls, each the prefill plus every
            decode segment's token step times its tokens (`loop_trips`), plus the sampler copy
            in rollout.precision. An upper bound where responses stop early: a segment runs
            while any row of the call is unfinished, and this counts every row to
            rollout.max_new_tokens.
  train_s   train.updates_per_batch RL steps. XLA counts a loop body once, so a step's time is
            rebuilt from its loops: without the statistics pass (the loss does not read the
            step's ESS) the body is one micro-batch's gradient g, run M times, and the step is
            M x optimal_seconds (the optimizer update, outside the loop, counted M times: a
            few ms); with it (`loop_trips` M - 1) the program holds a forward f, a gradient g
            and the last micro-batch's g once each, and the step runs (M - 1) f + M g, so
            step = optimal_seconds x ((M - 1) f + M g) / (f + 2 g), with g = 4 f under
            model.remat (forward, recomputed forward, backward of twice the forward's flops)
            and 3 f without.
  push_s    the trainer's copy of its params for the pull (twice their bytes through HBM).
  pull_s    the sampler's pull of one version: the train-layout params of a host's devices
            over --link_gbs, GB/s per host (default 1.55, results/groups_sync/smollm2.json: the
            loopback pull of 538 MB between two processes of the CPU host, one host's figure
            for all its devices; a floor: the slices' data-centre network is faster).

The synchronous run on both slices at once (one mesh of twice the chips, data-parallel over
the slices) runs the same per-device programs on half the rows each: sample_s / 2 + train_s /
2, leaving out its cross-slice gradient all-reduce, so the sync side is its fastest and the
predicted speed-up of the split (ess_jax/rl/async_cost.py: simulate) its smallest. Eval is
left out of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)

import plan_memory  # noqa: E402  (tools/plan_memory.py: a config file read as ess_jax.main reads it)

from ess_jax.config.schema import UserError  # noqa: E402
from ess_jax.rl import async_cost  # noqa: E402

LOOPBACK_GBS = 1.55  # results/groups_sync/smollm2.json: 538 MB in 0.346 s (median), one host


def step_seconds(row: dict, microbatches: int, remat: bool) -> float:
    """One RL step's seconds from its record row (module docstring)."""
    t, m = row["optimal_seconds"], microbatches
    if row["loop_trips"] == m:  # one gradient loop of M bodies
        return t * m
    if row["loop_trips"] != m - 1:
        raise ValueError(f"rl_step: loop_trips {row['loop_trips']} is neither M nor M - 1 (M={m})")
    g = 4.0 if remat else 3.0  # in units of one forward
    return t * ((m - 1) + m * g) / (1 + 2 * g)


def sampler_seconds(programs: dict, calls: int, precision: str) -> float:
    """One rollout batch's sampler seconds: `calls` x (prefill + decode segments) + the copy."""
    call = sum(
        p["optimal_seconds"] * p["loop_trips"]
        for name, p in programs.items()
        if name == "sample/prefill" or name.startswith("sample/decode")
    )
    copy = programs.get(f"sampler_copy/{precision}", {}).get("optimal_seconds", 0.0)
    return calls * call + copy


def terms(record: dict, config, max_lag: int, sync_every: int, link_gbs: float) -> dict:
    """The cost model's terms (seconds, one slice each side) and the sync run's on both."""
    progs = record["programs"]
    missing = {"rl_step", "sample/prefill"} - set(progs)
    if missing:
        raise ValueError(f"the record lacks {sorted(missing)}: compile it without --only")
    bad = [n for n, p in progs.items() if "error" in p or (p.get("optimal_seconds") or 0) <= 0]
    if bad:
        raise ValueError(f"no usable compiler time for {bad} (a refusal or a negative estimate)")
    t, r = config.train, config.rollout
    train_s = t.updates_per_batch * step_seconds(
        progs["rl_step"], t.num_microbatches, bool(config.model.remat)
    )
    sample_s = sampler_seconds(progs, int(r.get("sample_microbatches", 1)), r.precision)
    params = progs["reshard"]["memory"]["argument"]  # the train-layout params, per device
    hbm = record["per_device"]["hbm_bandwidth"]
    return {
        "sample_s": sample_s,
        "train_s": train_s,
        "push_s": 2 * params / hbm,
        "pull_s": params * record["devices"] / record["hosts"] / (link_gbs * 1e9),
        "params_bytes": params,
        "sync_both_s": (sample_s + train_s) / 2,
        "max_lag": max_lag,
        "sync_every": sync_every,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("record", help="a tools/compile_tpu.py record of every program")
    p.add_argument("--max_lag", type=int, default=1)
    p.add_argument("--sync_every", type=int, default=1)
    p.add_argument("--link_gbs", type=float, default=LOOPBACK_GBS, help="pull GB/s per host")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    try:
        with open(args.record) as f:
            record = json.load(f)
        path, _, arg = record["config"].partition(":")
        config = plan_memory.load_config(f"{os.path.join(ROOT, path)}:{arg}")
        out = terms(record, config, args.max_lag, args.sync_every, args.link_gbs)
    except (OSError, ValueError, KeyError, UserError) as e:
        print(f"error: {args.record}: {e}", file=sys.stderr)
        return 2
    model = async_cost.Terms(
        out["sample_s"], out["train_s"], out["push_s"], args.sync_every, args.max_lag,
        out["pull_s"],
    )  # fmt: skip
    pred = async_cost.simulate(model)
    out.update(
        record=args.record,
        config=record["config"],
        topology=record["topology"],
        async_step_s=pred.step_s,
        speedup=out["sync_both_s"] / pred.step_s,
        sampler_share=out["sample_s"] / (out["sample_s"] + out["train_s"]),
    )
    print(f"{record['config']} on two {record['topology']} slices (compiler's estimates):")
    per_device = out["params_bytes"] / 1e9
    print(f"  per slice: sample {out['sample_s']:.1f} s, train {out['train_s']:.1f} s, "
          f"push {out['push_s']:.3f} s, pull {out['pull_s']:.2f} s "
          f"({per_device:.2f} GB per device, {args.link_gbs} GB/s per host)")  # fmt: skip
    print(f"  sync on both slices: {out['sync_both_s']:.1f} s per step")
    print(f"  async, sampler slice + trainer slice (max_lag {args.max_lag}): "
          f"{pred.step_s:.1f} s per step, speed-up {out['speedup']:.2f}x")  # fmt: skip
    print(f"  the sampler's share of the sync step: {out['sampler_share']:.0%} (a split that "
          f"balances the two sides gives the sampler that share of the chips)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The params sync of the two-program async run (ess_jax/rl/groups.py) on loopback: seconds
and bytes per sync against the params' bytes.

    .venv/bin/python -m bench.groups_sync --model=embedded --json=sync_embedded.json
    .venv/bin/python -m bench.groups_sync --model=smollm2 --json=sync_smollm2.json

Two processes with `--devices` fake CPU devices each, as the two groups: the offering one
(the trainer's side) places the model's float32 params in the train layout of `config.mesh`
over its devices and offers them `--repeats` times under fresh ids
(`jax.experimental.transfer`, as `RemoteLink.push` does); this one (the sampler's side) pulls
each with `sampler_group.Puller`, shard for shard, then moves them to the sample layout. Reported
per sync: the pull's seconds, the gather to the sample layout's seconds, and the bytes moved
(the params' bytes: each shard crosses once). A measurement of this machine's loopback and
memory bandwidth, not of DCN; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _env(devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {ONE_THREAD}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _model(name: str):
    """(ModelConfig, config) of the embedded quickstart model or SmolLM2-135M."""
    from configs import quickstart
    from ess_jax.rl import experiment

    config = quickstart.get_config(None)
    if name == "smollm2":
        config.model.source = "smollm2"
    cfg, params, _ = experiment.load_policy(config.model, need_tokenizer=False)
    return cfg, params, config


def offer(name: str, repeats: int) -> None:
    """The trainer's side: params offered `repeats` times; prints the address, then waits for
    stdin to close."""
    import jax

    from ess_jax.model import decoder as model_lib
    from ess_jax.parallel import sharding as sharding_lib
    from ess_jax.rl import group_channel

    cfg, params, config = _model(name)
    mesh = sharding_lib.make_mesh(dict(config.mesh))
    params = jax.block_until_ready(jax.device_put(params, model_lib.param_shardings(cfg, mesh)))
    server = group_channel.transfer_server("127.0.0.1")
    for uuid in range(1, repeats + 1):
        server.await_pull(uuid, params)
    print(server.address(), flush=True)
    sys.stdin.read()


def pull(name: str, repeats: int, address: str) -> dict:
    import jax

    from ess_jax.model import decoder as model_lib
    from ess_jax.parallel import sharding as sharding_lib
    from ess_jax.rl import group_channel, sampler_group

    cfg, params, config = _model(name)
    abstract = group_channel.exchange_abstract(cfg, sharding_lib.make_mesh(dict(config.mesh)))
    sample_sh = model_lib.param_shardings(cfg, sharding_lib.make_mesh({"data": -1}), "sample")
    server = group_channel.transfer_server("127.0.0.1")
    puller = sampler_group.Puller(server, address, abstract, sample_sh)
    pull_s, gather_s = [], []
    for uuid in range(1, repeats + 1):
        t0 = time.perf_counter()
        pulled = jax.block_until_ready(puller.conn.pull(uuid, abstract))
        t1 = time.perf_counter()
        jax.block_until_ready(jax.device_put(pulled, sample_sh))
        pull_s.append(t1 - t0)
        gather_s.append(time.perf_counter() - t1)
    want = jax.device_get(params)
    got = jax.device_get(pulled)
    exact = all((a == b).all() for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "model": name,
        "devices_per_group": jax.device_count(),
        "param_bytes": nbytes,
        "repeats": repeats,
        "pull_s": {"min": min(pull_s), "median": statistics.median(pull_s), "max": max(pull_s)},
        "gather_to_sample_layout_s": statistics.median(gather_s),
        "pull_gb_per_s": nbytes / statistics.median(pull_s) / 1e9,
        "bit_exact": exact,
        "note": "loopback between two processes of one CPU machine; not DCN",
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("embedded", "smollm2"), default="embedded")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--offer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.offer:
        return offer(args.model, args.repeats)
    os.environ.update(_env(args.devices))  # before jax starts in this process
    cmd = [sys.executable, "-m", "bench.groups_sync", "--offer", f"--model={args.model}"]
    child = subprocess.Popen(
        [*cmd, f"--repeats={args.repeats}"],
        env=_env(args.devices),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = child.stdout.readline().strip()
        if not address:
            raise SystemExit("error: the offering process did not start (see its stderr)")
        result = pull(args.model, args.repeats, address)
    finally:
        child.stdin.close()
        child.wait(60)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

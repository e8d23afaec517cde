"""Time a full jitted train step (forward, loss, backward, adamw) with P3O vs GRPO.

    .venv/bin/python tools/bench_objectives.py [--batch 64 --seq 128 --microbatches 1 4]

The policy is a small MLP language model (embed -> relu MLP -> vocab logits) so that the
objective is a realistic fraction of the step. P3O's extra work is the ESS reduction and the
KL term; with ess_scope="step" and M > 1 micro-batches it also pays one no-grad statistics
forward pass over the batch. Prints wall and CPU milliseconds per step and P3O / GRPO.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ess_jax import accumulate  # noqa: E402
from ess_jax import objectives as obj_lib  # noqa: E402
from ess_jax.advantages import broadcast_to_tokens, group_advantages  # noqa: E402


def init_params(key, vocab: int, dim: int, hidden: int):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (vocab, dim)) * 0.02,
        "w1": jax.random.normal(k2, (dim, hidden)) / np.sqrt(dim),
        "w2": jax.random.normal(k3, (hidden, vocab)) / np.sqrt(hidden),
    }


def logp_fn(params, mb):
    """Teacher-forced log-probs of tokens[:, 1:] given tokens[:, :-1], float32 [B, T]."""
    h_BxTxD = params["embed"][mb["tokens"][:, :-1]]
    logits_BxTxV = jax.nn.relu(h_BxTxD @ params["w1"]) @ params["w2"]
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_BxTxV, mb["tokens"][:, 1:, None], axis=-1)[..., 0]


def make_batch(params, batch: int, seq: int, vocab: int, group: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    lengths = rng.integers(seq // 4, seq + 1, batch)
    mask = np.arange(seq)[None] < lengths[:, None]
    # Behaviour log-probs = trainer's plus sampler noise, so ESS < 1 and every branch is live.
    logp = np.asarray(jax.jit(logp_fn)(params, {"tokens": tokens}))
    blogp = np.where(mask, logp + rng.normal(0, 0.3, logp.shape), 0).astype(np.float32)
    adv = group_advantages(jnp.asarray(rng.integers(0, 2, batch), jnp.float32), group)
    return {
        "tokens": tokens,
        "mask": mask,
        "behaviour_logp": blogp,
        "advantages": np.asarray(broadcast_to_tokens(adv, mask)),
    }


def make_train_step(tx, cfg: obj_lib.ObjectiveConfig, num_microbatches: int):
    def train_step(params, opt_state, batch):
        loss, grads, metrics = accumulate.step_loss_and_grad(
            logp_fn, params, batch, cfg, num_microbatches
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return jax.jit(train_step, donate_argnums=(0, 1))


def time_steps(steps: dict, params, batch, tx, warmup: int, repeats: int) -> dict:
    """Median wall and process-CPU seconds per step of each jitted step. Steps are timed in
    alternation so load from other processes hits every objective alike; CPU time is the
    steadier number on a shared machine."""
    state = {}
    for name, step in steps.items():
        fresh = jax.tree.map(jnp.array, params)  # donated: each step gets its own copy
        state[name] = (fresh, tx.init(fresh))
        for _ in range(warmup):
            state[name] = jax.block_until_ready(step(*state[name], batch)[:2])
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            state[name] = jax.block_until_ready(step(*state[name], batch)[:2])
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: np.median(np.array(t), axis=0) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    params = init_params(jax.random.key(0), args.vocab, args.dim, args.hidden)
    batch = make_batch(params, args.batch, args.seq, args.vocab)
    tx = optax.adamw(1e-5)
    print(
        f"backend={jax.default_backend()} devices={jax.device_count()} B={args.batch} "
        f"T={args.seq} V={args.vocab} D={args.dim} H={args.hidden}"
    )
    for m in args.microbatches:
        cfgs = {"grpo": obj_lib.ObjectiveConfig(name="grpo"), "p3o": obj_lib.ObjectiveConfig()}
        if m > 1:  # the statistics pass is the price of step scope: show it separately
            cfgs["p3o[microbatch scope]"] = obj_lib.ObjectiveConfig(ess_scope="microbatch")
        steps = {label: make_train_step(tx, cfg, m) for label, cfg in cfgs.items()}
        t = time_steps(steps, params, batch, tx, args.warmup, args.repeats)
        print(f"microbatches={m} (ms per step, wall / cpu):")
        for label, (wall, cpu) in t.items():
            print(f"  {label:24s} {wall * 1e3:8.1f} / {cpu * 1e3:8.1f}")
        ratio = t["p3o"] / t["grpo"]
        print(f"  ratio p3o/grpo: wall {ratio[0]:.3f}, cpu {ratio[1]:.3f}")


if __name__ == "__main__":
    main()

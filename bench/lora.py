"""LoRA on the CPU, each measurement side by side in one process (alternating repeats, so both
sides see the same machine load; the figure is the ratio of their medians).

The sampler with adapters, two forms:

  merged    W' = W + (alpha / R) A B once per collection (lora.merge), then the plain decode
            (timed together; merge_s: the merge alone)
  adapters  x W + (alpha / R) (x A) B in every matmul of every decode step

`rl/lora_policy.SAMPLER_FORM` keeps the faster. `--train`: one P3O train step (update.make_rl_step,
one device, `train_batch` x `train_seq` tokens, 32 of them prompt) with LoRA, and QLoRA on an
int8 / int4 base (model.lora.base_precision), against full fine-tuning.

    python -m bench.lora [--set dim=256] [--rank 8] [--rows 32] [--new 64] [--train]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import Sizes, scalar_overrides
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora, quant
from ess_jax.sampling import sampler


def _model(s: Sizes, rank: int):
    cfg = model_lib.ModelConfig(
        vocab_size=s.vocab,
        hidden_size=s.dim,
        intermediate_size=s.mlp,
        num_layers=s.layers,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
    )
    lcfg = lora.with_lora(cfg, rank, 2.0 * rank, lora.TARGETS)
    base = model_lib.init_params(cfg, 0)
    adapters = lora.init_adapters(lcfg, jax.random.key(1))
    # B != 0, as after training: the adapter path computes real numbers
    adapters = jax.tree.map(lambda x: x + 0.01 * jnp.ones_like(x), adapters)
    return cfg, lcfg, base, adapters


def measure(s: Sizes, rank: int, rows: int, new: int, repeats: int) -> dict:
    cfg, lcfg, base, adapters = _model(s, rank)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, s.vocab, (rows, s.prompt)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    sampling = sampler.SamplingConfig(max_new_tokens=new, stop_ids=())
    merge = jax.jit(lambda b, a: lora.merge(lcfg, b, a))
    key = jax.random.key(0)

    def merged():
        out = sampler.sample(cfg, merge(base, adapters), prompts, mask, sampling, key)
        return jax.block_until_ready(out.tokens)

    def merge_only():
        return jax.block_until_ready(merge(base, adapters))

    def unmerged():
        out = sampler.sample(lcfg, lora.join(base, adapters), prompts, mask, sampling, key)
        return jax.block_until_ready(out.tokens)

    np.testing.assert_array_equal(merged(), unmerged())  # compile both; same draws
    merge_only()
    times = {"merged": [], "adapters": [], "merge": []}
    for _ in range(repeats):
        for name, fn in (("merged", merged), ("adapters", unmerged), ("merge", merge_only)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rank": rank,
        "rows": rows,
        "new_tokens": new,
        "merged_s": med["merged"],
        "adapters_s": med["adapters"],
        "merge_s": med["merge"],
        "adapters_over_merged": med["adapters"] / med["merged"],
    }


def measure_train(s: Sizes, rank: int, repeats: int) -> dict:
    from ess_jax import objectives
    from ess_jax.parallel import sharding
    from ess_jax.rl import steps, update
    from ess_jax.rl.optim import make_optimizer

    cfg, lcfg, base, adapters = _model(s, rank)
    mesh = sharding.make_mesh({"fsdp": 1}, jax.devices()[:1])
    tx = make_optimizer({"lr": 1e-5, "max_grad_norm": 1.0, "schedule": "constant"})
    b, t, p = s.train_batch, s.train_seq, 32
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, s.vocab, (b, t)).astype(np.int32),
        "attn_mask": np.ones((b, t), bool),
        "mask": np.ones((b, t - p), np.float32),
        "behaviour_logp": np.full((b, t - p), -9.0, np.float32),
        "advantages": rng.normal(size=(b, t - p)).astype(np.float32),
    }
    batch = sharding.shard_batch(batch, mesh)
    base = sharding.reshard(base, model_lib.param_shardings(cfg, mesh))
    adapters = sharding.reshard(adapters, lora.split(model_lib.param_shardings(lcfg, mesh))[1])
    runs = {}
    # QLoRA: the same adapters on the base's block matrices as int8 / int4 codes (model/quant.py)
    qlora = {
        f"qlora_{q}": (
            lcfg.replace(lora_base_precision=q),
            quant.quantize_base(jax.tree.map(jnp.copy, base), q),  # its own embedding, norms
        )
        for q in ("int8", "int4")
    }
    # each step donates its state: the full run trains a copy of the base the LoRA run freezes
    for name, c, params, frozen in (
        ("full", cfg, jax.tree.map(jnp.copy, base), None),
        ("lora", lcfg, adapters, base),
        *((n, qc, jax.tree.map(jnp.copy, adapters), qb) for n, (qc, qb) in qlora.items()),
    ):
        state, sh = steps.init_state(params, tx, mesh, frozen)
        bsh = sharding.batch_sharding(mesh)
        ucfg = update.UpdateConfig(c, objectives.ObjectiveConfig(), tx)
        fn = update.make_rl_step(ucfg, update.StepKey(p), sh, bsh)
        state, _ = fn(state, batch)  # compile
        runs[name] = [fn, jax.block_until_ready(state)]
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run[1], _ = run[0](run[1], batch)
            jax.block_until_ready(run[1])
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"rank": rank, **{f"{k}_s": v for k, v in med.items()}}
    return {**out, **{f"{k}_over_full": med[k] / med["full"] for k in med if k != "full"}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", action="append", default=[], help="a Sizes field, e.g. dim=256")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train", action="store_true", help="the train step instead of the sampler")
    a = p.parse_args(argv)
    kw = scalar_overrides(a.set)
    if a.train:
        print(measure_train(Sizes(**kw), a.rank, a.repeats))
    else:
        print(measure(Sizes(**kw), a.rank, a.rows, a.new, a.repeats))


if __name__ == "__main__":
    main()

"""One layer's training attention (forward + backward) at the paper's lengths, compiled for a TPU
with libtpu on any host: `model.attention_impl` "einsum" (layers.attention, query chunks of
model.logits_chunk against every key) against "splash" (model/splash.py, the Pallas
flash-attention kernel), per device, at the RL step's micro-batch shapes.

    .venv/bin/python -m bench.tpu_attention            # E3 and E5 on v5p-8: minutes on 2 cores
    .venv/bin/python -m bench.tpu_attention --json=results/tpu_attention/v5p-8.json

Per arm and path it prints what the TPU compiler lays out (temporaries of the program: the
attention's own buffers, the inputs and outputs aside) and, for the einsum path, the
compiler's bytes accessed, flops and `optimal_seconds`. XLA's cost analysis does not see
inside a Pallas kernel (a custom call), so the splash row's bytes, flops and time are an
analytic model of the kernel as model/splash.py configures it (blocks of b = 512, 256 or 128
queries and keys, the causal mask's empty blocks skipped):
  - blocks computed: the nb (nb + 1) / 2 causal (query block, key block) pairs of nb = T / b
    blocks, each b x b scores for every query head;
  - flops: forward 2 products (QK', PV), backward 7 (the dK/dV kernel recomputes QK' and
    forms dP, dV, dK; the dQ kernel recomputes QK' and forms dP, dQ), 2 b b K flops each per
    block and head;
  - HBM bytes: the forward reads each query block once and K and V once per visible block and
    writes the output and the log-sum-exp; the dK/dV kernel reads K and V once per key block
    and Q, dO, the log-sum-exp and the rowsum of dO * O once per visible block, writes dK and
    dV; the dQ kernel reads Q, dO and those two once per query block and K, V per visible block,
    writes dQ. Each query head reads its kv head's blocks (the kernel maps head h to kv head
    h // G; no sharing across the G heads is assumed);
  - seconds: the roofline max(flops / the chip's bf16 peak, bytes / its HBM bandwidth): a lower
    bound, not the compiler's estimate.
Both paths run the forward once here; under model.remat the train step runs it once more.
Needs libtpu (bash tools/install.sh --tpu); compiles only, runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU

# (name, rows per device, prompt + new tokens, query heads, kv heads, head dim, logits_chunk):
# the RL step's micro-batch on v5p-8 (fsdp 4) of configs/paper, Qwen3-4B
ARMS = {
    "e3": (4, 1024 + 4096, 32, 8, 128, 1024),  # 1024 rows / 64 micro-batches / 4 devices
    "e5": (1, 1024 + 16384, 32, 8, 128, 1024),  # 1024 rows / 256 micro-batches / 4 devices
}
FWD_PRODUCTS, BWD_PRODUCTS = 2, 7


def splash_model(rows: int, t: int, heads: int, kd: int, dtype_bytes: int, peak: float,
                 bandwidth: float) -> dict:  # fmt: skip
    """The kernel's flops, HBM bytes and roofline seconds, forward + backward (docstring)."""
    from ess_jax.model import splash

    tp = splash.padded_length(t)
    b = splash.block_size(tp)
    nb = tp // b
    pairs = nb * (nb + 1) // 2
    block = b * kd * dtype_bytes  # one [b, K] block of Q, K, V, O, dO, dQ, dK or dV
    stats = b * 4 * 2  # one block's float32 log-sum-exp and rowsum(dO * O)
    per_head = (
        nb * block + 2 * pairs * block + nb * (block + b * 4)  # forward: Q; K, V; O, lse
        + 2 * nb * block + pairs * (2 * block + stats) + 2 * nb * block  # dK/dV kernel
        + nb * (2 * block + stats) + 2 * pairs * block + nb * block  # dQ kernel
    )  # fmt: skip
    flops = (FWD_PRODUCTS + BWD_PRODUCTS) * 2 * b * b * kd * pairs * heads * rows
    hbm = per_head * heads * rows
    return {"flops": flops, "bytes_accessed": hbm, "seconds": max(flops / peak, hbm / bandwidth),
            "block": b, "padded_length": tp}  # fmt: skip


def _compile(fn, *args) -> dict:
    compiled = fn.lower(*args).compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "temp_bytes": float(mem.temp_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "optimal_seconds": float(cost.get("optimal_seconds", 0.0)),
    }


COSTS = ("flops", "bytes_accessed", "optimal_seconds")


def compile_arm(device, rows: int, t: int, heads: int, kv_heads: int, kd: int, chunk: int,
                impl: str) -> dict:  # fmt: skip
    """The compiler's memory and cost of one layer's attention forward + backward on `device`.
    The einsum path's query chunks are a loop (lax.map, its forward recomputed in the
    backward), whose body XLA's cost analysis counts once: its costs are the whole program's
    plus (n - 1) times one chunk's forward + backward and forward, each compiled alone."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from ess_jax.model import layers, splash

    sh = NamedSharding(jax.sharding.Mesh([device], ("one",)), PartitionSpec())
    bf16, g = jnp.bfloat16, heads // kv_heads

    def spec(shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def inputs(queries):
        q = spec((rows, queries, kv_heads, g, kd))
        k, v = spec((rows, kv_heads, t, kd)), spec((rows, kv_heads, t, kd))
        return q, k, v, spec((rows, t), jnp.bool_)

    def attend(q, k, v, mask):
        if impl == "splash":
            return splash.splash_attention(q, k, v, mask.astype(jnp.int32), interpret=False)
        if q.shape[1] < t:  # one chunk: its queries against every key, as the loop body
            return layers.attention(q, k, v, mask, t - q.shape[1] + jnp.arange(q.shape[1]), 0)
        return layers.attention(q, k, v, mask, jnp.arange(t), chunk, 0)

    def loss(q, k, v, mask):
        return jnp.sum(attend(q, k, v, mask).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = _compile(grad, *inputs(t))
    n = -(-t // chunk) if impl == "einsum" and 0 < chunk < t else 1
    if n > 1:
        body = _compile(grad, *inputs(chunk))
        fwd = _compile(jax.jit(loss), *inputs(chunk))
        out["loop_trips"] = n
        out["reported"] = {c: out[c] for c in COSTS}
        for c in COSTS:
            out[c] += (n - 1) * (body[c] + fwd[c])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1", help="libtpu topology (one device used)")
    ap.add_argument("--chip", default="v5p", help="config/presets.py CHIPS key: peak, bandwidth")
    ap.add_argument("--arms", nargs="+", default=sorted(ARMS), choices=sorted(ARMS))
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from ess_jax.config.presets import CHIPS
    from ess_jax.memory import tpu

    chip = CHIPS[a.chip]
    device = tpu.topology_devices(a.topology)[0]
    out = {"topology": a.topology, "chip": a.chip, "arms": {}}
    for name in a.arms:
        rows, t, heads, kv_heads, kd, chunk = ARMS[name]
        got = {impl: compile_arm(device, rows, t, heads, kv_heads, kd, chunk, impl)
               for impl in ("einsum", "splash")}  # fmt: skip
        model = splash_model(rows, t, heads, kd, 2, chip.bf16_flops, chip.hbm_bandwidth)
        got["splash"].update(model=model)
        out["arms"][name] = {"rows": rows, "length": t, "heads": heads, "kv_heads": kv_heads,
                             "head_dim": kd, "logits_chunk": chunk, **got}  # fmt: skip
        e, s = got["einsum"], got["splash"]
        print(f"{name}: {rows} rows x {t} tokens per device, {heads} heads ({kv_heads} kv) of "
              f"{kd}, one layer forward + backward on {a.topology}")  # fmt: skip
        print(f"  einsum (query chunks of {chunk}): temporaries {e['temp_bytes'] / 1e9:.2f} GB, "
              f"{e['bytes_accessed'] / 1e9:.1f} GB accessed, {e['flops'] / 1e12:.2f} TFLOP, "
              f"compiler's {e['optimal_seconds'] * 1e3:.1f} ms")  # fmt: skip
        tb, gb = model["flops"] / 1e12, model["bytes_accessed"] / 1e9
        print(f"  splash (block {model['block']}): temporaries {s['temp_bytes'] / 1e9:.2f} GB; "
              f"model: {gb:.1f} GB accessed, {tb:.2f} TFLOP, "
              f"roofline {model['seconds'] * 1e3:.1f} ms")  # fmt: skip
        print(f"  einsum / splash: bytes {e['bytes_accessed'] / model['bytes_accessed']:.1f}x, "
              f"time {e['optimal_seconds'] / model['seconds']:.1f}x")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One decode step's attention for one layer, compiled for a TPU with libtpu on any host: the
compiler's bytes accessed per device for `model.decode_attention` "dense" (the segment's whole
cache) and "blockwise" (the filled blocks only), at a sampler's per-device shapes.

    .venv/bin/python -m bench.tpu_decode          # E3's sampler on v5p-8: ~15 s on 2 cores
    .venv/bin/python -m bench.tpu_decode --length 1536 --block 128

Defaults: E3 (configs/paper/e3_temperature_1p2.py, Qwen3-4B: 8 kv heads of 128, 4 query heads
each) on v5p-8: 64 rows per sampler call over fsdp 4, so 16 rows per device, and the last
decode segment's cache, a 1024-wide prompt bucket and 4096 new tokens (5120 positions),
bfloat16 keys and values. XLA's cost analysis counts a while loop's body once, so the
blockwise program is compiled at two block sizes b and 2b: its body (one block of each of the
two passes) costs I(b) = C(2b) - C(b) and what lies outside the loops O = C(b) - I(b) (the
score buffer's initialisation over the whole cache, the output); a step whose query sits at
position f then reads O + ceil((f + 1) / b) I(b). The dense program has no loop: its number
is the step's. The blockwise program with one block of the whole cache separates the two
paths' formulations (elementwise float32 products and sums against einsums of the compute
dtype with float32 accumulation) from what reading the filled blocks only saves. Needs libtpu
(bash tools/install.sh --tpu); compiles only, runs nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU


def compile_bytes(topology: str, rows: int, kv_heads: int, group: int, head_dim: int,
                  length: int, blocks: tuple[int, ...]) -> dict:  # fmt: skip
    """{"dense": bytes, ("blockwise", b): bytes per block size b}: the compiler's bytes
    accessed of one step's attention on one device of `topology`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from ess_jax.memory import tpu
    from ess_jax.model import blockwise_decode, layers

    device = tpu.topology_devices(topology)[0]
    sh = NamedSharding(jax.sharding.Mesh([device], ("one",)), PartitionSpec())
    bf16 = jnp.bfloat16

    def spec(shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    q = spec((rows, kv_heads, group, head_dim))
    k, v = spec((rows, kv_heads, head_dim, length)), spec((rows, kv_heads, length, head_dim))
    mask, idx = spec((rows, length), jnp.bool_), spec((), jnp.int32)

    def cost(fn, *args, static=()):
        analysis = jax.jit(fn, static_argnums=static).lower(*args).compile().cost_analysis()
        return float((analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"])

    out = {"dense": cost(layers.decode_attention, q, k, v, mask, idx)}
    attend = blockwise_decode.blockwise_decode_attention
    for b in blocks:
        out[("blockwise", b)] = cost(attend, q, {"k": k, "v": v}, mask, idx, b, static=(4,))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1", help="libtpu topology (one device used)")
    ap.add_argument("--rows", type=int, default=16, help="sampler rows per device")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per kv head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=5120, help="the decode segment's cache length")
    ap.add_argument("--prompt", type=int, default=1024, help="the prompt bucket in the cache")
    ap.add_argument("--block", type=int, default=256, help="model.decode_block (also 2x it)")
    a = ap.parse_args(argv)
    b = a.block
    blocks = (b, 2 * b, a.length)
    got = compile_bytes(a.topology, a.rows, a.kv_heads, a.group, a.head_dim, a.length, blocks)
    kv = a.rows * a.kv_heads * a.head_dim * 2 * 2 * a.length  # bf16 K and V of the cache
    body = got[("blockwise", 2 * b)] - got[("blockwise", b)]
    fixed = got[("blockwise", b)] - body
    shape = f"{a.rows} rows x {a.kv_heads} kv heads x {a.group} x {a.head_dim}"
    print(f"{a.topology}, one layer, per device: {shape}, cache {a.length} positions "
          f"(K + V {kv / 1e6:.1f} MB)")  # fmt: skip
    print(f"dense: {got['dense'] / 1e6:.1f} MB per step")
    whole = got[("blockwise", a.length)]
    print(f"blockwise with one block of the whole cache: {whole / 1e6:.1f} MB per step")
    print(f"blockwise (block {b}): {fixed / 1e6:.1f} MB outside the loops + {body / 1e6:.1f} MB "
          f"per block ({body / (kv * b / a.length):.2f}x its K + V)")  # fmt: skip
    first = a.prompt + (a.length - a.prompt) // 2  # a later segment doubles the response span
    for f in (first, (first + a.length) // 2, a.length - 1):
        step = fixed + math.ceil((f + 1) / b) * body
        print(f"  query at {f}: {step / 1e6:.1f} MB ({got['dense'] / step:.1f}x less than dense)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

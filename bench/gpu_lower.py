"""Lower the GPU bench's jax programs for CUDA on a machine without a GPU: a dry run that
finds, at no device time, what a GPU run would hit first (a sequence length or layout that
jax's cuDNN checks refuse, an attention path that never reaches cuDNN, a backward that also
computes a bias gradient, a program that no longer lowers).

    python -m bench.gpu_lower            # bench_gpu's Qwen2.5-1.5B sizes: ~30 s on 2 cores
    python -m bench.gpu_lower --tiny

The programs: every train step and sampler program `bench/gpu.py` runs (the matmul and
copy ceilings aside), and two cuDNN variants it does not run (P3O at 4 micro-batches, the
prefill), marked "extra". jax lowers a program for a platform it does not run on
(`lower(lowering_platforms=("cuda",))`); only compiling it needs the GPU, so what cuDNN itself
and XLA decide at compile time (graph support, memory, fusions) is not checked here. jax asks
for cuDNN's version before it emits a cuDNN call: that check is stubbed (`cudnn_stub`) for the
lowering only, and jax's other cuDNN checks then assume a pre-Hopper GPU. Per program it
prints the cuDNN attention call sites forward and backward (a scan's body counts once), how
many backward ones also return a bias gradient, and the seconds to trace and lower.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time

from bench import gpu as bench_gpu

CUDNN_CALL = re.compile(r"stablehlo\.custom_call @__cudnn\$fmha(\w+)\([^\n]*-> (\([^\n]*\)|\S+)")


@contextlib.contextmanager
def cudnn_stub(version: int = 90100):
    """jax's cuDNN version check, answered without a GPU (restored on exit)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    real = fa.check_cudnn_version
    fa.check_cudnn_version = lambda: version
    try:
        yield
    finally:
        fa.check_cudnn_version = real


def cudnn_calls(hlo_text: str) -> dict:
    """Count the cuDNN attention calls of a lowered program: forward, backward, and backward
    calls whose results include a bias gradient (dq, dk, dv, [dbias], workspace)."""
    fwd = bwd = dbias = 0
    for kind, results in CUDNN_CALL.findall(hlo_text):
        if kind.endswith("Backward"):
            bwd += 1
            dbias += results.count("tensor<") == 5
        else:
            fwd += 1
    return {"fwd": fwd, "bwd": bwd, "bwd_with_dbias": dbias}


def programs(s):
    """(name, trace) of each program: `trace()` gives the traced jit, ready to lower."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.common import one_device_mesh
    from bench.decode import runner_static
    from bench.train import OPTIM, make_optimizer
    from ess_jax.data import bucket_width
    from ess_jax.model import decoder as model_lib
    from ess_jax.model import kv_cache
    from ess_jax.objectives import ObjectiveConfig
    from ess_jax.parallel import sharding
    from ess_jax.rl import steps, update
    from ess_jax.sampling import precision, sampler

    cfg = bench_gpu.model_config(s)
    mesh = one_device_mesh()
    rep = sharding.replicated(mesh)
    tx = make_optimizer(OPTIM)
    params = jax.eval_shape(lambda: model_lib.init_params(cfg, 0))  # shapes only: nothing allocated
    state = jax.eval_shape(
        lambda p: steps.TrainState(p, tx.init(p), jnp.int32(0), jnp.int32(0)), params
    )
    batch = {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
        for k, v in bench_gpu.train_batch(s).items()
    }
    m = bench_gpu.ESS_MICROBATCHES
    runs = [  # bench_gpu's sections train, grpo, train_fused, ess_microbatched; then extras
        ("p3o", "einsum", 1, ""),
        ("grpo", "einsum", 1, ""),
        ("p3o", "cudnn", 1, ""),
        ("p3o", "einsum", m, ""),
        ("grpo", "einsum", m, ""),
        ("p3o", "cudnn", m, " (extra)"),
    ]
    for obj, impl, mb, extra in runs:
        mcfg = cfg.replace(attention_impl=impl)
        step = update.make_rl_step(
            update.UpdateConfig(mcfg, ObjectiveConfig(name=obj), tx, mb),
            update.StepKey(0),
            jax.tree.map(lambda _: rep, state),
            sharding.batch_sharding(mesh),
        )
        yield f"train {obj} {impl} M={mb}{extra}", lambda step=step: step.trace(state, batch)

    # the sampler as bench_decode.jax_runner calls it: bfloat16 copy, bucketed prompts
    sample_params = jax.eval_shape(precision.prepare_fn("bfloat16"), params)
    b, p = s.decode_batches[0], bucket_width(s.prompt)
    st = runner_static(s.gen, "sampled")  # bench_gpu decodes "sampled"
    prompts = (jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), jnp.bool_))
    one, key = jnp.float32(1.0), jax.random.key(0)
    args = (sample_params, *prompts, key, one, one)
    compiled = {}  # attention_impl: (prefill, decode.Decode)
    for impl, extra in (("einsum", ""), ("cudnn", " (extra)")):
        compiled[impl] = sampler.programs(
            cfg.replace(dtype="bfloat16", attention_impl=impl), st, None
        )
        prefill = compiled[impl][0]
        yield f"prefill {impl} batch {b} x {p}{extra}", lambda f=prefill: f.trace(*args)
    prefill, loops = compiled["einsum"]
    dstate = jax.eval_shape(prefill, *args)
    for bound, loop in zip(loops.bounds, loops.segments):
        grow = lambda c, n=p + bound: [kv_cache.grow_layer(layer, n) for layer in c]
        seg = dstate.replace(cache=jax.eval_shape(grow, dstate.cache))
        yield (
            f"decode segment to {bound}",
            lambda f=loop, a=(sample_params, seg, one, one): f.trace(*a),
        )


def lower_all(s) -> dict:
    """{program name: cudnn_calls(...) plus "lower_s"}, every program lowered for CUDA
    (lower_s: seconds to trace and lower)."""
    out = {}
    with cudnn_stub():
        for name, trace in programs(s):
            t0 = time.perf_counter()
            text = trace().lower(lowering_platforms=("cuda",)).as_text()
            out[name] = {**cudnn_calls(text), "lower_s": time.perf_counter() - t0}
            print(f"{name:36s} {out[name]}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="bench_gpu's 2-layer smoke sizes")
    args = ap.parse_args(argv)
    lower_all(bench_gpu.TINY if args.tiny else bench_gpu.QWEN25_1_5B)
    return 0


if __name__ == "__main__":
    sys.exit(main())

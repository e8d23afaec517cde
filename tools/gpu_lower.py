"""Lower the GPU bench's jax programs for CUDA on a machine without a GPU: a dry run that
finds, at no device time, what a GPU run would hit first (a sequence length or layout cuDNN
refuses, an attention path that never reaches cuDNN, a backward that also computes a bias
gradient).

    python tools/gpu_lower.py            # bench_gpu's Qwen2.5-1.5B sizes, seconds per program
    python tools/gpu_lower.py --tiny

jax lowers a program for a platform it does not run on (`lower(lowering_platforms=("cuda",))`);
only compiling it needs the GPU, so XLA's own refusals (memory, unsupported fusions) are not
found here. jax asks for cuDNN's version before it emits a cuDNN call: that check is stubbed
(`cudnn_stub`) for the lowering only. Per program it prints the cuDNN attention calls forward
and backward, how many backward calls also return a bias gradient, and the seconds to lower.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time

import bench_gpu  # puts the repository root on sys.path

ROOT = bench_gpu.ROOT
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
    """(name, lowered program) of every jax program bench_gpu runs, cuDNN attention where it
    has a training variant, plus the sampler's prefill through cuDNN."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_common import one_device_mesh
    from bench_train import OPTIM, make_optimizer

    from ess_jax import decode, model, sampler, sharding, steps
    from ess_jax.objectives import ObjectiveConfig

    cfg = bench_gpu.model_config(s)
    mesh = one_device_mesh()
    rep = sharding.replicated(mesh)
    tx = make_optimizer(OPTIM)
    params = jax.eval_shape(lambda: model.init_params(cfg, 0))  # shapes only: nothing allocated
    state = jax.eval_shape(
        lambda p: steps.TrainState(p, tx.init(p), jnp.int32(0), jnp.int32(0)), params
    )
    batch = {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
        for k, v in bench_gpu.train_batch(s).items()
    }
    runs = [
        ("p3o", "einsum", 1),
        ("p3o", "cudnn", 1),
        ("p3o", "cudnn", bench_gpu.ESS_MICROBATCHES),
        ("grpo", "cudnn", bench_gpu.ESS_MICROBATCHES),
    ]
    for obj, impl, m in runs:
        step = steps.make_rl_step(
            cfg.replace(attention_impl=impl),
            tx,
            ObjectiveConfig(name=obj),
            m,
            0,
            jax.tree.map(lambda _: rep, state),
            sharding.batch_sharding(mesh),
        )
        yield f"train {obj} {impl} M={m}", lambda step=step: step.trace(state, batch)
    b, p = s.decode_batches[0], sampler.bucket_length(s.prompt)
    st = decode.Static(s.gen, 1, False, 0, False, (), 0)
    prefill = jax.jit(
        lambda prm, t, msk, key: decode.prefill(
            prm, t, msk, key, 1.0, 1.0, cfg=cfg.replace(attention_impl="cudnn"), st=st, mesh=None
        )
    )
    args = (
        params,
        jax.ShapeDtypeStruct((b, p), jnp.int32),
        jax.ShapeDtypeStruct((b, p), jnp.bool_),
        jax.random.key(0),
    )
    yield f"prefill cudnn batch {b} x {p}", lambda: prefill.trace(*args)


def lower_all(s) -> dict:
    """{program name: cudnn_calls(...) plus "lower_s"}, every program lowered for CUDA."""
    out = {}
    with cudnn_stub():
        for name, trace in programs(s):
            t0 = time.perf_counter()
            text = trace().lower(lowering_platforms=("cuda",)).as_text()
            out[name] = {**cudnn_calls(text), "lower_s": time.perf_counter() - t0}
            print(f"{name:32s} {out[name]}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="bench_gpu's 2-layer smoke sizes")
    args = ap.parse_args(argv)
    lower_all(bench_gpu.TINY if args.tiny else bench_gpu.QWEN25_1_5B)
    return 0


if __name__ == "__main__":
    sys.exit(main())

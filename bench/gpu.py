"""The bench on a GPU: a random-init model with Qwen2.5-1.5B's dimensions in bfloat16, its
MFU and decode speed against the chip's measured bf16 matmul and memory-bandwidth ceilings,
and the PyTorch peers (Hugging Face Qwen2ForCausalLM) on the same shapes.

    python -m bench.gpu --json gpu.json --md gpu.md   # on a CUDA machine
    python -m bench.gpu --tiny --json /tmp/g.json                # smoke run, any machine

Each side runs in its own process, one after the other (`--part jax`, `--part torch`), so
neither framework's allocator holds memory the other needs; this one merges their JSON and
writes the report. Per side:
  1. ceilings: median TFLOP/s of an n x n bfloat16 matmul (20 back-to-back per timing) and
     the device's copy bandwidth (y = 2x on a 2 GiB bfloat16 array, bytes read + written);
  2. the train step (forward + backward + AdamW, P3O; GRPO too for the ESS overhead):
     float32 master weights, bfloat16 compute (ess_jax: ModelConfig.dtype; torch: autocast),
     tokens/s and MFU = train_flops / s / the measured bf16 ceiling (bench/common.py's FLOP model);
     and the P3O step again with model.attention_impl "cudnn" (jax.nn.dot_product_attention's
     fused kernel) against the einsum attention (section train_fused); P3O and GRPO over 4
     micro-batches, the step-scope ESS's statistics pass (section ess_microbatched);
  3. sampling at batch 32 (temperature 1, whole vocabulary, no stop token, L new tokens from
     left-padded prompts): ess_jax's sampler in its "bfloat16" precision against `generate`
     on a bfloat16 copy of the model; decode ms/step against the bandwidth floor = (bf16
     matmul weights + the KV cache a step reads) / the measured copy bandwidth.
The two sides hold different random weights (the CPU bench, bench/cpu.py, checks identical
ones): neither side's work depends on the values here, with no stop token and no clipping.
Compile-heavy on a GPU (28 unrolled layers, 5 sampler programs): on one H200 the P3O step's
first call took 80-91 s, the sampler's 56 s, torch.compile's 78 s, the whole run ~6.5 min
(BENCHMARKS_GPU.md). `--budget` (seconds per part) skips the optional sections (grpo,
train_fused, ess_microbatched, torch_compile) when short; `--sections` names the ones to
run, whatever the budget.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

from bench.common import Sizes, hf_shape, median, time_round_robin
from bench.gpu_report import report_md, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN25_1_5B = Sizes(
    dim=1536,
    mlp=8960,
    layers=28,
    heads=12,
    kv_heads=2,
    vocab=151936,
    gemm=(8192,),
    train_batch=8,
    train_seq=1024,
    decode_batches=(32,),
    decode_modes=("sampled",),
    prompt=128,
    gen=256,
    warmup=2,
    repeats=5,
)
TINY = dataclasses.replace(
    QWEN25_1_5B,
    dim=64,
    mlp=128,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=512,
    gemm=(256,),
    train_batch=4,
    train_seq=32,
    decode_batches=(4,),
    prompt=8,
    gen=8,
    warmup=1,
    repeats=2,
)
ESS_MICROBATCHES = 4
H200_DATASHEET = {"bf16_tflops": 989.0, "hbm_gbps": 4800.0}  # dense, SXM (a lead, not measured)
COPY_BYTES = 2**31
# jax part: train (P3O), decode (sampler), grpo, train_fused (P3O with attention_impl "cudnn";
# "xla" off the GPU, for the smoke run), ess_microbatched (P3O and GRPO over ESS_MICROBATCHES
# micro-batches, ess_scope "step": the statistics pass's cost); torch part: torch_train
# (eager), generate, torch_compile. All but train, decode, torch_train and generate are
# optional: by default they run if time is left.
SECTIONS = (
    "train",
    "decode",
    "grpo",
    "train_fused",
    "ess_microbatched",
    "torch_train",
    "generate",
    "torch_compile",
)


def say(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_config(s: Sizes):
    from ess_jax.model import decoder as model_lib

    return model_lib.ModelConfig(
        vocab_size=s.vocab,
        hidden_size=s.dim,
        intermediate_size=s.mlp,
        num_layers=s.layers,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
        family="qwen2",
        max_position_embeddings=32768,
        dtype="bfloat16",
    )


def train_batch(s: Sizes) -> dict:
    """bench_train's random batch, behaviour log-probs -log V + N(0, 0.3) (no model forward:
    the two sides hold different weights here, and it spares a compile)."""
    import numpy as np

    from bench.train import random_train_batch

    return random_train_batch(s, lambda tokens: np.full(tokens.shape, -math.log(s.vocab)))


def timed(fn, warmup: int, repeats: int) -> tuple[list, list[str]]:
    """(per-call results, XLA compilations while timing) of one fn: time_round_robin's rules."""
    times, compiles = time_round_robin({"fn": fn}, warmup, repeats)
    return times["fn"], compiles


# ----------------------------------------------------------------------------- ess_jax


def part_jax(s: Sizes, budget: float, save, sections=SECTIONS) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.common import one_device_mesh
    from bench.decode import jax_runner
    from bench.train import jax_trainer
    from ess_jax.model import decoder as model_lib
    from ess_jax.sampling import precision

    if s != TINY and jax.devices()[0].platform == "cpu":  # a broken CUDA plugin falls back
        raise SystemExit("bench_gpu: jax sees no GPU (jax.devices() is CPU only); not running")
    t_start, res = time.perf_counter(), {"device": str(jax.devices()[0].device_kind)}
    left = lambda: budget - (time.perf_counter() - t_start)
    res["jax"] = jax.__version__
    say(f"jax {jax.__version__} on {res['device']}: ceilings")
    mm = jax.jit(lambda a, b: jnp.matmul(a, b))
    res["gemm_tflops"] = {}
    for n in s.gemm:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)

        def twenty(a=a):
            for _ in range(20):
                y = mm(a, a)
            y.block_until_ready()

        res["gemm_tflops"][str(n)] = 20 * 2 * n**3 / median(timed(twenty, 2, 5)[0]) / 1e12
    nbytes = 2**24 if s == TINY else COPY_BYTES
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    double = jax.jit(lambda x: x * 2)
    copy_s = median(timed(lambda x=x: double(x).block_until_ready(), 2, 9)[0])
    res["copy_gbps"] = 2 * nbytes / copy_s / 1e9
    save(res)

    cfg = model_config(s)
    mesh = one_device_mesh()
    params = model_lib.init_params(cfg, 0, model_lib.param_shardings(cfg, mesh, "train"))
    res["params"] = model_lib.num_params(params)
    batch = train_batch(s)
    res["train"] = {}

    def train(obj, impl="einsum", m=1):
        name = obj + ("" if impl == "einsum" else "_fused") + ("" if m == 1 else "_mb")
        say(f"train step {name}: {s.train_batch} x {s.train_seq} tokens, {m} micro-batch(es)")
        t0 = time.perf_counter()
        run_cfg = cfg.replace(attention_impl=impl)
        step, losses = jax_trainer(run_cfg, params, mesh, batch, obj, num_microbatches=m)
        step()
        compile_s = time.perf_counter() - t0
        times, compiles = timed(step, s.warmup, s.repeats)
        res["train"][name] = {
            "seconds": times,
            "first_step_s": compile_s,
            "loss": losses[0],
            "finite": all(math.isfinite(v) for v in losses),
            "compiles_while_timed": compiles,
            "attention_impl": impl,
            "num_microbatches": m,
        }
        say(f"  {name}: {median(times) * 1e3:.1f} ms/step, loss {losses[0]:.4f}")
        save(res)

    if "train" in sections:  # then the sampler, then (time allowing) GRPO for the ESS overhead
        train("p3o")
    sample_params = precision.prepare_fn("bfloat16")(params)
    sample_cfg = cfg.replace(dtype="bfloat16")
    from bench.common import left_padded_prompts

    res["decode"] = {}
    for b in s.decode_batches if "decode" in sections else ():
        say(f"sampler batch {b}: {s.prompt}-token prompts, {s.gen} new tokens (compiling)")
        prompts, mask = left_padded_prompts(b, s.prompt, s.vocab, seed=b)
        run = jax_runner(sample_cfg, sample_params, prompts, mask, s.gen, "sampled")
        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        rounds, compiles = timed(run, s.warmup, s.repeats)
        res["decode"][str(b)] = {
            "rounds": rounds,
            "first_call_s": compile_s,
            "compiles_while_timed": compiles,
        }
        say(f"  decode {median([r['decode'] for r in rounds]) / (s.gen - 1) * 1e3:.2f} ms/step")
        save(res)
    del sample_params
    if wanted(sections, "grpo", left() > 0.4 * budget):
        train("grpo")
    else:
        say(f"skipping the GRPO train step: {left():.0f} s left")
    if wanted(sections, "train_fused", left() > 0.4 * budget):  # cuDNN attention vs einsum
        train("p3o", "cudnn" if jax.devices()[0].platform == "gpu" else "xla")
    else:
        say(f"skipping the fused-attention train step: {left():.0f} s left")
    if wanted(sections, "ess_microbatched", left() > 0.4 * budget):  # the statistics pass
        for obj in ("p3o", "grpo"):
            train(obj, m=ESS_MICROBATCHES)
    else:
        say(f"skipping the micro-batched train steps: {left():.0f} s left")
    return res


# ----------------------------------------------------------------------------- torch


def hf_qwen2(s: Sizes, device: str):
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        **{**hf_shape(s), "tie_word_embeddings": True},
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Qwen2ForCausalLM(cfg).eval()


def part_torch(s: Sizes, budget: float, compile_torch: bool, save, sections=SECTIONS) -> dict:
    import torch

    from bench.common import left_padded_prompts
    from bench.decode import hf_runner
    from bench.train import torch_trainer

    t_start = time.perf_counter()
    left = lambda: budget - (time.perf_counter() - t_start)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    say(f"torch {torch.__version__} on {res['device']}: ceilings")
    res["gemm_tflops"] = {}
    for n in s.gemm:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)

        def twenty(a=a):
            for _ in range(20):
                torch.mm(a, a)
            sync()

        res["gemm_tflops"][str(n)] = 20 * 2 * n**3 / median(timed(twenty, 2, 5)[0]) / 1e12
    hf = hf_qwen2(s, device)
    batch = train_batch(s)
    res["train"] = {}

    def train(name, comp):
        say(f"train step {name}: {s.train_batch} x {s.train_seq} tokens")
        t0 = time.perf_counter()
        try:
            step, losses = torch_trainer(hf, batch, comp, device=device, autocast=torch.bfloat16)
            step()
        except Exception as e:  # "where it compiles": report the peer as missing, go on
            res["train"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            return
        first_s = time.perf_counter() - t0
        times, _ = timed(lambda: (step(), sync()), s.warmup, s.repeats)
        res["train"][name] = {"seconds": times, "first_step_s": first_s, "loss": losses[0]}
        say(f"  {name}: {median(times) * 1e3:.1f} ms/step, loss {losses[0]:.4f}")
        save(res)

    if "torch_train" in sections:  # then generate, then (time allowing) torch.compile
        train("torch_eager", False)
    if cuda:
        torch.cuda.empty_cache()
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)  # generate on bf16 weights, as the sampler's
    res["decode"] = {}
    for b in s.decode_batches if "generate" in sections else ():
        say(f"generate batch {b}: {s.prompt}-token prompts, {s.gen} new tokens")
        prompts, mask = left_padded_prompts(b, s.prompt, s.vocab, seed=b)
        run, _ = hf_runner(hf16, prompts, mask, s.gen, "sampled")
        # a whole generation as warm-up: on CUDA the first one also grows the caching
        # allocator through every KV-cache shape (seen: 22 s, then 7.7 s)
        res["decode"][str(b)] = {"rounds": timed(run, 1, max(2, s.repeats // 2))[0]}
        save(res)
    del hf16
    if compile_torch and wanted(sections, "torch_compile", left() > 0.4 * budget):
        train("torch_compile", True)
    else:
        say(f"skipping torch.compile: {left():.0f} s left" if compile_torch else "no compile")
    return res


def wanted(sections, name: str, time_left: bool) -> bool:
    """Whether to run an optional section: named in --sections, or (all sections asked for)
    when the part's budget still has time for it."""
    return name in sections and (time_left or set(sections) != set(SECTIONS))


def part_env(part: str) -> dict:
    """The environment of one part's process. The torch part builds its batch with jnp (the
    advantages): left to itself jax would take the GPU and preallocate 75% of its memory
    before torch allocates any, so there jax gets the CPU."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"} if part == "torch" else dict(os.environ)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: smoke run anywhere")
    ap.add_argument("--part", choices=("jax", "torch"), help="run one side (internal)")
    ap.add_argument("--json", metavar="FILE", help="write the figures and every measurement")
    ap.add_argument("--md", metavar="FILE", help="write the markdown report")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per part, soft")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma list of what to run (default all; named ones run whatever the budget)",
    )
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        ap.error(f"unknown --sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    s = TINY if args.tiny else QWEN25_1_5B
    if args.part:  # each section's results are saved as they land: a crash keeps them

        def save(res):
            with open(args.json + ".tmp", "w") as fh:
                json.dump(res, fh, indent=1)
            os.replace(args.json + ".tmp", args.json)

        if args.part == "jax":
            part_jax(s, args.budget, save, sections)
        else:
            part_torch(s, args.budget, not args.no_compile, save, sections)
        return 0
    import tempfile

    parts = {}
    with tempfile.TemporaryDirectory() as tmp:  # parts beside --json, so a killed run keeps them
        d = os.path.dirname(os.path.abspath(args.json)) if args.json else tmp
        for part in ("jax", "torch"):
            path = os.path.join(d, f"bench_gpu_{part}.json")
            cmd = [sys.executable, "-m", "bench.gpu", "--part", part, "--json", path]
            cmd += ["--budget", str(args.budget)] + ["--tiny"] * args.tiny
            cmd += ["--no-compile"] * args.no_compile + ["--sections", args.sections]
            try:  # a hung or slow part keeps what it saved; the other part still runs
                rc = subprocess.run(
                    cmd, timeout=1.5 * args.budget, env=part_env(part), cwd=ROOT
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            parts[part] = json.load(open(path)) if os.path.exists(path) else {}
            if rc:
                say(f"part {part} exited with {rc}")
    head = summarize(s, parts["jax"], parts["torch"])
    for k, v in head.items():
        print(f"{k:32s} {v:.4g}" if isinstance(v, float) else f"{k:32s} {v}")
    command = "python -m bench.gpu" + " --tiny" * args.tiny
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"headline": head, "details": parts}, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(report_md(s, parts["jax"], parts["torch"], head, command, args.tiny))
    return 0 if parts["jax"] and parts["torch"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of ess_jax against its PyTorch peers and the machine's limit, side by side.

    python -m bench                                     # full run, writes BENCHMARKS.md
    python -m bench --quick --json bench.json           # the headline ratios
    python -m bench --quick --tiny --json /tmp/b.json   # smoke run of every code path
    python -m bench --estimate [--quick]                # predicted run time, runs nothing

One run, one model: a Llama of ~32M params with random weights, built by Hugging Face and
loaded into ess_jax by its own loader (weights.load_hf), so both sides hold identical weights
(checked: the logits agree), all float32. It measures
  1. the machine's float32 matmul ceiling: GFLOP/s of square matmuls, jax and torch;
  2. the train step (forward + backward + AdamW, P3O): ess_jax's jitted step against a
     PyTorch loop over the Hugging Face model, eager and under torch.compile, on one batch;
     tokens/s and MFU = model FLOPs/s over the ceiling, with the FLOP count
     6 * N * tokens + 12 * L * H * K * T * tokens (common.train_flops);
  3. the sampler against Hugging Face `generate` (KV cache), greedy and sampled, at batch 1
     and 32: prefill and decode tokens/s, and ms per decode step at L and 2L new tokens;
  4. one full RL step taken apart (sampling, reward, old-logp pass if any, update) with P3O
     and GRPO at 1 and 4 micro-batches, and the ESS objective's overhead in it.
Every figure is a median over repeats after warm-up; calls alternate between competitors.
It prints markdown tables (ratios: ess_jax over the peer), writes them (with machine,
versions, command) into BENCHMARKS.md between its two markers on a full run, or into --md's
file (report.write_report: the rest of the file is kept), and with --json the headline ratios
(keys in report.headline: train_vs_torch, train_mfu, decode_vs_hf_b32,
decode_len_scaling, ess_overhead, ...) plus every measurement under "details".

--quick keeps the model and measures less: one matmul size, a train batch of 8 x 128
tokens, decode at batch 32 (sampled only) for 64 and 128 new tokens, an RL step of 4 prompts
x 4 samples (32 + 32 tokens) at 1 micro-batch.

Run time. `--estimate` adds up the FLOPs of every call the run makes (warm-ups included),
divided by the ceiling times an efficiency (train steps and prefill 50% of it, batch-32
decode steps 20%, batch-1 decode steps bound by reading every weight at 15 GB/s, plus
10 ms of Python per `generate` step), plus one-off compiles (20 s per jitted train step,
8 s per sampler program, 120 s for a cold torch.compile); the efficiencies are measured on
this model on a 2-core CPU. At a 150 GFLOP/s ceiling it predicts about 6 min for
--quick, 2 of them torch.compile's first (cold) compile, which inductor caches: about 4 min
on later runs. The full run: about 15 min, half of it the batch-32 decode at 128 and 256
new tokens (--set overrides any size, e.g. --set repeats=5; --estimate shows the effect).
--tiny shrinks the model and every size for a smoke run: about 1-2 min of CPU, nearly all
of it compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from bench.common import Sizes, forward_flops, matmul_params, train_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = Sizes()
QUICK = dataclasses.replace(
    FULL,
    gemm=(1024,),
    train_seq=128,
    decode_batches=(32,),
    decode_modes=("sampled",),
    gen=64,
    rl_prompts=4,
    rl_group=4,
    rl_prompt=32,
    rl_gen=32,
    microbatches=(1,),
)

# Efficiencies and one-off costs of the run-time estimate (see the module docstring).
TRAIN_EFF, DECODE_EFF = 0.5, 0.2
WEIGHT_BYTES_PER_S = 15e9
HF_STEP_OVERHEAD_S = 0.01
COMPILE_S = {"jax_step": 20.0, "jax_sampler": 8.0, "torch_compile": 120.0}


def tiny(s: Sizes) -> Sizes:
    """A 2-layer width-32 model and sizes a few tokens long, the same sections and modes."""
    return dataclasses.replace(
        s,
        dim=32,
        mlp=64,
        layers=2,
        heads=4,
        kv_heads=2,
        vocab=256,
        gemm=(64,),
        train_batch=4,
        train_seq=16,
        decode_batches=tuple(sorted({min(b, 4) for b in s.decode_batches})),
        prompt=8,
        gen=4,
        rl_prompts=2,
        rl_group=2,
        rl_prompt=8,
        rl_gen=4,
        microbatches=tuple(sorted({min(m, 2) for m in s.microbatches})),
        repeats=2,
    )


def estimate(s: Sizes, gflops: float = 150.0, compile_torch: bool = True) -> dict[str, float]:
    """Predicted seconds per section at a `gflops` ceiling (assumptions: module docstring)."""
    c = gflops * 1e9
    calls = s.warmup + s.repeats
    weight_bytes = 4 * (matmul_params(s) + s.vocab * s.dim)

    def prefill(b, p):
        return forward_flops(s, b, p, p) / (c * TRAIN_EFF)

    def step(b, keys):
        return max(
            forward_flops(s, b, 1, keys) / (c * DECODE_EFF), weight_bytes / WEIGHT_BYTES_PER_S
        )

    def train(b, t):
        return train_flops(s, b, t) / (c * TRAIN_EFF)

    est = {"gemm": sum(4 * n**3 for n in s.gemm) * (max(s.warmup, 1) + 3 * s.repeats) / c}
    peers = 3 if compile_torch else 2
    est["train"] = (
        peers * (s.warmup + 2 * s.repeats) * train(s.train_batch, s.train_seq)  # primed
        + COMPILE_S["jax_step"]
        + compile_torch * COMPILE_S["torch_compile"]
    )
    p, gen = s.prompt, s.gen
    dec = 0.0
    for b in s.decode_batches:
        for n in (gen, 2 * gen):
            jax_call = prefill(b, p) + (n - 1) * step(b, p + n)
            dec += calls * jax_call + COMPILE_S["jax_sampler"]
        hf_step = step(b, p + 2 * gen) + HF_STEP_OVERHEAD_S
        dec += s.repeats * (prefill(b, p) + (2 * gen - 1) * hf_step)
    est["decode"] = dec * len(s.decode_modes)
    rows, seq = s.rl_prompts * s.rl_group, s.rl_prompt + s.rl_gen
    sample = prefill(s.rl_prompts, s.rl_prompt) + (s.rl_gen - 1) * step(rows, seq)
    n_upd = sum(len(s.rl_objectives) + (m > 1) for m in s.microbatches)
    est["rl"] = (
        calls * (sample + n_upd * train(rows, seq))
        + COMPILE_S["jax_sampler"]
        + n_upd * COMPILE_S["jax_step"]
    )
    est["total"] = sum(est.values())
    return est


def _override(s: Sizes, assignments: list[str]) -> Sizes:
    """--set name=value (comma-separated for tuple fields), checked against Sizes' fields."""
    fields = {f.name: f for f in dataclasses.fields(Sizes)}
    kw = {}
    for a in assignments:
        name, sep, value = a.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {a!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        current = getattr(s, name)
        try:
            if not isinstance(current, tuple):
                kw[name] = int(value)
            elif isinstance(current[0], str):
                kw[name] = tuple(v.strip() for v in value.split(",") if v.strip())
            else:
                kw[name] = tuple(int(v) for v in value.split(","))
        except ValueError:
            raise SystemExit(f"--set {a!r}: {name} takes integers") from None
    try:
        return dataclasses.replace(s, **kw)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None


def parse_args(argv=None) -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced sizes: the headline ratios")
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes: a smoke run")
    ap.add_argument("--json", metavar="FILE", help="write the headline ratios (and details)")
    ap.add_argument(
        "--md", metavar="FILE", help="write the report here (default: BENCHMARKS.md on full runs)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument(
        "--single-thread",
        action="store_true",
        help="one thread for XLA and torch alike (default: each library's own, all cores)",
    )
    ap.add_argument("--estimate", action="store_true", help="print the predicted run time")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    s = _override(tiny(s) if args.tiny else s, args.set)
    if args.md is None and not (args.quick or args.tiny):
        args.md = os.path.join(ROOT, "BENCHMARKS.md")
    return args, s


def run(s: Sizes, compile_torch: bool = True) -> dict:
    """Every measurement of one run (the --json "details")."""
    import numpy as np
    import torch

    from bench.common import build_models, max_logit_diff, one_device_mesh
    from bench.decode import bench_decode
    from bench.rl import bench_rl
    from bench.train import bench_train, gemm_ceiling
    from ess_jax.model import decoder as model_lib

    load0 = os.getloadavg()[0]
    mesh = one_device_mesh()
    hf, cfg, params = build_models(s, mesh)
    probe = np.random.default_rng(0).integers(1, s.vocab, (2, min(s.train_seq, 32)))
    diff = max_logit_diff(hf, cfg, params, probe)
    if not diff <= 1e-3:
        raise RuntimeError(f"the two sides do not run the same model: max |logit diff| = {diff}")
    n_params = model_lib.num_params(params)
    say = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)
    say(f"llama, {n_params:,} params, max |logit diff| {diff:.1e}; matmul ceiling")
    res = {"gemm": gemm_ceiling(s)}
    say("train step: ess_jax, torch eager" + ("" if not compile_torch else ", torch.compile"))
    res["train"] = bench_train(hf, cfg, params, mesh, s, compile_torch)
    say("sampler vs generate")
    res["decode"] = bench_decode(hf, cfg, params, s)
    say("full RL step")
    res["rl"] = bench_rl(cfg, params, mesh, s)
    first = res["train"]["first_loss"]
    res["checks"] = {
        "logits": diff,
        "first_loss_rel": {
            k: abs(v - first["ess_jax"]) / max(abs(first["ess_jax"]), 1.0)
            for k, v in first.items()
            if k != "ess_jax"
        },
        "compiles_while_timed": sum(
            (res[k]["compiles_while_timed"] for k in ("train", "decode", "rl")), []
        ),
    }
    res["load"] = (load0, os.getloadavg()[0])
    res["params"] = n_params
    res["threads"] = f"torch {torch.get_num_threads()}, XLA " + (
        "1" if "multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "") else "all cores"
    )
    return res


def main(argv=None) -> dict:
    args, s = parse_args(argv)
    if args.estimate:
        for section, sec in estimate(s, compile_torch=not args.no_compile).items():
            print(f"{section:8s} {sec / 60:5.1f} min")
        return {}
    if args.single_thread:  # before XLA's backend starts (its first use): it reads them once
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        )
        import torch

        torch.set_num_threads(1)
    from bench.report import environment, headline, markdown, tables, write_report

    res = run(s, compile_torch=not args.no_compile)
    head = headline(res, s)
    print(tables(res, s))
    print(json.dumps(head, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**head, "sizes": dataclasses.asdict(s), "details": res}, f, indent=1)
    if args.md:
        env = environment(sys.argv[1:] if argv is None else argv)
        write_report(args.md, markdown(res, s, env, head))
        print(f"wrote {args.md}")
    return head


if __name__ == "__main__":
    main()

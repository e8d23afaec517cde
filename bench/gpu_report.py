"""bench/gpu.py's report: the headline figures from the two parts' JSON, and the
markdown written from them."""

from __future__ import annotations

from bench.common import Sizes, forward_flops, matmul_params, median, train_flops


def decode_floor_s(s: Sizes, batch: int, keys: int, gbps: float) -> float:
    """Seconds a decode step needs at least: read every bf16 matmul weight once and the K and
    V of `keys` positions per row and layer (bf16), at `gbps`."""
    kv = batch * s.layers * 2 * s.kv_heads * s.head_dim * keys * 2
    return (2 * matmul_params(s) + kv) / (gbps * 1e9)


def summarize(s: Sizes, jx: dict, th: dict) -> dict:
    """The headline figures from the two parts' JSON (missing sections give missing keys)."""
    out: dict = {}
    ceiling = max([*jx.get("gemm_tflops", {}).values(), *th.get("gemm_tflops", {}).values()])
    gbps = jx.get("copy_gbps")
    out["bf16_ceiling_tflops"], out["copy_gbps"] = ceiling, gbps
    flops, tokens = train_flops(s, s.train_batch, s.train_seq), s.train_batch * s.train_seq
    train = {k: median(v["seconds"]) for k, v in jx.get("train", {}).items()}
    peer_train = th.get("train", {}).items()
    train.update({k: median(v["seconds"]) for k, v in peer_train if "seconds" in v})
    for name, sec in train.items():
        out[f"train_{name}_tok_s"] = tokens / sec
        out[f"train_{name}_mfu"] = flops / sec / (ceiling * 1e12)
    peers = [train[k] for k in ("torch_eager", "torch_compile") if k in train]
    if "p3o" in train and peers:
        out["train_vs_torch"] = min(peers) / train["p3o"]
    if "p3o" in train and "grpo" in train:
        out["ess_overhead"] = train["p3o"] / train["grpo"] - 1
    if "p3o_mb" in train and "grpo_mb" in train:  # several micro-batches: the statistics pass
        out["ess_overhead_mb"] = train["p3o_mb"] / train["grpo_mb"] - 1
    if "p3o" in train and "p3o_fused" in train:  # above 1: the fused attention is faster
        out["fused_attention_speedup"] = train["p3o"] / train["p3o_fused"]
    for b in s.decode_batches:
        jd, hd = jx.get("decode", {}).get(str(b)), th.get("decode", {}).get(str(b))
        if jd:
            step = median([r["decode"] for r in jd["rounds"]]) / (s.gen - 1)
            prefill = median([r["prefill"] for r in jd["rounds"]])
            out[f"decode_b{b}_ms"] = step * 1e3
            out[f"decode_b{b}_tok_s"] = b / step
            out[f"prefill_b{b}_mfu"] = (
                forward_flops(s, b, s.prompt, s.prompt) / prefill / (ceiling * 1e12)
            )
            if gbps:  # keys read: the segment bound, the sampler attends up to it
                floor = decode_floor_s(s, b, s.prompt + s.gen, gbps)
                out[f"decode_b{b}_floor_ms"] = floor * 1e3
                out[f"decode_b{b}_of_bandwidth"] = floor / step
        if hd:
            hstep = median([r[f"decode@{s.gen}"] for r in hd["rounds"]]) / (s.gen - 1)
            out[f"hf_decode_b{b}_ms"] = hstep * 1e3
            if jd:
                out[f"decode_vs_hf_b{b}"] = hstep / step
    return out


def report_md(s: Sizes, jx: dict, th: dict, head: dict, command: str, tiny: bool) -> str:
    """The markdown report of one run (BENCHMARKS_GPU.md's tables come from it)."""
    f = lambda k, spec: format(head[k], spec) if k in head else "n/a"
    name = "a tiny smoke model" if tiny else "Qwen2.5-1.5B's dimensions"
    decodes = jx.get("decode", {}).items()
    b = s.decode_batches[-1]
    fused = jx.get("train", {}).get("p3o_fused", {}).get("attention_impl", "the fused kernel")
    mb = jx.get("train", {}).get("p3o_mb", {}).get("num_microbatches", "M")
    lines = [
        "# GPU benchmark (bench/gpu.py)",
        "",
        f"Command: `{command}`. Device: {jx.get('device', '?')}; jax {jx.get('jax', '?')}, "
        f"torch {th.get('torch', '?')}. Model: {name} ({s.layers} layers, "
        f"width {s.dim}, MLP {s.mlp}, {s.heads}/{s.kv_heads} heads, vocab {s.vocab}, tied "
        f"embeddings), random init, {jx.get('params', 0):,} params, float32 masters, bfloat16 "
        "compute. Medians over "
        f"{s.repeats} timed calls after {s.warmup} warm-ups.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| bf16 matmul ceiling, measured (TFLOP/s) | {f('bf16_ceiling_tflops', '.0f')} |",
        f"| copy bandwidth, measured (GB/s) | {f('copy_gbps', '.0f')} |",
        f"| train step ess_jax P3O, {s.train_batch} x {s.train_seq} (tok/s) "
        f"| {f('train_p3o_tok_s', ',.0f')} |",
        f"| train MFU ess_jax (of the measured ceiling) | {f('train_p3o_mfu', '.1%')} |",
        f"| train step torch eager (tok/s, MFU) | {f('train_torch_eager_tok_s', ',.0f')}, "
        f"{f('train_torch_eager_mfu', '.1%')} |",
        f"| train step torch.compile (tok/s, MFU) | {f('train_torch_compile_tok_s', ',.0f')}, "
        f"{f('train_torch_compile_mfu', '.1%')} |",
        f"| ess_jax train over best torch peer | {f('train_vs_torch', '.2f')}x |",
        f"| ESS overhead, P3O over GRPO step - 1 | {f('ess_overhead', '+.1%')} |",
        f"| ESS overhead at {mb} micro-batches (step scope), P3O over GRPO - 1 "
        f"| {f('ess_overhead_mb', '+.1%')} |",
        f"| P3O step, einsum attention over {fused} (above 1: fused faster) "
        f"| {f('fused_attention_speedup', '.2f')}x |",
        f"| decode batch {b}, ess_jax (ms/step, tok/s) | {f(f'decode_b{b}_ms', '.2f')}, "
        f"{f(f'decode_b{b}_tok_s', ',.0f')} |",
        f"| decode bandwidth floor (ms/step) and fraction reached "
        f"| {f(f'decode_b{b}_floor_ms', '.2f')}, {f(f'decode_b{b}_of_bandwidth', '.1%')} |",
        f"| decode batch {b}, HF generate (ms/step) | {f(f'hf_decode_b{b}_ms', '.2f')} |",
        f"| ess_jax decode over generate | {f(f'decode_vs_hf_b{b}', '.2f')}x |",
        f"| prefill MFU, batch {b} x {s.prompt} | {f(f'prefill_b{b}_mfu', '.1%')} |",
        "",
        "First calls (compile included), seconds: "
        + ", ".join(
            f"{k} {v['first_step_s']:.0f}"
            for part in (jx, th)
            for k, v in part.get("train", {}).items()
            if "first_step_s" in v
        )
        + "".join(f", sampler b{k} {v['first_call_s']:.0f}" for k, v in decodes)
        + ".",
        "",
    ]
    return "\n".join(lines)

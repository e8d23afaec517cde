"""Part of bench/cpu.py: the headline ratios (its --json), the tables it prints, and its part
of BENCHMARKS.md (machine, versions, command, tables), written between BEGIN and END so that
the hand-written rest of that file stays as it is."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

from bench.common import Sizes, paired

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ceiling_gflops(res: dict) -> float:
    """The machine's float32 matmul ceiling: the best median over libraries and sizes."""
    return max(v for lib in res["gemm"].values() for v in lib.values())


def _decode_at(res: dict, s: Sizes, mode: str, b: int) -> dict:
    """Seconds per decode step ("jax@n", "hf@n") and prefill seconds, for n in (L, 2L)."""
    d = res["decode"]["results"][mode][str(b)]
    out = {}
    for n in (s.gen, 2 * s.gen):
        out[f"jax@{n}"] = d[f"ess_jax@{n}"]["decode"] / (n - 1)
        out[f"hf@{n}"] = d["hf"][f"decode@{n}"] / (n - 1)
        out[f"jax_prefill@{n}"] = d[f"ess_jax@{n}"]["prefill"]
    out["hf_prefill"] = d["hf"]["prefill"]
    return out


def _decode_paired(res: dict, s: Sizes, mode: str, b: int) -> dict:
    """Paired ratios (`paired`) at one mode and batch: "decode@n" and "prefill" are
    generate's time over the sampler's (> 1: ess_jax ahead); "growth" and "hf_growth" each
    side's time per decode step at 2L over L."""
    r = res["decode"]["rounds"][mode][str(b)]
    L, two_l = s.gen, 2 * s.gen
    jax_l, jax_2l = r[f"ess_jax@{L}"], r[f"ess_jax@{two_l}"]
    per_step = {n: [x["decode"] / (n - 1) for x in r[f"ess_jax@{n}"]] for n in (L, two_l)}
    out = {
        f"decode@{n}": paired([h[f"decode@{n}"] for h in r["hf"]], [x["decode"] for x in jx])
        for n, jx in ((L, jax_l), (two_l, jax_2l))
    }  # both sides' times are over the same n - 1 decode steps
    out["prefill"] = paired([h["prefill"] for h in r["hf"]], [x["prefill"] for x in jax_l])
    out["growth"] = paired(per_step[two_l], per_step[L])
    out["hf_growth"] = paired(
        [h[f"decode@{two_l}"] / (two_l - 1) for h in r["hf"]],
        [h[f"decode@{L}"] / (L - 1) for h in r["hf"]],
    )
    return out


def _train_paired(tr: dict, peers) -> float:
    """ess_jax's speed over the fastest of `peers` in each round, median over rounds."""
    rounds = tr["rounds"]
    best = [min(ts) for ts in zip(*(rounds[p] for p in peers), strict=True)]
    return paired(best, rounds["ess_jax"])


def headline(res: dict, s: Sizes) -> dict:
    """The --json ratios, each paired by round (`paired`). train_vs_torch: ess_jax train
    tokens/s over the best PyTorch peer's (torch.compile where it compiled; in each round the
    faster peer); train_mfu: ess_jax's model FLOPs/s (median) over the ceiling;
    decode_vs_hf_b32: sampler decode tokens/s over `generate`'s at the largest decode batch
    (32 unless --tiny), sampled if measured, budget 2L; decode_len_scaling: the sampler's
    time per decode step at 2L over L there; ess_overhead: P3O full RL step time over
    GRPO's - 1 at the fewest micro-batches (ess_overhead_m<M> at each other count)."""
    tr = res["train"]["seconds"]
    peers = {k: v for k, v in tr.items() if k != "ess_jax"}
    mode = "sampled" if "sampled" in s.decode_modes else s.decode_modes[0]
    d = _decode_paired(res, s, mode, max(s.decode_batches))
    two_l = 2 * s.gen
    ms = sorted(s.microbatches)
    out = {
        "train_vs_torch": _train_paired(res["train"], peers),
        "train_mfu": res["train"]["flops_per_step"] / tr["ess_jax"] / (ceiling_gflops(res) * 1e9),
        "decode_vs_hf_b32": d[f"decode@{two_l}"],
        "decode_len_scaling": d["growth"],
        "ess_overhead": res["rl"]["ess_overhead"][str(ms[0])]["step"],
    }
    out.update({f"ess_overhead_m{m}": res["rl"]["ess_overhead"][str(m)]["step"] for m in ms[1:]})
    out["train_vs_torch_eager"] = _train_paired(res["train"], ["torch_eager"])
    return out


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def tables(res: dict, s: Sizes) -> str:
    """The results as markdown tables: ratios are ess_jax over the peer (> 1: ess_jax ahead),
    paired by round (`paired`); the other figures are medians."""
    lines = [_row("what", "ess_jax", "peer", "ratio"), _row(*["---"] * 4)]
    for n, jax_gf in res["gemm"]["jax"].items():
        torch_gf = res["gemm"]["torch"][n]
        lines.append(
            _row(
                f"float32 GEMM, {n}^2",
                f"{jax_gf:.3g} GFLOP/s",
                f"torch {torch_gf:.3g}",
                f"{jax_gf / torch_gf:.2f}",
            )
        )
    ceiling = ceiling_gflops(res) * 1e9
    tr = res["train"]
    tokens, flops = tr["tokens_per_step"], tr["flops_per_step"]
    jt = tr["seconds"]["ess_jax"]
    what = f"train step, {s.train_batch} x {s.train_seq} tokens, P3O + AdamW"
    ours = f"{tokens / jt:,.0f} tok/s, MFU {flops / jt / ceiling:.0%}"
    for peer, label in (("torch_eager", "torch eager"), ("torch_compile", "torch.compile")):
        if peer in tr["seconds"]:
            t = tr["seconds"][peer]
            mfu = flops / t / ceiling
            peer_s = f"{label} {tokens / t:,.0f} tok/s, MFU {mfu:.0%}"
            lines.append(_row(what, ours, peer_s, f"{_train_paired(tr, [peer]):.2f}"))
        elif peer in tr["errors"]:
            lines.append(_row(what, ours, f"{label}: failed ({tr['errors'][peer][:80]})", ""))
        what = ours = ""
    for mode in s.decode_modes:
        for b in s.decode_batches:
            d, pr = _decode_at(res, s, mode, b), _decode_paired(res, s, mode, b)
            ptok = b * s.prompt
            lines.append(
                _row(
                    f"prefill, {mode}, batch {b} x {s.prompt} tokens",
                    f"{ptok / d[f'jax_prefill@{s.gen}']:,.0f} tok/s "
                    f"(budget 2L: {ptok / d[f'jax_prefill@{2 * s.gen}']:,.0f})",
                    f"generate {ptok / d['hf_prefill']:,.0f} tok/s",
                    f"{pr['prefill']:.2f}",
                )
            )
            for n in (s.gen, 2 * s.gen):
                j, h = d[f"jax@{n}"], d[f"hf@{n}"]
                lines.append(
                    _row(
                        f"decode, {mode}, batch {b}, {n} new tokens",
                        f"{b / j:,.0f} tok/s, {1e3 * j:.1f} ms/step",
                        f"generate {b / h:,.0f} tok/s, {1e3 * h:.1f} ms/step",
                        f"{pr[f'decode@{n}']:.2f}",
                    )
                )
            two_l = 2 * s.gen
            lines.append(
                _row(
                    f"decode ms/step at {two_l} over {s.gen} new tokens, {mode}, batch {b}",
                    f"{pr['growth']:.2f}",
                    f"generate {pr['hf_growth']:.2f}",
                    "",
                )
            )
    rl = res["rl"]
    parts = ("sampling", "reward", "old_logp", "update", "step")
    lines += [
        "",
        _row(
            f"RL step, {s.rl_prompts} prompts x {s.rl_group} samples, prompt {s.rl_prompt}, "
            f"{s.rl_gen} new tokens (ms)",
            *parts,
            "sampling share",
        ),
        _row(*["---"] * (len(parts) + 2)),
    ]
    for label, p in rl["parts"].items():
        lines.append(
            _row(label, *(f"{1e3 * p[k]:.0f}" for k in parts), f"{p['sampling'] / p['step']:.0%}")
        )
    lines += ["", _row("ESS objective overhead, P3O / GRPO - 1", "full RL step", "update only")]
    lines.append(_row(*["---"] * 3))
    for m, o in rl["ess_overhead"].items():
        lines.append(_row(f"{m} micro-batch(es)", f"{o['step']:+.1%}", f"{o['update']:+.1%}"))
    lines += ["", _row("check", "value"), _row("---", "---")]
    chk = res["checks"]
    lines.append(
        _row("max abs logit diff, torch vs ess_jax (same weights)", f"{chk['logits']:.1e}")
    )
    for peer, rel in chk["first_loss_rel"].items():
        lines.append(
            _row(f"first-step loss, {peer} vs ess_jax: abs diff / max(1, loss)", f"{rel:.1e}")
        )
    lines.append(_row("XLA compilations while timing", len(chk["compiles_while_timed"])))
    return "\n".join(lines)


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "not installed"


def environment(argv: list[str]) -> dict:
    """Machine, library versions, commit and load: what a reader needs to trust the table."""
    import jax

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    libs = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "jax_devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in libs},
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "-m", "bench", *argv]),
    }


def markdown(res: dict, s: Sizes, env: dict, head: dict) -> str:
    """The run's part of the report (`write_report` puts it in place)."""
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    return f"""Written by `python -m bench` (bench/cpu.py), which replaces this part on every full
run and keeps the rest of the file; rerun the command below on a quiet machine. Both sides run
the same Llama weights (initialised by Hugging Face, loaded by ess_jax's loader) on the same
batches, in float32; every figure is a median over {s.repeats} repeats after {s.warmup} warm-up
call(s), the competitors taking turns in each round. Ratios are ess_jax over the peer (above
1: ess_jax ahead), each the median of its per-round ratios, so that a change of machine speed
between rounds cancels.

- command: `{env["command"]}`
- commit: {env["commit"]}; date: {env["date"]}
- machine: {env["cpu"]}, {env["cores"]} cores; {env["platform"]}; JAX {env["jax_devices"]}
- load average (1 min) at start / end: {res["load"][0]:.2f} / {res["load"][1]:.2f}
- versions: Python {env["python"]}, {vers}
- model: Llama, {res["params"]:,} params (D={s.dim} F={s.mlp} L={s.layers} \
H={s.heads} N={s.kv_heads} V={s.vocab}); threads: {res["threads"]}

{tables(res, s)}

Headline ratios (the `--json` output):

```json
{json.dumps(head, indent=1)}
```
"""


BEGIN = "<!-- python -m bench writes from here to the END marker; the rest is hand-written -->"
END = "<!-- END of the part python -m bench writes -->"


def write_report(path: str, generated: str) -> None:
    """Writes a run's part of the report (`markdown`) into `path` between BEGIN and END, keeping
    what the file holds around them (BENCHMARKS.md's hand-written sections); a file without
    both markers is replaced by a title and the run's part."""
    block = f"{BEGIN}\n{generated.strip()}\n{END}"
    text = open(path).read() if os.path.exists(path) else ""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    out = head + block + tail if begin and end else f"# Benchmarks\n\n{block}\n"
    with open(path, "w") as f:
        f.write(out)

"""Part of bench/cpu.py: the ess_jax sampler (jitted prefill + while_loop decode) against
Hugging Face `generate` (KV cache) on the same model and weights, greedy and sampled.

Both sides generate exactly the requested number of tokens (no stop token), from the same
left-padded prompts. ess_jax: its own jitted prefill (prompt forward, KV cache allocation,
token 0) and decode (tokens 1..n-1, with the cache's growth between decode segments) are
timed apart, at generation budgets L and 2L, since the sampler's decode segments follow the
budget. `generate` is timed from inside by a logits processor that stamps the clock after
every forward (the first right after the prompt's); it runs 2L tokens once per repeat and its
budget-L figures are the stamps of its first L steps (its cache grows with the tokens
generated, so a budget-L call does exactly those).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bench.common import Sizes, left_padded_prompts, median, time_round_robin
from ess_jax.data import bucket_width
from ess_jax.sampling import decode as decode_lib
from ess_jax.sampling import sampler


def runner_static(n: int, mode: str) -> decode_lib.Static:
    """The sampler programs' static configuration jax_runner compiles (bench/gpu_lower.py
    lowers the same): `n` new tokens, one sample, "greedy" or "sampled", no truncation, no
    stop token."""
    return decode_lib.Static(
        max_new_tokens=n,
        num_samples=1,
        greedy=mode == "greedy",
        top_k=0,
        use_top_p=False,
        stop_ids=(),
        pad_id=0,
    )


def jax_runner(cfg, params, prompts, mask, n: int, mode: str):
    """A call that prefills and decodes `n` tokens; returns {"prefill": s, "decode": s}."""
    b, p = prompts.shape
    pb = bucket_width(p)  # the prompt bucket a PromptBatcher would pad to
    toks = jnp.pad(jnp.asarray(prompts), ((0, 0), (pb - p, 0)))
    msk = jnp.pad(jnp.asarray(mask), ((0, 0), (pb - p, 0)))
    prefill, decode = sampler.programs(cfg, runner_static(n, mode), None)
    one, rng = jnp.float32(1.0), jax.random.key(0)

    def run():
        t0 = time.perf_counter()
        s = jax.block_until_ready(prefill(params, toks, msk, rng, one, one))
        t1 = time.perf_counter()
        out = jax.block_until_ready(decode(params, s, one, one))  # donates s
        t2 = time.perf_counter()
        if int(out.step) != n or not bool(out.mask.all()):
            raise RuntimeError(f"ess_jax sampler stopped at {int(out.step)} of {n} tokens")
        return {"prefill": t1 - t0, "decode": t2 - t1}

    return run


def hf_runner(hf, prompts, mask, n: int, mode: str):
    """(run, warm): `run` generates `n` tokens and returns {"prefill": s, "decode@k": s} for
    k = n // 2 and n (decode@k: the k - 1 forwards after the prompt's); `warm` generates 2.
    On `hf`'s device; on CUDA each stamp waits for the forward's kernels to finish."""
    import numpy as np
    import torch
    import transformers

    device = next(hf.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.tensor(np.asarray(prompts) * np.asarray(mask), dtype=torch.long, device=device)
    am = torch.tensor(np.asarray(mask), dtype=torch.long, device=device)
    how = {"do_sample": False}
    if mode == "sampled":  # temperature 1 over the whole vocabulary, as the ess_jax sampler
        how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}

    class Stamp(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            sync()
            self.times.append(time.perf_counter())
            return scores

    def generate(k):
        stamp = Stamp()
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=am,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=0,
                logits_processor=transformers.LogitsProcessorList([stamp]),
                **how,
            )
        if out.shape[1] != ids.shape[1] + k or len(stamp.times) != k:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} of {k} tokens")
        return t0, stamp.times

    def run():
        t0, times = generate(n)
        return {
            "prefill": times[0] - t0,
            f"decode@{n // 2}": times[n // 2 - 1] - times[0],
            f"decode@{n}": times[-1] - times[0],
        }

    return run, lambda: generate(2)


def bench_decode(hf, cfg, params, s: Sizes) -> dict:
    """{mode: {batch: {"ess_jax@n" | "hf": {part: median s}}}} for n in (L, 2L), the same
    per round ("rounds": lists instead of medians), and the names of XLA compilations while
    timing (none expected)."""
    out, rounds, all_compiles = {}, {}, []
    L = s.gen
    for mode in s.decode_modes:
        out[mode], rounds[mode] = {}, {}
        for b in s.decode_batches:
            prompts, mask = left_padded_prompts(b, s.prompt, s.vocab, seed=b)
            hf_run, hf_warm = hf_runner(hf, prompts, mask, 2 * L, mode)
            fns = {
                f"ess_jax@{n}": jax_runner(cfg, params, prompts, mask, n, mode) for n in (L, 2 * L)
            }
            fns["hf"] = hf_run
            times, compiles = time_round_robin(fns, s.warmup, s.repeats, warm={"hf": hf_warm})
            all_compiles += compiles
            rounds[mode][str(b)] = times
            out[mode][str(b)] = {
                name: {part: median([r[part] for r in rs]) for part in rs[0]}
                for name, rs in times.items()
            }
    return {"results": out, "rounds": rounds, "compiles_while_timed": all_compiles}

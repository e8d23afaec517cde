"""Sampler throughput: ess_jax (jit prefill + while_loop decode) vs Hugging Face PyTorch
`generate` on the same Llama architecture and weights, on this machine's CPU.

    .venv/bin/python tools/bench_sampler.py                      # ~33M params, batch 8
    .venv/bin/python tools/bench_sampler.py --layers 4 --batch 4 --gen 16

Reports prefill tokens/s (prompt tokens / prefill time), decode tokens/s (generated tokens
/ decode time) and the decode time per token at generated lengths L and 2L, which a KV
cache keeps flat. Both sides run float32, greedy, no stop token (every row generates
exactly the requested length), after a warm-up run (JAX compile, PyTorch allocator).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ess_jax import model, sampler, weights  # noqa: E402


def _best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _hf_model(args):
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.dim // args.heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def bench_jax(cfg, params, prompts, mask, gen, repeats):
    """(prefill s, {L: decode s}) from the sampler's own jitted prefill and decode."""
    b, p = prompts.shape
    pb = sampler.bucket_length(p)
    toks = jnp.asarray(np.pad(prompts, ((0, 0), (pb - p, 0))))
    msk = jnp.asarray(np.pad(mask, ((0, 0), (pb - p, 0))))
    one, rng = jnp.float32(1.0), jax.random.key(0)
    prefill_s, decode_s = None, {}
    for length in gen:
        st = sampler._Static(max_new_tokens=length, num_samples=1, greedy=True, top_k=0,
                             use_top_p=False, stop_ids=(), pad_id=0)
        prefill, decode = sampler._compiled(cfg, st, None)

        def run_prefill(prefill=prefill):
            return jax.block_until_ready(prefill(params, toks, msk, rng, one, one))

        def run_decode(decode=decode, run_prefill=run_prefill):
            s = run_prefill()  # fresh state: decode donates it
            t0 = time.perf_counter()
            out = jax.block_until_ready(decode(params, s, one, one))
            assert int(out.step) == length and bool(out.mask.all())
            return time.perf_counter() - t0

        run_decode()  # compile both
        pf = _best(run_prefill, repeats)
        prefill_s = pf if prefill_s is None else min(prefill_s, pf)
        decode_s[length] = min(run_decode() for _ in range(repeats))
    return prefill_s, decode_s


def bench_hf(hf, prompts, mask, gen, repeats):
    """(prefill s, {L: decode s}): prefill = generate(1 token); decode = the rest."""
    import torch

    ids = torch.tensor(prompts * mask, dtype=torch.long)
    am = torch.tensor(mask, dtype=torch.long)

    def generate(n):
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=am, do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n

    generate(2)  # warm-up
    prefill_s = _best(lambda: generate(1), repeats)
    return prefill_s, {n: max(_best(lambda n=n: generate(n), repeats) - prefill_s, 1e-9)
                       for n in gen}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--mlp", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32, help="L; also measured at 2L")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    hf = _hf_model(args)
    with tempfile.TemporaryDirectory() as d:  # the real loader, so both run identical weights
        hf.save_pretrained(d)
        cfg, params = weights.load_hf(d)
    n_params = model.num_params(params)

    rs = np.random.RandomState(0)
    lens = rs.randint(args.prompt // 2, args.prompt + 1, args.batch)
    lens[0] = args.prompt
    mask = np.arange(args.prompt)[None] >= (args.prompt - lens)[:, None]  # left padding
    prompts = np.where(mask, rs.randint(1, args.vocab, (args.batch, args.prompt)), 0)
    prompts = prompts.astype(np.int32)
    gen = (args.gen, 2 * args.gen)

    print(f"model: llama {n_params / 1e6:.1f}M params (D={args.dim} F={args.mlp} "
          f"L={args.layers} H={args.heads} N={args.kv_heads} V={args.vocab}), float32; "
          f"batch {args.batch}, prompt {args.prompt} (left-padded, {mask.sum()} real tokens), "
          f"greedy; {jax.device_count()} JAX CPU device(s), torch threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.1f}")
    results = {"ess_jax": bench_jax(cfg, params, prompts, mask, gen, args.repeats),
               "hf_torch": bench_hf(hf, prompts, mask, gen, args.repeats)}
    prompt_tokens = args.batch * args.prompt  # both sides compute the padded prompt
    hdr = (f"{'':10s} {'prefill tok/s':>14s} {'decode tok/s (2L)':>18s} "
           f"{'ms/token @L=' + str(gen[0]):>16s} {'ms/token @2L=' + str(gen[1]):>17s}")
    print(hdr)
    for name, (pf, dec) in results.items():
        # JAX decode runs tokens 1..L-1 (token 0 comes out of prefill); HF's rest is L-1 too
        per_tok = {n: dec[n] / (n - 1) for n in gen}
        print(f"{name:10s} {prompt_tokens / pf:14.0f} "
              f"{args.batch / per_tok[gen[1]]:18.0f} {1e3 * per_tok[gen[0]]:16.2f} "
              f"{1e3 * per_tok[gen[1]]:17.2f}")
    print("(ms/token = wall time of one decode step for the whole batch)")


if __name__ == "__main__":
    main()

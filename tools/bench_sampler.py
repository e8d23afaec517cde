"""Sampler throughput: ess_jax (jit prefill + while_loop decode) vs Hugging Face PyTorch
`generate` on the same Llama architecture and weights, on this machine's CPU.

    .venv/bin/python tools/bench_sampler.py                      # ~33M params, batch 8
    .venv/bin/python tools/bench_sampler.py --layers 4 --batch 4 --gen 16

Reports prefill tokens/s (prompt tokens / prefill time), decode tokens/s (generated tokens
/ decode time) and the decode time per token at generated lengths L and 2L, which a KV
cache keeps flat. Both sides run float32, greedy, no stop token (every row generates
exactly the requested length), after a warm-up run (JAX compile, PyTorch allocator), best
of --repeats. HF is timed inside `generate` by a logits processor that stamps the clock
after every forward. Default: one thread each (--threads).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def bench_jax(cfg, params, prompts, mask, gen, repeats):
    """(prefill s, {L: decode s}) from the sampler's own jitted prefill and decode."""
    import jax
    import jax.numpy as jnp

    from ess_jax import sampler

    b, p = prompts.shape
    pb = sampler.bucket_length(p)
    toks = jnp.asarray(np.pad(prompts, ((0, 0), (pb - p, 0))))
    msk = jnp.asarray(np.pad(mask, ((0, 0), (pb - p, 0))))
    one, rng = jnp.float32(1.0), jax.random.key(0)
    prefill_s, decode_s = None, {}
    for length in gen:
        st = sampler._Static(
            max_new_tokens=length,
            num_samples=1,
            greedy=True,
            top_k=0,
            use_top_p=False,
            stop_ids=(),
            pad_id=0,
        )
        prefill, decode = sampler._compiled(cfg, st, None)

        def run_prefill(prefill=prefill):
            return jax.block_until_ready(prefill(params, toks, msk, rng, one, one))

        def run_decode(decode=decode, run_prefill=run_prefill, length=length):
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
    """(prefill s, {L: decode s}) of `generate`, timed from inside it: a logits processor
    stamps the clock after every forward (the first right after the prompt's)."""
    import torch
    import transformers

    ids = torch.tensor(prompts * mask, dtype=torch.long)
    am = torch.tensor(mask, dtype=torch.long)

    class Stamp(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(n):
        stamp = Stamp()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=am,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                logits_processor=transformers.LogitsProcessorList([stamp]),
            )
        assert out.shape[1] == ids.shape[1] + n and len(stamp.times) == n
        return stamp.times[0] - t0, stamp.times[-1] - stamp.times[0]

    generate(2)  # warm-up
    prefill_s, decode_s = float("inf"), {}
    for n in gen:
        runs = [generate(n) for _ in range(repeats)]
        prefill_s = min([prefill_s] + [r[0] for r in runs])
        decode_s[n] = min(r[1] for r in runs)
    return prefill_s, decode_s


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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 also makes XLA single-threaded (on a busy 2-core machine "
        "torch's OpenMP threads spin and its timings become meaningless with 2)",
    )
    args = ap.parse_args()
    # the same thread budget for both: XLA's CPU intra-op pool and torch's
    if args.threads == 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        )
    import jax
    import torch

    from ess_jax import model, weights

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

    print(
        f"model: llama {n_params / 1e6:.1f}M params (D={args.dim} F={args.mlp} "
        f"L={args.layers} H={args.heads} N={args.kv_heads} V={args.vocab}), float32; "
        f"batch {args.batch}, prompt {args.prompt} (left-padded, {mask.sum()} real tokens), "
        f"greedy; {jax.device_count()} JAX CPU device(s), {args.threads} thread(s) each; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results = {
        "ess_jax": bench_jax(cfg, params, prompts, mask, gen, args.repeats),
        "hf_torch": bench_hf(hf, prompts, mask, gen, args.repeats),
    }
    prompt_tokens = args.batch * args.prompt  # both sides compute the padded prompt
    hdr = (
        f"{'':10s} {'prefill tok/s':>14s} {'decode tok/s (2L)':>18s} "
        f"{'ms/token @L=' + str(gen[0]):>16s} {'ms/token @2L=' + str(gen[1]):>17s}"
    )
    print(hdr)
    for name, (pf, dec) in results.items():
        # JAX decode runs tokens 1..L-1 (token 0 comes out of prefill); HF's rest is L-1 too
        per_tok = {n: dec[n] / (n - 1) for n in gen}
        print(
            f"{name:10s} {prompt_tokens / pf:14.0f} "
            f"{args.batch / per_tok[gen[1]]:18.0f} {1e3 * per_tok[gen[0]]:16.2f} "
            f"{1e3 * per_tok[gen[1]]:17.2f}"
        )
    print("(ms/token = wall time of one decode step for the whole batch)")


if __name__ == "__main__":
    main()

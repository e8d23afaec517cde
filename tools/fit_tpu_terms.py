"""Fits the train step's coefficients of ess_jax/memory/tpu_terms.py (TPU_COEF's update, stash,
embedding, logits, logits_splash, moe_rows, no_remat_stash, no_remat_attention) to the TPU
compiler's RL steps, and prints them with each compile's error in sample and left out of the
fit:

    .venv/bin/python tools/fit_tpu_terms.py

Reads the `rl_step` of every record in results/tpu/ (paper configs, tools/compile_tpu.py) and
results/tpu_fit/ (smaller models: `model` is the config.json over `model_base`, `config` the
dotted settings over config/defaults.py's base_config); a record's `role` is "fit" (the
default) or "held-out". Per compile, each term's basis is the planner's train-step term
(planner.plan on the record's device and device count) with its coefficient at 1, and the target
the compiler's bytes less the step's arguments (its outputs alias them): the bytes the terms
stand for. Least squares weighted by 1 / target (relative errors) over the "fit" compiles: the
four dense terms over the dense models' steps with einsum attention, then `moe_rows` over the
mixture-of-experts ones, `logits_splash` (the LM head's term with splash attention, which
writes none of the einsum path's chunk scores that `logits` carries) over the splash ones and
the two no-remat terms over the steps without `model.remat`, each with the dense four fixed; a
held-out compile is not fitted. Errors are (arguments + the
terms at the coefficients - compiler) / compiler. Plans only, compiles nothing (seconds).

`--phases` fits, instead, the step as a peak over two phases, over every RL step with remat
(the mixture-of-experts ones and the held-out compiles included): arguments + update + stash +
max(embedding + logits, attention + feed_forward), the LM head's backward against one
layer's recomputed backward, `attention` its einsum chunk's float32 scores (r H C T 4; none
with splash), `feed_forward` its activations (r T F b, terms.ffn_width). It prints each
compile's error in sample and left out (leave-one-out). docs/tpu.md reports why the planner
does not use it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tools")):
    if path not in sys.path:  # config files import configs.*; plan_memory is a tool
        sys.path.insert(0, path)

import numpy as np  # noqa: E402
import scipy.optimize  # noqa: E402

from ess_jax.config import names  # noqa: E402
from ess_jax.config.defaults import base_config  # noqa: E402
from ess_jax.config.presets import KNOWN_MODELS  # noqa: E402
from ess_jax.memory import planner, terms, tpu_terms  # noqa: E402
from ess_jax.parallel import sharding  # noqa: E402
from ess_jax.rl import packed  # noqa: E402

# TPU_COEF's key -> the name of its term in the planner's train-step phase
TERMS = {
    "update": "update",
    "stash": "activations (remat: block inputs)",
    "embedding": "embedding (gathered, its gradient)",
    "logits": "logits",
    "logits_splash": "logits",  # the same term of a step with splash attention
    "moe_rows": "dispatched rows (one MoE block)",
    "no_remat_stash": "activations (no remat: every layer's)",
    "no_remat_attention": "attention (one layer's backward)",
}
MOE = ("moe_rows",)  # fitted over the mixture-of-experts steps
NO_REMAT = ("no_remat_stash", "no_remat_attention")  # fitted over the steps without remat
SPLASH = ("logits_splash",)  # fitted over the steps with splash attention
DENSE = ("update", "stash", "embedding", "logits")  # fitted together over the dense steps


def record_config(record: dict, folder: str):
    """The config of `record`: its --config spec (results/tpu), or base_config with its dotted
    settings and its model's config.json written to `folder` (results/tpu_fit)."""
    if "model" not in record:
        import compile_tpu
        import plan_memory

        config = plan_memory.load_planned(record["config"])[0]
        return compile_tpu.overridden(config, record.get("set"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**KNOWN_MODELS[record["model_base"]], **record["model"]}, f)
    c = base_config()
    c.model.source = folder
    for key, value in record["config"].items():
        names.assign(c, key, tuple(value) if isinstance(value, list) else value)
    return c


def step_row(record: dict) -> tuple[dict, float, float] | None:
    """(bases, target, arguments) of `record`'s RL step, per device (module docstring), or
    None for a step that tpu_terms.train_terms leaves to XLA:CPU's terms (with LoRA), the
    bases with the phase model's `attention` and `feed_forward` (`--phases`); a term the
    planner leaves out of this step (an untied model's embedding, a dense model's experts)
    has basis 0. The planner's train-step terms that are not fitted here count with the
    arguments, as fixed bytes. The plan is made with the fitted coefficients at 1, so each
    fitted term is its basis (a coefficient fitted to 0 stays fittable)."""
    import compile_tpu

    device = record["topology"].split(":")[0]  # v5e:2x4 -> v5e, a key of presets.HBM
    with tempfile.TemporaryDirectory() as folder:
        config = record_config(record, folder)
        if record.get("layers"):  # compiled with --layers: the planner plans the same slice
            config = compile_tpu.sliced(config, record["layers"])
        cfg = planner.model_config(config.model)
        if not tpu_terms.models_step(cfg):
            return None
        with mock.patch.dict(tpu_terms.TPU_COEF, dict.fromkeys(TERMS, 1.0)):
            plan = planner.plan(config, record["devices"], device)
        mesh = planner.abstract_mesh(sharding.mesh_shape(dict(config.mesh), record["devices"]))
        length = max(config.data.buckets) + config.rollout.max_new_tokens  # as plan() has it
        t = config.train
        rows = config.data.prompts_per_step * config.rollout.group_size
        rows = rows // t.updates_per_batch // t.num_microbatches  # a micro-batch's, as plan()
        if packed.by_tokens(config):
            length = int(config.train.pack_length) or length
            rows = None  # one packed row per device
    step_terms = plan.phases["train step"]
    splash = cfg.attention_impl == "splash"
    unused = "logits" if splash else "logits_splash"  # the LM head's term takes the other one
    bases = {k: 0.0 if k == unused else step_terms.get(name, 0.0) for k, name in TERMS.items()}
    fixed = sum(v for name, v in step_terms.items() if name not in TERMS.values())
    b = np.dtype(cfg.compute_dtype).itemsize
    tokens = bases["stash"] / (cfg.num_layers * cfg.hidden_size * b)  # r T of a micro-batch
    heads = terms.axis_split(cfg.num_heads, mesh, "tensor")
    chunk = cfg.logits_chunk if 0 < cfg.logits_chunk < length else length  # queries at once
    bases["attention"] = 0.0 if splash else tokens * heads * chunk * 4
    bases["feed_forward"] = tokens * terms.ffn_width(cfg, mesh, rows) * b
    step = record["programs"]["rl_step"]
    arguments = step["memory"]["argument"] + fixed
    return bases, step["compiler_bytes"] - arguments, arguments


def read_rows(root: str = ROOT) -> list[tuple[str, str, dict, float, float, float]]:
    """(name, role, bases, target, arguments, compiler bytes) of every committed RL step."""
    rows = []
    for folder in ("tpu", "tpu_fit"):
        for path in sorted(glob.glob(os.path.join(root, "results", folder, "*.json"))):
            with open(path) as f:
                record = json.load(f)
            if "rl_step" not in record["programs"]:
                continue
            row = step_row(record)
            if row is None:  # a LoRA step: XLA:CPU's terms plan it, not TPU_COEF
                continue
            bases, target, args = row
            name = os.path.relpath(path, os.path.join(root, "results"))
            comp = record["programs"]["rl_step"]["compiler_bytes"]
            rows.append((name, record.get("role", "fit"), bases, target, args, comp))
    return rows


def fit(rows) -> dict[str, float]:
    """Least squares of the targets over the bases, weighted by 1 / target: DENSE's over the
    dense einsum steps, then MOE's over the mixture-of-experts ones and SPLASH's over the
    splash ones, each with DENSE's fixed and none below 0 (non-negative least squares: a term
    counts bytes; 0 without any)."""
    if any(r[2]["moe_rows"] and r[2]["logits_splash"] for r in rows):  # each fit fixes DENSE only
        raise ValueError("a mixture-of-experts step with splash attention: no fit takes it")
    dense = [r for r in rows if not any(r[2][k] for k in (*MOE, *SPLASH, *NO_REMAT))]
    a = np.array([[r[2][k] for k in DENSE] for r in dense]) / np.array([[r[3]] for r in dense])
    coef = dict(zip(DENSE, np.linalg.lstsq(a, np.ones(len(dense)), rcond=None)[0].tolist()))
    for keys in (MOE, SPLASH, NO_REMAT):
        some = [r for r in rows if any(r[2][k] for k in keys)]
        if not some:
            coef.update(dict.fromkeys(keys, 0.0))
            continue
        a = np.array([[r[2][k] / r[3] for k in keys] for r in some])
        rest = np.array([(r[3] - sum(coef[k] * r[2][k] for k in DENSE)) / r[3] for r in some])
        coef.update(zip(keys, scipy.optimize.nnls(a, rest)[0].tolist()))  # bytes: not below 0
    return coef


def error(row, coef: dict) -> float:
    """The planned step's error against the compiler's bytes, at `coef`."""
    _, _, bases, _, args, comp = row
    return (args + sum(coef[k] * bases[k] for k in TERMS) - comp) / comp


PHASES = {"base": ("update", "stash"), "head": ("embedding", "logits")}
PHASES["layer"] = ("attention", "feed_forward")
PHASE_TERMS = PHASES["base"] + PHASES["head"] + PHASES["layer"]


def phase_step(row, coef: dict) -> float:
    """The step's bytes under the phase model (module docstring) at `coef`."""
    bases, args = dict(row[2]), row[4]
    bases["logits"] += bases["logits_splash"]  # one LM-head term here; attention tells them apart
    total = {p: sum(coef[k] * bases[k] for k in ks) for p, ks in PHASES.items()}
    return args + total["base"] + max(total["head"], total["layer"])


def phase_fit(rows) -> dict[str, float]:
    """The phase model's coefficients (0 to 12 each) minimising the relative errors' squares,
    the best of 12 random starts (the max makes it piecewise linear)."""

    def residuals(c):
        coef = dict(zip(PHASE_TERMS, c))
        return [(phase_step(r, coef) - r[5]) / r[5] for r in rows]

    rng = np.random.default_rng(0)
    fits = [
        scipy.optimize.least_squares(
            residuals, rng.uniform(0.2, 4.0, len(PHASE_TERMS)), bounds=(0, 12)
        )
        for _ in range(12)
    ]
    return dict(zip(PHASE_TERMS, min(fits, key=lambda f: f.cost).x.tolist()))


def print_phases(rows) -> None:
    rows = [r for r in rows if not any(r[2][k] for k in NO_REMAT)]  # the model is remat's
    coef = phase_fit(rows)
    print(f"phase model over {len(rows)} compiles (every RL step, mixture of experts included):")
    print("  " + "  ".join(f"{k} {v:.2f}" for k, v in coef.items()))
    print(f"{'compile':<70} {'GB':>6} {'in fit':>7} {'left out':>9}")
    for i, row in enumerate(rows):
        out = phase_fit(rows[:i] + rows[i + 1 :])
        err_in = (phase_step(row, coef) - row[5]) / row[5]
        err_out = (phase_step(row, out) - row[5]) / row[5]
        print(f"{row[0]:<70} {row[5] / 1e9:6.2f} {err_in:+7.1%} {err_out:+9.1%}")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", action="store_true", help="fit the phase model instead")
    if parser.parse_args(argv).phases:
        print_phases(read_rows())
        return 0
    rows = read_rows()
    used = [r for r in rows if r[1] == "fit"]
    coef = fit(used)
    print(f"coefficients over {len(used)} compiles (TPU_COEF in tpu_terms.py):")
    for k, v in coef.items():
        print(f"  {k:<13} {v:5.2f}   TPU_COEF {tpu_terms.TPU_COEF[k]:.2f}")
    print(f"{'compile':<58} {'GB':>6} {'in fit':>7} {'left out':>9}")
    for row in rows:
        gb = row[5] / 1e9
        if row[1] == "fit":
            out = error(row, fit([r for r in used if r is not row]))
            print(f"{row[0]:<58} {gb:6.2f} {error(row, coef):+7.1%} {out:+9.1%}")
        else:  # held out: the fit never saw it
            print(f"{row[0]:<58} {gb:6.2f} {'':>7} {error(row, coef):+9.1%}  (held out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packed rows (train.pack_rows; micro-batches by rows and by tokens) against padded rows on the
CPU: one RL update of P3O (`update.Learner.learn`: the pi_prox scoring pass, the host-side
packing and the optimizer update), the three layouts alternating on one rollout, so all see
the same machine load.

The rollout is synthetic: B = prompts x G rows, prompts of 1 .. `prompt` tokens left-padded to
`prompt`, responses long-tailed as RL responses are (lognormal, median `gen` / 4, cut at
`gen`; a few reach `gen`, so the padded rows are P + gen wide). Reported per layout: trained
tokens per second (the loss mask's tokens / the update's seconds, median over repeats) and the
pad share (the positions of the rows the forwards run on that hold no token); then each packed
layout's tokens/s over the padded one's, and the largest relative difference between its
metrics and the padded update's (float32 rounding: a check, not a timing). `--micro M` cuts
the padded and the packed-by-rows update into M micro-batches of rows; the by-tokens one
sets its own count.

    python -m bench.packing [--tiny] [--set dim=256] [--rows 32] [--prompt 32] [--gen 256] \
        [--micro 4]
    python -m bench.packing --plan --rows 1024 --micro 64 --devices 4 --prompt 1024 --gen 4096

`--plan` builds no model and runs no update: it prints the pad shares of the packing plan alone
(data/packing.py: each micro-batch's sequences on each device packed on their own) for a batch
of the rows, micro-batches and device blocks given, at `--pack_length` positions per packed row
(0: prompt + gen, train.pack_length's default), and of micro-batches cut by tokens
(train.pack_microbatches "tokens", data/packing.regroup: one packed row per device each, as
many as the batch needs, `micro_by_tokens`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import Sizes, one_device_mesh, scalar_overrides
from bench.gpu import model_config
from ess_jax import objectives as obj_lib
from ess_jax.data import packing
from ess_jax.data.layout import RowLayout
from ess_jax.model import decoder as model_lib
from ess_jax.rl import packed, steps
from ess_jax.rl import update as update_lib
from ess_jax.rl.optim import make_optimizer
from ess_jax.rl.rollout import Rollout

GROUP = 4
OPTIM = {"lr": 1e-5, "max_grad_norm": 0.0, "schedule": "constant"}


def rollout(vocab: int, rows: int, prompt: int, gen: int, seed: int = 0) -> Rollout:
    """A synthetic rollout of `rows` sequences (module docstring: the length distribution)."""
    rng = np.random.default_rng(seed)
    mask = packing.long_tailed_mask(rng, rows, prompt, gen)
    tokens = np.where(mask, rng.integers(1, vocab, mask.shape), 0).astype(np.int32)
    loss_mask = mask[:, prompt:].astype(np.float32)
    adv = np.repeat(rng.normal(size=(rows // GROUP, 1)), GROUP, 0) * loss_mask
    return Rollout(
        tokens=tokens,
        attn_mask=mask,
        loss_mask=loss_mask,
        behaviour_logp=(-rng.uniform(4.0, 8.0, loss_mask.shape) * loss_mask).astype(np.float32),
        advantages=adv.astype(np.float32),
        rewards=np.zeros(rows, np.float32),
        policy_version=np.zeros(rows, np.int32),
        layout=RowLayout(rows // GROUP, GROUP),
        prompt_len=prompt,
    )


LAYOUTS = {  # name: (train.pack_rows' pack_length or None, micro-batches cut by tokens)
    "padded": (None, False),
    "packed": (0, False),
    "packed_by_tokens": (0, True),
}


def measure(s: Sizes, rows: int, prompt: int, gen: int, repeats: int, micro: int = 1) -> dict:
    """Tokens/s and pad share of each layout's update (module docstring), `micro` row
    micro-batches for the padded and the packed one (the by-tokens one sets its own)."""
    cfg = dataclasses.replace(model_config(s), dtype="float32")  # the CPU's fast dtype
    mesh = one_device_mesh()
    params = model_lib.init_params(cfg, 0, model_lib.param_shardings(cfg, mesh))
    batch = rollout(s.vocab, rows, prompt, gen)
    tx = make_optimizer(OPTIM)
    sides = {}
    for name, (pack_length, by_tokens) in LAYOUTS.items():
        state, state_sh = steps.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
        objective = obj_lib.paper_config("p3o")
        ucfg = update_lib.UpdateConfig(
            cfg, objective, tx, micro, 0, GROUP, pack_length, pack_by_tokens=by_tokens
        )
        sides[name] = [update_lib.Learner(ucfg, mesh, state_sh), state]

    def once(name):
        learner, state = sides[name]
        t0 = time.perf_counter()
        state, row = learner.learn(state, batch, params)
        jax.block_until_ready(state.params)
        sides[name][1] = state
        return time.perf_counter() - t0, row

    first = {name: once(name)[1] for name in sides}  # compiles; the rows of the same params
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            seconds[name].append(once(name)[0])
    tokens = float(batch.loss_mask.sum())
    out = {
        "rows": rows,
        "micro": micro,
        "trained_tokens": tokens,
        **shares(batch, prompt, 0, micro, 1),
        "seconds": {name: statistics.median(v) for name, v in seconds.items()},
    }
    out["tokens_per_s"] = {name: tokens / t for name, t in out["seconds"].items()}
    out["max_metric_diff"] = {}
    for name in ("packed", "packed_by_tokens"):
        out[f"{name}_vs_padded"] = out["tokens_per_s"][name] / out["tokens_per_s"]["padded"]
        # each metric's difference from the padded one's over max(1, |padded|): the largest
        diffs = {k: abs(first[name][k] - v) / max(1.0, abs(v)) for k, v in first["padded"].items()}
        worst = max(diffs, key=diffs.get)
        out["max_metric_diff"][name] = {"metric": worst, "relative": diffs[worst]}
    return out


def plan(rows: int, micro: int, devices: int, prompt: int, gen: int, pack_length: int) -> dict:
    """The pad shares of the padded and the packed layout of one synthetic batch (`--plan`)."""
    batch = rollout(2, rows, prompt, gen)
    return {
        "rows": rows,
        "micro": micro,
        "devices": devices,
        "pack_length": packed.length_for(pack_length, prompt + gen),
        **shares(batch, prompt, pack_length, micro, devices),
    }


def shares(batch: Rollout, prompt: int, pack_length: int, micro: int, devices: int) -> dict:
    """The pad share and positions of `batch` padded, packed by rows (`micro` micro-batches on
    `devices` device blocks) and packed by tokens, and the by-tokens micro-batch count."""
    mask = np.asarray(batch.attn_mask)
    pk = packed.pack(batch.tokens, mask, prompt, pack_length, micro, devices)
    rg, by_tokens = packed.regroup(batch.tokens, mask, prompt, pack_length, devices)
    return {
        "pad_share": {
            "padded": packed.padded_share(mask),
            "packed": pk.pad_share,
            "packed_by_tokens": by_tokens.pad_share,
        },
        "positions": {
            "padded": int(mask.size),
            "packed": int(pk.segments.size),
            "packed_by_tokens": int(by_tokens.segments.size),
        },
        "micro_by_tokens": rg.num_micro,  # train.pack_microbatches "tokens": M of this batch
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", action="append", default=[], help="a Sizes field, e.g. dim=256")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a width-32 model and a few tokens")
    p.add_argument("--json", metavar="FILE", help="also write the numbers here")
    p.add_argument("--plan", action="store_true", help="the packing plan's pad shares only")
    p.add_argument("--micro", type=int, default=1, help="row micro-batches")
    p.add_argument("--devices", type=int, default=1, help="--plan: device blocks")
    p.add_argument("--pack_length", type=int, default=0, help="--plan: 0 is prompt + gen")
    a = p.parse_args(argv)
    if a.plan:
        out = plan(a.rows, a.micro, a.devices, a.prompt, a.gen, a.pack_length)
        print(json.dumps(out, indent=1))
        return
    kw = scalar_overrides(a.set)
    if a.tiny:
        kw = {"dim": 32, "mlp": 64, "layers": 1, "heads": 4, "kv_heads": 2, "vocab": 64, **kw}
        a.rows, a.prompt, a.gen, a.repeats = 8, 4, 16, 1
    out = measure(Sizes(**kw), a.rows, a.prompt, a.gen, a.repeats, a.micro)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

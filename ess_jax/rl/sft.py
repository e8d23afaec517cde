"""The SFT warm start (config.sft) that `Run` runs once before RL, before its step-0 checkpoint
(a resume never redoes it): `warm_start`, sft.steps of cross-entropy on the completion tokens of
the task's demonstrations (`data.sft_batches`; a sft.demo_noise share of them with one digit
changed, `data.noise.corrupt_demonstrations`), with an optimizer of its own (AdamW, sft.lr with
sft.warmup_steps, clipped at grad norm 1, cosine decay to a tenth of sft.lr).
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from ess_jax.data import sft_batches
from ess_jax.data.noise import corrupt_demonstrations
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import steps
from ess_jax.rl.optim import make_optimizer


def warm_start(config, model_cfg, state, mesh, examples, tokenizer, quiet=False):
    """`state` (a `steps.TrainState`) with its params (and model.lora's frozen base) trained by
    config.sft.steps SFT steps on `examples`; its optimizer state and counters as given. The
    steps donate their state: use the returned one, not `state`'s params. `quiet`: no bar."""
    c = config.sft
    if not c.steps:
        return state
    tx = make_optimizer(
        {
            "lr": c.lr,
            "warmup_steps": c.warmup_steps,
            "total_steps": c.steps,
            "max_grad_norm": 1.0,
            "schedule": "cosine",
            "final_lr_fraction": 0.1,
        }
    )
    sft_state, state_sh = steps.init_state(state.params, tx, mesh, state.frozen)
    batch_sh = sharding_lib.batch_sharding(mesh)
    step_fn = steps.make_sft_step(model_cfg, tx, state_sh, batch_sh, seed=config.seed)
    demos = corrupt_demonstrations(examples, c.demo_noise, config.seed)
    it = sft_batches(demos, tokenizer, c.batch_size, c.seq_len, seed=config.seed)
    bar = tqdm(range(c.steps), desc="sft", dynamic_ncols=True, mininterval=2.0, disable=quiet)
    for i in bar:
        b = next(it)
        batch = sharding_lib.shard_batch(
            {
                "tokens": np.asarray(b["tokens"], np.int32),
                "loss_mask": np.asarray(b["loss_mask"]),
            },
            mesh,
        )
        sft_state, m = step_fn(sft_state, batch)
        if i % 20 == 0 or i == c.steps - 1:
            bar.set_postfix_str(f"loss={float(m['loss']):.3f}")
    return state.replace(params=sft_state.params, frozen=sft_state.frozen)  # donated

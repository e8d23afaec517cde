"""Part of bench/cpu.py: one full RL step of ess_jax taken apart, and the ESS objective's
overhead over GRPO in it.

The step is the one `train.Run.rl_step` runs, from the same public pieces: `rollout.collect`
(the sampler draws G completions per prompt; detokenize + reward + group advantages), the
old-logp pass (`steps.score_fn`, only for objectives that need pi_prox), and the optimizer
update (`update.make_rl_step`, with 1 or M micro-batches). Parts:
  sampling   collect minus its detokenize+reward time, plus the batch's move to the device
  reward     detokenize + the real gsm8k reward, summed over the completions
  old_logp   the teacher-forced re-score (0 when the objective needs none)
  update     forward + backward + AdamW
Sampling and reward do not depend on the objective, so each repeat samples once and every
objective updates on that same rollout (in alternating order), all updates threading one
train state; a variant's step time is its update (+ old-logp) plus the shared parts of the
same repeat. ESS overhead = step time of P3O / step time of GRPO - 1 at each micro-batch
count. The model has random weights: a stand-in detokenizer writes each token id's last
digit, so the gsm8k reward (the final number) scores about one completion in ten.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import CompileCounter, Sizes, left_padded_prompts, median, paired, train_flops
from bench.train import OPTIM
from ess_jax import objectives as obj_lib
from ess_jax import rewards as rewards_lib
from ess_jax.config import defaults
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl import steps
from ess_jax.rl import update as update_lib
from ess_jax.rl.optim import make_optimizer


class _Stopwatch:
    """Wraps functions and sums the wall time spent in them."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.total += time.perf_counter() - t0

        return timed


class _DigitTokenizer:
    def __init__(self, watch: _Stopwatch):
        self.decode = watch.wrap(self._decode)

    @staticmethod
    def _decode(ids, skip_special_tokens=True):
        return " ".join(str(i % 10) for i in ids)


def variants(s: Sizes) -> list[tuple[str, int, obj_lib.ObjectiveConfig]]:
    """(label, micro-batches, objective): every objective at every micro-batch count, and
    with M > 1 also P3O with micro-batch ESS scope (no statistics pass: its price shows)."""
    out = []
    for m in s.microbatches:
        for name in s.rl_objectives:
            out.append((f"{name} M={m}", m, obj_lib.paper_config(name)))
        if m > 1:
            cfg = obj_lib.ObjectiveConfig(ess_scope="microbatch")
            out.append((f"p3o[microbatch scope] M={m}", m, cfg))
    return out


def bench_rl(cfg, params, mesh, s: Sizes) -> dict:
    """Median seconds of each part and of the whole step per variant, and the overheads."""
    watch = _Stopwatch()
    tokenizer, reward = _DigitTokenizer(watch), watch.wrap(rewards_lib.get_reward("gsm8k"))
    prompts, pmask = left_padded_prompts(s.rl_prompts, s.rl_prompt, s.vocab, seed=7)
    digits = np.random.default_rng(7).integers(0, 10, s.rl_prompts)
    batch_in = {
        "prompt_tokens": prompts,
        "prompt_mask": pmask,
        "examples": [{"answer": str(d)} for d in digits],
    }
    rcfg = defaults.base_config().rollout
    rcfg.group_size, rcfg.max_new_tokens, rcfg.stop_ids = s.rl_group, s.rl_gen, ()
    engine = rollout_lib.policy_engine(cfg, rcfg)

    tx = make_optimizer(OPTIM)
    state, state_sh = steps.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    batch_sh = sharding_lib.batch_sharding(mesh)
    runs = {}
    for label, m, objective_cfg in variants(s):
        ucfg = update_lib.UpdateConfig(cfg, objective_cfg, tx, m)
        step = update_lib.make_rl_step(ucfg, update_lib.StepKey(s.rl_prompt), state_sh, batch_sh)
        score = None
        if obj_lib.needs_prox(objective_cfg):
            score = steps.score_fn(cfg, s.rl_prompt, mesh, m)
        runs[label] = (step, score)

    def one_repeat(r: int) -> dict[str, dict]:
        nonlocal state
        watch.total = 0.0
        t0 = time.perf_counter()
        engine.update_params(0, params)
        rollout, _ = rollout_lib.collect(
            engine, batch_in, tokenizer, reward, rcfg, jax.random.key(r)
        )
        engine.release()
        batch = sharding_lib.shard_batch(update_lib.rollout_to_batch(rollout), mesh)
        batch = jax.block_until_ready(batch)
        shared = {"sampling": time.perf_counter() - t0 - watch.total, "reward": watch.total}
        out = {}
        for label in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # no fixed first or last
            step, score = runs[label]
            b, t_old = dict(batch), 0.0
            if score is not None:
                t1 = time.perf_counter()
                b["prox_logp"] = jax.block_until_ready(score(state.params, b))
                t_old = time.perf_counter() - t1
            t1 = time.perf_counter()
            state = jax.block_until_ready(step(state, b)[0])
            rec = {**shared, "old_logp": t_old, "update": time.perf_counter() - t1}
            out[label] = {**rec, "step": sum(rec.values())}
        return out

    for r in range(s.warmup):
        one_repeat(r)
    with CompileCounter() as compiles:
        records = [one_repeat(r) for r in range(s.warmup, s.warmup + s.repeats)]

    parts = {
        label: {k: median([rec[label][k] for rec in records]) for k in records[0][label]}
        for label in runs
    }
    overhead = {}  # paired: P3O and GRPO of one round share its rollout and machine state
    for m in s.microbatches:
        p3o, grpo = f"p3o M={m}", f"grpo M={m}"
        overhead[str(m)] = {
            k: paired([r[p3o][k] for r in records], [r[grpo][k] for r in records]) - 1.0
            for k in ("step", "update")
        }
    rows = s.rl_prompts * s.rl_group
    return {
        "rows": rows,
        "update_flops": train_flops(s, rows, s.rl_prompt + s.rl_gen),
        "parts": parts,
        "ess_overhead": overhead,
        "rounds": records,  # {variant: {part: s}} per round, for the paired overheads
        "compiles_while_timed": compiles.names,
    }

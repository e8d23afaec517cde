"""Sample under one knob setting, re-score with the trainer, return the per-token arrays.

Axis alphabet: Bp prompts of a chunk, B rows (Bp x n samples), P prompt width, T response
length (max_new_tokens), V vocab.

Per chunk of prompts: `sampling/sampler.sample` draws n responses of each prompt in the
setting's precision / temperature / top-k / top-p, recording log pi_b of each drawn token;
the trainer (`model/scoring.token_logprobs`, float32 unless `trainer=bfloat16`) scores them
teacher-forced, as `rl/steps.logp_fn_for` does in an RL step; replay.py recomputes pi_b's whole
distribution along the sampler's decode path for the exact KLs. pi_b's params are the model's,
or (lag) the model's before `lag` SFT steps whose result pi_theta is, or (external) another
checkpoint's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax.config.defaults import base_config
from ess_jax.data import bucket_width, encode_completion, encode_prompts, get_task, sft_batches
from ess_jax.mismatch import replay as replay_lib
from ess_jax.mismatch.knobs import Setting, SettingError
from ess_jax.model import decoder as model_lib
from ess_jax.model import moe, scoring
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import experiment, saved_policy, steps
from ess_jax.rl.optim import make_optimizer
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling import sampler as sampler_lib
from ess_jax.sampling.rescore import Behaviour

SOURCES = "embedded | smollm2 | a Hugging Face directory | a .gguf file | a run's workdir"


@dataclasses.dataclass
class Model:
    cfg: model_lib.ModelConfig  # float32 trainer settings
    params: Any
    tokenizer: Any
    name: str


def one_device_mesh():
    return sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def load_model(source: str, mesh, init_seed: int = 0) -> Model:
    """The model `source` names, float32, params on `mesh`'s one device. embedded: the
    char-level model of config/fields.py, initialised from `init_seed` (untrained)."""
    mcfg = base_config().model
    mcfg.init_seed = init_seed
    if source in ("embedded", "smollm2"):
        cfg, params, tok = experiment.load_policy(experiment.with_source(mcfg, source), mesh)
        return Model(cfg, params, tok, source)
    if not os.path.exists(source):
        raise SettingError(f"--model {source!r}: no such file or directory; pass {SOURCES}")
    settings = experiment.trainer_settings(mcfg)
    cfg, params, tok, where = saved_policy.load(source, mesh, settings)
    if tok is None:
        raise SettingError(f"--model {source!r}: {where} has no tokenizer files")
    return Model(cfg, params, tok, source)


def parse_task(spec: str) -> tuple[str, dict]:
    """`name[:key=value,...]` -> (name, difficulty), e.g. `addition:digits=1,words=true`."""
    name, _, rest = spec.partition(":")
    difficulty: dict = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise SettingError(f"--task {spec!r}: {pair!r} is not key=value")
        low = value.lower()
        difficulty[key] = low == "true" if low in ("true", "false") else int(value)
    return name, difficulty


def task_examples(spec: str, n: int, split: str = "test") -> list[dict]:
    name, difficulty = parse_task(spec)
    if name not in experiment.SYNTHETIC_TASKS:
        raise SettingError(f"--task {spec!r}: not one of {', '.join(experiment.SYNTHETIC_TASKS)}")
    try:
        return get_task(name, **difficulty).examples(split, n)
    except (TypeError, ValueError) as e:
        raise SettingError(f"--task {spec!r}: {e}") from None


def left_pad(ids: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of the prompts left-padded to the bucket of the longest (data/batching.py
    `bucket_width`, as a PromptBatcher pads them; no bucket fits: the longest)."""
    longest = max(len(r) for r in ids)
    p = bucket_width(longest) or longest
    tokens = np.full((len(ids), p), pad_id, np.int32)
    mask = np.zeros((len(ids), p), bool)
    for i, row in enumerate(ids):
        tokens[i, p - len(row) :], mask[i, p - len(row) :] = row, True
    return tokens, mask


def sft_steps(model: Model, examples: list[dict], k: int, lr: float, mesh, seed: int = 0):
    """The params after `k` SFT steps (AdamW at constant `lr`, batch 16, no grad clip) on the
    examples' demonstrations: `rl/steps.make_sft_step`, the step of the runs' warm start."""
    tx = make_optimizer({"lr": lr, "warmup_steps": 0, "total_steps": k, "schedule": "constant"})
    params = jax.tree.map(jnp.copy, model.params)  # the step donates its state
    state, state_sh = steps.init_state(params, tx, mesh)
    batch_sh = sharding_lib.batch_sharding(mesh)
    step_fn = steps.make_sft_step(model.cfg, tx, state_sh, batch_sh)
    ids = encode_prompts(model.tokenizer, [e["prompt"] for e in examples])
    demos = [encode_completion(model.tokenizer, e["demonstration"]) for e in examples]
    longest = max(len(p) + len(d) for p, d in zip(ids, demos))
    it = sft_batches(examples, model.tokenizer, 16, longest, seed=seed)
    for _ in range(k):
        b = next(it)
        batch = {"tokens": np.asarray(b["tokens"], np.int32), "loss_mask": b["loss_mask"]}
        state, _ = step_fn(state, sharding_lib.shard_batch(batch, mesh))
    return state.params


@functools.lru_cache(maxsize=4)
def _score_fn(cfg, prompt_len: int):
    def score(params, seq, mask):
        logp = scoring.token_logprobs(cfg, params, seq, mask, start=prompt_len)
        full = replay_lib.trainer_log_softmax(cfg, params, seq, mask, prompt_len)
        return logp, full

    return jax.jit(score)


@functools.lru_cache(maxsize=4)
def _routed_score_fn(cfg, prompt_len: int):
    """An MoE model's re-score replaying the sampler's recorded routing, and where that routing
    is not the trainer's own: (logp, full log-softmax, differs [B, T, Ls], recorded [B, T])."""

    def score(params, seq, mask, routing):
        logp = scoring.token_logprobs(cfg, params, seq, mask, start=prompt_len,
                                      routing_BxTxLxX=routing)  # fmt: skip
        full = replay_lib.trainer_log_softmax(cfg, params, seq, mask, prompt_len, routing)
        _, _, own = scoring.scored_hidden_routed(cfg, params, seq, mask.astype(bool), 1)
        differs = moe.topk_differs(own.experts, routing)[:, prompt_len:]
        return logp, full, differs, routing[:, prompt_len:, 0, 0] != moe.NOT_RECORDED

    return jax.jit(score)


def sampler_model(cfg, params, precision: str):
    """(cfg, params) as `sampler.sample` builds them for `precision`: the compute dtype and the
    prepared copy (`precision.prepare_params`) its programs read."""
    cfg = precision_lib.sample_config(cfg, precision)
    return cfg, params if precision == "float32" else precision_lib.prepare_fn(precision)(params)


def measure(
    model: Model,
    setting: Setting,
    prompt_ids: list[list[int]],
    *,
    samples: int,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    seed: int,
    chunk: int,
    behaviour_model: Model | None = None,
    trainer_params=None,
) -> dict[str, np.ndarray]:
    """Per-token arrays [B, T] over every prompt: logp, blogp (recorded), mask, kl_fwd, kl_rev,
    replay_blogp. `behaviour_model`: pi_b (default `model`); `trainer_params`: pi_theta's params
    (default the model's). For a mixture-of-experts model sampling itself (no external pi_b),
    also the trainer under routing replay: logp_r, kl_fwd_r, kl_rev_r [B, T], `flip` [B, T, Ls]
    (the recorded top-k is not the trainer's own) and `routed` [B, T] (a recorded token)."""
    beh = behaviour_model or model
    tparams = model.params if trainer_params is None else trainer_params
    tcfg = model.cfg.replace(dtype=setting.trainer)
    scfg = sampler_lib.SamplingConfig(
        temperature=setting.temperature,
        top_k=setting.top_k,
        top_p=setting.top_p,
        max_new_tokens=max_new_tokens,
        num_samples=samples,
        stop_ids=stop_ids,
    )
    bcfg, bparams = sampler_model(beh.cfg, beh.params, setting.precision)
    behaviour = Behaviour(setting.temperature, setting.top_k, setting.top_p)
    pad_id = int(model.cfg.pad_token_id or 0)
    parts: dict[str, list] = {}
    for c, start in enumerate(range(0, len(prompt_ids), chunk)):
        ids = prompt_ids[start : start + chunk]
        bucket_tok, bucket_mask = left_pad(ids, pad_id)  # the sampler's and the replay's width
        p, pb = max(len(r) for r in ids), bucket_tok.shape[1]
        rng = jax.random.fold_in(jax.random.key(seed), c)
        out = sampler_lib.sample(
            beh.cfg,
            beh.params,
            bucket_tok,
            bucket_mask,
            scfg,
            rng,
            precision=setting.precision,
            kv_cache=setting.kv_cache,
        )
        # the trainer scores the prompts at the longest one's width (p)
        seq = np.asarray(out.sequences)[:, pb - p :]
        seq_mask = np.asarray(out.sequence_mask)[:, pb - p :]
        logp, full = _score_fn(tcfg, p)(tparams, seq, seq_mask)
        replay = functools.partial(
            replay_lib.replay,
            bparams,
            bucket_tok,
            bucket_mask,
            out.tokens,
            jnp.max(out.lengths),
            cfg=bcfg,
            n=samples,
            behaviour=behaviour,
            kv_cache=setting.kv_cache,
        )
        picked, kl_fwd, kl_rev = replay(full)
        arrays = {
            "logp": logp,
            "blogp": out.behaviour_logp,
            "mask": out.response_mask,
            "kl_fwd": kl_fwd,
            "kl_rev": kl_rev,
            "replay_blogp": picked,
        }
        if model.cfg.num_experts and behaviour_model is None:
            routing = np.asarray(out.routing)[:, pb - p :]
            logp_r, full_r, flip, routed = _routed_score_fn(tcfg, p)(
                tparams, seq, seq_mask, routing
            )
            _, kl_fwd_r, kl_rev_r = replay(full_r)
            arrays.update(logp_r=logp_r, kl_fwd_r=kl_fwd_r, kl_rev_r=kl_rev_r)
            arrays.update(flip=flip, routed=routed)
        for key, x in arrays.items():
            parts.setdefault(key, []).append(np.asarray(x))
    return {k: np.concatenate(v) for k, v in parts.items()}

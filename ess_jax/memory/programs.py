"""The programs of a run, built abstractly: what `tools/compile_tpu.py` compiles for a TPU slice.

`run_programs(config, mesh)` gives one `Program` per distinct jitted program that a run of
`config` executes on `mesh`, each with abstract inputs (`jax.ShapeDtypeStruct`s carrying the
NamedShardings the run gives them), built by the functions the run itself calls:

  rl_step              update.make_rl_step: one optimizer update (objective, micro-batches, ESS
                       scope, AdamW), on the rows of one update at the widest prompt bucket;
  score                steps.score_fn: teacher-forced pi_prox / reference log-probs of a whole
                       rollout batch (only where the objective or beta_kl needs them);
  sft_step             steps.make_sft_step (only with sft.steps > 0);
  reshard              the train -> sample layout move of the params (sharding.reshard);
  sampler_copy         precision.prepare_fn: the sampler's weights in rollout.precision;
  lora_merge           lora_policy.merge_fn, which replaces the two above under model.lora;
  sample/prefill, sample/decode<bound>
                       the sampler's prefill and each decode segment (decode.decode_bounds), the
                       segment's cache grown to its bound, at rollout.precision and
                       rollout.kv_cache_precision, one sampler call's prompts;
  eval/prefill, eval/decode<bound>
                       the same at eval's batch, k, precision and length (with eval.every > 0);
  external/...         the external behaviour model's reshard, sampler copy, prefill and decode
                       segments (rollout.external_fraction > 0: E7's Qwen3-8B sampler).

No weights are loaded: the model's shapes come from `planner.model_config` (a checkpoint's
config.json, else KNOWN_MODELS). Each program carries the planner's bytes for the same program
(its arguments, outputs and temporaries, as `compiled.memory_analysis()` counts them) and the
bytes the run holds beside it on each device (`beside_bytes`: the train state while the
sampler runs, the policy history, an external or reference model), so that a program's peak
on the device is compiler bytes + beside_bytes. `loop_trips`: how many times the program's
loop body runs per call (micro-batches, score chunks, decode steps): XLA's cost analysis
counts a loop body once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ess_jax import objectives as obj_lib
from ess_jax.config.presets import TPU_KINDS
from ess_jax.data import packing
from ess_jax.memory import planner, tpu_terms
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import accumulate, experiment, lora_policy, packed, steps
from ess_jax.rl import update as update_lib
from ess_jax.rl.optim import make_optimizer
from ess_jax.sampling import decode as decode_lib
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling import sampler as sampler_lib

# The train batch's arrays and dtypes (update.rollout_to_batch), by whether they span the whole
# sequence or only the response.
_SEQUENCE = {"tokens": jnp.int32, "attn_mask": jnp.bool_}
_RESPONSE = {"mask": jnp.float32, "behaviour_logp": jnp.float32, "advantages": jnp.float32}


@dataclasses.dataclass
class Program:
    """One jitted program and its abstract inputs. `args` may be a function of the programs
    compiled before it (name -> compiled), for inputs whose layout the compiler picks (the
    decode state that the prefill outputs)."""

    name: str
    fn: Any  # a jax.jit-wrapped function
    args: tuple | Callable[[dict], tuple]
    planner_bytes: float | None
    beside_bytes: float = 0.0
    loop_trips: int = 1

    def lower(self, compiled: dict):
        args = self.args(compiled) if callable(self.args) else self.args
        return self.fn.lower(*args)


def abstract(tree, shardings):
    """`tree`'s leaves as ShapeDtypeStructs carrying `shardings`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def abstract_state(params, optim: dict, frozen=None) -> tuple[steps.TrainState, steps.TrainState]:
    """The abstract TrainState of abstract `params` under the optimizer of config `optim`
    (rl.optim.make_optimizer's keys), and its shardings, laid out as steps.init_state lays out
    the real one: moments as their params, scalars replicated."""
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    rep = sharding_lib.replicated(mesh)
    leaves, treedef = jax.tree.flatten(params)
    avals = tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves)
    opt = _opt_shapes(json.dumps(optim, sort_keys=True, default=str), treedef, avals)
    opt_sh = optax.tree_map_params(
        make_optimizer(optim),
        lambda _, p: p.sharding,
        opt,
        params,
        transform_non_params=lambda _: rep,
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    state = steps.TrainState(params, abstract(opt, opt_sh), scalar, scalar, frozen)
    return state, jax.tree.map(lambda x: x.sharding, state)


@functools.lru_cache(maxsize=32)
def _opt_shapes(optim_json: str, treedef, avals: tuple):
    """The optimizer state's shapes of params of `avals`: cached, as tracing AdamW's init over
    a 36-layer model's ~400 params takes a third of replanning every TPU record
    (tools/compile_tpu.py --replan), and a run's programs ask for the same state again."""
    params = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in avals])
    return jax.eval_shape(make_optimizer(json.loads(optim_json)).init, params)


def _batch(rows: int, prompt: int, length: int, mesh) -> dict:
    sh = sharding_lib.batch_sharding(mesh)
    out = {k: jax.ShapeDtypeStruct((rows, length), dt, sharding=sh) for k, dt in _SEQUENCE.items()}
    for k, dt in _RESPONSE.items():
        out[k] = jax.ShapeDtypeStruct((rows, length - prompt), dt, sharding=sh)
    return out


def _bytes(tree) -> float:
    """Per-device bytes of an abstract tree's shards (planner.tree_bytes: int4 at half a
    byte, as the compiler counts it)."""
    leaves = jax.tree.leaves(tree)
    return float(planner.tree_bytes(leaves, [x.sharding for x in leaves]))


def token_batch(rows: int, prompt: int, length: int, pack_length: int, mesh):
    """(the abstract rows of one update cut by tokens, its micro-batch count M): train.
    pack_microbatches "tokens" (data/packing.regroup) on a batch of `rows` sequences at the
    lengths packing.long_tailed_mask assumes (seed 0; the paper states none), so M and the
    regrouped rows are those of one such batch: D C M padded rows beside D M packed rows."""
    mask = packing.long_tailed_mask(np.random.default_rng(0), rows, prompt, length - prompt)
    blocks = sharding_lib.batch_ranks(mesh.shape)  # the batch's row blocks
    s = packed.length_for(pack_length, length)
    rg = packing.regroup(mask, s, blocks)
    batch, sh = _batch(len(rg.index), prompt, length, mesh), sharding_lib.batch_sharding(mesh)
    for k in packed.PACKED:
        batch[k] = jax.ShapeDtypeStruct((blocks * rg.num_micro, s), jnp.int32, sharding=sh)
    batch[packed.INDEX] = jax.ShapeDtypeStruct((len(rg.index), length - prompt), jnp.int32,
                                               sharding=sh)  # fmt: skip
    return batch, rg.num_micro


def _static(cfg, n: int, new_tokens: int, temperature: float, kv: str) -> decode_lib.Static:
    eos = cfg.eos_token_id
    stops = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return decode_lib.Static(
        max_new_tokens=new_tokens, num_samples=n, greedy=temperature == 0, top_k=0,
        use_top_p=False, stop_ids=tuple(sorted(set(stops))), pad_id=int(cfg.pad_token_id or 0),
        kv_cache=kv,
    )  # fmt: skip


def device_of(mesh) -> str:
    """The planner's device key of `mesh`'s devices: a TPU generation (presets.TPU_KINDS), or
    "h100" for a CPU or GPU mesh (XLA:CPU's terms)."""
    return TPU_KINDS.get(mesh.devices.flat[0].device_kind, "h100")


def sampler_programs(prefix, cfg, weights, w_bytes, mesh, prompts, n, prompt, new, temperature,
                     precision, kv, amesh, beside) -> list[Program]:  # fmt: skip
    """The prefill and every decode segment of one sampler call of `prompts` x `n` samples
    (prompt width `prompt`, a data.buckets width). `weights(compiled)`: the sampler's abstract
    copy, laid out as the program that makes it outputs it; `w_bytes` its bytes per device.
    Planner bytes on a TPU: each segment's cache at its own bound (tpu_terms.sampler_terms);
    else the whole length's (terms.sampler_terms)."""
    scfg = precision_lib.sample_config(cfg, precision)
    st = _static(cfg, n, new, temperature, kv)
    prefill, dec = sampler_lib.programs(scfg, st, mesh)
    width = prompt  # the sampler pads no further than the batcher's bucket
    spec = sharding_lib.logical_to_spec(  # as the sampler places its prompts (sampler._place)
        ("batch", None), (prompts, width), mesh, sharding_lib.SAMPLE_RULES
    )
    sh = jax.sharding.NamedSharding(mesh, spec)
    toks = jax.ShapeDtypeStruct((prompts, width), jnp.int32, sharding=sh)
    mask = jax.ShapeDtypeStruct((prompts, width), jnp.bool_, sharding=sh)
    scalars = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))

    def prefill_args(compiled):
        return weights(compiled), toks, mask, jax.random.key(0), *scalars

    args = (scfg, amesh, prompts, n, width, new, precision, kv)
    device = device_of(mesh)
    tpu = tpu_terms.is_tpu(device)
    terms = tpu_terms.sampler_terms(*args, device=device) if tpu else planner.sampler_terms(*args)
    cache = terms["prefill_cache"] if tpu else terms["kv_cache"]
    out = [Program(f"{prefix}/prefill", prefill, prefill_args,
                   w_bytes + cache + terms["prefill"], beside)]  # fmt: skip

    def state_for(bound):
        def args(compiled):
            state = jax.eval_shape(prefill, *prefill_args(compiled))
            state = abstract(state, compiled[f"{prefix}/prefill"].output_shardings)
            grown = jax.eval_shape(
                lambda c: [decode_lib.grow_layer(x, width + bound, mesh) for x in c], state.cache
            )
            cache = abstract(grown, jax.tree.map(lambda x: x.sharding, state.cache))
            return weights(compiled), state.replace(cache=cache), *scalars

        return args

    previous = 1  # the prefill draws the first token
    for bound, segment in zip(dec.bounds, dec.segments):
        if tpu:
            terms = tpu_terms.sampler_terms(*args, bound=bound, device=device)
        out.append(
            Program(f"{prefix}/decode{bound}", segment, state_for(bound),
                    w_bytes + terms["kv_cache"] + terms["decode"], beside, bound - previous)
        )  # fmt: skip
        previous = bound
    return out


def _step_trips(objective_cfg, m: int) -> int:
    """How often the RL step's micro-batch loop body runs: M, or M - 1 for a loss that reads
    the step's ESS (rl/accumulate.statistics_pass from M = 3 on: its forward scan and
    the gradient scan each run M - 1 micro-batches, the last one outside both loops)."""
    objective = obj_lib.get_objective(objective_cfg.name)
    return m - 1 if accumulate.keeps_last_microbatch(objective, objective_cfg.ess_scope, m) else m


def run_programs(config, mesh) -> list[Program]:
    """Every distinct program a (synchronous) run of `config` compiles, on `mesh`."""
    sizes = dict(mesh.shape)
    amesh = planner.abstract_mesh(sizes)
    device = device_of(mesh)
    plan = planner.plan(config, mesh.size, device, sizes)
    cfg = lora_policy.lora_config(config.model, planner.model_config(config.model))
    rank = lora_policy.lora_settings(config.model)[0]
    policy_cfg = lora.base_config(cfg)
    r, t, e = config.rollout, config.train, config.eval
    resident = sum(plan.resident.values())

    params = abstract(model_lib.abstract_params(cfg), model_lib.param_shardings(cfg, mesh))
    frozen, trained = lora.split(params) if rank else (None, params)
    optim = {**config.optim.to_dict(), "total_steps": t.steps * t.updates_per_batch}
    tx = make_optimizer(optim)
    state, state_sh = abstract_state(trained, optim, frozen)
    held = _bytes(state.params) + _bytes(state.opt_state) + _bytes(frozen or {})
    beside_train = resident - held  # history, external and reference models

    prompt = max(config.data.buckets)
    length = prompt + r.max_new_tokens
    rows = config.data.prompts_per_step * r.group_size // t.updates_per_batch
    batch, m, key, pack_length = _batch(rows, prompt, length, mesh), t.num_microbatches, None, None
    if packed.by_tokens(config):
        pack_length = int(t.pack_length)
        batch, m = token_batch(rows, prompt, length, pack_length, mesh)
        key = m
    objective_cfg = obj_lib.objective_config(config.objective.to_dict())
    needs_prox = obj_lib.needs_prox(objective_cfg)
    used = {"prox_logp": needs_prox, "ref_logp": config.objective.beta_kl > 0}
    scored = [k for k, on in used.items() if on]
    if objective_cfg.kl_estimator == obj_lib.FULL_KL:
        raise ValueError(
            "objective.kl_estimator 'full': its step's re-score of pi_b is not built here yet "
            "(no paper arm uses it)"
        )
    for k in scored:  # the scoring pass's outputs, added to the batch before the updates
        batch[k] = batch["behaviour_logp"]
    bsh = sharding_lib.batch_sharding(mesh)
    ucfg = update_lib.UpdateConfig(cfg, objective_cfg, tx, t.num_microbatches, config.seed,
                                   int(r.group_size), pack_length, key is not None)  # fmt: skip
    skey = update_lib.StepKey(prompt, num_microbatches=key)
    step = update_lib.make_rl_step(ucfg, skey, state_sh, bsh)
    train_terms = sum(plan.phases[planner.TRAIN_PHASE].values())
    out = [
        Program("rl_step", step, (state, batch), held + _bytes(batch) + train_terms,
                beside_train, _step_trips(objective_cfg, m))
    ]  # fmt: skip
    if scored:
        chunks = t.num_microbatches * t.updates_per_batch
        whole = _batch(rows * t.updates_per_batch, prompt, length, mesh)
        score_in = {k: whole[k] for k in _SEQUENCE}
        score = steps.score_fn(policy_cfg if not rank else cfg, prompt, mesh, chunks)
        logp = whole["behaviour_logp"]  # the output's shape: float32 per response token
        planned = _bytes(params) + _bytes(score_in) + _bytes(logp)
        planned += sum(plan.phases[planner.SCORE_PHASE].values())
        out.append(
            Program("score", score, (params, score_in), planned, resident - _bytes(params), chunks)
        )
    if config.sft.steps:
        sft_optim = {
            "lr": config.sft.lr,
            "warmup_steps": config.sft.warmup_steps,
            "total_steps": config.sft.steps,
            "max_grad_norm": 1.0,
            "schedule": "cosine",
            "final_lr_fraction": 0.1,
        }  # as sft.py's
        stx = make_optimizer(sft_optim)
        sft_state, sft_sh = abstract_state(trained, sft_optim, frozen)
        sft_len = int(config.sft.seq_len)
        shape = (config.sft.batch_size, sft_len)
        sft_batch = {
            "tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh),
            "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=bsh),
        }
        terms = planner.device_train_terms(
            device, cfg, amesh, config.sft.batch_size, sft_len, 0, sft_len
        )
        sft_held = _bytes(sft_state.params) + _bytes(sft_state.opt_state) + _bytes(frozen or {})
        out.append(Program("sft_step", steps.make_sft_step(cfg, stx, sft_sh, bsh, config.seed),
                           (sft_state, sft_batch), sft_held + _bytes(sft_batch)
                           + sum(terms.values()), beside_train))  # fmt: skip

    def weights_for(precision: str):
        """(weights(compiled), bytes): the sampler's abstract weights in `precision`, and the
        programs that make them added to `out` (once per format)."""
        if not rank:
            made, weights, w_bytes = layout_programs(
                "", policy_cfg, params, mesh, amesh, precision, resident
            )
            out.extend(p for p in made if not any(q.name == p.name for q in out))
            return weights, w_bytes
        name = f"lora_merge/{precision}"
        fn, args = lora_policy.merge_fn(cfg, mesh, "sample", precision), (frozen, trained)
        copy = jax.eval_shape(fn, *args)
        if precision == "float32":  # the sample-layout params
            sample_sh = model_lib.param_shardings(policy_cfg, mesh, "sample")
            w_bytes = _bytes(abstract(model_lib.abstract_params(policy_cfg), sample_sh))
        else:
            w_bytes = planner.sampler_copy_bytes(policy_cfg, amesh, precision)
        if not any(p.name == name for p in out):  # beside it: the state but the train params
            out.append(Program(name, fn, args, _bytes(args) + w_bytes, resident - _bytes(params)))
        return (lambda compiled: abstract(copy, compiled[name].output_shardings)), w_bytes

    calls = int(r.get("sample_microbatches", 1))
    n_ext = round(r.external_fraction * r.group_size) if r.external_fraction > 0 else 0
    kv = r.get("kv_cache_precision", "compute")
    out += sampler_programs("sample", policy_cfg, *weights_for(r.precision), mesh,
                            config.data.prompts_per_step // calls, r.group_size - n_ext, prompt,
                            r.max_new_tokens, r.temperature, r.precision, kv, amesh,
                            resident)  # fmt: skip
    if n_ext:
        out += external_programs(config, mesh, amesh, prompt, n_ext, kv, resident)
    if e.every:
        eprec = str(e.get("precision", "float32"))
        out += sampler_programs("eval", policy_cfg, *weights_for(eprec), mesh, e.batch_size, e.k,
                                prompt, e.max_new_tokens, e.temperature, eprec,
                                e.get("kv_cache_precision", "compute"), amesh,
                                resident)  # fmt: skip
    return out


def layout_programs(prefix, cfg, params, mesh, amesh, precision: str, resident: float):
    """(programs, weights(compiled), bytes): what takes a model's train-layout `params` to the
    sampler's weights in `precision`: `{prefix}reshard` (train -> sample layout, beside the
    resident state but the train params) and, unless float32, `{prefix}sampler_copy/<format>`
    (beside all of it); the weights' abstract arrays from the compiled programs, and their
    planned bytes."""
    sample_sh = model_lib.param_shardings(cfg, mesh, "sample")
    sample = abstract(model_lib.abstract_params(cfg), sample_sh)
    # the reshard's all-gather buffers (the TPU compiler's second copy; XLA:CPU's: not measured)
    tpu = tpu_terms.is_tpu(device_of(mesh))
    buffers = tpu_terms.reshard_buffers(cfg, amesh) if tpu else 0.0
    move = jax.jit(lambda p: p, out_shardings=sample_sh)
    out = [Program(f"{prefix}reshard", move, (params,), _bytes(params) + _bytes(sample) + buffers,
                   resident - _bytes(params))]  # fmt: skip
    if precision == "float32":
        return out, (lambda compiled: sample), _bytes(sample)
    name = f"{prefix}sampler_copy/{precision}"
    fn = precision_lib.prepare_fn(precision)
    w_bytes = planner.sampler_copy_bytes(cfg, amesh, precision)
    out.append(Program(name, fn, (sample,), _bytes(sample) + w_bytes, resident))
    copy = jax.eval_shape(fn, sample)
    return out, (lambda compiled: abstract(copy, compiled[name].output_shardings)), w_bytes


def external_programs(config, mesh, amesh, prompt: int, n: int, kv: str, resident: float):
    """The external behaviour model's programs (rollout.external_checkpoint, E7): its params
    stay in the train layout (rl/train.py loads them so), and each rollout gathers them to the
    sample layout, formats them in rollout.external_precision and samples its `n` of each
    group: external/reshard, external/sampler_copy/<format>, external/prefill and its decode
    segments, the model's shapes from `planner.model_config` as the policy's."""
    r = config.rollout
    ecfg = planner.model_config(experiment.with_source(config.model, r.external_checkpoint))
    precision = str(r.external_precision)
    params = abstract(model_lib.abstract_params(ecfg), model_lib.param_shardings(ecfg, mesh))
    out, weights, w_bytes = layout_programs(
        "external/", ecfg, params, mesh, amesh, precision, resident
    )
    prompts = config.data.prompts_per_step // int(r.get("sample_microbatches", 1))
    out += sampler_programs("external", ecfg, weights, w_bytes, mesh, prompts, n, prompt,
                            r.max_new_tokens, r.temperature, precision, kv, amesh,
                            resident)  # fmt: skip
    return out

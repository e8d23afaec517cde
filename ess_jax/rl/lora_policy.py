"""model.lora in the RL loop: the adapters attached to a loaded policy, the sampler's copy of
base + adapters, and the exports (a merged HF checkpoint, a PEFT adapter directory).

With model.lora.rank > 0, `Run` holds the base in `TrainState.frozen` and the adapters in
`TrainState.params`: the optimizer, the policy history (rollout.lag), the proximal and
reference snapshots and the checkpoints all hold adapters only; the base is model.source,
reloaded on a resume. With model.lora.base_precision int8 / int4 (QLoRA) the frozen base holds
the block matrices quantized (`frozen_base`), and the merge starts from their dequantized
values. The sampler draws from the merged weights W + (alpha / R) A B (`SAMPLER_FORM`): one
dense matmul per weight per decode step instead of three. One jitted program merges them
straight into the sampler's format (`merged(..., precision=)`: rollout.precision's bfloat16
copy or int4 codes, sampling/precision.py), so the whole float32 merged model is never held
beside that copy; that copy is the sampler's `SamplerParams`, used as it is (`engine`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil

import jax

from ess_jax.config.schema import lora_targets
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora, quant
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling import sampler as sampler_lib
from ess_jax.sampling.engine import JaxEngine

# How the sampler runs base + adapters: "merged" (W + (alpha / R) A B once per collection, the
# plain model's decode) or "adapters" (x W + (alpha / R) (x A) B in every matmul). Side by
# side in one process on the CPU (bench/lora.py, BENCHMARKS.md), rank 8, 32 rows, 64 new
# tokens: "adapters" 1.20x the time at bench/cpu.py's 32M model, 1.47x at dim 256.
SAMPLER_FORM = "merged"


def lora_settings(mcfg) -> tuple[int, float, tuple[str, ...]]:
    spec = mcfg.get("lora")
    if spec is None:
        return 0, 16.0, lora.TARGETS
    return int(spec.rank), float(spec.alpha), lora_targets(spec.targets)


def lora_config(mcfg, cfg):
    """`cfg` with model.lora's adapters, base precision and dropout; `cfg` itself at rank 0."""
    rank, alpha, targets = lora_settings(mcfg)
    if not rank:
        return cfg
    spec = mcfg.get("lora")
    precision, dropout = spec.get("base_precision", "compute"), spec.get("dropout", 0.0)
    return lora.with_lora(cfg, rank, alpha, targets, precision, dropout)


@functools.lru_cache(maxsize=8)
def _quantize_fn(cfg, mesh):
    out = None if mesh is None else lora.split(model_lib.param_shardings(cfg, mesh))[0]
    return jax.jit(lambda p: quant.quantize_base(p, cfg.lora_base_precision), out_shardings=out)


def frozen_base(cfg, params, mesh=None):
    """The frozen base of a LoRA `cfg` from the loaded (float) params: themselves, or with
    model.lora.base_precision int8 / int4 their block matrices quantized (model/quant.py), in
    the train layout. A function of model.source alone, so a resume re-derives it exactly."""
    if cfg.lora_base_precision == "compute":
        return params
    return _quantize_fn(cfg, mesh)(params)


def attach(mcfg, cfg, params, mesh=None, seed: int = 0):
    """(cfg, frozen base or None, trainable params) of a loaded policy: without model.lora
    (rank 0) the params themselves; else the LoRA cfg, the params as the frozen base
    (`frozen_base`) and fresh adapters (B = 0: the policy is the base's), each created in the
    shard of its base matmul."""
    if not lora_settings(mcfg)[0]:
        return cfg, None, params
    cfg = lora_config(mcfg, cfg)
    shardings = None if mesh is None else lora.split(model_lib.param_shardings(cfg, mesh))[1]
    adapters = lora.init_adapters(cfg, jax.random.key(seed, impl="rbg"), shardings)
    return cfg, frozen_base(cfg, params, mesh), adapters


@functools.lru_cache(maxsize=16)
def merge_fn(cfg, mesh, layout: str, precision: str):
    """`merged`'s jitted program for a config, mesh, layout and format (cached: one compile
    per combination); its compiled memory is what tests/test_plan_memory.py measures."""
    out = None
    if mesh is not None:
        out = model_lib.param_shardings(lora.base_config(cfg), mesh, layout)
    merge = functools.partial(lora.merge, cfg)
    if precision == "float32":
        return jax.jit(merge, out_shardings=out)

    def merge_and_prepare(frozen, adapters):
        full = merge(frozen, adapters)
        if out is not None:  # the layout the two-program path prepares from
            full = jax.lax.with_sharding_constraint(full, out)
        return precision_lib.prepare_params(full, precision)

    return jax.jit(merge_and_prepare)


def merged(cfg, frozen, adapters, layout: str = "sample", precision: str = "float32"):
    """W + (alpha / R) A B for every adapter: the plain model's params (`lora.base_config`), in
    `layout` on the base's mesh (for the sampler: the merge and its gather in one program).
    With a `precision` other than float32, the sampler's copy in that format
    (precision.prepare_params of the merged params) from the same program: each merged
    float32 matrix is a temporary of its own conversion (XLA's compiled temporaries: at most
    one float32 matrix, tests/test_plan_memory.py), and the copy is bit for bit that of
    merging, then preparing (tests/test_lora.py)."""
    if precision not in precision_lib.PRECISIONS:
        raise ValueError(f"precision {precision!r} not in {precision_lib.PRECISIONS}")
    return merge_fn(cfg, _mesh_of(frozen), layout, precision)(frozen, adapters)


def _mesh_of(tree):
    sharding = getattr(jax.tree.leaves(tree)[0], "sharding", None)
    return getattr(sharding, "mesh", None)


def sampler_params(cfg, params, precision: str = "float32") -> sampler_lib.SamplerParams:
    """The sampler's copy of a LoRA policy's `params` (lora.join of the frozen base and the
    adapters) per `SAMPLER_FORM`: merged straight into `precision`'s format
    (config.rollout.precision, or for held-out eval config.eval.precision) in the sample
    layout, used by the sampler as it is."""
    frozen, adapters = lora.split(params)
    if SAMPLER_FORM == "merged":
        full = merged(cfg, frozen, adapters, precision=precision)
        return sampler_lib.SamplerParams(
            lora.base_config(cfg), full, precision, sampler_lib.params_mesh(full)
        )
    return sampler_lib.prepare(cfg, params, precision)


def engine(cfg, precision: str = "float32", kv_cache="compute", calls=1) -> JaxEngine:
    """The in-JAX sampler engine of a policy of config `cfg` in `precision`; with model.lora it
    is pushed the base and the adapters joined (lora.join) and prepares `sampler_params`."""
    prepare = functools.partial(sampler_params, cfg) if cfg.lora_rank else None
    return JaxEngine(cfg, precision=precision, kv_cache=kv_cache, calls=calls, prepare=prepare)


def export(cfg, frozen, params, hf_dir: str, peft_dir: str, tokenizer, base_source: str):
    """The merged HF checkpoint in `hf_dir`; the PEFT adapter in `peft_dir`, written to
    `peft_dir`.tmp first and renamed (a reader never sees half of one). With a quantized base
    (QLoRA) the adapters were trained on the int8 / int4 base, while PEFT applies them to the
    float base it loads: that policy is not the trained one (the merged `hf_dir` is), and a
    warning says so."""
    from ess_jax.io import peft_adapter, weights

    if cfg.lora_base_precision != "compute":
        logging.warning(
            "the PEFT adapter in %s was trained on a %s base; PEFT applies it to the float base "
            "%s, which is not the trained policy: use the merged checkpoint %s for that",
            peft_dir,
            cfg.lora_base_precision,
            base_source,
            hf_dir,
        )

    full = merged(cfg, frozen, params, layout="train")
    weights.save_hf(lora.base_config(cfg), full, hf_dir, tokenizer=tokenizer)
    tmp = peft_dir + ".tmp"
    primary = jax.process_index() == 0
    if primary and os.path.exists(tmp):
        shutil.rmtree(tmp)
    peft_adapter.save_peft(cfg, params, tmp, base_model=base_source)
    if primary:
        if os.path.exists(peft_dir):
            shutil.rmtree(peft_dir)
        os.replace(tmp, peft_dir)

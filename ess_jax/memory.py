"""Per-device memory plan of a run before launching it: does a config fit a device?

`plan(config, num_devices, device)` counts, per device, the buffers a run holds for its whole
length (float32 params and AdamW moments, the policy history and an external model, all in the
FSDP-sharded train layout) and the transients of each phase: the train step (gradients, update
temporaries, FSDP-gathered weights, one micro-batch's activations, chunked or not), a sampler
collection (the sample-layout gather of the weights, their bfloat16 / fp8 copy, the KV cache,
prefill and decode temporaries), eval and the history push; the peak phase decides. Shapes
and shardings are exact (`jax.eval_shape` of the optimizer, the model's logical axes on an
abstract mesh of any size); the per-unit coefficients (COEF) are XLA's, fitted to
`compiled.memory_analysis()` on CPU. tests/test_plan_memory.py holds the estimates within 25% of
XLA's for the train step and the sampler on 1 and 8 devices, on shapes not used for the fit.
objective.kl_estimator "full" adds its re-score's logits to the train step (and, with lag 0
and several updates per batch, the copy of the params it re-scores with).

Not modelled: XLA's workspace and collective buffers on accelerators (the HEADROOM margin),
host memory, the forward-only scoring pass of the dual anchor / TIS (one micro-batch, smaller
than the train step). `model.remat` is estimated as block inputs of every layer plus one layer
recomputed: XLA:CPU realises only part of that saving, so it cannot be checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from ess_jax import layers, layouts
from ess_jax import model as model_lib
from ess_jax import sharding as sharding_lib
from ess_jax.presets import GB, HBM, KNOWN_MODELS

HEADROOM = 0.10  # left free for XLA's workspace, collectives and fragmentation


# XLA's bytes per unit of each term (module docstring): fitted to `compiled.memory_analysis()`
# of the train step and the sampler on CPU (memory-minimising scheduler), float32 and bfloat16.
COEF = {
    # train step
    "update": 3.04,  # x params shard: gradients, clipped gradients, new params and moments
    "gathered": 2.57,  # x block weights in compute dtype: FSDP all-gathers, unsharded grads
    "stash_D": 10.23,  # x L r T D b: residual stream, norms, attention output per layer
    "stash_F": 4.42,  # x L r T F b: gate, up, silu(gate), product per layer
    "stash_mask": 0.53,  # x L r T T 4: attention mask per layer
    "stash_A": 1.02,  # x L r H T T 4: attention probabilities per layer (unchunked)
    "attn_tmp": 1.84,  # x r H T T 4: one layer's attention backward (unchunked)
    "attn_chunk_tmp": 3.46,  # x r H C T 4: chunked attention (recomputed per chunk)
    "logits": 1.21,  # x r T V 4: logits and their gradient (unchunked)
    "logits_chunk": 0.45,  # x r C V 4 (chunked)
    "full_kl": 1.5,  # x r C V 4 per behaviour model: kl_estimator "full"'s re-score (1.0-2.0)
    # sampler
    "draw": 9.47,  # x rows V 4: one token's draw (logits, noise, log-softmax, ...)
    "dequant": 1.34,  # x block weights in bfloat16 (fp8 sampler)
    "prefill_cache": 0.91,  # x the unique prompts' cache (before repeating it n times)
    "prefill_attn": 1.9,  # x uniq H C S 4: prefill attention scores
    "decode_attn": 3.19,  # x rows H S 4: one decode step's attention scores
}


def abstract_mesh(sizes: dict) -> AbstractMesh:
    """A mesh of any shape without devices: shardings and shard shapes, nothing placed."""
    axes = sharding_lib.MESH_AXES
    return AbstractMesh(tuple(int(sizes[a]) for a in axes), axes, axis_types=(AxisType.Auto,) * 3)


def model_config(mcfg) -> model_lib.ModelConfig:
    """The ModelConfig `model.source` names, without loading any weights: the checkpoint's
    config.json if it exists, else KNOWN_MODELS by the directory's name."""
    source = str(mcfg.source)
    if source == "embedded":
        return _embedded_config(tuple(sorted(mcfg.to_dict().items())))
    from ess_jax import weights

    name = "SmolLM2-135M-Instruct" if source == "smollm2" else os.path.basename(source.rstrip("/"))
    path = os.path.join(source, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            hf = json.load(f)
    elif name in KNOWN_MODELS:
        hf = KNOWN_MODELS[name]
    else:
        raise ValueError(
            f"config.model.source: {source!r} has no config.json and is not one of "
            f"{sorted(KNOWN_MODELS)}"
        )
    return weights.config_from_hf(hf).replace(
        dtype=mcfg.dtype, logits_chunk=int(mcfg.logits_chunk), remat=bool(mcfg.get("remat"))
    )


@functools.lru_cache(maxsize=32)
def _embedded_config(model_items: tuple) -> model_lib.ModelConfig:
    import ml_collections

    from ess_jax import experiment

    box = {}

    def build():
        mcfg = ml_collections.ConfigDict(dict(model_items))
        box["cfg"], params, _ = experiment.load_policy(mcfg)
        return params

    jax.eval_shape(build)  # the embedded model's config, no params allocated
    return box["cfg"]


def tree_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs placed with `shardings`."""
    return int(
        sum(
            math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
            for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
        )
    )


def param_bytes(cfg, mesh, mode: str, dtype=None) -> int:
    """Per-device bytes of the params in the `train` or `sample` layout (float32 masters, or
    `dtype`: the sampler's bfloat16 copy, the gathered compute-dtype weights)."""
    abstract = model_lib.abstract_params(cfg)
    if dtype is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), abstract)
    return tree_bytes(abstract, layouts.param_shardings(cfg, mesh, mode))


def sampler_copy_bytes(cfg, mesh, precision: str) -> int:
    """Per-device bytes of the sampler's low-precision copy (precision.prepare_params): matrices
    in bfloat16, or fp8 block matrices (1 byte) with float32 per-channel scales; norm vectors
    stay float32. float32 samples from the params themselves: no copy."""
    from ess_jax.precision import FP8_INPUT_AXES

    if precision == "float32":
        return 0
    total = 0.0
    shardings = layouts.param_shardings(cfg, mesh, "sample")
    flat = jax.tree_util.tree_leaves_with_path(model_lib.abstract_params(cfg))
    for (path, x), s in zip(flat, jax.tree.leaves(shardings)):
        elems = math.prod(s.shard_shape(x.shape))
        name = getattr(path[-1], "key", None)
        if x.ndim < 2:
            total += 4 * elems
        elif precision == "fp8" and name in FP8_INPUT_AXES:
            total += elems * (1 + 4 / math.prod(x.shape[i] for i in FP8_INPUT_AXES[name]))
        else:
            total += 2 * elems
    return int(total)


def embedding_bytes(cfg, mesh, dtype) -> int:
    """Per-device bytes of the embedding and LM head in the sample layout, in `dtype`."""
    abstract = model_lib.abstract_params(cfg)
    shardings = layouts.param_shardings(cfg, mesh, "sample")
    keys = [k for k in ("embed", "lm_head") if k in abstract]
    return tree_bytes(
        [jax.ShapeDtypeStruct(abstract[k].shape, dtype) for k in keys], [shardings[k] for k in keys]
    )


def optimizer_bytes(cfg, mesh, optim: dict) -> int:
    """Per-device bytes of the AdamW state of `config.optim`: moments take their param's
    layout (as steps.init_state places them), scalars are replicated."""
    from ess_jax.optim import make_optimizer

    items = tuple(sorted(optim.items()))
    tx = make_optimizer({**dict(items), "total_steps": 1})
    opt = _optimizer_shapes(cfg, items)
    rep = NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        opt,
        layouts.param_shardings(cfg, mesh, "train"),
        transform_non_params=lambda _: rep,
    )
    return tree_bytes(opt, opt_sh)


@functools.lru_cache(maxsize=32)
def _optimizer_shapes(cfg, optim_items: tuple):
    """The optimizer state's ShapeDtypeStructs (tracing tx.init is the slow part: cached)."""
    from ess_jax.optim import make_optimizer

    tx = make_optimizer({**dict(optim_items), "total_steps": 1})
    return jax.eval_shape(tx.init, model_lib.abstract_params(cfg))


def _div(n: int, mesh, axis: str) -> int:
    """n split over a mesh axis when it divides (sharding.logical_to_spec replicates else)."""
    k = mesh.shape[axis]
    return n // k if n % k == 0 else n


def _rows(n: int, mesh) -> float:
    k = mesh.shape["data"] * mesh.shape["fsdp"]
    return n / k if n % k == 0 else float(n)


def train_terms(cfg, mesh, rows: int, seq_len: int, full_kl_models=0, scored_len=None) -> dict:
    """Bytes of each transient of one train step on a micro-batch of `rows` sequences of
    `seq_len` tokens (activations, gradients and update temporaries), per device.
    `full_kl_models`: behaviour models re-scored in the step (objective.kl_estimator "full":
    1, 2 with an external model); their params are the caller's to count. `scored_len`: the
    positions the LM head runs on (an RL step's responses; default all)."""
    r, t = _rows(rows, mesh), seq_len
    s = seq_len if scored_len is None else scored_len
    b = np.dtype(cfg.compute_dtype).itemsize
    n_layers, d = cfg.num_layers, cfg.hidden_size
    f = _div(cfg.intermediate_size, mesh, "tensor")
    h = _div(cfg.num_heads, mesh, "tensor")
    v = _div(cfg.vocab_size, mesh, "tensor")
    c = cfg.logits_chunk if 0 < cfg.logits_chunk < t else 0  # attention's query chunks
    c_head = cfg.logits_chunk if 0 < cfg.logits_chunk < s else 0  # the LM head's
    k = COEF
    terms = {"update": k["update"] * param_bytes(cfg, mesh, "train")}
    if mesh.shape["fsdp"] > 1:  # whole (tensor-sharded) weights in compute dtype
        full = param_bytes(cfg, mesh, "sample", cfg.compute_dtype)
        blocks = full - embedding_bytes(cfg, mesh, cfg.compute_dtype)
        terms["gathered"] = k["gathered"] * blocks
    per_layer = k["stash_D"] * r * t * d * b + k["stash_F"] * r * t * f * b
    per_layer += k["stash_mask"] * r * t * t * 4
    causal = layers.causal_blocks(t)  # unchunked attention: (queries, keys) of each block
    if not c:
        per_layer += k["stash_A"] * r * h * sum((z - a) * keys for a, z, keys in causal) * 4
    if cfg.remat:  # block inputs of every layer, one layer's stash while it is recomputed
        terms["activations"] = n_layers * r * t * d * b + per_layer
    else:
        terms["activations"] = n_layers * per_layer
    if c:
        terms["attention"] = k["attn_chunk_tmp"] * r * h * c * t * 4
    else:
        terms["attention"] = k["attn_tmp"] * r * h * max((z - a) * n for a, z, n in causal) * 4
    if c_head:
        terms["logits"] = k["logits_chunk"] * r * c_head * v * 4
    else:
        terms["logits"] = k["logits"] * r * s * v * 4
    if full_kl_models:  # a float32 forward per behaviour model, its LM head like the policy's
        terms["full KL re-score"] = k["full_kl"] * full_kl_models * r * (c_head or s) * v * 4
    return terms


def sampler_terms(
    cfg, mesh, prompts: int, samples: int, prompt_len: int, new_tokens: int, precision: str
) -> dict[str, float]:
    """Bytes of one sampler call (sampler.sample) on `prompts` prompts x `samples` samples, per
    device: the decode state's KV cache, and the transients of the prefill and of one decode
    step. `cfg.dtype` is the sampler's compute dtype (the cache's); `prompt_len` the bucketed
    prompt width."""
    b = np.dtype(cfg.compute_dtype).itemsize
    s = prompt_len + new_tokens
    n_kv = _div(cfg.num_kv_heads, mesh, "tensor")
    h = _div(cfg.num_heads, mesh, "tensor")
    rows, uniq = _rows(prompts * samples, mesh), _rows(prompts, mesh)
    per_row = 2 * cfg.num_layers * n_kv * s * cfg.head_dim * b  # K and V of every layer
    c = cfg.logits_chunk  # queries per chunk, or of the largest causal block
    if not 0 < c < prompt_len:
        c = max(z - a for a, z, _ in layers.causal_blocks(prompt_len))
    k = COEF
    draw = k["draw"] * rows * cfg.vocab_size * 4  # float32 logits, noise, log-softmax ...
    shared = draw
    if precision == "fp8":  # block matrices dequantised to bfloat16 inside every forward
        blocks = param_bytes(cfg, mesh, "sample") - embedding_bytes(cfg, mesh, jnp.float32)
        shared += k["dequant"] * blocks / 2
    return {
        "kv_cache": rows * per_row,
        "prefill": shared
        + k["prefill_cache"] * uniq * per_row
        + k["prefill_attn"] * uniq * h * c * prompt_len * 4,  # attends over the prompt only
        "decode": shared + k["decode_attn"] * rows * h * s * 4,
    }


@dataclasses.dataclass
class Plan:
    """Per-device bytes: `resident` buffers live for the whole run, each phase adds its own."""

    device: str
    mesh: dict
    resident: dict[str, float]
    phases: dict[str, dict[str, float]]

    def phase_total(self, phase: str) -> float:
        return sum(self.resident.values()) + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> float:
        return self.phase_total(self.peak_phase)

    @property
    def usable(self) -> float:
        return HBM[self.device] * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    def lines(self) -> list[str]:
        out = [f"mesh {self.mesh}, device {self.device} ({HBM[self.device] / GB:.0f} GB)"]
        out += [f"  {k:<24} {v / GB:8.2f} GB" for k, v in self.resident.items()]
        for phase, terms in self.phases.items():
            out.append(f"phase {phase}: {self.phase_total(phase) / GB:.2f} GB")
            out += [f"  + {k:<22} {v / GB:8.2f} GB" for k, v in terms.items()]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out.append(
            f"peak {self.peak / GB:.2f} GB per device ({self.peak_phase}) of "
            f"{self.usable / GB:.1f} GB usable ({HEADROOM:.0%} headroom): {verdict}"
        )
        return out


def plan(config, num_devices: int, device: str, mesh: dict | None = None) -> Plan:
    """The memory plan of `config` on `num_devices` devices of kind `device` (a key of HBM),
    with the config's mesh or `mesh`."""
    from ess_jax.sampler import bucket_length

    if device not in HBM:
        raise ValueError(f"unknown device {device!r}; valid: {sorted(HBM)}")
    sizes = sharding_lib.mesh_shape(dict(mesh or config.mesh), num_devices)
    amesh = abstract_mesh(sizes)
    cfg = model_config(config.model)
    r, t = config.rollout, config.train
    train_params = param_bytes(cfg, amesh, "train")
    sample_params = param_bytes(cfg, amesh, "sample")
    resident: dict[str, float] = {
        "params (f32)": train_params,
        "optimizer state": optimizer_bytes(cfg, amesh, config.optim.to_dict()),
    }
    # The policy history holds lag + 1 versions in the train layout, copies when lag > 0 (with
    # lag 0 the one version is the train params' own buffers).
    if r.lag:
        resident[f"policy history ({r.lag + 1}x)"] = (r.lag + 1) * train_params
    ecfg = None
    if r.external_fraction > 0:
        ecfg = model_config(_with_source(config.model, r.external_checkpoint))
        resident["external model (f32)"] = param_bytes(ecfg, amesh, "train")
    if config.objective.beta_kl > 0:
        resident["reference params"] = train_params

    prompt_len = max(config.data.buckets)  # worst case: the widest prompt bucket
    seq_len = prompt_len + r.max_new_tokens
    rows = config.data.prompts_per_step * r.group_size // t.updates_per_batch // t.num_microbatches
    full_kl = config.objective.get("kl_estimator") == "full"
    n_full = (1 + (r.external_fraction > 0)) if full_kl else 0
    phases: dict[str, dict[str, float]] = {
        "train step": train_terms(cfg, amesh, rows, seq_len, n_full, r.max_new_tokens)
    }
    if full_kl and not r.lag and t.updates_per_batch > 1:  # steps.full_kl_inputs' copy
        phases["train step"]["behaviour params copy"] = train_params

    calls = int(r.get("sample_microbatches", 1))
    prompts = config.data.prompts_per_step // calls
    n_ext = round(r.external_fraction * r.group_size) if ecfg is not None else 0
    for name, mcfg, precision, n in (
        ("sample", cfg, r.precision, r.group_size - n_ext),
        ("sample external", ecfg, r.external_precision, n_ext),
    ):
        if mcfg is None or n == 0:
            continue
        scfg = mcfg.replace(dtype="float32" if precision == "float32" else "bfloat16")
        terms = sampler_terms(
            scfg, amesh, prompts, n, bucket_length(prompt_len), r.max_new_tokens, precision
        )
        gathered = param_bytes(mcfg, amesh, "sample") if sizes["fsdp"] > 1 else 0.0
        phases[name] = {
            "sample-layout params (f32)": gathered,  # sampler.sample_layout, per collection
            f"sampler copy ({precision})": sampler_copy_bytes(mcfg, amesh, precision),
            "kv_cache": terms["kv_cache"],
            "sampler_tmp": max(terms["prefill"], terms["decode"]),
        }
    e = config.eval
    if e.every:  # evaluate.py samples in float32 from a sample-layout copy of the params
        terms = sampler_terms(
            cfg.replace(dtype="float32"), amesh, e.batch_size, e.k, bucket_length(prompt_len),
            e.max_new_tokens, "float32",
        )  # fmt: skip
        phases["eval"] = {
            "eval params (f32)": sample_params if sizes["fsdp"] > 1 else 0.0,
            "kv_cache": terms["kv_cache"],
            "sampler_tmp": max(terms["prefill"], terms["decode"]),
        }
    if r.lag:
        phases["history push"] = {"new version": train_params}
    return Plan(device, sizes, resident, phases)


def _with_source(mcfg, source: str):
    m = mcfg.copy_and_resolve_references()
    m.source = source
    return m

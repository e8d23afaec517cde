"""Per-device memory plan of a run before launching it: does a config fit a device?

`plan(config, num_devices, device)` counts, per device, the buffers a run holds for its whole
length (float32 params and AdamW moments, the policy history and an external model, all in the
FSDP-sharded train layout) and the transients of each phase: the train step (gradients, update
temporaries, FSDP-gathered weights, one micro-batch's activations, chunked or not), a sampler
collection (the sample-layout gather of the weights, their bfloat16 / fp8 copy, the KV cache,
prefill and decode temporaries), eval, the scoring pass of an objective that reads pi_prox or a
reference KL (scoring_terms.py: one chunk's forward), the history push and, for a group of a
two-program async run (train.async_role), the params copy of a sync; the peak phase decides. Shapes
and shardings are exact (`jax.eval_shape` of the optimizer, the model's logical axes on an
abstract mesh of any size); the per-unit coefficients (COEF) are XLA's, fitted to
`compiled.memory_analysis()` on CPU. tests/test_plan_memory.py holds the estimates within 25% of
XLA's for the train step, the scoring pass and the sampler on 1 and 8 devices, on shapes not
used for the fit.
On a TPU device (a key of presets.CHIPS) the transients are the TPU compiler's
(tpu_terms.py: the train step as the compiler realises remat, decode segments at their own
cache bound with the weight copies it hoists, and a reshard phase with its second copy of the
sample-layout params), within 10% of libtpu's memory_analysis on the committed records
(results/tpu/*.json) but the misses tests/test_tpu_planner.py pins (docs/tpu.md): the
coefficients are fitted on v5e and v5p (tools/fit_tpu_terms.py), extrapolated on v4, v6e and
tpu7x.
objective.kl_estimator "full" adds its re-score's logits to the train step (and, with lag 0
and several updates per batch, the copy of the params it re-scores with).

Not modelled: XLA's workspace and collective buffers on accelerators (the memory left free by
`presets.memory_fraction`: 10% by default, and what `ess_jax.main` leaves jax on GPUs),
host memory. `model.remat` is estimated as block inputs of every layer plus one layer
recomputed: XLA:CPU realises only part of that saving, so it cannot be checked here.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jax.sharding import AbstractMesh, AxisType

from ess_jax import objectives as obj_lib
from ess_jax.config.presets import GB, HBM, KNOWN_MODELS, memory_fraction
from ess_jax.data import char_tokenizer
from ess_jax.memory import scoring_terms, tpu_terms
from ess_jax.memory.terms import (  # noqa: F401  (re-exported: memory.X is the API)
    COEF,
    embedding_bytes,
    optimizer_bytes,
    optimizer_shapes,
    param_bytes,
    sampler_copy_bytes,
    sampler_terms,
    train_terms,
    trained_bytes,
    tree_bytes,
)
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import experiment, lora_policy, packed

TRAIN_PHASE = "train step"  # the phase of a plan that holds the RL step
SCORE_PHASE = "scoring pass"  # pi_prox / reference log-probs before the updates (steps.score_fn)


def abstract_mesh(sizes: dict) -> AbstractMesh:
    """A mesh of any shape without devices: shardings and shard shapes, nothing placed."""
    axes = sharding_lib.MESH_AXES  # an axis `sizes` leaves out has size 1
    shape = tuple(int(sizes.get(a, 1)) for a in axes)
    return AbstractMesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def model_config(mcfg) -> model_lib.ModelConfig:
    """The ModelConfig `model.source` names, without loading any weights: the checkpoint's
    config.json if it exists, else KNOWN_MODELS by the directory's name; the trainer settings
    (dtype, logits_chunk, remat, attention_impl) as experiment.load_policy sets them."""
    source = str(mcfg.source)
    if source == "embedded":
        return experiment.embedded_model_config(mcfg, char_tokenizer())
    from ess_jax.io import weights

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
    return weights.config_from_hf(hf).replace(**experiment.trainer_settings(mcfg))


@dataclasses.dataclass
class Plan:
    """Per-device bytes: `resident` buffers live for the whole run, each phase adds its own;
    `notes`: what the plan does not count, printed after its verdict."""

    device: str
    mesh: dict
    resident: dict[str, float]
    phases: dict[str, dict[str, float]]
    notes: tuple[str, ...] = ()
    collective_matmul: str = "auto"  # model.collective_matmul: which compiled ratio lines() names

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
        return HBM[self.device] * memory_fraction(self.device)

    @property
    def compiled_step(self) -> float | None:
        """The RL step at the compiled-over-planned ratio of its generation's compiles
        (tpu_terms.step_ratio: on v6e and tpu7x, whose TPU terms are extrapolated); None
        elsewhere."""
        ratio = tpu_terms.step_ratio(self.device, self.collective_matmul)
        if ratio is None or TRAIN_PHASE not in self.phases:
            return None
        return ratio * self.phase_total(TRAIN_PHASE)

    @property
    def judged(self) -> float:
        """The bytes the verdict weighs: the planned peak, or the compiled step where larger."""
        return max(self.peak, self.compiled_step or 0.0)

    @property
    def fits(self) -> bool:
        return self.judged <= self.usable

    def lines(self) -> list[str]:
        out = [f"mesh {self.mesh}, device {self.device} ({HBM[self.device] / GB:.0f} GB)"]
        out += [f"  {k:<24} {v / GB:8.2f} GB" for k, v in self.resident.items()]
        for phase, terms in self.phases.items():
            out.append(f"phase {phase}: {self.phase_total(phase) / GB:.2f} GB")
            out += [f"  + {k:<22} {v / GB:8.2f} GB" for k, v in terms.items()]
        miss = self.judged - self.usable
        verdict = "fits" if self.fits else f"DOES NOT FIT: {miss / GB:.2f} GB over"
        if self.judged > self.peak:  # the compiled ratio decides
            ratio = tpu_terms.step_ratio(self.device, self.collective_matmul)
            verdict = (
                f"{verdict} (the {TRAIN_PHASE} at {ratio:.2f}x, as {self.device}'s compiles lay "
                f"it out: {self.judged / GB:.2f} GB)"
            )
        out.append(
            f"peak {self.peak / GB:.2f} GB per device ({self.peak_phase}) of "
            f"{self.usable / GB:.1f} GB usable ({memory_fraction(self.device):.0%} of "
            f"{HBM[self.device] / GB:.0f} GB): {verdict}"
        )
        if tpu_terms.is_tpu(self.device) and self.device not in tpu_terms.FITTED:
            line = (
                f"extrapolated: the TPU terms are fitted on {' and '.join(tpu_terms.FITTED)} "
                f"compiles, not {self.device}"
            )
            if self.device in tpu_terms.EXTRAPOLATED_STEPS:
                line += "; " + tpu_terms.compiled_step_ratio(self.device, self.collective_matmul)
            out.append(line + " (docs/tpu.md)")
        return out + list(self.notes)


def runs_scoring_pass(config) -> bool:
    """Whether a run of `config` scores its rollout batches before the updates (steps.score_fn):
    its objective reads pi_prox (objectives.needs_prox), or a KL to the reference model."""
    objective = obj_lib.objective_config(config.objective.to_dict())
    return obj_lib.needs_prox(objective) or config.objective.beta_kl > 0


def device_train_terms(device: str, *args, **kwargs) -> dict:
    """train_terms on `device`: the TPU compiler's (tpu_terms) on a TPU, XLA:CPU's else."""
    fn = tpu_terms.train_terms if tpu_terms.is_tpu(device) else train_terms
    return fn(*args, **kwargs)


def sampler_phase(
    cfg, mesh, merged: bool, precision, prompts, samples, prompt_len, new_tokens, kv_cache,
    device: str = "h100",
) -> dict[str, float]:  # fmt: skip
    """Per-device bytes of one sampler call of the policy `cfg` in `precision` on `device` (a
    key of presets.HBM; a collection or held-out eval): its weights, KV cache and
    temporaries. `merged` (LoRA): one program merges base + adapters straight into the
    sampler's format and layout (lora_policy.merged; its temporaries, at most one float32
    matrix in XLA's count, are gone before the KV cache exists). Else sampler.sample_layout's
    gather (fsdp > 1), then precision.prepare_params: `sampler.prepare` rebinds its params to
    the cast copy, so a gather cast to another format is freed before the KV cache exists,
    and the phase is max(gather + copy, copy + KV cache + temporaries); float32 samples from
    the gather itself, held throughout."""
    from ess_jax.sampling.precision import sample_config

    args = (sample_config(cfg, precision), mesh, prompts, samples, prompt_len, new_tokens,
            precision, kv_cache)  # fmt: skip
    if tpu_terms.is_tpu(device):  # the largest program: the last decode segment, or the prefill
        terms = tpu_terms.sampler_terms(*args, device=device)
        prefill = terms["prefill"] + terms["prefill_cache"] - terms["kv_cache"]
        terms["prefill"] = max(prefill, 0.0)
    else:
        terms = sampler_terms(*args)
    copy = sampler_copy_bytes(cfg, mesh, precision)
    if merged:
        if precision == "float32":
            copy = param_bytes(cfg, mesh, "sample")
        weights = {f"merged sampler copy ({precision})": copy}
    else:
        gathered = param_bytes(cfg, mesh, "sample") if mesh.shape["fsdp"] > 1 else 0.0
        weights = {"sample-layout params (f32)": gathered, f"sampler copy ({precision})": copy}
    decoding = {
        "kv_cache": terms["kv_cache"],
        "sampler_tmp": max(terms["prefill"], terms["decode"]),
    }
    if not merged and precision != "float32" and weights["sample-layout params (f32)"]:
        # the gather lives only while prepare casts it: counted where it exceeds decoding's
        gathered = weights.pop("sample-layout params (f32)")
        weights["f32 gather over kv+tmp"] = max(0.0, gathered - sum(decoding.values()))
    return {**weights, **decoding}


def plan(
    config, num_devices: int, device: str, mesh: dict | None = None, peer_devices=None
) -> Plan:
    """The memory plan of `config` on `num_devices` devices of kind `device` (a key of HBM),
    with the config's mesh or `mesh`; `peer_devices`: for a group of a two-program async run,
    the other group's device count (None: as many as this one)."""

    if device not in HBM:
        raise ValueError(f"unknown device {device!r}; valid: {sorted(HBM)}")
    sizes = sharding_lib.mesh_shape(dict(mesh or config.mesh), num_devices)
    amesh = abstract_mesh(sizes)
    cfg = model_config(config.model)
    rank = lora_policy.lora_settings(config.model)[0]
    # LoRA: a frozen base (QLoRA: its block matrices as int8 / int4 codes and float32 scales)
    # and trained adapters; the sampler runs the merged model in rollout.precision, eval in
    # eval.precision
    cfg = lora_policy.lora_config(config.model, cfg)
    policy_cfg = lora.base_config(cfg)
    r, t = config.rollout, config.train
    train_params = param_bytes(cfg, amesh, "train")  # LoRA: base and adapters
    trained = trained_bytes(cfg, amesh)  # what the optimizer, history and snapshots hold
    resident: dict[str, float] = {
        "params (f32)": train_params,
        "optimizer state": optimizer_bytes(cfg, amesh, config.optim.to_dict()),
    }
    if rank:
        base = "f32" if cfg.lora_base_precision == "compute" else cfg.lora_base_precision
        resident = {f"frozen base ({base})": train_params - trained, "adapters (f32)": trained}
        resident["optimizer state"] = optimizer_bytes(cfg, amesh, config.optim.to_dict())
    # The policy history holds lag + 1 versions in the train layout, copies when lag > 0 (with
    # lag 0 the one version is the train params' own buffers).
    if r.lag:
        resident[f"policy history ({r.lag + 1}x)"] = (r.lag + 1) * trained
    ecfg = None
    if r.external_fraction > 0:
        ecfg = model_config(experiment.with_source(config.model, r.external_checkpoint))
        resident["external model (f32)"] = param_bytes(ecfg, amesh, "train")
    if config.objective.beta_kl > 0:
        resident["reference params"] = trained

    prompt_len = max(config.data.buckets)  # worst case: the widest prompt bucket
    seq_len = prompt_len + r.max_new_tokens
    rows = config.data.prompts_per_step * r.group_size // t.updates_per_batch // t.num_microbatches
    padded_rows, padded_len = rows, seq_len  # a micro-batch's, before packing (the scoring pass)
    scored = r.max_new_tokens
    if packed.by_tokens(config):  # one packed row per device, the LM head on all of it
        rows = sharding_lib.batch_ranks(amesh.shape)
        seq_len = scored = int(t.pack_length) or seq_len
    full_kl = config.objective.get("kl_estimator") == "full"
    n_full = (1 + (r.external_fraction > 0)) if full_kl else 0
    tpu = tpu_terms.is_tpu(device)
    phases: dict[str, dict[str, float]] = {
        TRAIN_PHASE: device_train_terms(device, cfg, amesh, rows, seq_len, n_full, scored)
    }
    if full_kl and not r.lag and t.updates_per_batch > 1:  # full_kl.FullKL.inputs' copy
        phases[TRAIN_PHASE]["behaviour params copy"] = trained
    if runs_scoring_pass(config):  # steps.score_fn: the padded rows in the micro-batches' chunks
        args = (policy_cfg if not rank else cfg, amesh, padded_rows, padded_len, r.max_new_tokens)
        phases[SCORE_PHASE] = scoring_terms.device_score_terms(device, *args)

    calls = int(r.get("sample_microbatches", 1))
    prompts = config.data.prompts_per_step // calls
    n_ext = round(r.external_fraction * r.group_size) if ecfg is not None else 0
    kv = r.get("kv_cache_precision", "compute")
    for name, mcfg, precision, n in (
        ("sample", policy_cfg, r.precision, r.group_size - n_ext),
        ("sample external", ecfg, r.external_precision, n_ext),
    ):
        if mcfg is None or n == 0:
            continue
        merged = bool(rank) and mcfg is policy_cfg
        phases[name] = sampler_phase(
            mcfg, amesh, merged, precision, prompts, n, prompt_len, r.max_new_tokens, kv, device
        )
    e = config.eval
    if e.every:  # rl/heldout.py: the policy in eval.precision, its KV cache in eval's own
        precision = e.get("precision", "float32")
        phases["eval"] = sampler_phase(
            policy_cfg, amesh, bool(rank), precision, e.batch_size, e.k, prompt_len,
            e.max_new_tokens, e.get("kv_cache_precision", "compute"), device,
        )  # fmt: skip
    # the TPU compiler's train -> sample move (tpu_terms.reshard_buffers); the two layouts
    # differ in the FSDP sharding only, so with fsdp 1 nothing moves (sampler.sample_layout)
    if tpu and not rank and amesh.shape["fsdp"] > 1:
        phases["reshard"] = {
            "sample-layout params (f32)": param_bytes(policy_cfg, amesh, "sample"),
            "reshard all-gather buffers": tpu_terms.reshard_buffers(policy_cfg, amesh),
        }
    if r.lag:
        phases["history push"] = {"new version": trained}
    if t.get("mode") == "async" and t.get("async_role", "both") != "both":
        # rl/groups.py: the trainer keeps its newest copy (train layout) and the one offered
        # for a pull, in the exchange layout, which may outlive the next train step; the
        # sampler group pulls into the exchange layout while it samples, then gathers to its
        # sample layout (the sample phase's weights). The exchange layout is the train one when
        # both groups have as many devices, else "fsdp" over the smaller count's devices
        # (group_channel.exchange_mesh): there, each holds the params / that count.
        e = min(num_devices, int(peer_devices or num_devices))
        exchange = trained if e == num_devices else trained_bytes(cfg, abstract_mesh({"fsdp": e}))
        phases[TRAIN_PHASE]["params sync copies (newest + offered)"] = trained + exchange
        if "sample" in phases:
            phases["sample"]["params sync copy (exchange layout)"] = exchange
    note = tpu_terms.free_remat_note(cfg, amesh) if tpu else None
    notes = (note,) if note else ()
    return Plan(device, sizes, resident, phases, notes, cfg.collective_matmul)

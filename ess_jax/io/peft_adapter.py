"""LoRA adapters as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
the format `peft.PeftModel.from_pretrained(hf_base, path)` loads onto the Hugging Face base.

Axis alphabet: R rank, I / O a weight's flattened input / output width. Ours: A [*I, R] and
B [R, *O] with W [*I, *O] (model/lora.py); PEFT's torch Linear layout: lora_A.weight [R, I],
lora_B.weight [O, R], and the HF weight [O, I] gains (alpha / R) lora_B @ lora_A = ((alpha / R)
A B)^T, the transpose of ours (hf_layout.to_hf's). Tensor names follow PEFT's
`base_model.model.<HF module>.lora_A.weight`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import numpy as np

from ess_jax.io import hf_layout
from ess_jax.model import lora
from ess_jax.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_MODULE_OF = {
    **dict.fromkeys(lora.ATTENTION_TARGETS, "attn"),
    **dict.fromkeys(lora.MLP_TARGETS, "mlp"),
}


def _module(i, module: str, name: str) -> str:
    """HF module path of a targeted weight, e.g. model.layers.0.self_attn.q_proj."""
    return hf_layout.hf_name(("layers", i, module, name)).removesuffix(".weight")


def adapter_tensors(cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} of an adapters tree (host copies)."""
    out = {}
    for i, module, name, a, b in lora.pairs(adapters):
        a, b = np.asarray(jax.device_get(a), np.float32), np.asarray(jax.device_get(b), np.float32)
        r = cfg.lora_rank
        key = _PREFIX + _module(i, module, name)
        out[key + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        out[key + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return out


def base_model_path(base_model: str | None) -> str | None:
    """adapter_config.json's `base_model_name_or_path`: a local path that exists made absolute
    (a relative one, as typed at launch, would be resolved against the directory the adapter is
    loaded from: `AutoPeftModelForCausalLM` fails anywhere else); any other name as given."""
    if base_model and os.path.exists(base_model):
        return os.path.abspath(base_model)
    return base_model


def adapter_config(cfg: ModelConfig, base_model: str | None) -> dict:
    hf_names = {n: _module(0, m, n).rsplit(".", 1)[1] for n, m in _MODULE_OF.items()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path(base_model),
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(hf_names[n] for n in lora.targets_of(cfg, lora.TARGETS)),
        "use_rslora": False,
        "inference_mode": True,
    }


def save_peft(
    cfg: ModelConfig, adapters: dict, path: str | os.PathLike, base_model: str | None = None
) -> None:
    """Write the PEFT adapter directory of a LoRA `cfg`'s adapters. Every process must call it
    (sharded adapters are gathered); process 0 writes."""
    from safetensors.numpy import save_file

    tensors = adapter_tensors(cfg, adapters)
    expected = lora.num_adapter_params(cfg)
    got = sum(math.prod(t.shape) for t in tensors.values())
    if got != expected:
        raise ValueError(f"adapters hold {got} parameters, the config's targets need {expected}")
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, base_model), indent=2))

"""What a run reads and writes: orbax train-state checkpoints written atomically and resumed
exactly (checkpoint.py, checkpoint_tree.py, orbax_quiet.py), the run directory and its resume
rules (workdir.py), and Hugging Face / GGUF weights (weights.py, hf_layout.py, gguf_llama.py).

`ess_jax.io.weights` is imported on first use of its names: safetensors and gguf load only when
a run reads or writes a checkpoint of theirs."""

import importlib

from ess_jax.io.checkpoint import Checkpointer, CheckpointError
from ess_jax.io.workdir import WorkdirError, WorkdirLock

_LAZY = {
    "load_checkpoint": "weights",
    "load_hf": "weights",
    "save_hf": "weights",
    "load_gguf": "gguf_llama",
    "smollm2_gguf_path": "gguf_llama",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"ess_jax.io.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ess_jax.io' has no attribute {name!r}")


__all__ = ["CheckpointError", "Checkpointer", "WorkdirError", "WorkdirLock", *_LAZY]

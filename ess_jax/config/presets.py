"""Hardware presets: the slices the paper configs name (`--config=FILE:ARM,PRESET`).

A preset is a device kind, a device count over some hosts, and the (data, fsdp, tensor) mesh
that fits the paper's models (Qwen3-4B, Qwen2.5-1.5B; a Qwen3-8B external sampler) there. The
trainer's layout shards params and AdamW moments over `fsdp` (and `tensor`); the sampler's
layout drops the FSDP sharding (no all-gathers per decoded token), so its per-device weight
bytes are params / tensor: the v5e slice needs tensor parallelism to hold them in 16 GB.

Multi-host (v5e-16: 4 hosts): run the same command on every host; `jax.distributed` is
initialised from the environment (sharding.maybe_initialize_distributed: JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID when set, else jax's own detection of Cloud TPU VMs, SLURM
and Open MPI jobs of more than one process).

MEM_FRACTION: the share of device memory the planner allows and `ess_jax.main` gives jax;
`user_memory_fraction` reads (and checks) the user's own.

KNOWN_MODELS: the config.json fields of those models (and SmolLM2), so that the memory planner
(ess_jax/memory/planner.py) and the config checks can size a run without the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from ess_jax.config.schema import UserError

GB = 1e9
# Accelerator memory per device, decimal GB as the vendors state it (H100 SXM 80 GB, H200 141 GB,
# TPU v5p 95 GB per chip, TPU v5e 16 GB per chip, TPU v4 32 GB per chip).
HBM = {"h100": 80 * GB, "h200": 141 * GB, "v5p": 95 * GB, "v5e": 16 * GB, "v4": 32 * GB}
GPUS = ("h100", "h200")

# The share of each device's memory a run may fill; the rest is left to XLA's workspace,
# collectives and fragmentation. The memory planner checks a plan against it, and on GPUs the
# launch gives jax that share: jax preallocates the share its environment names (75% unless set),
# so `set_memory_fraction` sets it to this before jax starts, unless the user set it (then the
# planner uses the user's value for GPUs). jaxlib reads XLA_CLIENT_MEM_FRACTION or its older,
# deprecated name XLA_PYTHON_CLIENT_MEM_FRACTION, and refuses the two set together.
MEM_FRACTION = 0.9
MEM_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MEM_FRACTION_ENV = MEM_FRACTION_ENVS[1]  # the name the launch sets: every jaxlib reads it


def user_memory_fraction(environ=None) -> float | None:
    """The share of GPU memory the user gave jax under either of MEM_FRACTION_ENVS (an empty
    value is unset, as jaxlib reads it), or None; UserError (one line) for a value that is not a
    number in (0, 1], or for both names set to different values."""
    environ = os.environ if environ is None else environ
    given = {}
    for name in MEM_FRACTION_ENVS:
        text = environ.get(name, "")
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= 1:  # NaN too
            raise UserError(
                f"{name}={text!r}: must be a number in (0, 1], the share of each GPU's memory "
                "jax may take"
            )
        given[name] = value
    if len(set(given.values())) > 1:
        both = " and ".join(f"{n}={environ[n]}" for n in given)
        raise UserError(f"{both} disagree: set one of them ({MEM_FRACTION_ENVS[0]}: jaxlib's name)")
    return next(iter(given.values()), None)


def memory_fraction(device: str, environ=None) -> float:
    """The share of a `device`'s memory a run may use: the user's (`user_memory_fraction`) on a
    GPU when set, else MEM_FRACTION."""
    user = user_memory_fraction(environ) if device in GPUS else None
    return MEM_FRACTION if user is None else user


def set_memory_fraction(environ=None) -> None:
    """Before jax starts a backend: MEM_FRACTION_ENV = MEM_FRACTION unless the user set either
    name (`user_memory_fraction`: UserError for a bad value). Both names set to one value: the
    deprecated one is dropped, as jaxlib refuses the two together."""
    environ = os.environ if environ is None else environ
    if user_memory_fraction(environ) is None:
        environ[MEM_FRACTION_ENV] = str(MEM_FRACTION)
    elif all(environ.get(name) for name in MEM_FRACTION_ENVS):
        del environ[MEM_FRACTION_ENVS[1]]


@dataclasses.dataclass(frozen=True)
class Preset:
    device: str  # a key of HBM
    num_devices: int  # JAX devices (one per GPU / TPU chip)
    num_hosts: int
    mesh: dict  # sharding.MESH_AXES -> size


PRESETS: dict[str, Preset] = {
    "8xh100": Preset("h100", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}),
    "8xh200": Preset("h200", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}),
    # a v5p-8 slice is 4 chips (8 TensorCores, one JAX device per chip) on one host
    "v5p-8": Preset("v5p", 4, 1, {"data": 1, "fsdp": 4, "tensor": 1}),
    "v5e-16": Preset("v5e", 16, 4, {"data": 1, "fsdp": 4, "tensor": 4}),
}


DEFAULT = "8xh100"  # the paper's hardware


class PresetRefused(ValueError):
    """A config file refuses a preset its runs do not fit (configs/paper/common.py `parse`)."""


_planning: list[bool] = []


@contextlib.contextmanager
def planning():
    """Config files build a config for any preset inside this block, the ones they refuse
    included (tools/plan_memory.py shows by how much those miss)."""
    _planning.append(True)
    try:
        yield
    finally:
        _planning.pop()


def refuse(why: str) -> None:
    """PresetRefused(why), except inside `planning()`."""
    if not _planning:
        raise PresetRefused(why)


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


# config.json fields of the paper's models (and SmolLM2), for planning without the checkpoint.
KNOWN_MODELS: dict[str, dict] = {
    "Qwen3-4B-Thinking-2507": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560,
        intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=5e6, max_position_embeddings=262144,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "Qwen3-8B": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "Qwen2.5-1.5B": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536,
        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=131072,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "SmolLM2-135M-Instruct": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, rope_theta=1e5, max_position_embeddings=8192,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
}  # fmt: skip

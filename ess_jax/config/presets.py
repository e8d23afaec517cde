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

KNOWN_MODELS: the config.json fields of those models (and SmolLM2, and the mixture of experts
Qwen3-30B-A3B), so that the memory planner
(ess_jax/memory/planner.py) and the config checks can size a run without the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from ess_jax.config.schema import UserError

GB = 1e9
GIB = 2**30
# Accelerator memory per JAX device, as the vendors state it per chip (H100 SXM 80 GB, H200
# 141 GB; TPUs: CHIPS below), divided among the chip's devices as libtpu describes them.
HBM = {"h100": 80 * GB, "h200": 141 * GB}


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's per-chip figures, as Google's Cloud TPU pages state them
    (docs.cloud.google.com/tpu/docs/{v4,v5e,v5p-training,v6e,tpu7x}), and the JAX devices per
    chip on a TPU VM: one, or TPU7x's two chiplets. (v4's two TensorCores are one megacore
    device on a VM, as HBM counts them; memory/tpu.topology_devices asks libtpu for the same,
    its chip config "megacore".)"""

    hbm: float  # bytes per chip
    bf16_flops: float  # peak dense bf16 flop/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float | None  # bidirectional inter-chip bytes/s per chip (v4: not stated)
    devices_per_chip: int = 1


CHIPS = {
    "v4": Chip(32 * GIB, 275e12, 1200e9, None),
    "v5e": Chip(16 * GB, 197e12, 819e9, 400e9),
    "v5p": Chip(95 * GB, 459e12, 2765e9, 1200e9),
    "v6e": Chip(32 * GB, 918e12, 1638e9, 800e9),
    "tpu7x": Chip(192 * GIB, 2307e12, 7380e9, 1200e9, 2),
}
HBM.update({kind: chip.hbm / chip.devices_per_chip for kind, chip in CHIPS.items()})
GPUS = ("h100", "h200")
# libtpu's device_kind of each TPU generation (jax.Device.device_kind) -> its key in CHIPS
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e",
             "TPU7x": "tpu7x"}  # fmt: skip

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
    num_devices: int  # JAX devices (one per GPU; per TPU chip, or TensorCore: Chip)
    num_hosts: int
    mesh: dict  # sharding.MESH_AXES -> size
    topology: str | None = None  # TPUs: libtpu's name (tools/compile_tpu.py compiles for it)


# TPU slices are named as Google names them: v4 and v5p by TensorCores (v5p-8: 4 chips), v5e,
# v6e and TPU7x by chips. Meshes: FSDP over the chips while params, AdamW moments and the
# sampler's bf16 copy fit; tensor parallelism where the sample layout (params / tensor per
# device) would not fit 16 GB devices; data parallelism across the pods' remaining chips.
PRESETS: dict[str, Preset] = {
    "8xh100": Preset("h100", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}),
    "8xh200": Preset("h200", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}),
    "v5p-8": Preset("v5p", 4, 1, {"data": 1, "fsdp": 4, "tensor": 1}, "v5p:2x2x1"),
    "v5e-16": Preset("v5e", 16, 4, {"data": 1, "fsdp": 4, "tensor": 4}, "v5e:4x4"),
    "v4-8": Preset("v4", 4, 1, {"data": 1, "fsdp": 1, "tensor": 4}, "v4:2x2x1"),
    "v5e-8": Preset("v5e", 8, 2, {"data": 1, "fsdp": 2, "tensor": 4}, "v5e:2x4"),
    "v6e-8": Preset("v6e", 8, 2, {"data": 1, "fsdp": 4, "tensor": 2}, "v6e:2x4"),
    "tpu7x-8": Preset("tpu7x", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}, "tpu7x:2x2x1"),
    "v5p-64": Preset("v5p", 32, 8, {"data": 8, "fsdp": 4, "tensor": 1}, "v5p:4x4x2"),
    "v5e-256": Preset("v5e", 256, 64, {"data": 16, "fsdp": 4, "tensor": 4}, "v5e:16x16"),
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


def parse_mesh(text: str, flag: str = "--mesh") -> dict[str, int]:
    """A tool's mesh flag, 'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}; UserError naming
    `flag` for an item that is not AXIS=SIZE with an integer size. Which axes and sizes fit
    the devices is parallel/sharding.mesh_shape's to say."""
    out = {}
    for item in text.split(","):
        axis, _, size = item.partition("=")
        try:
            out[axis.strip()] = int(size)
        except ValueError:
            raise UserError(
                f"{flag} {text}: {item!r} is not AXIS=SIZE (e.g. fsdp=4,tensor=2; one size may "
                "be -1, the devices left)"
            ) from None
    return out


# config.json fields of the paper's models (and SmolLM2, Qwen3-30B-A3B), for planning without
# the checkpoint.
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
    "Qwen3-30B-A3B": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
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

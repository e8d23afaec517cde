"""model.collective_matmul and model.scheduler_memory_percent: libtpu's flags as the train mesh's
programs' compiler_options (ess_jax/parallel/sharding.py `compiler_options`, docs/tpu.md).

The flags are libtpu's: XLA:CPU refuses them ("No such compile option"), which lets a CPU test
see which programs carry them, and a toy FSDP step compiled for tpu7x shows what they do.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ess_jax.config.defaults import base_config
from ess_jax.memory import planner, programs
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import steps

TRAIN_MESH = {"rl_step", "score", "sft_step"}


# a one-layer embedded model whose run has all three train-mesh programs: grpo_tis needs
# pi_prox (the scoring pass), sft.steps the SFT step
TINY = {"model.num_layers": 1, "model.collective_matmul": "none",
        "model.scheduler_memory_percent": 25, "data.prompts_per_step": 8,
        "data.buckets": (16,), "rollout.group_size": 2, "rollout.max_new_tokens": 4,
        "objective.name": "grpo_tis", "sft.steps": 1, "sft.seq_len": 16,
        "sft.batch_size": 8}  # fmt: skip


def _tiny_config():
    c = base_config()
    for path, value in TINY.items():
        section, field = path.split(".")
        c[section][field] = value
    return c


def _compile_all(config, only=None):
    """name -> None if the program compiled on this host's CPU devices, else the error."""
    steps.score_fn.cache_clear()  # its jitted pass is cached by (cfg, ..., mesh)
    mesh = sharding_lib.make_mesh(dict(config.mesh), jax.devices())
    out, compiled = {}, {}
    for program in programs.run_programs(config, mesh):
        if only and program.name not in only:
            continue
        try:
            compiled[program.name] = program.lower(compiled).compile()
            out[program.name] = None
        except Exception as e:  # XLA's INVALID_ARGUMENT
            out[program.name] = str(e)
    return out


def test_the_flags_reach_the_train_programs_only_and_not_a_cpu_compile(monkeypatch):
    """Catches model.collective_matmul "none" or a scheduler memory limit that breaks a CPU or GPU
    run (libtpu's flags handed to XLA:CPU, which refuses them), both settings not turned into
    their flags, and a train-mesh program built without the options (the RL step, the scoring
    pass or the SFT step left on libtpu's collective matmuls), or a sampler program given them:
    with the platform check bypassed, exactly the train programs fail on the CPU (the sampler's
    prefill and the reshard compile), each naming the flag."""
    config = _tiny_config()
    errors = _compile_all(config, only=TRAIN_MESH)
    assert set(errors) == TRAIN_MESH and not any(errors.values()), errors

    def everywhere(cfg, mesh):  # as on a TPU mesh
        assert mesh.devices.flat[0].platform == "cpu"
        return sharding_lib.libtpu_flags(cfg) or None

    monkeypatch.setattr(sharding_lib, "compiler_options", everywhere)
    errors = _compile_all(config, only=TRAIN_MESH | {"reshard", "sample/prefill"})
    failed = {name for name, e in errors.items() if e}
    assert failed == TRAIN_MESH, errors
    assert all("No such compile option" in errors[n] for n in TRAIN_MESH)
    flags = sharding_lib.libtpu_flags(planner.model_config(config.model))
    assert flags == {**sharding_lib.NO_COLLECTIVE_MATMUL, sharding_lib.SCHEDULER_MEMORY_LIMIT: 25}
    assert all(any(flag in errors[n] for flag in flags) for n in TRAIN_MESH), errors


def test_the_flags_remove_tpu7x_collective_matmul_buffer():
    """Catches the flags going stale (a libtpu that renames or ignores them: the knob would
    silently do nothing): an FSDP-gathered projection compiled for tpu7x becomes a collective
    matmul writing into an `AllocateBuffer` of its own under libtpu's defaults, and is a plain
    all-gather with collective_matmul "none"'s compiler_options, its temporaries smaller."""
    from ess_jax.memory import tpu
    from ess_jax.model.config import ModelConfig

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    mesh = Mesh(np.array(tpu.topology_devices("tpu7x:2x2x1")), ("fsdp",))
    assert len(mesh.devices.flat) == 8

    def loss(x, w):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))  # FSDP's gather
        return jnp.sum(jax.nn.relu(x @ w))

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    args = (arg((8 * 8192, 4096), P("fsdp", None)), arg((4096, 2048), P("fsdp", None)))
    out = {}
    for setting in ("auto", "none"):
        options = sharding_lib.compiler_options(ModelConfig(collective_matmul=setting), mesh)
        assert (options is None) == (setting == "auto")
        compiled = jax.jit(loss, compiler_options=options).lower(*args).compile()
        out[setting] = (compiled.as_text().count("AllocateBuffer"),
                        compiled.memory_analysis().temp_size_in_bytes)  # fmt: skip
    assert out["auto"][0] >= 1 and out["none"][0] == 0, out
    assert out["none"][1] < out["auto"][1], out


@pytest.mark.parametrize(
    "field, value, message",
    [("collective_matmul", "off", "collective_matmul: unknown"),
     ("collective_matmul", "", "collective_matmul: unknown"),
     ("scheduler_memory_percent", 101, r"must be in \[0, 100\]"),
     ("scheduler_memory_percent", -5, r"must be in \[0, 100\]")],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_the_field(field, value, message):
    """Catches a misspelt setting taken as "auto" (the flags silently not set) and a memory
    limit outside a percentage handed to libtpu."""
    from ess_jax.model.config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})

"""Every config file and arm loads, validates, shards sensibly and (paper configs) fits its preset.

configs/*.py, configs/paper/*.py and configs/mini/*.py. Paths that only exist on a cluster
(checkpoints, dataset dirs) and required placeholders are replaced by fakes: a directory with
the named model's config.json, an empty dataset directory, the embedded model, so `validate`
runs its mesh, batch and precision checks instead of stopping at the first missing path. The
model, train state and sampler shardings are built abstractly (`jax.eval_shape`, an abstract
mesh of the preset's shape: no weights, any device count).
"""

import glob
import importlib.util
import json
import os

import jax
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs.mini import common as mini_common
from configs.paper import common as paper
from ess_jax.config import presets
from ess_jax.memory import planner as memory
from ess_jax.model import decoder as model
from ess_jax.parallel import sharding
from ess_jax.rl import experiment
from ess_jax.rl.optim import make_optimizer

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = sorted(
    p
    for pattern in ("configs/*.py", "configs/paper/*.py", "configs/mini/*.py")
    for p in glob.glob(os.path.join(ROOT, pattern))
    if os.path.basename(p) not in ("__init__.py", "common.py")
)
LARGE = 2**20  # elements: a leaf this big must not be replicated on every device


def load_module(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__doc__ and "python -m ess_jax.main" in mod.__doc__, f"{path}: no run command"
    return mod


def config_args(mod) -> list:
    """Every arm a file offers: ARMS (paper arms also with `tiny`, the first and last on each
    preset the file says it fits), or None plus `tiny` when the docstring promises `:tiny`."""
    if not hasattr(mod, "ARMS"):
        return [None] + (["tiny"] if ":tiny" in mod.__doc__ else [])
    if "/paper/" not in mod.__file__:
        return list(mod.ARMS)
    return [a + suffix for a in mod.ARMS for suffix in ("", ",tiny")] + [
        f"{a},{p}" for a in {mod.ARMS[0], mod.ARMS[-1]} for p in mod.PRESETS
    ]


def fake_checkpoint(source, tmp_path) -> str:
    """A directory holding only the config.json of the model `source` names."""
    if source is None:  # a required placeholder (configs/mini: the seed's warm start)
        return "embedded"
    if source in ("embedded", "smollm2") or os.path.exists(source):
        return source
    name = os.path.basename(source.rstrip("/"))
    fake = tmp_path / name
    fake.mkdir(exist_ok=True)
    (fake / "config.json").write_text(json.dumps(memory.KNOWN_MODELS[name]))
    return str(fake)


def with_fakes(c, tmp_path):
    if c.task.manual_dir and not os.path.isdir(c.task.manual_dir):
        c.task.manual_dir = str(tmp_path / "data")
        os.makedirs(c.task.manual_dir, exist_ok=True)
    if c.rollout.external_fraction:
        c.rollout.external_checkpoint = fake_checkpoint(c.rollout.external_checkpoint, tmp_path)
    c.model.source = fake_checkpoint(c.model.source, tmp_path)
    return c


def preset_of(arg, mod=None) -> presets.Preset | None:
    """The preset of `arg` (ARM,PRESET); a bare arm's is presets.DEFAULT, or the first of the
    file's PRESETS where DEFAULT is not one of them (configs/paper/moe_qwen3_30b_a3b.py)."""
    default = presets.DEFAULT
    if default not in getattr(mod, "PRESETS", (default,)):
        default = mod.PRESETS[0]
    name = (arg or "").partition(",")[2] or (default if arg else "")
    return presets.PRESETS.get(name)


def check_shardings(c, num_devices: int) -> None:
    """Model, train state and sampler shardings on an abstract mesh of the config's shape:
    no large param or optimizer leaf replicated; the sample layout has no FSDP axis."""
    mesh = memory.abstract_mesh(sharding.mesh_shape(dict(c.mesh), num_devices))
    cfg = memory.model_config(c.model)
    params = model.abstract_params(cfg)
    train_sh = model.param_shardings(cfg, mesh, "train")
    tx = make_optimizer({**c.optim.to_dict(), "total_steps": 1})
    opt = memory.optimizer_shapes(cfg, tuple(sorted(c.optim.to_dict().items())))
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, opt, train_sh, transform_non_params=lambda _: rep
    )
    for tree, shardings in ((params, train_sh), (opt, opt_sh)):
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
            if x.size >= LARGE and mesh.size > 1:
                assert not s.is_fully_replicated, (x.shape, s)
    for s in jax.tree.leaves(model.param_shardings(cfg, mesh, "sample")):
        assert "fsdp" not in jax.tree.leaves(tuple(s.spec))  # no FSDP all-gathers per token


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_config_and_arm_validates_shards_and_fits(path, tmp_path, monkeypatch):
    """Catches: a config a user cannot launch (bad mesh / batch / precision / objective, an
    arm its docstring promises but get_config ignores), a rules table that leaves a large
    parameter or Adam moment replicated on the preset's mesh, and a paper preset whose
    batching the memory planner says does not fit the device."""
    mod = load_module(path)
    configs = {arg: mod.get_config(arg) for arg in config_args(mod)}
    if "tiny" in configs:
        assert configs["tiny"].to_dict() != configs[None].to_dict(), "':tiny' is ignored"
    for arg, c in configs.items():
        c = with_fakes(c, tmp_path)
        if getattr(mod, "WARM", "policy") == "moe":  # its warm start is the embedded MoE
            mini_common.moe_model(c)
        preset = preset_of(arg, mod)
        n = preset.num_devices if preset else jax.device_count()
        with monkeypatch.context() as m:
            m.setattr(jax, "device_count", lambda n=n: n)  # the preset's slice, not this host
            if preset is not None and preset.topology:  # a TPU's kernels (moe_impl grouped)
                m.setattr(jax, "default_backend", lambda: "tpu")
            experiment.validate(c)
        check_shardings(c, n)
        if preset is not None:
            plan = memory.plan(c, preset.num_devices, preset.device)
            assert plan.fits, (arg, "\n".join(plan.lines()))


def test_paper_arms_parse_and_reject_unknown_names():
    """Catches: an arm or preset typo silently running the default."""
    assert paper.parse("p3o,v5p-8", ("p3o",)) == ("p3o", "v5p-8")
    assert paper.parse("p3o", ("p3o",)) == ("p3o", presets.DEFAULT)
    with pytest.raises(ValueError, match="unknown arm"):
        paper.parse("p3o_typo", ("p3o",))
    with pytest.raises(ValueError, match="unknown preset"):
        paper.parse("p3o,v5p-9", ("p3o",))
    with pytest.raises(ValueError, match="does not fit"):
        paper.parse("p3o,v5e-16", ("p3o",), fits=("8xh100",))


def test_dapo_arms_take_the_overlong_penalty_in_paper_configs_only():
    """Catches a paper DAPO arm without DAPO's soft overlong penalty, a buffer other than a fifth
    of the finished config's max_new_tokens (DAPO: 4096 of 20480; `tiny` shrinks the budget
    after the arm is chosen, and a 4K-sized buffer of 819 would exceed its 16 new tokens), and a
    configs/mini arm that gains the penalty (the committed results/ were run without it)."""
    dapo = 0
    for path in CONFIGS:
        mod = load_module(path)
        for arg in config_args(mod):
            c = mod.get_config(arg)
            buffer, budget = c.rollout.overlong_buffer, c.rollout.max_new_tokens
            if c.objective.name == "dapo" and "/paper/" in path:
                assert buffer == budget // paper.DAPO_OVERLONG_FRACTION and 0 < buffer <= budget
                dapo += 1
            else:
                assert buffer == 0, (path, arg)
    assert dapo and paper.DAPO_OVERLONG_FRACTION == 5  # 4096 / 20480
    from configs.paper import e1_clip_sweep

    assert e1_clip_sweep.get_config("dapo").rollout.overlong_buffer == 819  # at 4096 tokens


def test_paper_configs_evaluate_on_a_held_out_split():
    """Catches: the in-run eval reading DeepScaleR's training prompts (test_split 'train')."""
    for path in CONFIGS:
        mod = load_module(path)
        for arg in config_args(mod):
            c = mod.get_config(arg)
            if c.task.manual_dir:
                assert c.eval.every == 0 or c.task.test_split != "train", (path, arg)


def test_known_models_have_the_papers_sizes():
    """Catches: a typo in the planner's model table (the README's memory column uses it)."""
    sizes = {
        name: sum(
            x.size for x in jax.tree.leaves(model.abstract_params(memory.model_config(_m(name))))
        )
        for name in memory.KNOWN_MODELS
    }
    assert 3.9e9 < sizes["Qwen3-4B-Thinking-2507"] < 4.1e9
    assert 8.0e9 < sizes["Qwen3-8B"] < 8.4e9
    assert 1.5e9 < sizes["Qwen2.5-1.5B"] < 1.6e9
    assert 1.3e8 < sizes["SmolLM2-135M-Instruct"] < 1.4e8


def _m(name):
    from ess_jax.config.defaults import base_config

    c = base_config().model
    c.source = "/nonexistent/" + name
    return c


def test_every_objective_field_is_in_the_config_and_none_means_paper_default():
    import dataclasses

    from ess_jax.config.defaults import base_config
    from ess_jax.objectives import ObjectiveConfig, objective_config

    c = base_config()
    assert set(c.objective.keys()) == {f.name for f in dataclasses.fields(ObjectiveConfig)}
    assert objective_config(c.objective) == ObjectiveConfig()
    c.objective.name = "dapo"
    assert objective_config(c.objective).clip_eps_high == 0.28  # DAPO clip-higher
    c.objective.clip_eps_high = 0.3
    assert objective_config(c.objective).clip_eps_high == 0.3

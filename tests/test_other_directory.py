"""Commands and exports used from another directory than the repository's root: a config file
named by its full path loads from anywhere (its `configs.*` imports found), and a PEFT adapter
records its base model by a path that holds from anywhere."""

import os
import sys

import pytest
from conftest import tiny_model_cfg
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from ess_jax import main
from ess_jax.config import names
from ess_jax.io import peft_adapter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM_START = os.path.join(REPO, "configs", "mini", "warm_start.py")


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A process started in `tmp_path`: neither the repository nor its `configs` package is
    importable until something puts the repository on sys.path."""
    monkeypatch.chdir(tmp_path)
    keep = [
        p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != os.path.realpath(REPO)
    ]
    monkeypatch.setattr(sys, "path", keep)
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_a_config_file_in_the_repository_loads_from_any_directory(elsewhere):
    """Catches `cd /tmp && python -m ess_jax.main --config=<repo>/configs/mini/warm_start.py`
    failing with "No module named 'configs'": main must put the directory holding the file's
    `configs` package on sys.path before the flags parser loads the file."""
    spec = f"{WARM_START}:external"
    with pytest.raises(ModuleNotFoundError, match="configs"):  # the bug, without main's step
        ConfigFileFlagParser("config").parse(spec)
    main._config_root_on_path(["main", f"--config={spec}", "--workdir=run"])
    assert sys.path[0] == REPO
    config = ConfigFileFlagParser("config").parse(spec)
    assert config.model.init_seed == config.seed + 1000  # the :external arm of that file
    assert names.config_root(os.path.join(REPO, "configs", "quickstart.py")) == REPO
    assert names.config_root(str(elsewhere / "mine.py")) is None


def test_a_config_file_outside_any_repository_says_where_to_run_from(elsewhere):
    """Catches a copied config file that imports `configs.*` ending in the bare "No module
    named 'configs'", which does not say that the repository's root is the place to run from."""
    argv = ["main", f"--config={elsewhere / 'mine.py'}", "--workdir=run"]
    exc = ModuleNotFoundError("No module named 'configs'", name="configs")
    line = names.explain_flag_error(argv, exc)
    assert line.startswith(f"config file {elsewhere / 'mine.py'}: No module named 'configs': ")
    assert line.endswith("or run from the repository's root") and "\n" not in line


def test_the_peft_adapter_records_its_local_base_by_absolute_path(elsewhere):
    """Catches adapter_config.json recording `model.source` as typed at launch (a relative
    path), which AutoPeftModelForCausalLM.from_pretrained resolves against its own working
    directory and fails from any other; a name that is no local path must stay as given."""
    (elsewhere / "runs" / "warm" / "hf").mkdir(parents=True)
    cfg = tiny_model_cfg(lora_rank=2)
    conf = peft_adapter.adapter_config(cfg, "runs/warm/hf")
    assert conf["base_model_name_or_path"] == str(elsewhere / "runs" / "warm" / "hf")
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", None):
        assert peft_adapter.adapter_config(cfg, name)["base_model_name_or_path"] == name

"""Where a local data set's tfds build goes: `task.cache_dir` (default <manual_dir>/_tfds), a
one-line error naming the place when a build is needed where nothing can be written (a
read-only data directory), and an existing build read without writing."""

import json

import pytest

from configs import quickstart
from ess_jax.config.schema import ConfigError
from ess_jax.data import datasets
from ess_jax.rl import experiment

GSM8K = [
    {"question": "What is 999 + 1,001?", "answer": "999 + 1001 = 2000\n#### 2,000"},
    {"question": "Temperature drops from 3 by 8. Now?", "answer": "3 - 8 = -5\n#### -5"},
]


@pytest.fixture
def manual(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    return d


def _task(manual, cache_dir=""):
    c = quickstart.get_config("tiny")
    c.task.name, c.task.reward, c.task.manual_dir = "gsm8k", "gsm8k", str(manual)
    c.task.cache_dir = cache_dir
    return c.task


def test_unwritable_default_location_names_it_and_the_setting(manual):
    """Catches tfds' own OSError traceback (or a write attempt nobody asked for) when the data
    directory is read-only: here <manual_dir>/_tfds cannot be created (a file has its name)."""
    (manual / "_tfds").write_text("")
    with pytest.raises(ConfigError) as e:
        experiment.load_examples(_task(manual))
    msg = str(e.value)
    assert msg.startswith("config.task.cache_dir: cannot write the tfds build of gsm8k")
    assert f"to {manual / '_tfds'}:" in msg and "\n" not in msg


def test_cache_dir_moves_the_build_and_a_built_cache_is_only_read(manual, tmp_path, monkeypatch):
    """Catches task.cache_dir not passed to the builder (the build still lands in the data
    directory), and a writability check on a cache that is already built (a read-only cache
    built beforehand must still load)."""
    (manual / "_tfds").write_text("")  # the default location is unusable
    cache = tmp_path / "cache"
    train, test = experiment.load_examples(_task(manual, str(cache)))
    assert [ex["answer"] for ex in train] == ["2000", "-5"] and len(test) == 2
    assert any(p.suffix != ".lock" for p in cache.rglob("*array_record*"))

    def refuse(root, name, manual_dir):
        raise datasets.CacheDirError(f"{root} is read-only")

    monkeypatch.setattr(datasets, "_check_writable", refuse)
    again, _ = experiment.load_examples(_task(manual, str(cache)))
    assert again == train
    with pytest.raises(ConfigError, match=r"config\.task\.cache_dir: .*other is read-only"):
        experiment.load_examples(_task(manual, str(tmp_path / "other")))


def test_evaluate_tool_takes_a_cache_dir(manual, tmp_path):
    """Catches tools/evaluate.py building a benchmark in its (read-only) data directory with no
    way to move it, or failing there with a traceback."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import evaluate as evaluate_tool  # tools/evaluate.py

    (manual / "_tfds").write_text("")
    with pytest.raises(SystemExit, match=r"^error: cannot write the tfds build .*--cache_dir"):
        evaluate_tool.load_benchmark("gsm8k", str(manual))
    rows = evaluate_tool.load_benchmark("gsm8k", str(manual), cache_dir=str(tmp_path / "c"))
    assert [ex["answer"] for ex in rows] == ["2000", "-5"]

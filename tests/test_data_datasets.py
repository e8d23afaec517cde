"""Local-file datasets: tfds array_record builders from jsonl / json / parquet, no TensorFlow."""

import importlib.util
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ess_jax.data import load_dataset
from ess_jax.data.datasets.base import last_boxed
from ess_jax.data.datasets.records import find_split_files
from ess_jax.rewards import get_reward

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {"question": "What is 999 + 1,001?", "answer": "999 + 1001 = 2000\n#### 2,000"},
    {"question": "Temperature drops from 3 by 8. Now?", "answer": "3 - 8 = -5\n#### -5"},
]
DEEPSCALER = [
    {"problem": "Compute $1+1$.", "answer": "2", "solution": "$1+1=\\boxed{2}$"},
    {"problem": "Half of one?", "answer": "\\frac{1}{2}", "solution": ""},
]
MATH = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "We have $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Simplify $\\sqrt{12}$.",
        "solution": "$\\sqrt{12} = \\boxed{2\\sqrt{3}}$",
        "level": "Level 2",
        "type": "Algebra",
    },
]


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")  # trailing blank line


def _write_parquet(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


@pytest.fixture(autouse=True)
def no_tensorflow():
    assert importlib.util.find_spec("tensorflow") is None, "tests must run without TensorFlow"
    yield
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_gsm8k_builds_and_reads(tmp_path, fmt):
    manual = tmp_path / "gsm8k"
    if fmt == "jsonl":
        _write_jsonl(manual / "train.jsonl", GSM8K)
        _write_jsonl(manual / "test.jsonl", GSM8K[:1])
    else:  # the Hugging Face hub layout
        _write_parquet(manual / "main" / "train-00000-of-00001.parquet", GSM8K)
        _write_parquet(manual / "main" / "test-00000-of-00001.parquet", GSM8K[:1])
    data_dir = tmp_path / "built"
    ds = load_dataset("gsm8k", manual, "train", data_dir=data_dir)
    assert len(ds) == 3 and len(load_dataset("gsm8k", manual, "test", data_dir=data_dir)) == 1
    examples = list(ds)
    assert [ex["question"] for ex in examples] == [r["question"] for r in GSM8K]  # file order
    assert [ex["answer"] for ex in examples] == ["72", "2000", "-5"]
    ex = examples[0]
    assert ex["task"] == "gsm8k" and ex["solution"] == GSM8K[0]["answer"]
    assert ex["prompt"].startswith(GSM8K[0]["question"]) and '"####"' in ex["prompt"]
    assert ex["source"].endswith(":0")
    assert ds[-1] == examples[-1]
    with pytest.raises(IndexError):
        ds[3]
    # The reference solution scores 1 under the gsm8k reward, a wrong one 0.
    for ex in examples:
        assert get_reward("gsm8k")(ex["demonstration"], ex) == 1.0
        assert get_reward("gsm8k")("#### 12345", ex) == 0.0
    # Built under data_dir as array_record files, nothing under the manual dir.
    built = [f for _, _, fs in os.walk(data_dir) for f in fs]
    assert any(".array_record" in f for f in built)
    assert not (manual / "_tfds").exists()


def test_deepscaler_json_array_and_parquet(tmp_path):
    (tmp_path / "deepscaler.json").write_text(json.dumps(DEEPSCALER))
    ds = load_dataset("deepscaler", tmp_path, "train", split_files={"train": "deepscaler.json"})
    assert [ex["answer"] for ex in ds] == ["2", "\\frac{1}{2}"]
    assert ds[1]["demonstration"] == "\\boxed{\\frac{1}{2}}"  # no solution: boxed answer
    assert ds[0]["prompt"].endswith("within \\boxed{}.")
    for ex in ds:
        assert get_reward("deepscaler")(ex["demonstration"], ex) == 1.0
        assert get_reward("deepscaler")("\\boxed{7}", ex) == 0.0
    _write_parquet(tmp_path / "pq" / "train.parquet", DEEPSCALER)
    assert [ex["problem"] for ex in load_dataset("deepscaler", tmp_path / "pq", "train")] == [
        r["problem"] for r in DEEPSCALER
    ]


def test_math_tree_of_json_files_and_answer_extraction(tmp_path):
    # The MATH tarball layout: one JSON object per file under train/<subject>/.
    for i, record in enumerate(MATH):
        path = tmp_path / "train" / record["type"].lower() / f"{i}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    _write_jsonl(tmp_path / "test.jsonl", [{**MATH[0], "answer": "0.75", "subject": "X"}])
    ds = load_dataset("math", tmp_path, "train", prompt_template="Q: {problem}")
    assert sorted(ex["answer"] for ex in ds) == ["2\\sqrt{3}", "\\frac{3}{4}"]
    assert {ex["level"] for ex in ds} == {"Level 1", "Level 2"}
    for ex in ds:
        assert ex["prompt"] == "Q: " + ex["problem"]
        assert get_reward("math")(ex["solution"], ex) == 1.0
        assert get_reward("math")("\\boxed{1}", ex) == 0.0
    test = load_dataset("math", tmp_path, "test")
    assert test[0]["answer"] == "0.75"  # an explicit answer field wins over \boxed
    assert get_reward("math")("\\boxed{\\frac{3}{4}}", test[0]) == 1.0


def test_rebuilds_when_a_file_changes(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", GSM8K[:1])
    assert len(load_dataset("gsm8k", tmp_path, "train")) == 1
    _write_jsonl(tmp_path / "train.jsonl", GSM8K)
    assert len(load_dataset("gsm8k", tmp_path, "train")) == 3


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("gsm8k", "", r"train.jsonl: file has no records"),
        ("gsm8k", "\n\n", r"train.jsonl: file has no records"),
        ("gsm8k", json.dumps(GSM8K[0]) + "\n{not json\n", r"train.jsonl, record 1: invalid JSON"),
        (
            "gsm8k",
            json.dumps(GSM8K[0]) + "\n[1, 2]\n",
            r"train.jsonl, record 1: expected a JSON object",
        ),
        ("gsm8k", json.dumps({"question": "q"}), r"train.jsonl, record 0: missing field 'answer'"),
        (
            "gsm8k",
            json.dumps({"question": " ", "answer": "#### 1"}),
            r"record 0: field 'question' is empty",
        ),
        (
            "gsm8k",
            json.dumps({"question": "q", "answer": "no marker 1"}),
            r"record 0: .*'#### <number>'",
        ),
        (
            "gsm8k",
            json.dumps({"question": ["q"], "answer": "#### 1"}),
            r"record 0: field 'question' is a list",
        ),
        ("math", json.dumps({"problem": "p", "solution": "no box"}), r"record 0: no answer field"),
        (
            "deepscaler",
            json.dumps({"problem": "p", "solution": "s"}),
            r"record 0: missing field 'answer'",
        ),
    ],
)
def test_malformed_records_name_file_and_record(tmp_path, name, content, match):
    (tmp_path / "train.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_dataset(name, tmp_path, "train")


def test_oversized_record(tmp_path):
    big = {"question": "x" * 5000, "answer": "#### 1"}
    _write_jsonl(tmp_path / "train.jsonl", [GSM8K[0], big])
    with pytest.raises(
        ValueError, match=r"train.jsonl, record 1: record has 5\d+ characters, more than 1000"
    ):
        load_dataset("gsm8k", tmp_path, "train", max_record_chars=1000)


def test_empty_and_corrupt_parquet(tmp_path):
    _write_parquet(tmp_path / "a" / "train.parquet", [])  # no columns, no rows
    with pytest.raises(ValueError, match=r"train.parquet: file has no records"):
        load_dataset("gsm8k", tmp_path / "a", "train")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"train.parquet: not a readable parquet file"):
        load_dataset("gsm8k", tmp_path / "b", "train")


def test_missing_things(tmp_path):
    with pytest.raises(ValueError, match="valid:.*deepscaler.*gsm8k.*math"):
        load_dataset("svamp", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="no train/test/validation files"):
        load_dataset("gsm8k", tmp_path, "train")
    _write_jsonl(tmp_path / "train.jsonl", GSM8K)
    with pytest.raises(ValueError, match=r"no 'test' files.*found splits \['train'\]"):
        load_dataset("gsm8k", tmp_path, "test")


def test_split_file_discovery(tmp_path):
    for rel in [
        "train.jsonl",
        "main/test-00000-of-00001.parquet",
        "validation/a/1.json",
        "_tfds/train.jsonl",
        ".cache/train.jsonl",
        "README.md",
        "trainer.jsonl",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    found = {
        k: [os.path.relpath(p, tmp_path) for p in v]
        for k, v in find_split_files(str(tmp_path)).items()
    }
    assert found == {
        "train": ["train.jsonl"],
        "test": ["main/test-00000-of-00001.parquet"],
        "validation": ["validation/a/1.json"],
    }


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{3}", "3"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{1", None),
        ("none", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected

"""E6 held-out evaluation: tfds builders for AIME 2024 / AIME 2025 / AMC 2023 / MATH-500 from
local files in their public layouts (no TensorFlow), the pass@j table, and tools/evaluate.py
end to end on a tiny exported checkpoint."""

import importlib.util
import itertools
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import one_line_exit, tiny_model_cfg

from ess_jax.data.datasets.records import RecordError
from ess_jax.rewards import get_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import evaluate as evaluate_tool  # noqa: E402  (tools/evaluate.py)


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(autouse=True)
def no_tensorflow():
    assert importlib.util.find_spec("tensorflow") is None, "tests must run without TensorFlow"


def test_builders_read_the_public_layouts(tmp_path):
    """Catches: a field name of one release not read (AMC's `question`, AIME's capitalised
    `Problem` / `Answer`), AMC's float answers compared as '27.0', the only split of a release
    named `train` (HuggingFaceH4/aime_2024) not found, MATH-500's answer field ignored."""
    aime24 = tmp_path / "aime24"
    aime24.mkdir()
    rows = [{"id": 60, "problem": "Find $x$ if $x+1=3$.", "solution": "x=2", "answer": "2",
             "url": "u", "year": "2024"}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), aime24 / "train-00000-of-00001.parquet")
    _jsonl(
        tmp_path / "aime25" / "test.jsonl", [{"Problem": "What is $7 \\cdot 10$?", "Answer": 70}]
    )
    _jsonl(
        tmp_path / "amc23" / "test.jsonl", [{"question": "Compute $3^3$.", "answer": 27.0, "id": 1}]
    )
    _jsonl(
        tmp_path / "math500" / "test.jsonl",
        [{"problem": "Half of one?", "solution": "\\boxed{0.5}", "answer": "\\frac{1}{2}",
          "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}],
    )  # fmt: skip
    reward = get_reward("math")
    expected = {"aime24": "2", "aime25": "70", "amc23": "27", "math500": "\\frac{1}{2}"}
    for name, answer in expected.items():
        (ex,) = evaluate_tool.load_benchmark(name, str(tmp_path / name))
        assert ex["answer"] == answer, name
        assert ex["prompt"].endswith("within \\boxed{}."), ex["prompt"]
        assert reward(f"so \\boxed{{{answer}}}", ex) == 1.0
        assert reward("so \\boxed{1000}", ex) == 0.0
    _jsonl(tmp_path / "bad" / "test.jsonl", [{"question": "no answer"}])
    with pytest.raises(RecordError, match="test.jsonl, record 0: none of the fields"):
        evaluate_tool.load_benchmark("amc23", str(tmp_path / "bad"))


def test_pass_table_equals_enumerating_every_subset():
    """Catches: a biased pass@j (e.g. 1 - (1 - p)^j, or the fraction of problems with any hit)
    instead of the chance that j of the k samples, drawn without replacement, hold a hit."""
    rng = np.random.default_rng(0)
    correct = rng.random((7, 8)) < np.linspace(0.05, 0.9, 7)[:, None]
    table = evaluate_tool.pass_table(correct)
    assert sorted(table) == [1, 2, 4, 8]
    for j, value in table.items():
        brute = np.mean(
            [np.mean([row[list(s)].any() for s in itertools.combinations(range(8), j)])
             for row in correct]
        )  # fmt: skip
        assert value == pytest.approx(brute, abs=1e-12)
    assert table[1] == pytest.approx(correct.mean())


def test_tool_evaluates_an_exported_checkpoint(tmp_path, capsys):
    """Catches: the tool not loading a run's hf/ export (a workdir's own config.json, the
    experiment config, taken for a model's), losing a benchmark or a token budget in the table,
    or mixing samples of different problems into one problem's pass@j (with greedy decoding
    every sample of a problem is the same, so pass@j must equal pass@1), or a prompt wider than
    every --buckets width escaping as a traceback."""
    from configs import quickstart
    from ess_jax.data import char_tokenizer
    from ess_jax.io import weights
    from ess_jax.model import decoder as model

    tok = char_tokenizer()
    model_cfg = tiny_model_cfg(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    hf_dir = str(tmp_path / "run" / "hf")
    weights.save_hf(model_cfg, model.init_params(model_cfg, 0), hf_dir, tokenizer=tok)
    (tmp_path / "run" / "config.json").write_text(json.dumps(quickstart.get_config().to_dict()))
    problems = [{"problem": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(3)]
    for name in ("aime24", "amc23"):
        _jsonl(tmp_path / name / "test.jsonl", problems)
    out = tmp_path / "rows.json"
    args = [
        f"--checkpoint={tmp_path / 'run'}",
        f"--data=aime24={tmp_path / 'aime24'},amc23={tmp_path / 'amc23'}",
        "--max_new_tokens=4,8", "--k=4", "--batch_size=2", "--dtype=float32",
        "--prompt_template={problem}", "--buckets=32", "--temperature=0", f"--out={out}",
    ]  # fmt: skip
    assert evaluate_tool.main(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()  # tfds prints its build first
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("| bench")) :]
    assert table[0].startswith("| benchmark | problems | max tokens | pass@1 | pass@2 | pass@4")
    assert [line.split(" | ")[0:3] for line in table[2:]] == [
        ["| AIME 2024", "3", "4"], ["| AIME 2024", "3", "8"],
        ["| AMC 2023", "3", "4"], ["| AMC 2023", "3", "8"],
    ]  # fmt: skip
    for row in json.loads(out.read_text()):
        assert row["pass@1"] == row["pass@2"] == row["pass@4"]
        assert 0 < row["response_len"] <= row["max_new_tokens"]
    # a prompt wider than every bucket: one line naming --buckets, before any sampling
    short = [a if not a.startswith("--buckets") else "--buckets=8" for a in args]
    with pytest.raises(
        SystemExit, match=r"^error: --buckets \(8,\): aime24 .* more than the largest bucket 8"
    ) as e:
        evaluate_tool.main(short)
    assert e.value.code == 2  # ess_jax.main's status for a mistake the user can fix


def test_tool_refuses_bad_data_and_unencodable_prompts_in_one_line(tmp_path, capsys):
    """Catches tracebacks from tools/evaluate.py, or another exit status than ess_jax.main's 2,
    for a --data directory that does not exist (refused before the checkpoint loads: the
    checkpoint here does not exist either), one with no data files, and a prompt with a
    character the tokenizer cannot encode (refused before any sampling, naming the
    benchmark)."""
    from ess_jax.data import char_tokenizer

    missing = tmp_path / "aime24"
    line = one_line_exit(
        capsys, lambda: evaluate_tool.main(["--checkpoint=nowhere", f"--data=aime24={missing}"])
    )
    assert line == f"error: --data aime24={missing}: no such directory"
    missing.mkdir()
    line = one_line_exit(capsys, lambda: evaluate_tool.load_benchmark("aime24", str(missing)))
    assert line.startswith(f"error: --data aime24={missing}: no train/test/validation files")
    fine = [{"prompt": "what is 1+1?"}]
    evaluate_tool.check_prompts({"amc23": fine}, char_tokenizer(), (32,))
    benchmarks = {"amc23": fine, "math500": [*fine, {"prompt": "What is 1+1?"}]}
    line = one_line_exit(
        capsys, lambda: evaluate_tool.check_prompts(benchmarks, char_tokenizer(), (32,))
    )
    assert line == (
        "error: --data math500: prompt has characters the tokenizer cannot encode: 'What is 1+1?'"
    )


@pytest.mark.parametrize(
    "flag, line",
    [
        ("--buckets=128,2k", "--buckets 128,2k: not a comma-separated list of positive integers"),
        ("--max_new_tokens=4096,0", "--max_new_tokens 4096,0: not a comma-separated list of "
         "positive integers"),
        ("--mesh=fsdp", "--mesh fsdp: 'fsdp' is not AXIS=SIZE (e.g. fsdp=4,tensor=2; one size "
         "may be -1, the devices left)"),
        ("--mesh=fsdp=3", "--mesh fsdp=3: mesh {'data': 1, 'fsdp': 3, 'tensor': 1, 'expert': 1} "
         "needs 3 devices, have 8"),
        ("--mesh=pipeline=8", "--mesh pipeline=8: unknown mesh axes ['pipeline']; valid: "
         "('data', 'fsdp', 'tensor', 'expert')"),
        ("--data=aime24", "--data aime24: 'aime24' is not NAME=DIR (names: aime24, aime25, amc23, "
         "math500)"),
    ],
)  # fmt: skip
def test_tool_refuses_a_malformed_flag_in_one_line(flag, line, tmp_path, monkeypatch, capsys):
    """Catches tools/evaluate.py ending in a ValueError traceback for a --buckets or
    --max_new_tokens that is no list of integers (or a non-positive one, which reached the
    batcher as a --data error), a --mesh item that is not AXIS=SIZE, an unknown axis or sizes
    the devices do not fill, or a --data item without "=": one line naming the flag, exit 2,
    before the checkpoint loads (it does not exist here)."""
    from ess_jax.config import presets

    monkeypatch.setenv(presets.MEM_FRACTION_ENV, "0.9")  # main sets it: undone after the test
    argv = ["--checkpoint=nowhere", f"--data=aime24={tmp_path}", flag]
    assert one_line_exit(capsys, lambda: evaluate_tool.main(argv)) == "error: " + line

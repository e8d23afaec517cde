"""Local-file datasets (GSM8K, DeepScaleR, MATH; AIME 2024 / 2025, AMC 2023, MATH-500 for
held-out evaluation) as tfds array_record builders.

    ds = load_dataset("gsm8k", "/data/gsm8k", "train")   # builds once, then reuses
    ds[0] -> {"prompt", "answer", "demonstration", "task", "source", <dataset fields>}

The build goes to `data_dir` (default: <manual_dir>/_tfds; `task.cache_dir` in a run's config),
in a subfolder keyed by a fingerprint of the input files and options, so editing a file triggers
a rebuild and nothing is ever written to ~/tensorflow_datasets. A build that is needed where
nothing can be written is a `CacheDirError` naming the place; an existing build is only read.
"""

import hashlib
import importlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence

from ess_jax.data.datasets.records import MAX_RECORD_CHARS, RecordError, find_split_files

# name -> "module:class". Imported on first use: tensorflow_datasets takes ~1 s to
# import, and runs on the synthetic tasks never need it.
BUILDERS: dict[str, str] = {
    "gsm8k": "ess_jax.data.datasets.gsm8k:Gsm8k",
    "deepscaler": "ess_jax.data.datasets.deepscaler:Deepscaler",
    "math": "ess_jax.data.datasets.math_dataset:Math",
    # held-out evaluation sets (docs/method.md, E6; tools/evaluate.py)
    "aime24": "ess_jax.data.datasets.competition:Competition",
    "aime25": "ess_jax.data.datasets.competition:Competition",
    "amc23": "ess_jax.data.datasets.competition:Competition",
    "math500": "ess_jax.data.datasets.math_dataset:Math",
}

# The instructions the public RL recipes append (verl's GSM8K preprocessing; DeepScaleR's),
# matching where the gsm8k and math rewards look for the final answer.
_BOXED_INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
PROMPT_TEMPLATES: dict[str, str] = {
    "gsm8k": '{question} Let\'s think step by step and output the final answer after "####".',
    "deepscaler": "{problem}" + _BOXED_INSTRUCTION,
    "math": "{problem}" + _BOXED_INSTRUCTION,
    **{name: "{problem}" + _BOXED_INSTRUCTION for name in ("aime24", "aime25", "amc23", "math500")},
}


class CacheDirError(OSError):
    """The tfds build of a data set is needed where nothing can be written."""


def _check_writable(root: str, name: str, manual_dir: str) -> None:
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise CacheDirError(
            f"cannot write the tfds build of {name} ({manual_dir}) to {root}: "
            f"{e.strerror or e}; point the cache at a writable directory"
        ) from e


def _fill(template: str, fields: dict[str, str]) -> str:
    # str.replace, not str.format: templates contain literal braces (\boxed{}).
    for key, value in fields.items():
        template = template.replace("{" + key + "}", value)
    return template


class LocalDataset(Sequence):
    """Random-access view of a built split: example dicts with decoded text."""

    def __init__(self, source, name: str, split: str, prompt_template: str):
        self.source, self.name, self.split = source, name, split
        self.prompt_template = prompt_template

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        if not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} examples")
        raw = self.source[index % n]
        fields = {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in raw.items()}
        demonstration = fields.get("solution") or f"\\boxed{{{fields['answer']}}}"
        return {
            **fields,
            "task": self.name,
            "prompt": _fill(self.prompt_template, fields),
            "demonstration": demonstration,
        }

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"LocalDataset({self.name!r}, split={self.split!r}, n={len(self)})"


def _fingerprint(builder_cls, files: dict[str, list[str]], options: dict) -> str:
    h = hashlib.sha256(f"{builder_cls.__name__}:{builder_cls.VERSION}".encode())
    for split in sorted(files):
        for path in files[split]:
            st = os.stat(path)
            h.update(f"{split}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def get_builder(name: str) -> type:
    """The tfds builder class of dataset `name`; ValueError listing valid names."""
    if name not in BUILDERS:
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(BUILDERS)}")
    module, cls = BUILDERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_dataset(
    name: str,
    manual_dir: str | os.PathLike,
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    split_files: dict[str, str | Sequence[str]] | None = None,
    prompt_template: str | None = None,
    max_record_chars: int = MAX_RECORD_CHARS,
) -> LocalDataset:
    """Builds (once) and opens split `split` of dataset `name` from files in `manual_dir`.

    Malformed, empty or oversized records raise a ValueError naming file and record.
    `prompt_template` ({question} / {problem} placeholders) defaults to PROMPT_TEMPLATES.
    The build goes under `data_dir` (default <manual_dir>/_tfds); a CacheDirError if it is
    needed there and the place is not writable.
    """
    import tensorflow_datasets as tfds

    builder_cls = get_builder(name)
    manual_dir = os.fspath(manual_dir)
    files = find_split_files(manual_dir, split_files)
    if split not in files:
        raise ValueError(
            f"{name}: no {split!r} files in {manual_dir}; found splits {sorted(files)}"
        )
    options = {"split_files": split_files, "max_record_chars": max_record_chars}
    root = os.fspath(data_dir) if data_dir is not None else os.path.join(manual_dir, "_tfds")
    fingerprint = _fingerprint(builder_cls, files, options)
    builder = builder_cls(
        data_dir=os.path.join(root, f"{name}-{fingerprint}"),
        split_files=split_files,
        max_record_chars=max_record_chars,
    )
    if not builder.data_path.exists():
        _check_writable(root, name, manual_dir)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir)
    )
    template = PROMPT_TEMPLATES[name] if prompt_template is None else prompt_template
    return LocalDataset(builder.as_data_source(split=split), name, split, template)


__all__ = [
    "BUILDERS",
    "CacheDirError",
    "PROMPT_TEMPLATES",
    "LocalDataset",
    "RecordError",
    "get_builder",
    "load_dataset",
]

"""A tfds builder over local files: the shared part of the gsm8k / deepscaler / math builders.

Builders write `array_record` files, the one tfds format that needs no TensorFlow,
and are read back with `as_data_source` (random access, no tf.data). They skip
tfds' global registry (`skip_registration=True`): they are instantiated by class,
and names such as "math" must not collide with tfds' own datasets.
"""

import os
from collections.abc import Sequence
from typing import ClassVar

import tensorflow_datasets as tfds

from ess_jax.data.datasets.records import (
    MAX_RECORD_CHARS,
    RecordError,
    check_size,
    find_split_files,
    read_records,
)


class LocalFilesBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Subclasses set FIELDS (all stored as text) and implement `convert(record, path, index)`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Local jsonl / json / parquet files."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train/test files (.jsonl, .json or .parquet, the public dataset's field "
        "names) in the manual dir: train.jsonl, test.parquet, main/train-00000-of-00001"
        ".parquet, train/algebra/1.json ... or pass split_files."
    )
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        split_files: dict[str, str | Sequence[str]] | None = None,
        max_record_chars: int = MAX_RECORD_CHARS,
        **kwargs,
    ):
        self._split_files = split_files
        self._max_record_chars = max_record_chars
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = {name: tfds.features.Text() for name in self.FIELDS}
        # "<file>:<index>" of the source record, to trace any example back to its line.
        features["source"] = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(features),
            # Keep file order: reproducible, and example i is record i of the files.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        manual_dir = os.fspath(dl_manager.manual_dir)
        files = find_split_files(manual_dir, self._split_files)
        return {
            split: self._generate_examples(paths=paths, manual_dir=manual_dir)
            for split, paths in files.items()
        }

    def _generate_examples(self, paths: list[str], manual_dir: str):
        for path in paths:
            rel = os.path.relpath(path, manual_dir)
            for index, record in read_records(path):
                fields = self.convert(record, path, index)
                check_size(fields, path, index, self._max_record_chars)
                yield f"{rel}:{index}", {**fields, "source": f"{rel}:{index}"}

    def convert(self, record: dict, path: str, index: int) -> dict[str, str]:
        """The stored text fields of one raw record; RecordError if it is malformed."""
        raise NotImplementedError


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced."""
    best = None
    for command in ("\\boxed{", "\\fbox{"):
        start = text.rfind(command)
        if start != -1 and (best is None or start > best[0]):
            best = (start, start + len(command))
    if best is None:
        return None
    depth, begin = 1, best[1]
    for i in range(begin, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced


__all__ = ["LocalFilesBuilder", "RecordError", "last_boxed"]

"""Reading and checking records of local jsonl / json / parquet files.

Every problem is reported as "<file>, record <i>: <what>" so a bad line in a
40k-line file can be found without bisecting.
"""

import json
import os
import re
from collections.abc import Iterator, Sequence

EXTENSIONS = (".jsonl", ".json", ".parquet")
MAX_RECORD_CHARS = 100_000  # MATH's longest solutions are ~10k characters
KNOWN_SPLITS = ("train", "test", "validation")


class RecordError(ValueError):
    """A malformed, empty or oversized record, or an unreadable file."""

    def __init__(self, path: str, index: int | None, message: str):
        where = path if index is None else f"{path}, record {index}"
        super().__init__(f"{where}: {message}")


def _json_records(path: str) -> Iterator[tuple[int, object]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # not one JSON document: read it as JSON lines below
    if isinstance(whole, list):  # e.g. DeepScaleR's deepscaler.json
        yield from enumerate(whole)
        return
    if isinstance(whole, dict):  # e.g. the MATH tarball: one problem per file
        yield 0, whole
        return
    index = 0
    for line in text.splitlines():
        if not line.strip():
            continue  # trailing / separating blank lines are not records
        try:
            yield index, json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(path, index, f"invalid JSON ({e.msg}): {line[:80]!r}") from None
        index += 1


def _parquet_records(path: str) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise RecordError(path, None, f"not a readable parquet file ({e})") from None
    index = 0
    for batch in reader.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def read_records(path: str) -> Iterator[tuple[int, dict]]:
    """(index, record dict) for each record of a .jsonl / .json / .parquet file.

    An empty file, a line that is not JSON or a record that is not an object is a
    RecordError naming the file and the record index.
    """
    reader = _parquet_records if path.endswith(".parquet") else _json_records
    count = 0
    for index, record in reader(path):
        if not isinstance(record, dict):
            raise RecordError(path, index, f"expected a JSON object, got {type(record).__name__}")
        count += 1
        yield index, record
    if count == 0:
        raise RecordError(path, None, "file has no records")


def text_field(record: dict, field: str, path: str, index: int, *, required: bool = True) -> str:
    """record[field] as a non-empty string (numbers are accepted and stringified)."""
    value = record.get(field)
    if value is None:
        if required:
            raise RecordError(path, index, f"missing field {field!r} (has {sorted(record)})")
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RecordError(path, index, f"field {field!r} is a {type(value).__name__}, not text")
    value = str(value)
    if required and not value.strip():
        raise RecordError(path, index, f"field {field!r} is empty")
    return value


def check_size(fields: dict[str, str], path: str, index: int, max_chars: int) -> None:
    size = sum(len(v) for v in fields.values())
    if size > max_chars:
        raise RecordError(path, index, f"record has {size} characters, more than {max_chars}")


def _split_of_path(relpath: str) -> str | None:
    """'train' for train.jsonl, main/train-00000-of-00001.parquet or train/algebra/1.json."""
    *dirs, base = relpath.split(os.sep)
    prefix = re.split(r"[-_.]", base, maxsplit=1)[0]
    for name in KNOWN_SPLITS:
        if prefix == name or name in dirs:
            return name
    return None


def find_split_files(
    manual_dir: str, split_files: dict[str, str | Sequence[str]] | None = None
) -> dict[str, list[str]]:
    """Split name -> sorted data files under manual_dir.

    Without `split_files`, a file belongs to a split (train / test / validation)
    when its name starts with it (train.jsonl, train-00000-of-00001.parquet) or a
    directory on its path is named after it (train/algebra/1.json). Directories
    starting with '.' or '_' (such as the default build dir '_tfds') are skipped.
    With `split_files` ({"train": "deepscaler.json"}), exactly those files are used,
    relative to manual_dir unless absolute.
    """
    if not os.path.isdir(manual_dir):
        raise FileNotFoundError(f"manual_dir not found: {manual_dir}")
    if split_files is not None:
        out = {}
        for split, files in split_files.items():
            files = [files] if isinstance(files, str) else list(files)
            paths = [os.path.join(manual_dir, f) for f in files]
            for p in paths:
                if not os.path.isfile(p):
                    raise FileNotFoundError(f"{split} file not found: {p}")
            out[split] = paths
        return out
    out: dict[str, list[str]] = {}
    for root, dirs, files in os.walk(manual_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in files:
            if not name.endswith(EXTENSIONS):
                continue
            path = os.path.join(root, name)
            split = _split_of_path(os.path.relpath(path, manual_dir))
            if split is not None:
                out.setdefault(split, []).append(path)
    if not out:
        raise FileNotFoundError(
            f"no {'/'.join(KNOWN_SPLITS)} files ({', '.join(EXTENSIONS)}) in {manual_dir}; "
            "name them e.g. train.jsonl, or pass split_files={'train': 'file.json'}"
        )
    return {split: sorted(paths) for split, paths in out.items()}
